"""onnxruntime's fused products: FusedMatMul, FusedGemm, FusedConv (com.microsoft).

FusedMatMul without transposes or scaling is hetero_exec's own FusedMatMul (packed
constant weights on the host); FusedConv is conv.py's FusedConv (the same epilogue),
with LeakyRelu, which that epilogue lacks, applied after it.
"""

from __future__ import annotations

from hetero_exec.kernels import fused as own
from hetero_exec.kernels._packed import fused_matmul_hook
from hetero_exec.kernels.contrib import schemas
from hetero_exec.kernels.contrib.schemas import MS_DOMAIN, define
from hetero_exec.kernels.conv import FusedConv as _fused_conv
from hetero_exec.kernels.conv import _specialize as _conv_specialize
from hetero_exec.kernels.registry import kernel

_FLOATS = ("tensor(float16)", "tensor(float)", "tensor(double)", "tensor(bfloat16)")


def _infer_matmul(ctx) -> None:
    a, b = schemas.input_dims(ctx, 0), schemas.input_dims(ctx, 1)
    dims = None
    if a is not None and b is not None and len(a) >= 2 and len(b) >= 2 \
            and not schemas.attr_int(ctx, "transBatchA") and not schemas.attr_int(ctx, "transBatchB"):
        m = a[-1] if schemas.attr_int(ctx, "transA") else a[-2]
        n = b[-2] if schemas.attr_int(ctx, "transB") else b[-1]
        batch_a, batch_b = a[:-2], b[:-2]
        if len(batch_a) < len(batch_b):
            batch_a, batch_b = batch_b, batch_a
        batch = list(batch_a)
        off = len(batch_a) - len(batch_b)
        for i, d in enumerate(batch_b):
            if batch[off + i] == 1:
                batch[off + i] = d
        dims = batch + [m, n]
    schemas.set_output(ctx, 0, schemas.elem_type(ctx, 0), dims)


def _infer_gemm(ctx) -> None:
    a, b = schemas.input_dims(ctx, 0), schemas.input_dims(ctx, 1)
    dims = None
    if a is not None and b is not None and len(a) == 2 and len(b) == 2:
        dims = [a[1] if schemas.attr_int(ctx, "transA") else a[0],
                b[0] if schemas.attr_int(ctx, "transB") else b[1]]
    schemas.set_output(ctx, 0, schemas.elem_type(ctx, 0), dims)


define("FusedMatMul", ["A:T", "B:T"], ["Y:T"], {"T": _FLOATS},
       {"alpha": "f", "transA": "i", "transB": "i", "transBatchA": "i", "transBatchB": "i"},
       _infer_matmul)
define("FusedGemm", ["A:T", "B:T", "C:T?"], ["Y:T"],
       {"T": ("tensor(float16)", "tensor(float)", "tensor(double)", "tensor(uint32)",
              "tensor(uint64)", "tensor(int32)", "tensor(int64)")},
       {"alpha": "f", "beta": "f", "transA": "i", "transB": "i", "activation": "s",
        "activation_alpha": "f", "activation_beta": "f", "activation_gamma": "f"}, _infer_gemm)
define("FusedConv", ["X:T", "W:T", "B:T?", "Z:T?"], ["Y:T"],
       {"T": ("tensor(float16)", "tensor(float)", "tensor(double)")},
       {"activation": "s", "activation_params": "floats", "auto_pad": "s", "dilations": "ints",
        "group": "i", "kernel_shape": "ints", "pads": "ints", "strides": "ints"})


# --------------------------------------------------------------------------- FusedMatMul


def _operand(xp, X, trans_batch, trans):
    if trans_batch:
        r = X.ndim
        if r < 3:
            raise ValueError("FusedMatMul: transBatch needs inputs of rank 3 or more")
        X = X.transpose(tuple(range(1, r - 1)) + (0, r - 1))
    if trans:
        X = xp.swapaxes(X, -1, -2) if X.ndim >= 2 else X
    return X


def _plain(attrs) -> bool:
    return (attrs.get("alpha", 1.0) == 1.0 and not attrs.get("transA") and not attrs.get("transB")
            and not attrs.get("transBatchA") and not attrs.get("transBatchB"))


def _matmul_specialize(xp, kwargs, inputs):
    """Without transposes or scaling: the packed-weight product of our own FusedMatMul."""
    if not _plain(kwargs):
        return None

    def unpacked(xp, A, B, bias=None, **attrs):  # the hook's fallback, in its signature
        return FusedMatMul(xp, A, B, **attrs)

    return fused_matmul_hook(lambda: unpacked, own._activate_after)(xp, {}, inputs)


@kernel("FusedMatMul", since=1, domain=MS_DOMAIN, specialize=_matmul_specialize)
def FusedMatMul(xp, A, B, alpha=1.0, transA=0, transB=0, transBatchA=0, transBatchB=0):
    """alpha * op(A) @ op(B); op transposes the last two axes (transA/B), after moving
    the first axis to just before the last two (transBatchA/B)."""
    if transBatchA or transBatchB:
        if A.ndim != B.ndim or A.ndim < 3:
            raise ValueError("FusedMatMul: transBatchA/B need inputs of one rank, 3 or more")
    a = _operand(xp, A, transBatchA, transA)
    b = _operand(xp, B, transBatchB, transB)
    Y = own.FusedMatMul(xp, a, b)[0]
    if alpha != 1.0:
        Y = Y * Y.dtype.type(alpha)
    return (Y,)


# --------------------------------------------------------------------------- FusedGemm


def _activation(xp, Y, activation: str, alpha: float, beta: float, gamma: float):
    """onnxruntime's fused activations, in place on the fresh float array Y."""
    if not activation:
        return Y
    if activation == "LeakyRelu":
        a = Y.dtype.type(alpha if alpha else 0.01)
        return xp.where(Y < 0, Y * a, Y).astype(Y.dtype, copy=False)
    if activation == "Elu":
        a = Y.dtype.type(alpha if alpha else 1.0)
        return xp.where(Y < 0, a * (xp.exp(xp.minimum(Y, 0)) - 1), Y).astype(Y.dtype, copy=False)
    if activation == "HardSigmoid":
        return own.activate(xp, Y, "HardSigmoid", (alpha if alpha else 0.2,
                                                   beta if beta else 0.5))
    if activation in ("Relu", "Tanh", "Sigmoid"):
        return own.activate(xp, Y, activation)
    raise ValueError(f"FusedGemm: unsupported activation {activation!r}")


_GEMM_ACTIVATIONS = frozenset({"", "Relu", "Tanh", "Sigmoid", "LeakyRelu", "Elu", "HardSigmoid"})


def _gemm_refuse(attrs, given, num_outputs) -> str | None:
    act = attrs.get("activation", "")
    return None if act in _GEMM_ACTIVATIONS else f"activation {act!r} is not supported"


def _conv_refuse(attrs, given, num_outputs) -> str | None:
    act = attrs.get("activation", "")
    ok = act in own.ACTIVATIONS or act == "LeakyRelu"
    return None if ok else f"activation {act!r} is not supported"


@kernel("FusedGemm", since=1, domain=MS_DOMAIN, refuse=_gemm_refuse)
def FusedGemm(xp, A, B, C=None, alpha=1.0, beta=1.0, transA=0, transB=0, activation="",
              activation_alpha=0.0, activation_beta=0.0, activation_gamma=0.0):
    """activation(alpha * op(A) @ op(B) + beta * C)."""
    a = A.T if transA else A
    b = B.T if transB else B
    Y = xp.asarray(own.product(xp, a, b))
    if alpha != 1.0:
        Y *= Y.dtype.type(alpha)
    if C is not None and beta != 0:
        Y = Y + (C if beta == 1.0 else C * C.dtype.type(beta)).astype(Y.dtype, copy=False)
    if isinstance(activation, bytes):
        activation = activation.decode()
    return (_activation(xp, Y, activation, activation_alpha, activation_beta, activation_gamma),)


# --------------------------------------------------------------------------- FusedConv


def _conv_hook(xp, kwargs, inputs):
    act = kwargs.get("activation", "")
    if act not in own.ACTIVATIONS:
        return None
    return _conv_specialize("FusedConv")(xp, kwargs, inputs)


@kernel("FusedConv", since=1, domain=MS_DOMAIN, specialize=_conv_hook, refuse=_conv_refuse)
def FusedConv(xp, X, W, B=None, Z=None, activation="", activation_params=None, auto_pad="NOTSET",
              dilations=None, group=1, kernel_shape=None, pads=None, strides=None):
    """activation(Conv(X, W, B) + Z)."""
    if isinstance(activation, bytes):
        activation = activation.decode()
    conv = dict(auto_pad=auto_pad, dilations=dilations, group=group, kernel_shape=kernel_shape,
                pads=pads, strides=strides)
    if activation in own.ACTIVATIONS:
        return _fused_conv(xp, X, W, B, Z, activation, activation_params, **conv)
    Y = _fused_conv(xp, X, W, B, Z, "", None, **conv)[0]
    params = list(activation_params or [])
    return (_activation(xp, Y, activation, params[0] if params else 0.0, 0.0, 0.0),)
