"""MatMul, Gemm and FusedMatMul on a constant weight packed once (native/packed_gemm.py).

Each op's ``specialize`` hook sees its weight at compile time. When that weight is a
2-D float32 constant and the packed products are available, the node gets a function
that packs it on first use (`PackedWeight`) and runs its products on the packed copy,
with the bias and Relu/Clip added as the tiles are stored. Anything else (another dtype,
an operand the run feeds in place of the constant, fewer than `packed_gemm.MIN_ROWS`
rows, a Gemm with alpha/beta/transA) runs the op's own kernel, which stays the
definition.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import numpy as np

from hetero_exec.kernels.native import (
    blas_split,  # noqa: F401 (registers it with _threads)
    packed_gemm,
)
from hetero_exec.kernels.native.activation import activation_args
from hetero_exec.kernels.registry import KnownInput


class PackedWeight:
    """One node's constant, packed on first use, for the one array that the plan's slot
    holds run after run. That is the array of the first run (a provider may hold its
    own copy of the initializer, as sim-gpu's host mode does), except for an overridable
    initializer, which a run may feed: there only the initializer itself is served, and
    a fed weight takes the unpacked path."""

    __slots__ = ("value", "transpose", "K", "N", "_packed", "_lock")

    def __init__(self, known: KnownInput, transpose: bool = False):
        value = known.value
        self.value = value if known.overridable else None  # None: the first run's array
        self.transpose = transpose
        self.K = int(value.shape[1 if transpose else 0])
        self.N = int(value.shape[0 if transpose else 1])
        self._packed: Any = None
        self._lock = threading.Lock()

    def takes(self, A: Any, B: Any) -> bool:
        """Whether ``A @ B`` runs packed: B the constant itself, A float32 with a number
        of rows the packed path takes (checked first: cheap, and most calls stop here)."""
        if self.value is None and type(B) is np.ndarray:
            with self._lock:
                if self.value is None:
                    self.value = B
        if B is not self.value or type(A) is not np.ndarray or A.ndim < 2:
            return False
        return (packed_gemm.right_takes(A.size // self.K, self.N)
                and A.dtype == np.float32 and A.shape[-1] == self.K)

    def packed(self) -> packed_gemm.PackedRight:
        """The weight packed (the first time: concurrent first runs pack once); call
        after `takes` said yes."""
        packed = self._packed
        if packed is None:
            with self._lock:
                if self._packed is None:
                    self._packed = packed_gemm.PackedRight(
                        self.value.T if self.transpose else self.value)
                packed = self._packed
        return packed


def constant_weight(xp, inputs: Sequence[KnownInput], index: int = 1) -> KnownInput | None:
    """The input at ``index`` when it is a 2-D float32 host constant and the packed
    products are available, else None."""
    if xp is not np or len(inputs) <= index:
        return None
    known = inputs[index]
    w = known.value
    if not isinstance(w, np.ndarray) or w.ndim != 2 or w.dtype != np.float32 or 0 in w.shape:
        return None
    return known if packed_gemm.available() else None


def packed_product(pw: PackedWeight, A: Any, bias: Any = None, act: int = 0,
                   lo: float = 0.0, hi: float = 0.0) -> np.ndarray | None:
    """act(A @ B + bias) on the packed weight, for a call `PackedWeight.takes`; None
    when its bias does not suit the store."""
    packed = pw.packed()
    if bias is not None and (bias.dtype != np.float32 or bias.size != packed.N
                             or bias.shape[-1:] != (packed.N,)):
        return None
    return packed.matmul(A, bias=None if bias is None else bias.reshape(packed.N),
                         act=act, lo=lo, hi=hi)


def matmul_hook(kernel: Callable[[], Callable]) -> Callable:
    """The MatMul hook; ``kernel()`` gives the generic kernel (defined after the hook)."""

    def hook(xp, kwargs: dict, inputs: Sequence[KnownInput]):
        known = constant_weight(xp, inputs)
        if known is None:
            return None
        pw, generic = PackedWeight(known), kernel()

        def MatMul_packed(xp, A, B):
            Y = packed_product(pw, A) if pw.takes(A, B) else None
            return generic(xp, A, B) if Y is None else (Y,)

        MatMul_packed.packed_weight = pw
        return MatMul_packed

    return hook


def gemm_hook(kernel: Callable[[], Callable]) -> Callable:
    def hook(xp, kwargs: dict, inputs: Sequence[KnownInput]):
        known = constant_weight(xp, inputs)
        if known is None or kwargs.get("transA", 0) or kwargs.get("alpha", 1.0) != 1.0:
            return None
        pw, generic = PackedWeight(known, transpose=bool(kwargs.get("transB", 0))), kernel()
        beta = kwargs.get("beta", 1.0)

        def Gemm_packed(xp, A, B, C=None, **attrs):
            Y = None
            # (a scaled or 2-D C: the generic kernel adds it)
            if pw.takes(A, B) and (C is None or (beta == 1.0 and C.ndim <= 2
                                                 and (C.ndim < 2 or C.shape[0] == 1))):
                Y = packed_product(pw, A, C)
            return generic(xp, A, B, C, **attrs) if Y is None else (Y,)

        Gemm_packed.packed_weight = pw
        return Gemm_packed

    return hook


def fused_matmul_hook(kernel: Callable[[], Callable], after: Callable) -> Callable:
    """``after(xp, Y, activation, params)`` applies an activation the store does not."""

    def hook(xp, kwargs: dict, inputs: Sequence[KnownInput]):
        known = constant_weight(xp, inputs)
        if known is None:
            return None
        pw, generic = PackedWeight(known), kernel()
        activation = kwargs.get("activation", "")
        params = kwargs.get("activation_params")
        store = activation_args(activation, params, store_only=True)  # None: ``after`` does

        def FusedMatMul_packed(xp, A, B, bias=None, **attrs):
            Y = None
            if pw.takes(A, B):
                if store is not None:
                    Y = packed_product(pw, A, bias, *store)
                else:
                    Y = packed_product(pw, A, bias)
                    if Y is not None:
                        after(xp, Y, activation, params)
            return generic(xp, A, B, bias, **attrs) if Y is None else (Y,)

        FusedMatMul_packed.packed_weight = pw  # shared with a bound program's products
        return FusedMatMul_packed

    return hook
