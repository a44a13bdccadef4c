"""The activations a fused Conv or MatMul applies in place (kernels.fused.activate),
in the spellings the exporters write after them:

* ``Relu``; ``Relu -> Min(6)`` (the dynamo exporter's relu6) and ``Clip(0, 6)`` (the
  TorchScript exporter's) become ``Clip``;
* ``HardSigmoid``, ``HardSwish``, and ``x * HardSigmoid(x)`` with torch's 1/6, 0.5;
* SiLU: ``x * Sigmoid(x)`` (both exporters); Tanh and Sigmoid;
* GELU: the fusion pass's ``FusedGelu`` (fusions/gelu.py runs first) and opset 20's
  ``Gelu``, as ``Gelu`` (erf) or ``GeluTanh``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import helper

from hetero_exec.ir.graph import Node
from hetero_exec.kernels.fused import FUSED_DOMAIN
from hetero_exec.placement.fusions.rewriter import Rewriter, attr, near, other, str_attr


@dataclass
class Activation:
    nodes: list[Node]  # the nodes it replaces, in order
    output: str
    name: str
    params: tuple[float, ...] = ()

    def attrs(self) -> dict:
        out = {"activation": str_attr("activation", self.name)}
        if self.params:
            out["activation_params"] = helper.make_attribute("activation_params",
                                                             [float(p) for p in self.params])
        return out



def match_activation(rw: Rewriter, y: str) -> Activation | None:
    """The activation applied to ``y`` (and only to it), if any."""
    readers = rw.readers(y)
    if readers is None:
        return None
    if len(readers) == 2:
        return _times_gate(rw, y, readers)
    (node,) = readers
    if sum(1 for i in node.inputs if i == y) != 1 or node.inputs[0] != y:
        return None
    out = node.outputs[0] if len(node.outputs) == 1 else None
    if out is None or not rw.mine(node) or node.subgraphs:
        return None
    op = node.op_type
    if (op == "FusedGelu" and node.domain == FUSED_DOMAIN) or (
            op == "Gelu" and node.canonical_domain == "ai.onnx"):
        tanh = attr(node, "approximate", "none") == "tanh"
        return Activation([node], out, "GeluTanh" if tanh else "Gelu")
    if node.canonical_domain != "ai.onnx":
        return None
    if op == "Relu":
        capped = _min_after(rw, out)
        if capped is not None:
            mn, hi = capped
            return Activation([node, mn], mn.outputs[0], "Clip", (0.0, hi))
        return Activation([node], out, "Relu")
    if op == "Clip":
        bounds = _clip_bounds(rw, node)
        return None if bounds is None else Activation([node], out, "Clip", bounds)
    if op == "HardSigmoid":
        return Activation([node], out, "HardSigmoid",
                          (float(attr(node, "alpha", 0.2)), float(attr(node, "beta", 0.5))))
    if op in ("HardSwish", "Tanh", "Sigmoid"):
        return Activation([node], out, op)
    return None


def _min_after(rw: Rewriter, r: str):
    mn = rw.sole_reader(r)
    if not rw.onnx_op(mn, "Min") or len(mn.inputs) != 2:
        return None
    hi = rw.scalar(other(mn, r))
    if hi is None or hi < 0:
        return None
    return mn, hi


def _clip_bounds(rw: Rewriter, node: Node) -> tuple[float, float] | None:
    if rw.graph.opset("") < 11:
        lo = float(attr(node, "min", -np.inf))
        hi = float(attr(node, "max", np.inf))
        return lo, hi
    bounds = []
    for pos, default in ((1, -np.inf), (2, np.inf)):
        name = node.inputs[pos] if len(node.inputs) > pos else ""
        if not name:
            bounds.append(default)
            continue
        v = rw.scalar(name)
        if v is None:
            return None
        bounds.append(v)
    return bounds[0], bounds[1]


def _times_gate(rw: Rewriter, y: str, readers: list[Node]) -> Activation | None:
    """y * Sigmoid(y) (SiLU) or y * HardSigmoid(y; 1/6, 1/2) (HardSwish)."""
    gate = next((r for r in readers if r.op_type in ("Sigmoid", "HardSigmoid")), None)
    mul = next((r for r in readers if r.op_type == "Mul"), None)
    if gate is None or mul is None or not rw.onnx_op(gate, gate.op_type) or not rw.onnx_op(mul, "Mul"):
        return None
    if len(mul.inputs) != 2 or y not in mul.inputs or other(mul, y) != gate.outputs[0]:
        return None
    if rw.sole_reader(gate.outputs[0]) is not mul:
        return None
    if gate.op_type == "Sigmoid":
        return Activation([gate, mul], mul.outputs[0], "SiLU")
    if near(float(attr(gate, "alpha", 0.2)), 1 / 6, 1e-5) and near(float(attr(gate, "beta", 0.5)), 0.5):
        return Activation([gate, mul], mul.outputs[0], "HardSwish")
    return None
