"""Memory admission (SEMANTICS.md section 5): refuse before admission, never OOM mid-run.

A segment needs its weights, the peak of its live activations (from the liveness of
its order) and kernel workspaces. Symbolic dims count only through a declared bound
(`dim_bounds`); an unbounded one is an error, never a guess.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from hetero_exec.errors import MemoryAdmissionError, UnboundedSymbolError, UnresolvedShapeError
from hetero_exec.ir.graph import Graph, Node, node_reads
from hetero_exec.placement.dims import bound_dim, symbols_of
from hetero_exec.placement.partition import resolve_shape, weight_bytes
from hetero_exec.placement.plan import PlacementPlan, Segment


def tensor_bytes(graph: Graph, name: str, bounds: dict[str, int]) -> int:
    """Bytes of a value; UnboundedSymbolError for a symbol without a bound."""
    v = graph.value(name)
    if v.kind != "tensor" or v.dtype is None or v.shape is None:
        return 0  # nothing declared: sequences and unknown values are not admitted
    for d in v.shape:
        if isinstance(d, str) and bound_dim(d, bounds) is None:
            missing = [s for s in symbols_of(d) if s not in bounds]
            raise UnboundedSymbolError(missing[0] if missing else d, name)
        if d is None:
            producer = graph.producer.get(name)
            raise UnresolvedShapeError(name, producer.op_class if producer else "<graph input>")
    shape = resolve_shape(graph, name, bounds)
    return int(np.prod(shape, dtype=np.int64)) * v.dtype.itemsize if shape is not None else 0


def workspace_bytes(graph: Graph, node: Node, bounds: dict[str, int]) -> int:
    """Scratch a kernel allocates beyond its outputs (im2col columns for convolutions)."""
    if node.op_type not in ("Conv", "ConvInteger", "QLinearConv") or len(node.inputs) < 2:
        return 0
    w = resolve_shape(graph, node.inputs[1], bounds)
    out = resolve_shape(graph, node.outputs[0], bounds)
    v = graph.value(node.outputs[0])
    if w is None or out is None or v.dtype is None:
        return 0
    return out[0] * math.prod(w[1:]) * math.prod(out[2:]) * v.dtype.itemsize


def segment_need(graph: Graph, seg: Segment, bounds: dict[str, int]) -> tuple[int, int]:
    """(weights, peak live activations + workspace) of a segment, in bytes."""
    return nodes_need(graph, seg.nodes, seg.inputs, seg.outputs, bounds)


def nodes_need(graph: Graph, nodes: list[Node], inputs: list[str], outputs: list[str],
               bounds: dict[str, int]) -> tuple[int, int]:
    """(weights, peak live activations + workspace) of running ``nodes`` in order."""
    weights = weight_bytes(graph, nodes)
    last_use: dict[str, int] = {}
    for i, node in enumerate(nodes):
        for name in node_reads(node):
            last_use[name] = i
    keep = set(outputs)
    live = {n: tensor_bytes(graph, n, bounds) for n in inputs if n not in graph.initializers}
    current = sum(live.values())
    peak = current
    for i, node in enumerate(nodes):
        outs = [o for o in node.outputs if o]
        sizes = {o: tensor_bytes(graph, o, bounds) for o in outs}
        peak = max(peak, current + sum(sizes.values()) + workspace_bytes(graph, node, bounds))
        live.update(sizes)
        current += sum(sizes.values())
        for name in set(node_reads(node)) | set(outs):
            if name in live and name not in keep and last_use.get(name, -1) <= i:
                current -= live.pop(name)
    return weights, peak


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
