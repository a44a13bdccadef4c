"""``fuse_gelu``: the node chains exporters write for GELU before opset 20 -> FusedGelu.

* erf: torch's nn.GELU, x/sqrt2 (or x * 1/sqrt2) -> Erf -> +1 -> * x -> * 0.5;
* tanh: gelu_new and nn.GELU(approximate="tanh"),
  0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), the cube as Pow(x, 3) or x*x*x.

The 0.5 may come first (x * 0.5) or last, constants on either side of each product.
"""

from __future__ import annotations

import math

from hetero_exec.ir.graph import Graph, Node
from hetero_exec.kernels.fused import FUSED_DOMAIN
from hetero_exec.placement.fusions.rewriter import Region, Rewriter, near, other, str_attr

_SQRT2 = math.sqrt(2.0)
_SQRT_2_PI = math.sqrt(2.0 / math.pi)


def _const_operand(rw: Rewriter, node: Node, name: str, want: float) -> bool:
    """``node`` (two inputs) combines ``name`` with a scalar constant close to ``want``."""
    if node is None or len(node.inputs) != 2 or name not in node.inputs:
        return False
    return near(rw.scalar(other(node, name)), want)


def _half_times(rw: Rewriter, mul: Node, x: str, a: str) -> list[Node] | None:
    """The tail of both Gelu chains: y = x * a * 0.5 in any of the exporters' orders,
    starting at ``mul``, the sole reader of ``a``. Returns the tail nodes (last is y's)."""
    if not rw.onnx_op(mul, "Mul") or len(mul.inputs) != 2:
        return None
    o = other(mul, a)
    if o == x:  # (x * a) * 0.5
        last = rw.sole_reader(mul.outputs[0])
        if rw.onnx_op(last, "Mul") and _const_operand(rw, last, mul.outputs[0], 0.5):
            return [mul, last]
        return None
    half = rw.producer(o)  # (x * 0.5) * a
    if rw.onnx_op(half, "Mul") and _const_operand(rw, half, x, 0.5) and rw.feeds_only(half, mul):
        return [half, mul]
    return None


def _plus_one_half_times(rw: Rewriter, f: Node, x: str) -> list[Node] | None:
    """The shared end of both chains after erf/tanh ``f``: (f + 1), then `_half_times`."""
    add = rw.sole_reader(f.outputs[0])
    if not rw.onnx_op(add, "Add") or not _const_operand(rw, add, f.outputs[0], 1.0):
        return None
    tail = _half_times(rw, rw.sole_reader(add.outputs[0]), x, add.outputs[0])
    return None if tail is None else [add] + tail


def _gelu_erf(rw: Rewriter, erf: Node):
    d = rw.producer(erf.inputs[0])
    if d is None or not rw.feeds_only(d, erf) or len(d.inputs) != 2:
        return None
    if rw.onnx_op(d, "Div") and near(rw.scalar(d.inputs[1]), _SQRT2):
        x = d.inputs[0]
    elif rw.onnx_op(d, "Mul"):
        x = next((i for i in d.inputs if near(rw.scalar(other(d, i)), 1 / _SQRT2)), None)
        if x is None:
            return None
    else:
        return None
    tail = _plus_one_half_times(rw, erf, x)
    return None if tail is None else (x, [d, erf] + tail, "none")


def _cube(rw: Rewriter, name: str, reader: Node) -> tuple[str, list[Node]] | None:
    """``name`` = x^3 read by ``reader`` only: Pow(x, 3), Mul(Mul(x, x), x) or Mul(x, Mul(x, x))."""
    p = rw.producer(name)
    if p is None or not rw.feeds_only(p, reader):
        return None
    if rw.onnx_op(p, "Pow") and near(rw.scalar(p.inputs[1]), 3.0):
        return p.inputs[0], [p]
    if not rw.onnx_op(p, "Mul") or len(p.inputs) != 2:
        return None
    for sq_name, x in (p.inputs, p.inputs[::-1]):
        sq = rw.producer(sq_name)
        if rw.onnx_op(sq, "Mul") and sq.inputs == [x, x] and rw.feeds_only(sq, p):
            return x, [sq, p]
    return None


def _gelu_tanh(rw: Rewriter, tanh: Node):
    k = rw.producer(tanh.inputs[0])  # inner * sqrt(2/pi)
    if not rw.onnx_op(k, "Mul") or not rw.feeds_only(k, tanh) or len(k.inputs) != 2:
        return None
    inner_name = next((i for i in k.inputs if near(rw.scalar(other(k, i)), _SQRT_2_PI)), None)
    inner = rw.producer(inner_name) if inner_name else None
    if not rw.onnx_op(inner, "Add") or not rw.feeds_only(inner, k) or len(inner.inputs) != 2:
        return None
    for x, scaled in (inner.inputs, inner.inputs[::-1]):  # x + 0.044715 x^3
        m = rw.producer(scaled)
        if not rw.onnx_op(m, "Mul") or not rw.feeds_only(m, inner) or len(m.inputs) != 2:
            continue
        cube_name = next((i for i in m.inputs if near(rw.scalar(other(m, i)), 0.044715)), None)
        cube = _cube(rw, cube_name, m) if cube_name else None
        if cube is None or cube[0] != x:
            continue
        tail = _plus_one_half_times(rw, tanh, x)
        return None if tail is None else (x, cube[1] + [m, inner, k, tanh] + tail, "tanh")
    return None


def fuse_gelu(graph: Graph, region: Region | None = None) -> Graph | None:
    rw = Rewriter(graph, region)
    for node in list(graph.nodes):
        if rw.onnx_op(node, "Erf"):
            found = _gelu_erf(rw, node)
        elif rw.onnx_op(node, "Tanh"):
            found = _gelu_tanh(rw, node)
        else:
            continue
        if found is None:
            continue
        x, chain, approx = found
        if not rw.float_value(x):
            continue
        chain.sort(key=rw.position)
        rw.fuse(chain, "FusedGelu", FUSED_DOMAIN, [x], chain[-1].outputs[0],
                {"approximate": str_attr("approximate", approx)})
    return graph if rw.finish() else None
