"""What a stage actor is sent: its stage's nodes and weights as one ONNX model.

The driver cuts a stage (a contiguous run of segments, `placement.stages`) out of the
session graph into a small ONNX model: the stage's nodes, only the initializers they
read (once, however many of its segments read them), the value types it knows. With
it go the segments' boundaries and providers, and the stage's inputs and outputs.
The actor builds the IR once and compiles each segment there, so weights are loaded
where they run and each actor holds its own stage's weights only. Node identities
(``graph/node#12 "name"``) are restored to the session graph's, so errors raised in an
actor name the same nodes as the local executor does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import onnx
from onnx import helper, numpy_helper

from hetero_exec.ir.export import node_proto, value_proto
from hetero_exec.ir.graph import Graph, Node, node_reads
from hetero_exec.placement.plan import Segment
from hetero_exec.placement.stages import Stage
from hetero_exec.providers import Provider, parse_provider


@dataclass(frozen=True)
class SegmentPart:
    """One segment of a stage: its provider and where its nodes are in the stage model."""

    segment_id: int
    provider_kind: str  # cpu | gpu | sim-gpu
    provider_options: dict[str, Any]
    nodes: tuple[int, int]  # [first, end) positions among the stage model's nodes
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

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


@dataclass(frozen=True)
class StageSpec:
    """Everything an actor needs to rebuild and compile one stage."""

    stage_id: int
    device: str  # the provider its actor reserves: "cpu" or a device's name
    model: bytes  # the stage as an ONNX model
    node_ids: tuple[int, ...]  # the session graph's ids of the model's nodes, in order
    node_scope: str
    segments: tuple[SegmentPart, ...]
    inputs: tuple[str, ...]  # feeds and earlier stages' values it reads
    outputs: tuple[str, ...]  # values later stages read, and graph outputs
    fold_constants: bool = True
    weight_bytes: int = 0
    #: the session's ranked providers as (kind, options), for placing control-flow
    #: bodies of a heterogeneous session as the local executor does
    body_providers: tuple[tuple[str, dict[str, Any]], ...] = ()

    @property
    def name(self) -> str:
        return f"stage#{self.stage_id}"

    @property
    def label(self) -> str:
        """``stage#0 (sim-gpu:0)``."""
        return f"{self.name} ({self.device})"

    @property
    def provider_kind(self) -> str:
        return self.device.split(":")[0]

    @property
    def segment_labels(self) -> str:
        first, last = self.segments[0], self.segments[-1]
        if first is last:
            return first.name
        return f"{first.name}..{last.name} ({len(self.segments)} segments)"


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


def stage_spec(graph: Graph, stage: Stage, segments: Sequence[Segment], fold_constants: bool = True,
               body_providers: Sequence[Provider] = ()) -> StageSpec:
    """Cut ``stage`` (its ``segments``, in order) out of ``graph`` into a StageSpec.

    >>> import onnx.helper as h
    >>> from hetero_exec.ir import load
    >>> from hetero_exec.placement.segments import build_plan
    >>> from hetero_exec.placement.stages import plan_stages
    >>> from hetero_exec.providers import parse_provider
    >>> g = h.make_graph([h.make_node("Relu", ["x"], ["a"]), h.make_node("Neg", ["a"], ["y"])],
    ...     "g", [h.make_tensor_value_info("x", 1, [2])], [h.make_tensor_value_info("y", 1, [2])])
    >>> _, graph = load(h.make_model(g))
    >>> cpu, dev = parse_provider("cpu"), parse_provider("sim-gpu")
    >>> plan = build_plan(graph, graph.nodes, {graph.nodes[0]: dev, graph.nodes[1]: cpu})
    >>> (stage,) = plan_stages(plan, 1)
    >>> spec = stage_spec(graph, stage, plan.segments)
    >>> spec.label, spec.inputs, spec.outputs, [p.label for p in spec.segments]
    ('stage#0 (sim-gpu:0)', ('x',), ('y',), ['segment#0 (sim-gpu:0)', 'segment#1 (cpu)'])
    """
    nodes: list[Node] = []
    parts = []
    for seg in segments:
        kind, opts = provider_spec(seg.provider)
        lo = len(nodes)
        nodes.extend(seg.nodes)
        parts.append(SegmentPart(seg.id, kind, opts, (lo, len(nodes)), tuple(seg.inputs),
                                 tuple(seg.outputs)))
    model, weight_bytes = stage_model(graph, f"{graph.name}_stage{stage.id}", nodes,
                                      stage.inputs, stage.outputs)
    scopes = {n.scope for n in nodes}
    return StageSpec(
        stage_id=stage.id,
        device=stage.provider,
        model=model.SerializeToString(),
        node_ids=tuple(n.id for n in nodes),
        node_scope=scopes.pop() if len(scopes) == 1 else "graph",
        segments=tuple(parts),
        inputs=tuple(stage.inputs),
        outputs=tuple(stage.outputs),
        fold_constants=fold_constants,
        weight_bytes=weight_bytes,
        body_providers=tuple(provider_spec(p) for p in body_providers),
    )


def stage_model(graph: Graph, name: str, nodes: Sequence[Node], inputs: Sequence[str],
                outputs: Sequence[str]) -> tuple[onnx.ModelProto, int]:
    """``nodes`` as an ONNX model (not checked: a fragment) and its weight bytes."""
    reads = {n for node in nodes for n in node_reads(node)}
    weights = {n: a for n, a in graph.initializers.items() if n in reads}
    initializers = [numpy_helper.from_array(a, n) for n, a in weights.items()]
    touched: list[str] = []
    for node in nodes:
        touched.extend(n for n in list(node.inputs) + list(node.outputs) if n)
    value_info = [
        vi for vi in (value_proto(graph.value(n)) for n in dict.fromkeys(touched)) if vi is not None
    ]

    def declared(names: Sequence[str]) -> list[onnx.ValueInfoProto]:
        return [value_proto(graph.value(n)) or helper.make_value_info(n, onnx.TypeProto())
                for n in names]

    body = helper.make_graph([node_proto(n) for n in nodes], name, declared(inputs),
                             declared(outputs), initializers, value_info=value_info)
    opsets = [helper.make_opsetid(d, v) for d, v in graph.opsets.items()]
    model = helper.make_model(body, opset_imports=opsets)
    return model, sum(int(a.nbytes) for a in weights.values())


def load_stage_graph(spec: StageSpec) -> Graph:
    """The stage's Graph, with the session graph's node ids and scopes.

    >>> import onnx.helper as h
    >>> from hetero_exec.ir import load
    >>> from hetero_exec.placement.segments import build_plan
    >>> from hetero_exec.placement.stages import plan_stages
    >>> from hetero_exec.providers import parse_provider
    >>> g = h.make_graph([h.make_node("Relu", ["x"], ["a"]), h.make_node("Neg", ["a"], ["y"])],
    ...     "g", [h.make_tensor_value_info("x", 1, [2])], [h.make_tensor_value_info("y", 1, [2])])
    >>> _, graph = load(h.make_model(g))
    >>> cpu, dev = parse_provider("cpu"), parse_provider("sim-gpu")
    >>> plan = build_plan(graph, graph.nodes, {graph.nodes[0]: cpu, graph.nodes[1]: dev})
    >>> stages = plan_stages(plan, [1])
    >>> spec = stage_spec(graph, stages[1], plan.segments[1:])
    >>> [n.identity for n in load_stage_graph(spec).nodes]
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
