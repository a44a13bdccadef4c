"""From an ordered node assignment to segments and seams."""

from __future__ import annotations

from typing import Sequence

from hetero_exec.ir.graph import Graph, Node, node_reads
from hetero_exec.placement.plan import PlacementPlan, Seam, Segment
from hetero_exec.providers.base import Provider


def build_plan(graph: Graph, order: Sequence[Node], assignment: dict[Node, Provider],
               strategy: str = "single") -> PlacementPlan:
    """Group consecutive same-provider nodes of ``order`` into segments and list seams."""
    segments: list[Segment] = []
    for node in order:
        prov = assignment[node]
        if not segments or segments[-1].provider is not prov:
            segments.append(Segment(id=len(segments), provider=prov, nodes=[]))
        segments[-1].nodes.append(node)
    seg_of: dict[str, int] = {}
    for seg in segments:
        for node in seg.nodes:
            for o in node.outputs:
                if o:
                    seg_of[o] = seg.id
    readers: dict[str, list[int]] = {}
    for seg in segments:
        seen: set[str] = set()
        for node in seg.nodes:
            for name in node_reads(node):
                if name in seen:
                    continue
                seen.add(name)
                if seg_of.get(name) != seg.id:
                    seg.inputs.append(name)
                    readers.setdefault(name, []).append(seg.id)
    for name, segs in readers.items():
        p = seg_of.get(name)
        if p is not None and name not in segments[p].outputs:
            segments[p].outputs.append(name)
    for name in graph.outputs:
        p = seg_of.get(name)
        if p is not None and name not in segments[p].outputs:
            segments[p].outputs.append(name)
    seams = []
    for name, segs in readers.items():
        p = seg_of.get(name)
        if p is None:
            continue  # graph inputs and initializers are fed, not seams
        v = graph.value(name)
        seams.append(Seam(value=name, producer=p, consumers=sorted(set(segs)),
                          dtype=v.dtype_name, shape=v.shape, nbytes=v.nbytes()))
    return PlacementPlan(segments=segments, seams=seams, graph=graph, strategy=strategy,
                         assignment={n: assignment[n].name for n in order})
