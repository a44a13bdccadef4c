"""What a segment actor is sent: its own nodes and weights as ONNX bytes.

The driver cuts a segment out of the session graph into a small ONNX model (the
segment's nodes, only the initializers they read, the value types it knows) and
sends those bytes with the segment's inputs, outputs and provider. The actor builds
the IR and compiles there, so weights are loaded where they run, and each actor
holds its segment's weights only. Node identities (``graph/node#12 "name"``) are
restored to the session graph's, so errors raised in an actor name the same nodes
as the local executor does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import onnx
from onnx import helper, numpy_helper

from hetero_exec.ir.graph import Graph, Node, Value, node_reads
from hetero_exec.placement.plan import Segment
from hetero_exec.providers import Provider, parse_provider


@dataclass(frozen=True)
class SegmentSpec:
    """Everything an actor needs to rebuild and compile one segment."""

    segment_id: int
    provider_kind: str  # cpu | gpu | sim-gpu
    provider_options: dict[str, Any]
    model: bytes  # the segment as an ONNX model
    node_ids: tuple[int, ...]  # the session graph's ids of the model's nodes, in order
    node_scope: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    fold_constants: bool = True
    weight_bytes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"segment#{self.segment_id}"

    @property
    def provider_name(self) -> str:
        dev = self.provider_options.get("device_id", 0)
        return self.provider_kind if self.provider_kind == "cpu" else f"{self.provider_kind}:{dev}"

    @property
    def label(self) -> str:
        """``segment#1 (sim-gpu:0)``: how errors and logs name the segment."""
        return f"{self.name} ({self.provider_name})"

    def make_provider(self, device_id: int | None = None) -> Provider:
        """The provider, optionally on another device id (Ray renumbers visible GPUs)."""
        opts = dict(self.provider_options)
        if device_id is not None and self.provider_kind == "gpu":
            opts["device_id"] = device_id
        return parse_provider((self.provider_kind, opts))


def provider_spec(provider: Provider) -> tuple[str, dict[str, Any]]:
    """``(kind, options)`` that `parse_provider` turns back into an equal provider."""
    o = provider.options
    opts: dict[str, Any] = {"device_id": o.device_id}
    if o.mem_limit is not None:
        opts["mem_limit"] = o.mem_limit
    if o.exclude_ops:
        opts["exclude_ops"] = sorted(o.exclude_ops)
    if not o.strict:  # sim-gpu over plain NumPy arrays (providers.base.ProviderOptions)
        opts["strict"] = False
    if provider.kind == "cpu":
        opts.pop("device_id")
    return provider.kind, opts


def segment_spec(graph: Graph, segment: Segment, fold_constants: bool = True) -> SegmentSpec:
    """Cut ``segment`` out of ``graph`` into a SegmentSpec.

    >>> import onnx.helper as h
    >>> from hetero_exec.ir import load
    >>> from hetero_exec.placement.segments import build_plan
    >>> from hetero_exec.providers import parse_provider
    >>> g = h.make_graph([h.make_node("Relu", ["x"], ["y"])], "g",
    ...     [h.make_tensor_value_info("x", 1, [2])], [h.make_tensor_value_info("y", 1, [2])])
    >>> _, graph = load(h.make_model(g))
    >>> plan = build_plan(graph, graph.nodes, {n: parse_provider("cpu") for n in graph.nodes})
    >>> spec = segment_spec(graph, plan.segments[0])
    >>> spec.label, spec.inputs, spec.outputs
    ('segment#0 (cpu)', ('x',), ('y',))
    """
    kind, opts = provider_spec(segment.provider)
    model, weight_bytes = segment_model(graph, segment)
    scopes = {n.scope for n in segment.nodes}
    scope = scopes.pop() if len(scopes) == 1 else "graph"
    return SegmentSpec(
        segment_id=segment.id,
        provider_kind=kind,
        provider_options=opts,
        model=model.SerializeToString(),
        node_ids=tuple(n.id for n in segment.nodes),
        node_scope=scope,
        inputs=tuple(segment.inputs),
        outputs=tuple(segment.outputs),
        fold_constants=fold_constants,
        weight_bytes=weight_bytes,
    )


def segment_model(graph: Graph, segment: Segment) -> tuple[onnx.ModelProto, int]:
    """The segment as an ONNX model (not checked: it is a fragment) and its weight bytes."""
    reads = {name for node in segment.nodes for name in node_reads(node)}
    weights = {n: a for n, a in graph.initializers.items() if n in reads}
    initializers = [numpy_helper.from_array(a, name) for name, a in weights.items()]
    touched: list[str] = []
    for node in segment.nodes:
        touched.extend(n for n in list(node.inputs) + list(node.outputs) if n)
    value_info = [
        vi for vi in (value_proto(graph.value(n)) for n in dict.fromkeys(touched)) if vi is not None
    ]
    inputs = [
        value_proto(graph.value(n)) or helper.make_value_info(n, onnx.TypeProto())
        for n in segment.inputs
    ]
    outputs = [
        value_proto(graph.value(n)) or helper.make_value_info(n, onnx.TypeProto())
        for n in segment.outputs
    ]
    body = helper.make_graph(
        [node_proto(n) for n in segment.nodes],
        f"{graph.name}_{segment.name}",
        inputs,
        outputs,
        initializers,
        value_info=value_info,
    )
    opsets = [helper.make_opsetid(d, v) for d, v in graph.opsets.items()]
    model = helper.make_model(body, opset_imports=opsets)
    return model, sum(int(a.nbytes) for a in weights.values())


def node_proto(node: Node) -> onnx.NodeProto:
    p = helper.make_node(
        node.op_type, node.inputs, node.outputs, domain=node.domain, name=node.name or None
    )
    p.attribute.extend(node.attrs.values())
    return p


def value_proto(v: Value) -> onnx.ValueInfoProto | None:
    """The ValueInfoProto of what the IR knows of a value (None when nothing is known)."""
    if v.kind == "tensor" and v.elem_type:
        shape = None if v.shape is None else list(v.shape)
        return helper.make_tensor_value_info(v.name, v.elem_type, shape)
    if v.kind == "sequence" and v.elem_type:
        return helper.make_tensor_sequence_value_info(v.name, v.elem_type, None)
    if v.kind == "optional" and v.elem_type:
        inner = helper.make_tensor_type_proto(v.elem_type, None)
        return helper.make_value_info(v.name, helper.make_optional_type_proto(inner))
    return None


def load_segment_graph(spec: SegmentSpec) -> Graph:
    """The segment's Graph, with the session graph's node ids and scopes.

    >>> import onnx.helper as h
    >>> from hetero_exec.ir import load
    >>> from hetero_exec.placement.segments import build_plan
    >>> from hetero_exec.providers import parse_provider
    >>> g = h.make_graph([h.make_node("Relu", ["x"], ["a"]), h.make_node("Neg", ["a"], ["y"])],
    ...     "g", [h.make_tensor_value_info("x", 1, [2])], [h.make_tensor_value_info("y", 1, [2])])
    >>> _, graph = load(h.make_model(g))
    >>> cpu, dev = parse_provider("cpu"), parse_provider("sim-gpu")
    >>> plan = build_plan(graph, graph.nodes, {graph.nodes[0]: cpu, graph.nodes[1]: dev})
    >>> [n.identity for n in load_segment_graph(segment_spec(graph, plan.segments[1])).nodes]
    ['graph/node#1']
    """
    from hetero_exec.ir.load import build_graph

    model = onnx.load_from_string(spec.model)
    opsets = {("" if o.domain == "ai.onnx" else o.domain): o.version for o in model.opset_import}
    graph = build_graph(model.graph, opsets, spec.node_scope)
    for position, (node, original_id) in enumerate(zip(graph.nodes, spec.node_ids)):
        if original_id != position:
            _renumber(node, position, original_id)
    graph.reindex()
    return graph


def _renumber(node: Node, position: int, original_id: int) -> None:
    """Give ``node`` its session id back, and its bodies' scopes with it."""
    old = f"{node.scope}/node#{position}/"
    new = f"{node.scope}/node#{original_id}/"
    node.id = original_id
    for sub in node.subgraphs.values():
        _rescope(sub, old, new)


def _rescope(graph: Graph, old: str, new: str) -> None:
    graph.scope = new + graph.scope[len(old) :] if graph.scope.startswith(old) else graph.scope
    for node in graph.nodes:
        if node.scope.startswith(old):
            node.scope = new + node.scope[len(old) :]
        for sub in node.subgraphs.values():
            _rescope(sub, old, new)
