"""Every value's shape in the graph inputs' symbols, for memory admission.

onnx's shape inference leaves a dim unnamed wherever it is computed: a ``Range`` whose
limit is ``Shape(past)[2] + Shape(ids)[1]``, a ``Reshape`` or ``Expand`` whose target is
a ``Concat`` of ``Shape`` slices, a ``ConstantOfShape`` of one, and everything
downstream of them. Admission cannot count what it cannot size, so it refused every
decoder an exporter writes this way (issue 23).

This pass runs the shape subgraph symbolically, in graph order:

* small integer tensors (``Shape``, its ``Gather``/``Slice``/``Concat``/``Unsqueeze``,
  their arithmetic, constants) get their *elements* as `symbolic.Dim`s;
* every tensor gets its *shape* as Dims: the declared dims where onnx named them, the
  op's rule from its inputs' shapes and elements where it did not (``Range``'s length,
  ``Reshape``'s target with its ``0`` and ``-1``, broadcasting, ``MatMul``, ...).

A dim is a polynomial in the input symbols while the arithmetic is exact, a numeric range
once it is not (`placement/symbolic.py`); admission takes its ceiling under
``dim_bounds``. An op with no rule keeps what onnx declared. Ray-free, numpy-free:
nothing runs.

>>> import onnx.helper as h
>>> from onnx import TensorProto as T
>>> from hetero_exec.ir import load
>>> g = h.make_graph([h.make_node("Shape", ["x"], ["s"]),
...                   h.make_node("Gather", ["s", "one"], ["n"], axis=0),
...                   h.make_node("Range", ["zero", "n", "step"], ["r"])], "g",
...                  [h.make_tensor_value_info("x", T.FLOAT, ["batch", "seq"])],
...                  [h.make_tensor_value_info("r", T.INT64, [None])],
...                  [h.make_tensor("one", T.INT64, [], [1]), h.make_tensor("zero", T.INT64, [], [0]),
...                   h.make_tensor("step", T.INT64, [], [1])])
>>> _, graph = load(h.make_model(g, opset_imports=[h.make_opsetid("", 17)]))
>>> sb = ShapeBounds(graph, {"batch": 2, "seq": 48})
>>> [str(d) for d in sb.shape("r")], sb.ceiling("r")
(['seq'], (48,))
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

import numpy as np

from hetero_exec.errors import UnboundedSymbolError, UnresolvedShapeError
from hetero_exec.ir.graph import Graph, Node, attr_value
from hetero_exec.kernels.fused import FUSED_DOMAIN
from hetero_exec.placement.element_rules import ELEMENT_RULES, MAX_ELEMENTS
from hetero_exec.placement.shape_rules import SHAPE_RULES, Shape
from hetero_exec.placement.symbolic import Dim, Poly, arith, constant, join, parse_dim, span

log = logging.getLogger(__name__)


class ShapeBounds:
    """The shapes of a graph's values as Dims, and their ceilings under ``bounds``."""

    def __init__(self, graph: Graph, bounds: Mapping[str, int]):
        self.graph = graph
        self.bounds = dict(bounds)
        self.shapes: dict[str, Shape | None] = {}
        self.elements: dict[str, list[Dim]] = {}
        for name in graph.inputs:
            self.shapes[name] = self._declared(name)
        for name, arr in graph.initializers.items():
            self._constant(name, arr)
        for node in graph.nodes:
            try:
                self._infer(node)
            except Exception as e:  # a rule that cannot apply: onnx's declared shapes stand
                log.debug("shape bounds: %s (%s): %s", node.identity, node.op_type, e)
                for o in node.outputs:
                    if o:
                        self.shapes[o] = self._declared(o)

    # -- what admission reads -------------------------------------------------------

    def shape(self, name: str) -> Shape | None:
        if name not in self.shapes:
            return self._declared(name)
        return self.shapes[name]

    def ceiling(self, name: str) -> tuple[int, ...] | None:
        """The value's shape at its ceiling (None when its rank is unknown).
        UnboundedSymbolError names a symbol without a bound; UnresolvedShapeError a dim
        nothing sizes."""
        dims = self.shape(name)
        if dims is None:
            return None
        out = []
        for d in dims:
            s = None if d is None else span(d, self.bounds)
            if s is None or s.hi is None:
                if s is not None and s.missing:
                    raise UnboundedSymbolError(s.missing, name)
                producer = self.graph.producer.get(name)
                raise UnresolvedShapeError(name, producer.op_class if producer else "<graph input>")
            out.append(max(s.hi, 0))
        return tuple(out)

    # -- the pass ---------------------------------------------------------------------

    def _declared(self, name: str) -> Shape | None:
        v = self.graph.value(name)
        if v.shape is None:
            return None
        return [Poly.const(d) if isinstance(d, int) else
                parse_dim(d, self.bounds) if isinstance(d, str) else None for d in v.shape]

    def _constant(self, name: str, arr: Any) -> None:
        arr = np.asarray(arr)
        self.shapes[name] = [Poly.const(d) for d in arr.shape]
        if arr.size <= MAX_ELEMENTS and arr.dtype.kind in "iub":
            self.elements[name] = [Poly.const(int(x)) for x in arr.reshape(-1)]
        elif arr.size <= MAX_ELEMENTS and arr.dtype.kind == "f" and np.all(arr == np.round(arr)):
            self.elements[name] = [Poly.const(int(x)) for x in arr.reshape(-1)]

    def _infer(self, node: Node) -> None:
        outs = list(node.outputs)
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            attr = next(iter(node.attrs.values()))
            self._constant(outs[0], np.asarray(attr_value(attr)))
            return
        rule = SHAPE_RULES.get(node.op_type) if node.domain in RULE_DOMAINS else None
        computed = rule(self, node) if rule is not None else None
        for i, o in enumerate(outs):
            if not o:
                continue
            mine = computed[i] if computed is not None and i < len(computed) else None
            self.shapes[o] = _merge(self._declared(o), mine)
        elements = ELEMENT_RULES.get(node.op_type)
        if elements is not None and outs and outs[0] and node.domain in ("", "ai.onnx"):
            vals = elements(self, node)
            if vals is not None and len(vals) <= MAX_ELEMENTS:
                self.elements[outs[0]] = vals

    # -- helpers for the rules ----------------------------------------------------------

    def input_shape(self, node: Node, i: int) -> Shape | None:
        if i >= len(node.inputs) or not node.inputs[i]:
            return None
        return self.shape(node.inputs[i])

    def input_elements(self, node: Node, i: int) -> list[Dim] | None:
        if i >= len(node.inputs) or not node.inputs[i]:
            return None
        return self.elements.get(node.inputs[i])

    def ints(self, node: Node, i: int, attr: str) -> list[int] | None:
        """Constant integers from input ``i`` or, in older opsets, attribute ``attr``."""
        vals = self.input_elements(node, i)
        if vals is not None:
            consts = [constant(v) for v in vals]
            return None if any(c is None for c in consts) else consts
        if i < len(node.inputs) and node.inputs[i]:
            return None  # an input whose elements are not known
        a = node.attrs.get(attr)
        return None if a is None else [int(x) for x in attr_value(a)]

    def attr(self, node: Node, name: str, default: Any = None) -> Any:
        a = node.attrs.get(name)
        return default if a is None else attr_value(a)

    def arith(self, op: str, a: Dim | None, b: Dim | None) -> Dim | None:
        return arith(op, a, b, self.bounds)

    def join(self, a: Dim | None, b: Dim | None) -> Dim | None:
        return join(a, b, self.bounds)

    def broadcast(self, shapes: Sequence[Shape | None]) -> Shape | None:
        if any(s is None for s in shapes):
            return None
        rank = max(len(s) for s in shapes)
        out = []
        for axis in range(rank):
            dims = [s[axis - rank + len(s)] for s in shapes if axis - rank + len(s) >= 0]
            out.append(self._broadcast_dim(dims))
        return out

    def _broadcast_dim(self, dims: list[Dim | None]) -> Dim | None:
        """One axis of a broadcast: the dim that is not 1 (a runtime 1 broadcasts; two
        others must be equal, so the larger ceiling counts)."""
        known = [d for d in dims if d is not None and constant(d) != 1]
        if not known:
            return Poly.const(1) if all(d is not None for d in dims) else None
        fixed = [d for d in known if constant(d) is not None]
        if fixed:
            return fixed[0]
        return max(known, key=self._ceiling_or_none)

    def _ceiling_or_none(self, d: Dim) -> float:
        hi = span(d, self.bounds).hi
        return float("inf") if hi is None else hi  # unbounded first: its error surfaces


#: domains whose ops the rules know by op type: onnx, onnxruntime's contrib ops, our fusions
RULE_DOMAINS = frozenset({"", "ai.onnx", "com.microsoft", FUSED_DOMAIN})


def _merge(declared: Shape | None, computed: Shape | None) -> Shape | None:
    """onnx's named dims where it named them, this pass's elsewhere."""
    if declared is None:
        return computed
    if computed is None or len(computed) != len(declared):
        return declared
    return [d if d is not None else c for d, c in zip(declared, computed)]
