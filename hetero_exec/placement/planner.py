"""classify_placement: single provider, or a PlacementPlan of segments and seams.

Rules, as onnxruntime's design has them: providers in priority order claim the nodes
they support, cpu goes last so every node is placed; control-flow and sequence nodes
run on the coordinator's host; segments are grouped by a topological order chosen to
minimise provider switches, not the file order. Shape arithmetic that only feeds host
inputs runs on the host inside its device segment (`exec.host_steps`), so it costs no
seam.
"""

from __future__ import annotations

import heapq
import logging
import re
from typing import Sequence

from hetero_exec.errors import PlacementError
from hetero_exec.exec.host_steps import METADATA_OPS
from hetero_exec.ir.graph import Graph, Node, node_reads
from hetero_exec.placement.coverage import node_support, skipped
from hetero_exec.placement.plan import PlacementPlan
from hetero_exec.placement.segments import build_plan
from hetero_exec.providers.base import Provider

log = logging.getLogger(__name__)



def compile_affinity(affinity: Sequence[tuple[str, str]] | None) -> list[tuple[re.Pattern, str]]:
    out = []
    for item in affinity or ():
        try:
            pattern, prov = item
            out.append((re.compile(pattern), str(prov)))
        except (TypeError, ValueError, re.error) as e:
            raise PlacementError(f"bad affinity entry {item!r}: expected (regex, provider): {e}") from None
    return out


def match_affinity(rules: list[tuple[re.Pattern, str]], node: Node) -> str | None:
    """First rule whose regex matches the node's name or op type wins."""
    for pattern, prov in rules:
        if (node.name and pattern.fullmatch(node.name)) or pattern.fullmatch(node.op_type):
            return prov
    return None


def find_provider(providers: Sequence[Provider], name: str) -> Provider:
    for p in providers:
        if p.name == name or p.kind == name:
            return p
    raise PlacementError(f"affinity names provider {name!r}, which is not in the session's "
                         f"providers {[p.name for p in providers]}")


def capability(graph: Graph, providers: Sequence[Provider],
               affinity: list[tuple[re.Pattern, str]]) -> dict[Node, Provider]:
    """First provider (in rank order) that supports each top-level node; pins win."""
    cpu = providers[-1]
    usable = [p for p in providers if p.available()]
    assign: dict[Node, Provider] = {}
    for node in graph.nodes:
        pin = match_affinity(affinity, node)
        if pin is not None:
            prov = find_provider(providers, pin)
            sup = node_support(graph, node, prov) if not skipped(node) or not prov.is_device else None
            if skipped(node) and prov.is_device:
                raise PlacementError(f"affinity pins {node.identity} ({node.op_class}) to {prov.name}, "
                                     f"which cannot run it: control-flow and sequence ops run on the host")
            if sup is not None and not sup:
                raise PlacementError(f"affinity pins {node.identity} ({node.op_class}) to {prov.name}, "
                                     f"which cannot run it: {sup.reason}")
            assign[node] = prov
            continue
        if skipped(node):
            assign[node] = cpu
            continue
        for prov in usable:
            if not prov.is_device or node_support(graph, node, prov):
                assign[node] = prov
                break
        else:
            assign[node] = cpu
    return assign


def metadata_follows_input(graph: Graph, assign: dict[Node, Provider], cpu: Provider,
                           pinned: set[Node]) -> None:
    """Shape/Size of a tensor produced on the host stay on the host: on a device they
    would copy the whole tensor across a seam to read a few bytes of metadata."""
    for node in graph.nodes:  # topological: a Shape of a Shape's output follows too
        if node.op_type not in METADATA_OPS or node in pinned or not assign[node].is_device:
            continue
        src = graph.producer.get(node.inputs[0]) if node.inputs and node.inputs[0] else None
        if src is not None and assign.get(src) is cpu:
            assign[node] = cpu


def grouped_order(graph: Graph, assign: dict[Node, Provider]) -> list[Node]:
    """A topological order that keeps running the current provider's ready nodes, so
    segments are as few (and as large) as the dependencies allow."""
    nodes = graph.nodes
    idx = {n: i for i, n in enumerate(nodes)}
    producer = {o: n for n in nodes for o in n.outputs if o}
    deps: dict[Node, set[Node]] = {n: set() for n in nodes}
    users: dict[Node, list[Node]] = {n: [] for n in nodes}
    for n in nodes:
        for name in node_reads(n):
            p = producer.get(name)
            if p is not None and p is not n and p not in deps[n]:
                deps[n].add(p)
                users[p].append(n)
    indeg = {n: len(d) for n, d in deps.items()}
    ready: dict[str, list[tuple[int, Node]]] = {}

    def push(n: Node) -> None:
        heapq.heappush(ready.setdefault(assign[n].name, []), (idx[n], n))

    for n in nodes:
        if indeg[n] == 0:
            push(n)
    order: list[Node] = []
    current: str | None = None
    while any(ready.values()):
        if current is None or not ready.get(current):
            # switch to the provider whose earliest ready node comes first
            current = min((q[0][0], name) for name, q in ready.items() if q)[1]
        _, n = heapq.heappop(ready[current])
        order.append(n)
        for u in users[n]:
            indeg[u] -= 1
            if indeg[u] == 0:
                push(u)
    return order


def classify_placement(graph: Graph, providers: Sequence[Provider], *, affinity=None,
                       strategy: str = "greedy", dim_bounds: dict[str, int] | None = None,
                       cost_model=None) -> PlacementPlan | None:
    """None when the first provider covers everything alone (single provider);
    otherwise the heterogeneous PlacementPlan."""
    rules = compile_affinity(affinity)
    cpu = providers[-1]
    assign = capability(graph, providers, rules)
    devices = [p for p in providers if p.is_device and p.available()]
    first = providers[0]
    pinned = {n for n in graph.nodes if match_affinity(rules, n) is not None}
    # control-flow and sequence nodes are not asked: they make a graph mixed only
    # through what their bodies hold
    if len(devices) <= 1 and all(p is first or (skipped(n) and n not in pinned and _bodies_covered(n, first))
                                 for n, p in assign.items()):
        return None
    metadata_follows_input(graph, assign, cpu, pinned)
    absorb_index_tails(graph, assign, cpu, pinned)
    if len(devices) > 1:
        from hetero_exec.placement.partition import split_devices

        split_devices(graph, grouped_order(graph, assign), assign, devices, strategy,
                      dim_bounds or {}, pinned, cost_model)
    order = grouped_order(graph, assign)
    plan = build_plan(graph, order, assign, strategy=strategy if len(devices) > 1 else "hetero")
    from hetero_exec.placement.partition import annotate_costs

    annotate_costs(plan, dim_bounds or {}, cost_model)
    return plan


#: ops that only move or index data: a device segment of nothing else does no work
#: worth a round trip across a seam
DATA_MOVEMENT_OPS = frozenset({
    "Gather", "GatherND", "GatherElements", "Reshape", "Transpose", "Squeeze", "Unsqueeze",
    "Flatten", "Slice", "Concat", "Split", "Identity", "Expand", "Cast", "Shape", "Size",
})


def absorb_index_tails(graph: Graph, assign: dict[Node, Provider], cpu: Provider,
                       pinned: set[Node]) -> None:
    """A device segment made only of data movement that reads a cpu-produced value (say,
    gathering the boxes a host-only NonMaxSuppression selected) runs on cpu instead: it
    would cost a seam each way and do no work on the device."""
    order = grouped_order(graph, assign)
    runs: list[list[Node]] = []
    for node in order:
        if runs and assign[runs[-1][-1]] is assign[node]:
            runs[-1].append(node)
        else:
            runs.append([node])
    for run in runs:
        if not assign[run[0]].is_device or any(n in pinned for n in run):
            continue
        if not all(n.op_type in DATA_MOVEMENT_OPS and not n.subgraphs for n in run):
            continue
        members = set(run)
        reads_host = any(
            (p := graph.producer.get(name)) is not None and p not in members and assign.get(p) is cpu
            for n in run for name in n.inputs if name)
        if reads_host:
            for n in run:
                assign[n] = cpu


def _bodies_covered(node: Node, provider: Provider) -> bool:
    from hetero_exec.placement.coverage import collect_declines

    if not provider.is_device:
        return True
    return not any(collect_declines(sub, provider) for sub in node.subgraphs.values())


def single_plan(graph: Graph, provider: Provider) -> PlacementPlan:
    return build_plan(graph, graph.nodes, {n: provider for n in graph.nodes})
