"""Memory admission (SEMANTICS.md section 5): refuse before admission, never OOM mid-run.

A segment needs its weights, the peak of its live activations (from the liveness of
its order) and kernel workspaces. Symbolic dims count only through a declared bound
(`dim_bounds`); an unbounded one is an error, never a guess. Dims onnx leaves unnamed
(a ``Range``'s length, a ``Reshape`` of a computed shape) are worked out in the input
symbols by `placement/shape_bounds.py` first (`sizes.tensor_bytes`).
"""

from __future__ import annotations

from typing import Any

from hetero_exec.errors import MemoryAdmissionError, UnboundedSymbolError, UnresolvedShapeError
from hetero_exec.ir.graph import Graph
from hetero_exec.placement.plan import PlacementPlan, Segment
from hetero_exec.placement.sizes import nodes_need, weight_bytes


def segment_need(graph: Graph, seg: Segment, bounds: dict[str, int]) -> tuple[int, int]:
    """(weights, peak live activations + workspace) of a segment, in bytes."""
    return nodes_need(graph, seg.nodes, seg.inputs, seg.outputs, bounds)


def admit(plan: PlacementPlan, bounds: dict[str, int], explicit: Any = None) -> None:
    """Check every segment against its provider's budget; annotate ``mem_need``.

    Providers without an explicit ``mem_limit`` are admitted on what can be proven:
    weights always, activations when their shapes are static or bounded.
    """
    used: dict[str, int] = {}
    for seg in plan.segments:
        prov = seg.provider
        strict = prov.options.mem_limit is not None
        budget = prov.mem_limit
        if budget is None:
            continue
        try:
            weights, peak = segment_need(plan.graph, seg, bounds)
        except (UnboundedSymbolError, UnresolvedShapeError):
            if strict:
                raise
            weights, peak = weight_bytes(plan.graph, seg.nodes), 0
        seg.mem_need = weights + peak
        prior = used.get(prov.name, 0)
        if prior + weights + peak > budget:
            raise MemoryAdmissionError(seg.name, prov.name, weights + peak, max(budget - prior, 0),
                                       f"weights {weights} B + peak activations {peak} B")
        used[prov.name] = prior + weights  # weights stay resident; activations are reused
