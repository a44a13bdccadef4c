"""Reductions (Sum, Mean, Max, Min, Prod) over constant axes, and ArgMax over the last
axis: float32 (summed in double) and integer inputs."""

from __future__ import annotations

import numpy as np

from hetero_exec.exec.program.lower_movement import _ints
from hetero_exec.exec.program.place import NotLowered, Place, contiguous_strides
from hetero_exec.exec.program.registry import lowers

CODES = {"ReduceSum": "R_SUM", "ReduceMean": "R_MEAN", "ReduceMax": "R_MAX",
         "ReduceMin": "R_MIN", "ReduceProd": "R_PROD"}
TYPES = (np.dtype(np.float32), np.dtype(np.int64), np.dtype(np.int32))


@lowers(*CODES)
def reduce(b, st, ins, outs):
    x = b.readable(ins[0])
    op = st.node.op_type
    if x.dtype not in TYPES or outs[0].dtype != x.dtype:
        raise NotLowered(f"{op} of {x.dtype}")
    if op == "ReduceMean" and x.dtype != TYPES[0] or op == "ReduceProd" and x.dtype == TYPES[2]:
        raise NotLowered(f"{op} of {x.dtype}")
    axes = _ints(b, st, 1) if len(st.inputs) > 1 else st.kwargs.get("axes")
    rank = len(x.shape)
    if not axes:
        if st.kwargs.get("noop_with_empty_axes", 0):
            return [x]
        axes = list(range(rank))
    axes = sorted({int(a) % rank for a in axes}) if rank else []
    if x.size == 0:
        raise NotLowered(f"{op} of an empty input")
    out = b.like(outs[0])
    kept = tuple(1 if i in axes else d for i, d in enumerate(x.shape))
    # the output seen over the input's dims: stride 0 along the reduced ones
    acc = Place(out.buf, out.off, x.shape,
                tuple(0 if i in axes else s for i, s in enumerate(contiguous_strides(kept))),
                out.dtype)
    count = 1
    for a in axes:
        count *= x.shape[a]
    from hetero_exec.exec.program.place import coalesce

    dims, (so, si) = coalesce(x.shape, [acc.strides, x.strides])
    if not dims:
        dims, so, si = (1,), (0,), (0,)
    b.emit("OP_REDUCE", code=b.codes[CODES[op]], dims=dims, tensors=[acc, x],
           strides=[so, si], p=[out.size], f=[1.0 / count])
    return [out]


@lowers("ArgMax")
def argmax(b, st, ins, outs):
    x = b.readable(ins[0])
    rank = len(x.shape)
    if x.dtype != TYPES[0] or not rank or st.kwargs.get("axis", 0) % rank != rank - 1 \
            or st.kwargs.get("select_last_index", 0):
        raise NotLowered("ArgMax other than the first maximum of the last axis")
    x = b.contiguous(x)
    n = x.shape[-1]
    out = b.like(outs[0])
    b.emit("OP_ARGMAX", tensors=[out, x], p=[x.size // n, n, n])
    return [out]
