"""float16 models on the cpu provider: the float16 values between nodes that compute in
float32 anyway (`exec/half.FLOAT32_OPS`) are kept in float32, as onnxruntime's cpu
provider does once it has inserted its casts and removed the ones that cancel.

Per node, `exec/half.py` already computes those ops in float32 and rounds each output
to float16; every node then casts its inputs up and its outputs down, runs as a Python
step, and no fusion or program sees a float32 chain. Here the graph itself changes:

* a node converts when its op computes in float32 here (`FLOAT32_OPS`, `CHAINED`) or
  only moves values (`MOVES`), and every float tensor it reads or writes is float16 or float32;
* its float16 outputs become float32 values (renamed ``<name>/f32``); one Cast back to
  float16 keeps the old name for the readers that did not convert and for graph
  outputs;
* the float16 values it reads from elsewhere (graph inputs, initializers, Constants,
  nodes that did not convert) reach it through one Cast up (constants converted once).

It applies to graphs that store float16 weights, what onnxruntime's float16 converters
make. A graph of float16 arithmetic without weights (the ONNX node suite's function
expansions, whose expected values round at every node, as the spec defines) keeps the
per-node rounding: between two nodes the float32 chain is up to a few float16 ulps off
that, as onnxruntime is.

Nodes that did not convert keep their float16 semantics: an explicit ``Cast`` to
float16 still rounds there, and ops outside both sets (Softmax, comparisons, ...) still
see float16 operands. Results change by float16 rounding only, toward the float32
model. Graphs with control flow are left to the per-node path.
"""

from __future__ import annotations

import itertools
import logging

import numpy as np
from onnx import TensorProto, helper

from hetero_exec.exec.half import FLOAT32_OPS
from hetero_exec.ir.graph import Graph, Node, Value

log = logging.getLogger(__name__)

F16, F32 = TensorProto.FLOAT16, TensorProto.FLOAT

#: ops that move or select values without arithmetic: exact in either type
MOVES = frozenset({
    "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Concat", "Split", "Slice",
    "Gather", "GatherElements", "GatherND", "Expand", "Identity", "Tile", "Pad", "Shape",
    "Size", "DepthToSpace", "SpaceToDepth", "ReduceMax", "ReduceMin", "MaxPool",
    "GlobalMaxPool", "Trilu", "ScatterND", "ScatterElements", "Dropout",
})
#: computed in float32 here too, though not per node (`FLOAT32_OPS` says why): inside a
#: float32 chain they are what lets the attention fusion see MatMul-Softmax-MatMul
CHAINED = frozenset({"Softmax", "LogSoftmax"})
SUFFIX = "/f32"


def float16_in_float32(graph: Graph) -> Graph | None:
    """Rewrite ``graph`` in place (the cpu provider's pass, before the fusions); None when
    nothing changed."""
    if any(n.subgraphs for n in graph.nodes) or not any(
            a.dtype == np.float16 for a in graph.initializers.values()):
        return None
    convert = [n for n in graph.nodes if _converts(graph, n)]
    if not convert:
        return None
    converted = {id(n) for n in convert}
    ids = itertools.count(max((n.id for n in graph.nodes), default=0) + 1)
    outputs = set(graph.outputs)
    up: dict[str, str] = {}  # a float16 value -> its float32 copy, for converted readers
    new_nodes: dict[int, list[Node]] = {}  # id(node) -> casts to place right after it
    head: list[Node] = []  # casts of graph inputs, placed first

    def cast(src: str, dst: str, to: int, after: Node | None, beside: Node) -> None:
        node = Node(id=next(ids), op_type="Cast", domain="", inputs=[src], outputs=[dst],
                    attrs={"to": helper.make_attribute("to", to)}, scope=beside.scope,
                    name=f"{dst}/cast")
        node.fused_from = [beside.identity]
        (head if after is None else new_nodes.setdefault(id(after), [])).append(node)

    # the converted nodes' own float16 outputs: float32 under a new name, cast back for
    # the rest of the graph
    for n in convert:
        for k, o in enumerate(n.outputs):
            if not o or _elem(graph, o) != F16:
                continue
            name = _fresh(graph, o + SUFFIX)
            graph.values[name] = _retyped(graph.values.get(o), name)
            n.outputs[k] = name
            up[o] = name
            readers = graph.consumers.get(o, [])
            if o in outputs or any(id(r) not in converted for r in readers):
                cast(name, o, F16, n, n)
    # what the converted nodes read from elsewhere in float16
    for n in convert:
        for k, i in enumerate(n.inputs):
            if not i or _elem(graph, i) != F16:
                continue
            if i not in up:
                name = _fresh(graph, i + SUFFIX)
                const = graph.initializers.get(i) if i not in graph.inputs else None
                if const is not None:
                    graph.initializers[name] = const.astype(np.float32)
                    graph.values[name] = _retyped(graph.values.get(i), name)
                else:
                    graph.values[name] = _retyped(graph.values.get(i), name)
                    cast(i, name, F32, graph.producer.get(i), n)
                up[i] = name
            n.inputs[k] = up[i]
    order: list[Node] = list(head)
    for n in graph.nodes:
        order.append(n)
        order.extend(new_nodes.get(id(n), ()))
    graph.nodes = order
    graph.reindex()
    for name in [i for i in graph.initializers if i not in graph.consumers
                 and i not in graph.inputs and i not in outputs]:
        del graph.initializers[name]
    log.debug("float16 graph: %d nodes compute and pass float32", len(convert))
    return graph


def _converts(graph: Graph, node: Node) -> bool:
    if node.op_type not in FLOAT32_OPS and not (
            node.op_type in MOVES | CHAINED and node.canonical_domain == "ai.onnx"):
        return False
    types = [_elem(graph, v) for v in list(node.inputs) + list(node.outputs) if v]
    floats = [t for t in types if t in _FLOAT_TYPES]
    return F16 in floats and all(t in (F16, F32) for t in floats) and 0 not in types


_FLOAT_TYPES = frozenset({F16, F32, TensorProto.DOUBLE, TensorProto.BFLOAT16})


def _elem(graph: Graph, name: str) -> int:
    """The element type of a value (0 when unknown)."""
    c = graph.initializers.get(name)
    if c is not None:
        return helper.np_dtype_to_tensor_dtype(c.dtype)
    v = graph.values.get(name)
    return v.elem_type if v is not None and v.kind == "tensor" else 0


def _retyped(v: Value | None, name: str) -> Value:
    return Value(name, "tensor", F32, None if v is None else v.shape)


def _fresh(graph: Graph, base: str) -> str:
    name = base
    for i in itertools.count(1):
        if name not in graph.values and name not in graph.initializers \
                and name not in graph.producer:
            return name
        name = f"{base}_{i}"
    raise AssertionError("unreachable")

