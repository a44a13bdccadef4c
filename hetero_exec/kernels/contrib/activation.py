"""onnxruntime's activations and bias sums: Gelu, FastGelu, BiasGelu, QuickGelu, BiasAdd
(com.microsoft). The GELUs are erf_gelu.py's (compiled on the host)."""

from __future__ import annotations

import numpy as np

from hetero_exec.kernels import fused as own
from hetero_exec.kernels.contrib import schemas
from hetero_exec.kernels.contrib.schemas import FLOATS, MS_DOMAIN, define
from hetero_exec.kernels.erf_gelu import Gelu as _gelu
from hetero_exec.kernels.registry import kernel

define("Gelu", ["X:T"], ["Y:T"], {"T": FLOATS}, infer=schemas.same_as(0))
define("FastGelu", ["X:T", "bias:T?"], ["Y:T"], {"T": FLOATS}, infer=schemas.same_as(0))
define("BiasGelu", ["A:T", "B:T"], ["C:T"], {"T": FLOATS}, infer=schemas.same_as(0))
define("QuickGelu", ["X:T"], ["Y:T"], {"T": FLOATS}, {"alpha": "f"}, schemas.same_as(0))
define("BiasAdd", ["X:T", "bias:T", "skip:T"], ["Y:T"],
       {"T": ("tensor(float16)", "tensor(float)")}, infer=schemas.same_as(0))


@kernel("Gelu", since=1, domain=MS_DOMAIN)
def Gelu(xp, X):
    """x * (1 + erf(x / sqrt 2)) / 2."""
    return _gelu(xp, X, "none")


def _gelu_of_sum(xp, A, B, activation: str):
    """GELU of A + B: on the host the sum's fresh array takes the compiled GELU in place
    (one pass less than a separate GELU's output)."""
    Y = A + B
    if Y.flags.c_contiguous and Y.dtype in (np.float32, np.float64):
        act = own._native_code(xp, Y, activation, None)
        if act is not None:
            own._native_last_axis(Y, None, act)
            return (Y,)
    return _gelu(xp, Y, "tanh" if activation == "GeluTanh" else "none")


@kernel("FastGelu", since=1, domain=MS_DOMAIN)
def FastGelu(xp, X, bias=None):
    """The tanh GELU of X (+ bias)."""
    if bias is None:
        return _gelu(xp, X, "tanh")
    return _gelu_of_sum(xp, X, bias, "GeluTanh")


@kernel("BiasGelu", since=1, domain=MS_DOMAIN)
def BiasGelu(xp, A, B):
    """The erf GELU of A + B (B a bias along the last axis)."""
    return _gelu_of_sum(xp, A, B, "Gelu")


@kernel("QuickGelu", since=1, domain=MS_DOMAIN)
def QuickGelu(xp, X, alpha=1.702):
    """x * sigmoid(alpha * x)."""
    cdt = np.float32 if X.dtype.itemsize < 4 else X.dtype
    x = X.astype(cdt, copy=False)
    t = x * np.dtype(cdt).type(-alpha)
    with np.errstate(over="ignore"):  # exp -> inf gives x / inf = 0, as wanted
        xp.exp(t, out=t)
    t += 1
    return ((x / t).astype(X.dtype, copy=False),)


@kernel("BiasAdd", since=1, domain=MS_DOMAIN)
def BiasAdd(xp, X, bias, skip):
    """X + bias + skip (X and skip (N, S, C), bias (C,))."""
    Y = X + skip
    Y += bias
    return (Y,)
