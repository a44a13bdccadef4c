"""GPU coverage: every node the requested device declines, and the grouped
FallbackReport (SEMANTICS.md section 1, `format_cuda_coverage_issues`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterator

from hetero_exec.ir.graph import Graph, Node
from hetero_exec.providers.base import CONTROL_FLOW_OPS, SEQUENCE_OPS, Provider, Support

log = logging.getLogger(__name__)

MAX_EXAMPLES_PER_CLASS = 3


@dataclass(frozen=True, order=True)
class Decline:
    """One node a provider refused: identity, canonical domain, op_type, reason."""

    node: str
    domain: str
    op_type: str
    reason: str


@dataclass
class FallbackReport:
    requested_provider: str
    declines: list[Decline]
    fallback_provider: str = "cpu"
    assigned_node_count: int = 0
    assigned_ops: list[str] = field(default_factory=list)
    unavailable: str | None = None  # why the requested provider cannot run at all

    def grouped(self) -> str:
        """``domain::op_type: reason [count=N; examples: a, b, c]`` groups joined by ``; ``."""
        return format_declines(self.declines)

    def __str__(self) -> str:
        head = (f"execution provider fallback: requested={self.requested_provider} "
                f"fallback={self.fallback_provider} assigned_nodes={self.assigned_node_count} "
                f"assigned_ops=[{', '.join(self.assigned_ops)}]")
        if self.unavailable:
            return f"{head} unavailable: {self.unavailable}"
        return f"{head} declines: {self.grouped()}"

    def to_dict(self) -> dict:
        return {"requested_provider": self.requested_provider,
                "fallback_provider": self.fallback_provider,
                "assigned_node_count": self.assigned_node_count,
                "assigned_ops": list(self.assigned_ops), "unavailable": self.unavailable,
                "declines": [d.__dict__ for d in self.declines]}


def format_declines(declines: list[Decline]) -> str:
    groups: dict[tuple[str, str, str], list[str]] = {}
    for d in declines:
        groups.setdefault((d.domain, d.op_type, d.reason), []).append(d.node)
    parts = []
    for (domain, op_type, reason) in sorted(groups):
        nodes = sorted(groups[(domain, op_type, reason)])
        parts.append(f"{domain}::{op_type}: {reason} [count={len(nodes)}; "
                     f"examples: {', '.join(nodes[:MAX_EXAMPLES_PER_CLASS])}]")
    return "; ".join(parts)


def walk_scoped(graph: Graph) -> Iterator[tuple[Graph, Node]]:
    """(owning graph, node) for every node, recursively through subgraphs."""
    for node in graph.nodes:
        yield graph, node
        for sub in node.subgraphs.values():
            yield from walk_scoped(sub)


def node_signature(graph: Graph, node: Node) -> tuple[list, list, list]:
    """Declared input shapes, dtypes, and the kinds of inputs and outputs."""
    shapes, dtypes, kinds = [], [], []
    for name in node.inputs:
        if not name:
            continue
        v = graph.value(name)
        shapes.append(v.shape)
        dtypes.append(v.dtype if v.kind == "tensor" else None)
        kinds.append(v.kind)
    for name in node.outputs:
        if name:
            v = graph.value(name)
            if v.kind in ("sequence", "map", "optional"):
                kinds.append(v.kind)
    return shapes, dtypes, kinds


def is_static(shapes: list) -> bool:
    return all(s is not None and all(isinstance(d, int) for d in s) for s in shapes)


def has_kernel(node: Node, opset: int) -> bool:
    """Whether the kernel table (or the op's function body) can run the node at all,
    dtypes and providers aside."""
    from hetero_exec.exec.functions import function_proto_for_support
    from hetero_exec.kernels.registry import lookup

    return lookup(node.domain, node.op_type, opset) is not None \
        or function_proto_for_support(node, opset)


def skipped(node: Node) -> bool:
    """Control-flow and sequence ops are not asked: they run on the coordinator's host."""
    return node.canonical_domain == "ai.onnx" and (node.op_type in CONTROL_FLOW_OPS
                                                   or node.op_type in SEQUENCE_OPS)


def node_support(graph: Graph, node: Node, provider: Provider) -> Support:
    """supports_op, plus kernel creation for static shapes ("kernel creation failed")."""
    shapes, dtypes, kinds = node_signature(graph, node)
    opset = graph.opset(node.domain)
    sup = provider.supports_op(node, opset, shapes, dtypes, kinds)
    if not sup or not is_static(shapes):
        return sup
    import numpy as np

    from hetero_exec.exec.plan import Compiler

    try:
        Compiler(np, provider.name).check_node(graph, node)
    except Exception as e:  # the kernel cannot be created for this node
        return Support(False, f"kernel creation failed: {e}")
    return sup


def collect_declines(graph: Graph, provider: Provider) -> list[Decline]:
    declines = []
    for g, node in walk_scoped(graph):
        if skipped(node):
            continue
        sup = node_support(g, node, provider)
        if not sup:
            declines.append(Decline(node.identity, node.canonical_domain, node.op_type, sup.reason))
    return declines


def assigned_ops(graph: Graph) -> tuple[int, list[str]]:
    """Node count and sorted op classes, recursively through subgraphs."""
    ops = set()
    count = 0
    for _, node in walk_scoped(graph):
        count += 1
        ops.add(node.op_class)
    return count, sorted(ops)


def coverage_report(graph: Graph, provider: Provider) -> FallbackReport | None:
    """None when the device covers every node; else the report of its declines."""
    if not provider.is_device:
        return None
    avail = provider.available()
    if not avail:
        count, ops = assigned_ops(graph)
        return FallbackReport(provider.name, [], assigned_node_count=count, assigned_ops=ops,
                              unavailable=avail.reason)
    declines = collect_declines(graph, provider)
    if not declines:
        return None
    count, ops = assigned_ops(graph)
    return FallbackReport(provider.name, sorted(declines), assigned_node_count=count, assigned_ops=ops)
