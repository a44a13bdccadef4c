"""Element rules of `placement/shape_bounds.py`: the values of small integer tensors
(``Shape``, its ``Gather``/``Slice``/``Concat``, their arithmetic and comparisons,
constants) as `symbolic.Dim`s, which the shape rules read as targets (``Reshape``,
``Expand``, ``ConstantOfShape``, ``Range``'s bounds). None where a value is not known
before running.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

import numpy as np

from hetero_exec.ir.graph import Node
from hetero_exec.placement.shape_rules import product, shape_slice
from hetero_exec.placement.symbolic import BOOL, Dim, Poly, Span, constant, exact, span

if TYPE_CHECKING:
    from hetero_exec.placement.shape_bounds import ShapeBounds

#: integer tensors up to this many elements have their elements tracked
MAX_ELEMENTS = 64

def _shape_elements(sb: ShapeBounds, node: Node) -> list | None:
    s = sb.input_shape(node, 0)
    if s is None or any(d is None for d in s):
        return None
    return list(shape_slice(sb, node, s))


def _size_elements(sb: ShapeBounds, node: Node) -> list | None:
    s = sb.input_shape(node, 0)
    if s is None or any(d is None for d in s):
        return None
    return [product(sb, s)]


def _passed(sb: ShapeBounds, node: Node) -> list | None:
    return sb.input_elements(node, 0)


def _concat_elements(sb: ShapeBounds, node: Node) -> list | None:
    out: list = []
    for i, n in enumerate(node.inputs):
        vals = sb.input_elements(node, i)
        if vals is None:
            return None
        out += vals
    return out


def _gather_elements(sb: ShapeBounds, node: Node) -> list | None:
    data, idx = sb.input_elements(node, 0), sb.ints(node, 1, "")
    if data is None or idx is None or sb.attr(node, "axis", 0) != 0:
        return None
    return [data[i] for i in idx]


def _slice_elements(sb: ShapeBounds, node: Node) -> list | None:
    data = sb.input_elements(node, 0)
    if data is None:
        return None
    if len(node.inputs) > 1:
        starts, ends = sb.ints(node, 1, "starts"), sb.ints(node, 2, "ends")
        steps = sb.ints(node, 4, "steps") if len(node.inputs) > 4 and node.inputs[4] else [1]
    else:
        starts, ends, steps = sb.attr(node, "starts"), sb.attr(node, "ends"), [1]
    if not starts or not ends or not steps or len(starts) != 1:
        return None
    return data[slice(starts[0], ends[0], steps[0])]


def _pairwise(op: str) -> Callable[[ShapeBounds, Node], list | None]:
    def rule(sb: ShapeBounds, node: Node) -> list | None:
        a, b = sb.input_elements(node, 0), sb.input_elements(node, 1)
        pairs = _broadcast_elements(a, b)
        if pairs is None:
            return None
        if op == "/" and _is_float(sb, node):
            return [_float_div(sb, x, y) for x, y in pairs]
        return [sb.arith(op, x, y) for x, y in pairs]
    return rule


def _float_div(sb: ShapeBounds, x: Dim, y: Dim) -> Dim | None:
    """A float quotient: exact when it divides, else the integers around it (a Ceil or
    a Cast after it must not lose the fraction)."""
    q = exact(x), exact(y)
    if q[0] is not None and q[1] is not None and q[0].exact_div(q[1]) is not None:
        return q[0].exact_div(q[1])
    s = span(sb.arith("//", x, y), sb.bounds)
    return Span(s.lo, None if s.hi is None else s.hi + 1, s.missing)


def _is_float(sb: ShapeBounds, node: Node) -> bool:
    dt = sb.graph.value(node.outputs[0]).dtype
    return dt is not None and dt.kind == "f"


def _broadcast_elements(a: list | None, b: list | None) -> list | None:
    if a is None or b is None:
        return None
    if len(a) == len(b):
        return list(zip(a, b))
    if len(a) == 1:
        return [(a[0], y) for y in b]
    if len(b) == 1:
        return [(x, b[0]) for x in a]
    return None


def _compare(op: str) -> Callable[[ShapeBounds, Node], list | None]:
    def rule(sb: ShapeBounds, node: Node) -> list | None:
        pairs = _broadcast_elements(sb.input_elements(node, 0), sb.input_elements(node, 1))
        if pairs is None:
            return None
        return [_decide(sb, op, x, y) for x, y in pairs]
    return rule


def _decide(sb: ShapeBounds, op: str, x: Dim, y: Dim) -> Dim:
    """1, 0, or not known (a 0..1 range) before running."""
    px, py = exact(x), exact(y)
    if op == "==" and px is not None and px == py:
        return Poly.const(1)
    a, b = span(x, sb.bounds), span(y, sb.bounds)
    if a.hi is None or b.hi is None:
        return BOOL
    truth = {"==": (a.lo == a.hi == b.lo == b.hi, a.hi < b.lo or b.hi < a.lo),
             "<": (a.hi < b.lo, a.lo >= b.hi), "<=": (a.hi <= b.lo, a.lo > b.hi),
             ">": (a.lo > b.hi, a.hi <= b.lo), ">=": (a.lo >= b.hi, a.hi < b.lo)}[op]
    return Poly.const(1) if truth[0] else Poly.const(0) if truth[1] else BOOL


def _not_elements(sb: ShapeBounds, node: Node) -> list | None:
    vals = sb.input_elements(node, 0)
    if vals is None:
        return None
    return [Poly.const(1 - c) if (c := constant(v)) is not None else BOOL for v in vals]


def _where_elements(sb: ShapeBounds, node: Node) -> list | None:
    c, x, y = (sb.input_elements(node, i) for i in range(3))
    if c is None or x is None or y is None:
        return None
    n = max(len(c), len(x), len(y))
    pick = []
    for i in range(n):
        ci, xi, yi = (v[i if len(v) > 1 else 0] for v in (c, x, y))
        cc = constant(ci)
        pick.append(xi if cc == 1 else yi if cc == 0 else sb.join(xi, yi))
    return pick


def _neg_elements(sb: ShapeBounds, node: Node) -> list | None:
    vals = sb.input_elements(node, 0)
    return None if vals is None else [sb.arith("-", Poly(), v) for v in vals]


def _constant_of_shape_elements(sb: ShapeBounds, node: Node) -> list | None:
    target = sb.ints(node, 0, "")
    if target is None or math.prod(target) > MAX_ELEMENTS:
        return None
    value = sb.attr(node, "value")
    fill = 0 if value is None else np.asarray(value).reshape(-1)[0]
    if float(fill) != round(float(fill)):
        return None
    return [Poly.const(int(fill))] * math.prod(target)


def _range_elements(sb: ShapeBounds, node: Node) -> list | None:
    args = [sb.ints(node, i, "") for i in range(3)]
    if any(a is None or len(a) != 1 for a in args) or args[2][0] == 0:
        return None
    vals = range(args[0][0], args[1][0], args[2][0])
    return [Poly.const(v) for v in vals] if len(vals) <= MAX_ELEMENTS else None


def _expand_elements(sb: ShapeBounds, node: Node) -> list | None:
    vals, target = sb.input_elements(node, 0), sb.ints(node, 1, "")
    if vals is None or target is None or len(vals) != 1 or math.prod(target) > MAX_ELEMENTS:
        return None
    return vals * math.prod(target)


def _reduce_elements(op: str) -> Callable[[ShapeBounds, Node], list | None]:
    def rule(sb: ShapeBounds, node: Node) -> list | None:
        vals = sb.input_elements(node, 0)
        if not vals or sb.attr(node, "keepdims", 1) and len(sb.input_shape(node, 0) or []) != 1:
            return None
        out = vals[0]
        for v in vals[1:]:
            out = sb.arith(op, out, v)
        return [out]
    return rule


ELEMENT_RULES: dict[str, Callable[[ShapeBounds, Node], list | None]] = {
    "Shape": _shape_elements, "Size": _size_elements,
    **{op: _passed for op in ("Identity", "Cast", "CastLike", "Squeeze", "Unsqueeze",
                              "Reshape", "Flatten")},
    "Concat": _concat_elements, "Gather": _gather_elements, "Slice": _slice_elements,
    "Add": _pairwise("+"), "Sub": _pairwise("-"), "Mul": _pairwise("*"),
    "Div": _pairwise("/"), "Mod": _pairwise("%"), "Min": _pairwise("min"),
    "Max": _pairwise("max"), "Neg": _neg_elements,
    "Equal": _compare("=="), "Less": _compare("<"), "LessOrEqual": _compare("<="),
    "Greater": _compare(">"), "GreaterOrEqual": _compare(">="), "Not": _not_elements,
    "Where": _where_elements, "ConstantOfShape": _constant_of_shape_elements,
    "Range": _range_elements, "Expand": _expand_elements,
    "ReduceProd": _reduce_elements("*"), "ReduceSum": _reduce_elements("+"),
    "ReduceMax": _reduce_elements("max"), "ReduceMin": _reduce_elements("min"),
}
