"""Shape and data movement: reshapes, transposes, slices, splits and broadcasts are views
(no record); Concat and Gather copy; Range fills. Their host inputs (shape, axes, starts)
are the same on every run of a bound plan (`ProgramBuilder.static`)."""

from __future__ import annotations

import numpy as np

from hetero_exec.exec.program.place import NotLowered
from hetero_exec.exec.program.registry import lowers


def _norm(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


@lowers("Reshape", "Flatten", "Squeeze", "Unsqueeze")
def reshape(b, st, ins, outs):
    x = ins[0]
    if x is None:
        raise NotLowered("no input")
    view = x.reshape(tuple(outs[0].shape))
    if view is None:
        view = b.contiguous(x).reshape(tuple(outs[0].shape))
    return [view]


@lowers("Transpose")
def transpose(b, st, ins, outs):
    x = ins[0]
    perm = st.kwargs.get("perm")
    perm = tuple(reversed(range(len(x.shape)))) if perm is None else tuple(int(p) for p in perm)
    return [x.transpose(perm)]


def _ints(b, st, i, default=None):
    if i < len(st.inputs) and st.inputs[i]:
        return [int(v) for v in b.static(st.inputs[i]).reshape(-1)]
    return default


@lowers("Slice")
def slice_(b, st, ins, outs):
    x = ins[0]
    if len(st.inputs) > 1:
        starts, ends = _ints(b, st, 1), _ints(b, st, 2)
        axes, steps = _ints(b, st, 3), _ints(b, st, 4)
    else:  # opset 1: attributes
        starts, ends = list(st.kwargs.get("starts", ())), list(st.kwargs.get("ends", ()))
        axes, steps = st.kwargs.get("axes"), None
    rank = len(x.shape)
    axes = [_norm(int(a), rank) for a in axes] if axes else list(range(len(starts)))
    steps = steps or [1] * len(starts)
    for start, end, axis, step in zip(starts, ends, axes, steps):
        dim = x.shape[axis]
        start += dim if start < 0 else 0
        end += dim if end < 0 else 0
        if step > 0:
            start, end = min(max(start, 0), dim), min(max(end, 0), dim)
        else:
            start, end = min(max(start, 0), dim - 1), min(max(end, -1), dim - 1)
        x = x.slice(axis, start, end, step)
    if x.shape != tuple(outs[0].shape):
        raise NotLowered(f"Slice gave {x.shape}, the kernel {outs[0].shape}")
    return [x]


@lowers("Split")
def split(b, st, ins, outs):
    x = ins[0]
    axis = _norm(int(st.kwargs.get("axis", 0)), len(x.shape))
    pos, views = 0, []
    for o in outs:
        n = o.shape[axis]
        views.append(x.slice(axis, pos, pos + n, 1))
        pos += n
    return views


@lowers("Expand")
def expand(b, st, ins, outs):
    return [ins[0].broadcast(tuple(outs[0].shape))]


@lowers("Concat")
def concat(b, st, ins, outs):
    if len(ins) == 1:
        return [b.readable(ins[0])]
    out = b.like(outs[0])
    axis = _norm(int(st.kwargs.get("axis", 0)), len(out.shape))
    pos = 0
    for x in ins:
        if x is None or x.dtype != out.dtype:
            raise NotLowered("Concat of mixed types")
        n = x.shape[axis]
        if n:
            b.elementwise("OP_COPY", 0, out.slice(axis, pos, pos + n, 1), [x])
        pos += n
    return [out]


@lowers("Gather")
def gather(b, st, ins, outs):
    data, idx = b.readable(ins[0]), b.readable(ins[1])
    if idx.dtype not in (np.dtype(np.int64), np.dtype(np.int32)):
        raise NotLowered(f"Gather indices of {idx.dtype}")
    data, idx = b.contiguous(data), b.contiguous(idx)
    axis = _norm(int(st.kwargs.get("axis", 0)), len(data.shape))
    outer = int(np.prod(data.shape[:axis], dtype=np.int64))
    inner = int(np.prod(data.shape[axis + 1:], dtype=np.int64)) * data.itemsize
    out = b.like(outs[0])
    b.emit("OP_GATHER", tensors=[out, data, idx],
           p=[outer, data.shape[axis], idx.size, inner])
    return [out]


@lowers("Range")
def range_(b, st, ins, outs):
    start, _limit, delta = ins
    if outs[0].ndim != 1:
        raise NotLowered("Range of rank != 1")
    out = b.like(outs[0])
    for x in (start, delta):
        b.readable(x)
        if x.dtype != out.dtype or x.size != 1:
            raise NotLowered("Range of mixed types")
    b.emit("OP_RANGE", dims=[out.size], tensors=[out, start, delta])
    return [out]


@lowers("GatherND")
def gather_nd(b, st, ins, outs):
    """Indices the same on every run (an export's mask arithmetic): their rows into the
    data, found once, then a Gather of those rows at each run."""
    from hetero_exec.kernels.gather import _nd_rows

    data = b.readable(ins[0])
    indices = b.static(st.inputs[1])
    shape_only = np.empty(data.shape, np.uint8)  # (_nd_rows reads the data's shape only)
    rows, table = _nd_rows(np, shape_only, indices, int(st.kwargs.get("batch_dims", 0)))
    data = b.contiguous(data).reshape(tuple(table.shape))
    out = b.like(outs[0])
    inner = int(np.prod(table.shape[1:], dtype=np.int64)) * data.itemsize
    idx = b.const(np.ascontiguousarray(rows, dtype=np.int64))
    b.emit("OP_GATHER", tensors=[out, data, idx], p=[1, table.shape[0], rows.size, inner])
    return [out]
