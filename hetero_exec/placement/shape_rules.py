"""Shape rules of `placement/shape_bounds.py`: an op's output shapes as `symbolic.Dim`s
from its inputs' shapes and (small integer inputs) elements. A rule returns one shape
per output, None where it cannot tell; onnx's declared dims win over it where onnx
named them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from hetero_exec.ir.graph import Node
from hetero_exec.placement.symbolic import Dim, Poly, Span, constant, span

if TYPE_CHECKING:
    from hetero_exec.placement.shape_bounds import ShapeBounds

Shape = list  # list[Dim | None]: one entry per axis, None where nothing is known
#: an end this large means "to the end of the axis" (exporters write INT64_MAX or INT32_MAX)
OPEN_END = 2**31 - 1


def _axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def _same(sb: ShapeBounds, node: Node) -> list:
    s = sb.input_shape(node, 0)
    return [s for _ in node.outputs]


def _elementwise(sb: ShapeBounds, node: Node) -> list:
    return [sb.broadcast([sb.input_shape(node, i) for i, n in enumerate(node.inputs) if n])]


def _matmul(sb: ShapeBounds, node: Node) -> list:
    a, b = sb.input_shape(node, 0), sb.input_shape(node, 1)
    if a is None or b is None:
        return [None]
    if node.op_type == "FusedMatMul":
        a = _swap_last(a) if sb.attr(node, "transA", 0) else a
        b = _swap_last(b) if sb.attr(node, "transB", 0) else b
    if len(a) == 1 and len(b) == 1:
        return [[]]
    if len(a) == 1:
        return [b[:-2] + b[-1:]]
    if len(b) == 1:
        return [a[:-1]]
    batch = sb.broadcast([a[:-2], b[:-2]])
    return [None if batch is None else batch + [a[-2], b[-1]]]


def _attention(sb: ShapeBounds, node: Node) -> list:
    """FusedAttention: Q's shape, V's last axis."""
    q, v = sb.input_shape(node, 0), sb.input_shape(node, 2)
    if q is None or v is None:
        return [None]
    return [q[:-1] + v[-1:]]


def _swap_last(s: Shape) -> Shape:
    return s[:-2] + [s[-1], s[-2]] if len(s) >= 2 else s


def _gemm(sb: ShapeBounds, node: Node) -> list:
    a, b = sb.input_shape(node, 0), sb.input_shape(node, 1)
    if a is None or b is None or len(a) != 2 or len(b) != 2:
        return [None]
    m = a[1] if sb.attr(node, "transA", 0) else a[0]
    n = b[0] if sb.attr(node, "transB", 0) else b[1]
    return [[m, n]]


def _transpose(sb: ShapeBounds, node: Node) -> list:
    s = sb.input_shape(node, 0)
    if s is None:
        return [None]
    perm = sb.attr(node, "perm") or list(reversed(range(len(s))))
    return [[s[p] for p in perm]]


def _reshape(sb: ShapeBounds, node: Node) -> list:
    target = sb.input_elements(node, 1)
    if target is None:
        return [None]
    src = sb.input_shape(node, 0)
    allowzero = sb.attr(node, "allowzero", 0)
    out: Shape = []
    infer = None
    for i, t in enumerate(target):
        c = constant(t)
        if c == -1:
            infer = i
            out.append(None)
        elif c == 0 and not allowzero:
            out.append(src[i] if src is not None and i < len(src) else None)
        else:
            out.append(t)
    if infer is not None:
        out[infer] = _remaining(sb, src, [d for i, d in enumerate(out) if i != infer])
    return [out]


def _remaining(sb: ShapeBounds, src: Shape | None, others: Shape) -> Dim | None:
    """A ``-1`` of Reshape: the input's elements over the other dims'."""
    if src is None or any(d is None for d in src) or any(d is None for d in others):
        return None
    total = product(sb, src)
    rest = product(sb, others)
    q = sb.arith("//", total, rest)
    if isinstance(q, Span) and q.hi is None and span(total, sb.bounds).hi is not None:
        return Span(0, span(total, sb.bounds).hi)  # at most the whole input
    return q


def product(sb: ShapeBounds, dims: Shape) -> Dim:
    out: Dim = Poly.const(1)
    for d in dims:
        out = sb.arith("*", out, d)
    return out


def _flatten(sb: ShapeBounds, node: Node) -> list:
    s = sb.input_shape(node, 0)
    if s is None or any(d is None for d in s):
        return [None]
    axis = _axis(sb.attr(node, "axis", 1), len(s))
    return [[product(sb, s[:axis]), product(sb, s[axis:])]]


def _unsqueeze(sb: ShapeBounds, node: Node) -> list:
    s, axes = sb.input_shape(node, 0), sb.ints(node, 1, "axes")
    if s is None or axes is None:
        return [None]
    rank = len(s) + len(axes)
    axes = sorted(_axis(a, rank) for a in axes)
    out = list(s)
    for a in axes:
        out.insert(a, Poly.const(1))
    return [out]


def _squeeze(sb: ShapeBounds, node: Node) -> list:
    s, axes = sb.input_shape(node, 0), sb.ints(node, 1, "axes")
    if s is None:
        return [None]
    if axes is None:
        if (len(node.inputs) > 1 and node.inputs[1]) or any(d is None for d in s):
            return [None]
        return [[d for d in s if constant(d) != 1]]
    drop = {_axis(a, len(s)) for a in axes}
    return [[d for i, d in enumerate(s) if i not in drop]]


def _concat(sb: ShapeBounds, node: Node) -> list:
    shapes = [sb.input_shape(node, i) for i, n in enumerate(node.inputs) if n]
    if not shapes or any(s is None for s in shapes):
        return [None]
    axis = _axis(sb.attr(node, "axis", 0), len(shapes[0]))
    out = list(shapes[0])
    total: Dim | None = Poly()
    for s in shapes:
        total = sb.arith("+", total, s[axis])
    out[axis] = total
    return [out]


def _split(sb: ShapeBounds, node: Node) -> list:
    s = sb.input_shape(node, 0)
    if s is None:
        return [None] * len(node.outputs)
    axis = _axis(sb.attr(node, "axis", 0), len(s))
    sizes = sb.input_elements(node, 1)
    if sizes is None and "split" in node.attrs:
        sizes = [Poly.const(int(x)) for x in sb.attr(node, "split")]
    n = len([o for o in node.outputs])
    if sizes is None:
        part = sb.arith("//", s[axis], Poly.const(n))
        sizes = [part] * n
    return [s[:axis] + [d] + s[axis + 1:] for d in sizes]


def _slice(sb: ShapeBounds, node: Node) -> list:
    s = sb.input_shape(node, 0)
    if s is None:
        return [None]
    if len(node.inputs) > 1:  # opset 10: starts, ends, axes, steps as inputs
        starts, ends = sb.input_elements(node, 1), sb.input_elements(node, 2)
        axes = sb.ints(node, 3, "axes") if len(node.inputs) > 3 and node.inputs[3] else None
        steps = sb.ints(node, 4, "steps") if len(node.inputs) > 4 and node.inputs[4] else None
    else:
        starts = [Poly.const(int(x)) for x in sb.attr(node, "starts")]
        ends = [Poly.const(int(x)) for x in sb.attr(node, "ends")]
        axes, steps = sb.attr(node, "axes"), None
    given = [len(node.inputs) > i and bool(node.inputs[i]) for i in (3, 4)]
    if starts is None or ends is None or (given[0] and axes is None) or (given[1] and steps is None):
        return [None]
    axes = list(range(len(starts))) if axes is None else axes
    steps = [1] * len(starts) if steps is None else steps
    out = list(s)
    for a, b, e, k in zip(axes, starts, ends, steps):
        a = _axis(a, len(s))
        out[a] = _slice_length(sb, s[a], b, e, k)
    return [out]


def _slice_length(sb: ShapeBounds, dim: Dim | None, start: Dim, end: Dim, step: int) -> Dim | None:
    """The length of ``dim[start:end:step]``: exact for the exporters' forms (a constant
    start, an end that is a constant, a symbol, or open), a range otherwise."""
    b, e = constant(start), constant(end)
    if step != 1:
        whole = _slice_length(sb, dim, start, end, 1) if step > 0 else dim
        if step < 0:
            return None if dim is None else Span(0, span(dim, sb.bounds).hi, span(dim, sb.bounds).missing)
        return sb.arith("//", sb.arith("+", whole, Poly.const(step - 1)), Poly.const(step))
    if b is not None and b < 0:  # the last -b (at most)
        if e is not None and e >= OPEN_END:
            return _at_most(sb, Poly.const(-b), dim)
        if e is not None and e < 0:
            return Poly.const(max(e - b, 0))
        return None
    if b is None:
        return None if dim is None else Span(0, span(dim, sb.bounds).hi, span(dim, sb.bounds).missing)
    if e is not None and e >= OPEN_END:
        return None if dim is None else sb.arith("-", dim, Poly.const(b))
    if e is not None and e < 0:
        return None if dim is None else sb.arith("-", dim, Poly.const(b - e))
    return _at_most(sb, sb.arith("-", end, Poly.const(b)), dim)


def _at_most(sb: ShapeBounds, d: Dim | None, dim: Dim | None) -> Dim | None:
    """``d``, or ``dim`` where that is a constant below it (a slice past the end)."""
    cd, cdim = constant(d), constant(dim)
    if cd is not None and cdim is not None:
        return Poly.const(max(min(cd, cdim), 0))
    return d


def _gather(sb: ShapeBounds, node: Node) -> list:
    s, idx = sb.input_shape(node, 0), sb.input_shape(node, 1)
    if s is None or idx is None:
        return [None]
    axis = _axis(sb.attr(node, "axis", 0), len(s))
    return [s[:axis] + list(idx) + s[axis + 1:]]


def _indices_shaped(sb: ShapeBounds, node: Node) -> list:
    return [sb.input_shape(node, 1)]


def _expand(sb: ShapeBounds, node: Node) -> list:
    s, target = sb.input_shape(node, 0), sb.input_elements(node, 1)
    if target is None:
        return [None]
    return [sb.broadcast([s, list(target)])]


def _tile(sb: ShapeBounds, node: Node) -> list:
    s, reps = sb.input_shape(node, 0), sb.input_elements(node, 1)
    if s is None or reps is None or len(reps) != len(s):
        return [None]
    return [[sb.arith("*", d, r) for d, r in zip(s, reps)]]


def _range(sb: ShapeBounds, node: Node) -> list:
    start, limit, delta = (sb.input_elements(node, i) for i in range(3))
    if not start or not limit or not delta:
        return [None]
    span_ = sb.arith("-", limit[0], start[0])
    step = constant(delta[0])
    if step is None or step == 0:
        return [None]
    if step < 0:
        span_, step = sb.arith("-", Poly(), span_), -step
    return [[sb.arith("//", sb.arith("+", span_, Poly.const(step - 1)), Poly.const(step))]]


def _constant_of_shape(sb: ShapeBounds, node: Node) -> list:
    target = sb.input_elements(node, 0)
    return [None if target is None else list(target)]


def _shape(sb: ShapeBounds, node: Node) -> list:
    s = sb.input_shape(node, 0)
    if s is None:
        return [None]
    return [[Poly.const(len(shape_slice(sb, node, s)))]]


def shape_slice(sb: ShapeBounds, node: Node, s: Shape) -> Shape:
    start, end = sb.attr(node, "start", 0), sb.attr(node, "end")
    return s[start:end] if end is not None else s[start:]


def _scalar(sb: ShapeBounds, node: Node) -> list:
    return [[]]


def _reduce(sb: ShapeBounds, node: Node) -> list:
    s = sb.input_shape(node, 0)
    if s is None:
        return [None]
    axes = sb.ints(node, 1, "axes")
    keep = sb.attr(node, "keepdims", 1)
    if axes is None:
        if len(node.inputs) > 1 and node.inputs[1]:
            return [None]
        if sb.attr(node, "noop_with_empty_axes", 0):
            return [list(s)]
        axes = list(range(len(s)))
    drop = {_axis(a, len(s)) for a in axes}
    return [[Poly.const(1) if i in drop else d for i, d in enumerate(s) if keep or i not in drop]]


def _arg_reduce(sb: ShapeBounds, node: Node) -> list:
    s = sb.input_shape(node, 0)
    if s is None:
        return [None]
    axis = _axis(sb.attr(node, "axis", 0), len(s))
    keep = sb.attr(node, "keepdims", 1)
    return [[Poly.const(1) if i == axis else d for i, d in enumerate(s) if keep or i != axis]]


def _topk(sb: ShapeBounds, node: Node) -> list:
    s, k = sb.input_shape(node, 0), sb.input_elements(node, 1)
    if s is None or not k:
        return [None, None]
    axis = _axis(sb.attr(node, "axis", -1), len(s))
    out = s[:axis] + [k[0]] + s[axis + 1:]
    return [out, out]


def _pad(sb: ShapeBounds, node: Node) -> list:
    s = sb.input_shape(node, 0)
    pads = sb.input_elements(node, 1)
    if pads is None and "pads" in node.attrs:
        pads = [Poly.const(int(x)) for x in sb.attr(node, "pads")]
    if s is None or pads is None:
        return [None]
    axes = sb.ints(node, 3, "axes") if len(node.inputs) > 3 and node.inputs[3] else None
    axes = [_axis(a, len(s)) for a in axes] if axes is not None else list(range(len(s)))
    out = list(s)
    n = len(axes)
    for j, a in enumerate(axes):
        out[a] = sb.arith("+", sb.arith("+", s[a], pads[j]), pads[j + n])
    return [out]


def _nonzero(sb: ShapeBounds, node: Node) -> list:
    s = sb.input_shape(node, 0)
    if s is None or any(d is None for d in s):
        return [None]
    total = span(product(sb, s), sb.bounds)
    return [[Poly.const(len(s)), Span(0, total.hi, total.missing)]]


SAME_AS_FIRST = (
    "Identity", "Cast", "CastLike", "Neg", "Abs", "Sqrt", "Exp", "Log", "Erf", "Tanh",
    "Sigmoid", "Relu", "LeakyRelu", "Elu", "Selu", "Celu", "Gelu", "FastGelu", "QuickGelu",
    "BiasGelu", "Softplus", "Softsign", "HardSigmoid", "HardSwish", "Mish", "Sin", "Cos",
    "Tan", "Reciprocal", "Floor", "Ceil", "Round", "Not", "IsNaN", "IsInf", "Sign",
    "Softmax", "LogSoftmax", "Hardmax", "Trilu", "CumSum", "Clip", "Shrink",
    "ThresholdedRelu", "LpNormalization", "Dropout", "LayerNormalization",
    "SimplifiedLayerNormalization", "SkipLayerNormalization",
    "SkipSimplifiedLayerNormalization", "RMSNormalization", "BatchNormalization",
    "InstanceNormalization", "RotaryEmbedding", "QuantizeLinear", "DequantizeLinear",
    "ScatterND", "ScatterElements", "BitwiseNot", "FusedGelu", "FusedLayerNorm",
    "FusedRMSNorm", "FusedRotary")
BROADCASTING = (
    "Add", "Sub", "Mul", "Div", "Pow", "Mod", "Equal", "Less", "LessOrEqual", "Greater",
    "GreaterOrEqual", "And", "Or", "Xor", "Where", "Min", "Max", "Sum", "Mean", "PRelu",
    "BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "BiasAdd")

SHAPE_RULES: dict[str, Callable[[ShapeBounds, Node], list]] = {
    **{op: _same for op in SAME_AS_FIRST},
    **{op: _elementwise for op in BROADCASTING},
    "MatMul": _matmul, "FusedMatMul": _matmul, "FusedAttention": _attention, "MatMulInteger": _matmul, "Gemm": _gemm,
    "Transpose": _transpose, "Reshape": _reshape, "Flatten": _flatten,
    "Unsqueeze": _unsqueeze, "Squeeze": _squeeze, "Concat": _concat, "Split": _split,
    "Slice": _slice, "Gather": _gather, "GatherElements": _indices_shaped,
    "Expand": _expand, "Tile": _tile, "Range": _range, "ConstantOfShape": _constant_of_shape,
    "Shape": _shape, "Size": _scalar, "ArgMax": _arg_reduce, "ArgMin": _arg_reduce,
    "TopK": _topk, "Pad": _pad, "NonZero": _nonzero,
    **{op: _reduce for op in ("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin",
                              "ReduceProd", "ReduceL1", "ReduceL2", "ReduceLogSum",
                              "ReduceLogSumExp", "ReduceSumSquare")},
}
