"""Internal ops of the fusion passes (hetero_exec/placement/fusions.py), in the
"hetero_exec" domain: several ONNX nodes computed as one kernel, with the later steps
in place on the first one's fresh output. FusedConv lives with Conv in conv.py.
"""

from __future__ import annotations

from hetero_exec.kernels.elementwise import Gelu
from hetero_exec.kernels.linalg import _float_operands
from hetero_exec.kernels.registry import kernel

FUSED_DOMAIN = "hetero_exec"


def _activate(xp, Y, activation, op):
    if activation == "Relu":
        xp.maximum(Y, 0, out=Y)
    elif activation:
        raise ValueError(f"{op}: unsupported activation {activation!r}")


@kernel("FusedMatMul", since=1, domain=FUSED_DOMAIN)
def FusedMatMul(xp, A, B, bias=None, activation=""):
    """``activation(MatMul(A, B) + bias)``, bias (N,) along the last axis; from MatMul+Add
    and from Gemm (alpha = beta = 1, transA = 0; transB folded into B by the pass)."""
    (Ac, Bc), back = _float_operands(xp, A, B)
    Y = xp.asarray(xp.matmul(Ac, Bc))
    if Y.ndim == 0:  # 1-D @ 1-D: a 0-d result, which in-place steps would turn into a scalar
        Y = Y.reshape(1)
        shape = ()
    else:
        shape = None
    if bias is not None:
        Y += bias.astype(Y.dtype, copy=False)
    _activate(xp, Y, activation, "FusedMatMul")
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
