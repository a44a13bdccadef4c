"""The session-building decision of SEMANTICS.md section 1: which providers run what.

Order: (signatures and cycles are checked by ir.load) -> unsupported-operator
rejection when cpu is requested -> provider passes -> GPU coverage -> fallback,
require or hetero -> guard -> memory admission.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

from hetero_exec.errors import ProviderError, UnsupportedOperatorError
from hetero_exec.ir.graph import Graph, Node
from hetero_exec.placement.plan import PlacementPlan
from hetero_exec.placement.segments import build_plan
from hetero_exec.providers import Provider, parse_provider
from hetero_exec.providers.base import CONTROL_FLOW_OPS, SEQUENCE_OPS

log = logging.getLogger(__name__)


@dataclass
class SessionBuild:
    placement: PlacementPlan
    providers: list[Provider]
    fallback_report: Any = None
    requested: str = "cpu"

    @property
    def provider_names(self) -> list[str]:
        return [p.name for p in self.providers]


def parse_providers(providers: Sequence[Any] | None) -> list[Provider]:
    if providers is None:
        providers = ["cpu"]
    if isinstance(providers, (str, tuple)):
        providers = [providers]
    parsed = [parse_provider(p) for p in providers]
    if not parsed:
        raise ProviderError("providers must name at least one provider")
    return parsed


def node_signature(graph: Graph, node: Node) -> tuple[list, list, list]:
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


def is_static(shapes: Sequence[Any]) -> bool:
    return all(s is not None and all(isinstance(d, int) for d in s) for s in shapes)


def reject_unsupported_operators(graph: Graph, provider: Provider) -> None:
    """On a cpu request, the first node with static input shapes that cpu cannot run
    is a load-time error (symbolic ones are deferred to run time)."""
    for g, node in walk_with_graph(graph):
        if node.op_type in CONTROL_FLOW_OPS or node.op_type in SEQUENCE_OPS:
            continue
        shapes, dtypes, kinds = node_signature(g, node)
        if not is_static(shapes):
            continue
        opset = g.opset(node.domain)
        sup = provider.supports_op(node, opset, shapes, dtypes, kinds)
        if not sup:
            raise UnsupportedOperatorError(node.identity, node.canonical_domain, node.op_type,
                                           opset, provider.name, sup.reason)


def walk_with_graph(graph: Graph):
    for node in graph.nodes:
        yield graph, node
        for sub in node.subgraphs.values():
            yield from walk_with_graph(sub)


def build_session_plan(graph: Graph, providers: Sequence[Any] | None, options) -> SessionBuild:
    provs = parse_providers(providers)
    requested = provs[0]
    from hetero_exec.placement.coverage import decide_placement

    return decide_placement(graph, provs, requested, options)
