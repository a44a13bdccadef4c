"""Provider-scoped graph passes (SEMANTICS.md 1.4): a provider may rewrite the graph.

A pass maps a Graph to a new Graph; the result is re-validated and its shapes
re-inferred on a copy, and adopted only when that succeeds. Passes are registered per
provider kind; `register_pass` lets experiments add their own.
"""

from __future__ import annotations

import copy
import logging
from typing import Callable

from hetero_exec.ir.graph import Graph
from hetero_exec.providers.base import Provider

log = logging.getLogger(__name__)

GraphPass = Callable[[Graph], Graph | None]
_PASSES: dict[str, list[GraphPass]] = {}


def register_pass(provider_kind: str, fn: GraphPass) -> GraphPass:
    _PASSES.setdefault(provider_kind, []).append(fn)
    return fn


def unregister_pass(provider_kind: str, fn: GraphPass) -> None:
    if fn in _PASSES.get(provider_kind, []):
        _PASSES[provider_kind].remove(fn)


def run_provider_passes(graph: Graph, provider: Provider) -> Graph:
    """Apply the provider's passes to a copy; the original graph is never mutated."""
    passes = _PASSES.get(provider.kind, [])
    if not passes:
        return graph
    out = graph
    for fn in passes:
        candidate = fn(copy.deepcopy(out))
        if candidate is None:
            continue
        try:
            from hetero_exec.ir.load import check_acyclic

            check_acyclic(candidate)
            candidate.reindex()
        except Exception as e:  # a pass that breaks the graph is not adopted
            log.warning("provider pass %s on %s not adopted: %s", getattr(fn, "__name__", fn),
                        provider.name, e)
            continue
        out = candidate
    return out


def drop_identities(graph: Graph) -> Graph | None:
    """Device pass: Identity nodes cost a kernel launch each; rewire their readers."""
    graph_outputs = set(graph.outputs)
    victims = [n for n in graph.nodes if n.op_type == "Identity" and n.canonical_domain == "ai.onnx"
               and n.outputs[0] not in graph_outputs and not n.subgraphs]
    if not victims:
        return None
    rename = {n.outputs[0]: n.inputs[0] for n in victims}
    drop = set(id(n) for n in victims)
    graph.nodes = [n for n in graph.nodes if id(n) not in drop]
    for n in graph.nodes:
        n.inputs = [_resolve(rename, i) for i in n.inputs]
        for sub in n.subgraphs.values():
            if any(c in rename for c in sub.captures):
                return None  # bodies capture the name: keep it simple, skip the pass
    return graph


def _resolve(rename: dict[str, str], name: str) -> str:
    while name in rename:
        name = rename[name]
    return name


register_pass("gpu", drop_identities)
register_pass("sim-gpu", drop_identities)

from hetero_exec.placement import fusions as _fusions  # noqa: E402, F401  (registers the cpu fusions)
