"""Exact integer products of 8-bit operands on float32 BLAS (MatMulInteger, QLinearMatMul,
ConvInteger, DynamicQuantizeMatMul, MatMulIntegerToFloat, QGemm).

numpy has no integer GEMM (its int32 matmul is a plain loop, ~100x slower than sgemm),
and float64 BLAS is twice float32's cost. float32 holds every integer up to 2**24
exactly, so a product whose partial sums stay under 2**24 is exact in float32: with
zero points subtracted an 8-bit operand is at most 255 in magnitude, so the reduction
axis is cut into chunks of at most ``2**24 // (max|a| * max|b|)`` terms (258 for two
arbitrary 8-bit operands, 518 for a weight within [-127, 127]), each chunk is one
float32 GEMM whose result is an exact integer, and the chunks are summed in int32 (which
wraps as the spec allows). The same code runs on CuPy (cuBLAS sgemm).

A constant weight is centred and converted to float32 once, at compile time, by the
ops' ``specialize`` hooks (`CenteredWeight`), which also measure its actual magnitude
(longer chunks).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from hetero_exec.kernels._threads import matmul
from hetero_exec.kernels.registry import KnownInput

#: float32 represents every integer of magnitude up to this exactly
EXACT_F32 = 1 << 24


def span(dtype: Any) -> int:
    """The largest ``|x - zero_point|`` of an integer dtype (255 for 8-bit)."""
    info = np.iinfo(np.dtype(dtype))
    return int(info.max) - int(info.min)


def centered(xp, x: Any, zero_point: Any, axis: int) -> Any:
    """``x - zero_point`` as float32; a zero point of more than one value runs along
    ``axis`` of x (-2: per row of a left operand, -1: per column of a right one)."""
    xf = x.astype(np.float32)
    if zero_point is None:
        return xf
    z = zero_point.astype(np.float32)
    if z.size == 1:
        z = z.reshape(())
    elif z.ndim == 1:
        z = z.reshape(-1, 1) if axis == -2 else z.reshape(1, -1)
    elif axis == -2 and z.shape[-1] != 1:
        z = z[..., None]
    return xf - z


def chunk_for(a_max: int, b_max: int) -> int:
    """How many terms of a reduction stay exact in float32."""
    return max(1, EXACT_F32 // max(1, a_max * b_max))


def exact_matmul(xp, Af: Any, Bf: Any, chunk: int) -> Any:
    """int32 ``Af @ Bf`` of integer-valued float32 operands, exact when ``chunk`` terms of
    the reduction stay under 2**24."""
    K = Af.shape[-1]
    if K <= chunk:
        return matmul(xp, Af, Bf).astype(np.int32)
    acc = None
    for k0 in range(0, K, chunk):
        part = matmul(xp, Af[..., k0:k0 + chunk], Bf[..., k0:k0 + chunk, :]).astype(np.int32)
        if acc is None:
            acc = part
        else:
            acc += part
    return acc


def int_matmul(xp, A: Any, B: Any, a_zero_point: Any = None, b_zero_point: Any = None,
               Bf: Any = None, b_max: int | None = None) -> Any:
    """int32 ``(A - azp) @ (B - bzp)``; ``Bf`` / ``b_max`` a weight centred beforehand."""
    Af = centered(xp, A, a_zero_point, -2)
    if Bf is None:
        Bf = centered(xp, B, b_zero_point, -1)
        b_max = span(B.dtype)
    return exact_matmul(xp, Af, Bf, chunk_for(span(A.dtype), b_max or 1))


class CenteredWeight:
    """A constant right operand centred and in float32, made once at compile time."""

    __slots__ = ("source", "zero_point", "fed", "Bf", "b_max")

    def __init__(self, B: np.ndarray, b_zero_point: np.ndarray | None, overridable: bool,
                 transpose: bool = False):
        self.source = B
        self.zero_point = b_zero_point
        self.fed = overridable  # a run may feed another B: check it is this one
        if transpose:  # B given as [N, K]: its zero points still run along N
            self.Bf = np.ascontiguousarray(centered(np, B.T, b_zero_point, -1))
        else:
            self.Bf = np.ascontiguousarray(centered(np, B, b_zero_point, -1))
        self.b_max = int(np.abs(self.Bf).max()) if self.Bf.size else 1

    def serves(self, B: Any, b_zero_point: Any) -> bool:
        """Whether this run's (B, zero point) are the constants it was made from."""
        if (b_zero_point is None) != (self.zero_point is None):
            return False
        return not self.fed or B is self.source


def centered_weight_hook(b_index: int, zp_index: int, make: Callable[[], Callable],
                         transpose_attr: str | None = None) -> Callable:
    """A ``specialize`` hook for an op whose input ``b_index`` is an 8-bit right operand
    with its zero point at ``zp_index``: on cpu, a constant 2-D B is centred and made
    float32 once (`CenteredWeight`) and ``make()(weight)`` gives the node's function
    (``make()()`` is the op's kernel). On a device the kernel converts B each run: a
    copy made here would be memory the planner does not see."""

    def hook(xp, kwargs: dict, inputs: Sequence[KnownInput]):
        if xp is not np or len(inputs) <= b_index or inputs[b_index].value is None:
            return None
        B = inputs[b_index].value
        zp = inputs[zp_index] if len(inputs) > zp_index else None
        if B.ndim != 2 or B.dtype.kind not in "iu" or (zp is not None and zp.overridable):
            return None
        transpose = bool(transpose_attr and kwargs.get(transpose_attr, 0))
        return make()(CenteredWeight(B, None if zp is None else zp.value,
                                     inputs[b_index].overridable, transpose))

    return hook
