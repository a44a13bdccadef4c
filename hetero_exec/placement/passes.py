"""Provider-scoped graph passes (SEMANTICS.md 1.4): a provider may rewrite the graph.

Two kinds, registered per provider kind:

* graph passes (`register_pass`) run on the single-provider path: a pass maps a Graph to
  a new Graph; the result is re-validated and re-indexed on a copy, and adopted only
  when that succeeds;
* segment passes (`register_segment_pass`) run on a heterogeneous plan after placement
  (SEMANTICS.md 2: hetero is decided before the passes): each rewrites one segment's
  nodes in place (`fusions.Region`), never moving a node across segments, so every
  segment keeps its provider, inputs, outputs and seams.

`register_pass` and `register_segment_pass` let experiments add their own.
"""

from __future__ import annotations

import copy
import logging
from typing import Callable

from hetero_exec.ir.graph import Graph
from hetero_exec.placement import fusions
from hetero_exec.placement.fusions import Region
from hetero_exec.placement.plan import PlacementPlan
from hetero_exec.providers.base import Provider

log = logging.getLogger(__name__)

GraphPass = Callable[[Graph], Graph | None]
SegmentPass = Callable[[Graph, Region], Graph | None]
_PASSES: dict[str, list[GraphPass]] = {}
_SEGMENT_PASSES: dict[str, list[SegmentPass]] = {}


def register_pass(provider_kind: str, fn: GraphPass) -> GraphPass:
    _PASSES.setdefault(provider_kind, []).append(fn)
    return fn


def unregister_pass(provider_kind: str, fn: GraphPass) -> None:
    if fn in _PASSES.get(provider_kind, []):
        _PASSES[provider_kind].remove(fn)


def register_segment_pass(provider_kind: str, fn: SegmentPass) -> SegmentPass:
    _SEGMENT_PASSES.setdefault(provider_kind, []).append(fn)
    return fn


def unregister_segment_pass(provider_kind: str, fn: SegmentPass) -> None:
    if fn in _SEGMENT_PASSES.get(provider_kind, []):
        _SEGMENT_PASSES[provider_kind].remove(fn)


def graph_copy(graph: Graph) -> Graph:
    """A deep copy sharing the initializer arrays (passes add new ones, never write them)."""
    memo = {id(a): a for a in graph.initializers.values()}
    return copy.deepcopy(graph, memo)


def run_provider_passes(graph: Graph, provider: Provider) -> Graph:
    """Apply the provider's passes to a copy; the original graph is never mutated."""
    passes = _PASSES.get(provider.kind, [])
    if not passes:
        return graph
    out = graph
    for fn in passes:
        candidate = fn(graph_copy(out))
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


def run_segment_passes(plan: PlacementPlan) -> PlacementPlan:
    """Each segment's provider passes over its own nodes, on a copy of the plan's graph.

    Adopted (``plan`` updated in place: its graph, each segment's nodes, the assignment)
    only when every pass ran and the result is acyclic; otherwise ``plan`` stays as it was.
    """
    if not any(_SEGMENT_PASSES.get(s.provider.kind) for s in plan.segments):
        return plan
    graph = graph_copy(plan.graph)
    pos = {id(n): i for i, n in enumerate(plan.graph.nodes)}
    regions = [Region([graph.nodes[pos[id(n)]] for n in s.nodes], set(s.outputs), s.provider)
               for s in plan.segments]
    changed = False
    try:
        for seg, region in zip(plan.segments, regions):
            for fn in _SEGMENT_PASSES.get(seg.provider.kind, []):
                changed = fn(graph, region) is not None or changed
        if not changed:
            return plan
        from hetero_exec.ir.load import check_acyclic

        check_acyclic(graph)
        graph.reindex()
    except Exception as e:  # a pass that breaks the graph is not adopted
        log.warning("segment passes not adopted; the plan runs as placed: %s", e)
        return plan
    _adopt(plan, graph, regions)
    return plan


def _adopt(plan: PlacementPlan, graph: Graph, regions: list[Region]) -> None:
    for seg, region in zip(plan.segments, regions):
        seg.nodes = region.nodes
        reads = {r for n in seg.nodes for r in n.inputs} | {
            c for n in seg.nodes for sub in n.subgraphs.values() for c in sub.captures}
        # initializers a fused node no longer reads (folded weights) leave the inputs
        seg.inputs = [i for i in seg.inputs if i in reads or i in graph.inputs
                      or (i in graph.producer and i not in graph.initializers)]
    plan.graph = graph
    plan.assignment = {n: seg.provider.name for seg in plan.segments for n in seg.nodes}


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


register_pass("cpu", fusions.fuse_cpu)
register_pass("gpu", drop_identities)
register_pass("sim-gpu", drop_identities)
# the fused kernels are written against xp: every provider's segments get them (each
# fused node is checked against the segment's provider before it replaces anything)
for _kind in ("cpu", "gpu", "sim-gpu"):
    register_segment_pass(_kind, fusions.fuse)
