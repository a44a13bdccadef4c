"""Rotary position embedding, Llama style (rotate_half), -> FusedRotary::

    x1 = x[..., :h]; x2 = x[..., h:]
    y = x * cos + Concat(-x2, x1) * sin

(Slice, Slice, Neg, Concat, Mul, Mul, Add; products and the sum in either order).
"""

from __future__ import annotations

from onnx import helper

from hetero_exec.ir.graph import Graph, Node
from hetero_exec.kernels.fused import FUSED_DOMAIN
from hetero_exec.placement.fusions.rewriter import Region, Rewriter, attr, other

_END = 2**31 - 1  # an end at or past this is "to the end" (exporters write INT64_MAX)


def _last_axis(rw: Rewriter, x: str, axis: int) -> bool:
    rank = rw.rank(x)
    return axis == -1 or (rank is not None and axis == rank - 1)


def _slice_range(rw: Rewriter, node: Node) -> tuple[str, int, int] | None:
    """(x, start, end) of a unit-step Slice of x's last axis; end None-free (_END for open)."""
    if rw.graph.opset("") < 10:
        starts, ends, axes = attr(node, "starts", None), attr(node, "ends", None), attr(node, "axes", None)
        steps = None
    else:
        ins = list(node.inputs) + [""] * (5 - len(node.inputs))
        starts, ends = rw.ints(ins[1]), rw.ints(ins[2])
        axes = rw.ints(ins[3]) if ins[3] else None
        steps = rw.ints(ins[4]) if ins[4] else None
        if (ins[3] and axes is None) or (ins[4] and steps is None):
            return None
    x = node.inputs[0]
    if starts is None or ends is None or len(starts) != 1 or len(ends) != 1:
        return None
    if axes is None:
        axes = [0]
    if len(axes) != 1 or not _last_axis(rw, x, axes[0]) or (steps is not None and steps != [1]):
        return None
    start, end = starts[0], ends[0]
    if start < 0:
        return None
    return x, start, min(end, _END)


def _rotate_half(rw: Rewriter, cat: Node) -> tuple[str, int, list[Node]] | None:
    """Concat(Neg(x[..., h:]), x[..., :h]) on the last axis: (x, h, nodes)."""
    if len(cat.inputs) != 2 or not _last_axis(rw, cat.inputs[0], int(attr(cat, "axis", 0))):
        return None
    neg = rw.producer(cat.inputs[0])
    s1 = rw.producer(cat.inputs[1])
    if not rw.onnx_op(neg, "Neg") or not rw.feeds_only(neg, cat) or not rw.onnx_op(s1, "Slice") \
            or not rw.feeds_only(s1, cat):
        return None
    s2 = rw.producer(neg.inputs[0])
    if not rw.onnx_op(s2, "Slice") or not rw.feeds_only(s2, neg):
        return None
    r1, r2 = _slice_range(rw, s1), _slice_range(rw, s2)
    if r1 is None or r2 is None or r1[0] != r2[0]:
        return None
    x, start1, h = r1
    _, h2, end2 = r2
    shape = rw.shape(x)
    if start1 != 0 or h2 != h or h <= 0 or shape is None or not isinstance(shape[-1], int):
        return None
    if h >= shape[-1] or end2 < shape[-1]:
        return None
    return x, h, [s1, s2, neg, cat]


def _rotary(rw: Rewriter, cat: Node) -> None:
    found = _rotate_half(rw, cat)
    if found is None:
        return
    x, h, nodes = found
    m2 = rw.sole_reader(cat.outputs[0])
    if not rw.onnx_op(m2, "Mul") or len(m2.inputs) != 2:
        return
    sin = other(m2, cat.outputs[0])
    add = rw.sole_reader(m2.outputs[0])
    if not rw.onnx_op(add, "Add") or len(add.inputs) != 2:
        return
    m1 = rw.producer(other(add, m2.outputs[0]))
    if not rw.onnx_op(m1, "Mul") or len(m1.inputs) != 2 or x not in m1.inputs or not rw.feeds_only(m1, add):
        return
    cos = other(m1, x)
    out = add.outputs[0]
    if not rw.float_value(x) or not all(_along(rw, t, x) for t in (cos, sin)):
        return
    rw.fuse(nodes + [m2, m1, add], "FusedRotary", FUSED_DOMAIN, [x, cos, sin], out,
            {"split": helper.make_attribute("split", h)})


def _along(rw: Rewriter, t: str, x: str) -> bool:
    """``t`` (cos or sin) multiplies x elementwise: x's dtype, no higher rank, and a last
    dim of x's (or 1, or unknown)."""
    v = rw.graph.values.get(t)
    shape = rw.graph.initializers[t].shape if t in rw.graph.initializers else (
        v.shape if v is not None else None)
    xs = rw.shape(x)
    if rw.dtype(t) != rw.dtype(x) or shape is None or xs is None or len(shape) > len(xs):
        return False
    return not shape or shape[-1] in (1, xs[-1], None)


def fuse_rotary(graph: Graph, region: Region | None = None) -> Graph | None:
    rw = Rewriter(graph, region)
    for node in list(graph.nodes):
        if rw.onnx_op(node, "Concat"):
            _rotary(rw, node)
    return graph if rw.finish() else None
