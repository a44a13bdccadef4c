"""Internal ops of the fusion passes (hetero_exec/placement/fusions/), in the
"hetero_exec" domain: several ONNX nodes computed as one kernel, with the later steps
in place on the first one's fresh output.

FusedConv lives with Conv in conv.py (its epilogue calls `activate` below);
FusedLayerNorm and FusedRMSNorm in norm.py; FusedAttention and FusedRotary in
fused_attention.py.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from hetero_exec.kernels._packed import fused_matmul_hook
from hetero_exec.kernels._threads import matmul
from hetero_exec.kernels.erf_gelu import Gelu
from hetero_exec.kernels.linalg import _float_operands
from hetero_exec.kernels.native import library, row_kernels
from hetero_exec.kernels.native.activation import ActivationArgs, activation_args
from hetero_exec.kernels.registry import kernel

FUSED_DOMAIN = "hetero_exec"

#: what `activate` applies in place; ``activation_params`` are (min, max) for Clip and
#: (alpha, beta) for HardSigmoid; Gelu is erf GELU, GeluTanh the tanh one
ACTIVATIONS = frozenset({"", "Relu", "Clip", "HardSigmoid", "HardSwish", "SiLU", "Tanh", "Sigmoid",
                         "Gelu", "GeluTanh"})


def _sigmoid_into(xp, t):
    """1 / (1 + exp(-t)) in place: the Sigmoid kernel's steps."""
    with np.errstate(over="ignore"):
        xp.negative(t, out=t)
        xp.exp(t, out=t)
    t += 1
    return xp.reciprocal(t, out=t)


def activate(xp, Y, activation: str, params: Sequence[float] | None = None, op: str = "fused op"):
    """``activation(Y)`` written into ``Y`` (a fresh float array); at most one work array."""
    if not activation:
        return Y
    if activation == "Relu":
        xp.maximum(Y, 0, out=Y)
    elif activation == "Clip":
        lo, hi = params if params else (-np.inf, np.inf)
        # max then min, as Clip: min > max gives max everywhere
        if lo > -np.inf:
            xp.maximum(Y, Y.dtype.type(lo), out=Y)
        if hi < np.inf:
            xp.minimum(Y, Y.dtype.type(hi), out=Y)
    elif activation == "HardSigmoid":
        alpha, beta = params if params else (0.2, 0.5)
        _hard_sigmoid(xp, Y, alpha, beta, out=Y)
    elif activation == "HardSwish":
        Y *= _hard_sigmoid(xp, Y, 1.0 / 6.0, 0.5)
    elif activation == "Tanh":
        xp.tanh(Y, out=Y)
    elif activation == "Sigmoid":
        _sigmoid_into(xp, Y)
    elif activation in ("Gelu", "GeluTanh"):
        Y[...] = Gelu(xp, Y, "tanh" if activation == "GeluTanh" else "none")[0]
    elif activation == "SiLU":
        t = xp.empty_like(Y)
        with np.errstate(over="ignore"):  # exp(-y) -> inf gives y / inf = 0, as wanted
            xp.negative(Y, out=t)
            xp.exp(t, out=t)
        t += 1
        Y /= t
    else:
        raise ValueError(f"{op}: unsupported activation {activation!r}")
    return Y


def product(xp, a, b, out=None):
    """a @ b: split over our threads where it pays (kernels/_threads.matmul)."""
    if a.ndim >= 2 and b.ndim >= 2:
        return matmul(xp, a, b, out=out)  # (its batch dims folded into one GEMM)
    return xp.matmul(a, b, out=out) if out is not None else xp.matmul(a, b)


def epilogue_activation(activation: str, params: Sequence[float] | None = None):
    """``activation`` in the form conv.py's epilogue takes: "" (none), "Relu", or a
    callable ``(xp, Y)`` applying it in place."""
    if not activation or activation == "Relu":
        return activation
    if activation not in ACTIVATIONS:
        raise ValueError(f"FusedConv: unsupported activation {activation!r}")
    params = tuple(params) if params else None

    def apply(xp, Y):
        activate(xp, Y, activation, params, "FusedConv")

    apply.__name__ = activation
    apply.activation, apply.params = activation, params  # for compiled epilogues
    return apply


def _hard_sigmoid(xp, Y, alpha, beta, out=None):
    t = xp.multiply(Y, Y.dtype.type(alpha), out=out)
    t += Y.dtype.type(beta)
    xp.maximum(t, 0, out=t)
    xp.minimum(t, 1, out=t)
    return t


#: activations numpy applies in one pass after the bias's: on fewer values than
#: SMALL_EPILOGUE those two ufunc calls beat a call of the compiled epilogue (~3.5 us a
#: call here; numpy's bias and tanh on 4096 values 2.3 us, on 16384 7: the C pass 8)
_ONE_PASS = frozenset({"", "Relu", "Clip", "Tanh"})
SMALL_EPILOGUE = 16384


def _native_code(xp, Y, activation: str, params) -> ActivationArgs | None:
    """The C epilogue's (code, p0, p1) for ``activation`` on the numpy float32 array Y,
    or None (numpy's passes then)."""
    if Y.size == 0 or (Y.size <= SMALL_EPILOGUE and activation in _ONE_PASS) \
            or not library.takes(xp, Y):
        return None
    return activation_args(activation, params)


def _native_last_axis(Y, bias, act: ActivationArgs) -> None:
    """act(Y + bias) in place, bias (K,) along Y's last axis (or None), by native/act.c
    (16 lanes a step), the rows split over the library's workers."""
    row_kernels.last_axis(Y.reshape(-1, Y.shape[-1]), bias, *act)


def _activate_after(xp, Y, activation: str, params) -> None:
    """``activation`` in place on a product whose bias is added already."""
    act = _native_code(xp, Y, activation, params)
    if act is not None and Y.flags.c_contiguous:
        _native_last_axis(Y, None, act)
    else:
        activate(xp, Y, activation, params, "FusedMatMul")


@kernel("FusedMatMul", since=1, domain=FUSED_DOMAIN,
        specialize=fused_matmul_hook(lambda: FusedMatMul,
                                     _activate_after))
def FusedMatMul(xp, A, B, bias=None, activation="", activation_params=None):
    """``activation(MatMul(A, B) + bias)``, bias (N,) along the last axis; from MatMul+Add
    and from Gemm (alpha = beta = 1, transA = 0; transB folded into B by the pass)."""
    (Ac, Bc), back = _float_operands(xp, A, B)
    Y = xp.asarray(product(xp, Ac, Bc))
    if Y.ndim == 0:  # 1-D @ 1-D: a 0-d result, which in-place steps would turn into a scalar
        Y = Y.reshape(1)
        shape = ()
    else:
        shape = None
    act = _native_code(xp, Y, activation, activation_params)
    if act is not None and (bias is None or bias.shape == Y.shape[-1:]) and Y.flags.c_contiguous:
        _native_last_axis(Y, bias, act)
    else:
        if bias is not None:
            Y += bias.astype(Y.dtype, copy=False)
        activate(xp, Y, activation, activation_params, "FusedMatMul")
    if shape is not None:
        Y = Y.reshape(shape)
    if back is not None:
        Y = Y.astype(back)
    return (Y,)


@kernel("FusedGelu", since=1, domain=FUSED_DOMAIN)
def FusedGelu(xp, X, approximate="none"):
    """The Gelu of opset 20 (approximate "none": erf, "tanh": tanh), for the node chains
    exporters write for it at earlier opsets (torch's nn.GELU and gelu_new)."""
    return Gelu(xp, X, approximate=approximate)
