"""Norms and softmax over trailing axes, float32: the C library's row kernels
(native/norm.c, softmax.c) over a contiguous (rows, cols) view; the skip variants' sums
as element-wise records before them."""

from __future__ import annotations

import math

import numpy as np

from hetero_exec.exec.program.place import NotLowered, Place
from hetero_exec.exec.program.registry import lowers
from hetero_exec.kernels.contrib.schemas import MS_DOMAIN
from hetero_exec.kernels.fused import FUSED_DOMAIN

F32 = np.dtype(np.float32)


def _vector(b, v: Place | None, tail: tuple[int, ...]) -> Place | None:
    """A scale or bias as cols contiguous values, when it covers the normalised axes
    exactly (its leading dims 1)."""
    if v is None:
        return None
    if v.dtype != F32:
        raise NotLowered(f"a norm's scale of {v.dtype}")
    cols = math.prod(tail)
    shape = tuple(d for d in v.shape)
    while shape and shape[0] == 1 and len(shape) > len(tail):
        shape = shape[1:]
    if shape != tail and not (len(tail) and v.size == cols and shape == (cols,)):
        raise NotLowered(f"a norm's scale of {v.shape} over {tail}")
    return b.contiguous(v).reshape((cols,))


def row_norm(b, x: Place, scale, bias, eps: float, rms: bool, axis: int, outs,
             stats: bool = False) -> list[Place]:
    """[Y, mean, inv std] (the last two when ``stats``) of x normalised over axis.."""
    if x.dtype != F32:
        raise NotLowered(f"a norm of {x.dtype}")
    axis = axis % len(x.shape)
    tail = x.shape[axis:]
    rows, cols = math.prod(x.shape[:axis]), math.prod(tail)
    x = b.contiguous(x)
    g, bb = _vector(b, scale, tail), _vector(b, bias, tail)
    out = b.like(outs[0])
    mean = b.scratch((rows,), F32) if stats else None
    inv = b.scratch((rows,), F32) if stats else None
    b.emit("OP_ROW_NORM", tensors=[out, x, g, bb, mean, inv], p=[rows, cols, int(rms)],
           f=[float(eps)], parts=b.parts(rows, 8.0 * rows * cols))
    res = [out]
    if stats:
        stat_shape = x.shape[:axis] + (1,) * len(tail)
        res += [mean.reshape(stat_shape), inv.reshape(stat_shape)]
    return res


@lowers("FusedRMSNorm", domain=FUSED_DOMAIN)
def fused_rms_norm(b, st, ins, outs):
    return row_norm(b, ins[0], ins[1] if len(ins) > 1 else None, None,
                    st.kwargs.get("epsilon", 1e-5), True, st.kwargs.get("axis", -1), outs)


@lowers("FusedLayerNorm", domain=FUSED_DOMAIN)
def fused_layer_norm(b, st, ins, outs):
    if st.kwargs.get("axes") is not None:
        raise NotLowered("FusedLayerNorm over chosen axes")
    return row_norm(b, ins[0], ins[1] if len(ins) > 1 else None, ins[2] if len(ins) > 2 else None,
                    st.kwargs.get("epsilon", 1e-5), False, st.kwargs.get("axis", -1), outs)


@lowers("LayerNormalization")
def layer_norm(b, st, ins, outs):
    if st.kwargs.get("stash_type", 1) != 1 and ins[0].dtype != F32:
        raise NotLowered("a stash type other than float32")
    res = row_norm(b, ins[0], ins[1], ins[2] if len(ins) > 2 else None,
                   st.kwargs.get("epsilon", 1e-5), False, st.kwargs.get("axis", -1), outs,
                   stats=len(outs) > 1)
    return res[:len(outs)]


@lowers("RMSNormalization")
@lowers("SimplifiedLayerNormalization")
@lowers("SimplifiedLayerNormalization", domain=MS_DOMAIN)
def rms_norm(b, st, ins, outs):
    if len(outs) > 1:
        raise NotLowered("the inverse std output")
    if ins[1] is not None and ins[1].dtype != ins[0].dtype:
        raise NotLowered("a scale of another type")
    return row_norm(b, ins[0], ins[1], None, st.kwargs.get("epsilon", 1e-5), True,
                    st.kwargs.get("axis", -1), outs)


def _skip_sum(b, x: Place, skip: Place, bias: Place | None, like) -> Place:
    s = b.like(like)
    b.elementwise("OP_BINARY", b.codes["B_ADD"], s, [x, skip])
    if bias is not None:
        b.elementwise("OP_BINARY", b.codes["B_ADD"], s, [s, bias])
    return s


@lowers("SkipLayerNormalization", "SkipSimplifiedLayerNormalization", domain=MS_DOMAIN)
def skip_norm(b, st, ins, outs):
    simplified = st.node.op_type == "SkipSimplifiedLayerNormalization"
    x, skip, gamma = ins[0], ins[1], ins[2]
    beta = None if simplified else (ins[3] if len(ins) > 3 else None)
    bias = ins[3 if simplified else 4] if len(ins) > (3 if simplified else 4) else None
    for p in (x, skip, gamma, beta, bias):
        if p is not None and p.dtype != F32:
            raise NotLowered("a skip norm of float16")
    s = _skip_sum(b, x, skip, bias, outs[0])
    res = row_norm(b, s, gamma, beta, st.kwargs.get("epsilon", 1e-12), simplified, -1,
                   outs, stats=len(outs) > 1)
    if len(outs) > 3:
        res.append(s)
    return res[:len(outs)]


@lowers("Softmax")
def softmax(b, st, ins, outs):
    x = ins[0]
    if x.dtype != F32 or not x.shape:
        raise NotLowered(f"a softmax of {x.dtype}")
    axis = st.kwargs.get("axis", -1 if st.node.op_type == "Softmax" else 1)
    if axis % len(x.shape) != len(x.shape) - 1:
        raise NotLowered("a softmax over an inner axis")
    x = b.contiguous(x)
    n = x.shape[-1]
    rows = x.size // n if n else 0
    out = b.like(outs[0])
    if rows:
        b.emit("OP_SOFTMAX", tensors=[out, x], p=[rows, n], parts=b.parts(rows, 16.0 * x.size))
    return [out]
