"""Plans as artifacts: JSON (save and reload), a text report, and Graphviz DOT."""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

from hetero_exec.errors import PlacementError
from hetero_exec.ir.graph import Graph
from hetero_exec.placement.coverage import node_support, skipped
from hetero_exec.placement.plan import PlacementPlan
from hetero_exec.providers.base import Provider

PLAN_FORMAT = "hetero_exec.placement/1"

#: fill colours by provider kind for DOT output
COLOURS = {"cpu": "#9ecae1", "gpu": "#a1d99b", "sim-gpu": "#fdae6b"}
DEVICE_SHADES = ["#a1d99b", "#fdae6b", "#bcbddc", "#fc9272", "#c7e9c0", "#fdd0a2"]


def plan_to_dict(plan: PlacementPlan) -> dict[str, Any]:
    return {
        "format": PLAN_FORMAT,
        "graph": plan.graph.name,
        "strategy": plan.strategy,
        "providers": plan.providers,
        "segments": [
            {"id": s.id, "provider": s.provider.name,
             # a node fused by a provider pass stands for the model's nodes it replaced
             "nodes": [i for n in s.nodes for i in getattr(n, "fused_from", None) or [n.identity]],
             "inputs": s.inputs, "outputs": s.outputs, "predicted_cost_s": s.predicted_cost,
             "mem_need_bytes": s.mem_need}
            for s in plan.segments
        ],
        "seams": [
            {"value": s.value, "producer": s.producer, "consumers": s.consumers, "dtype": s.dtype,
             "shape": list(s.shape) if s.shape is not None else None, "bytes": s.nbytes}
            for s in plan.seams
        ],
        "stages": [
            {"id": st.id, "segments": st.segments, "device": st.device,
             "inputs": st.inputs, "outputs": st.outputs,
             "predicted_compute_s": st.compute_s, "predicted_hop_s": st.hop_s}
            for st in plan.stages
        ],
    }


def load_plan(source: Any, graph: Graph, providers: Sequence[Provider]) -> PlacementPlan:
    """Rebuild a saved plan for ``graph``; every node must be placed on a provider of the
    session that can run it."""
    from hetero_exec.placement.segments import build_plan

    data = source
    if isinstance(source, (str, os.PathLike)):
        try:
            with open(source) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise PlacementError(f"cannot read saved plan {source!r}: {e}") from None
    if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
        raise PlacementError(f"not a saved hetero_exec plan (format {PLAN_FORMAT!r} expected)")
    segments = data.get("segments")
    if not isinstance(segments, list) or not all(
            isinstance(seg, dict) and isinstance(seg.get("provider"), str)
            and isinstance(seg.get("nodes"), list) for seg in segments):
        raise PlacementError("saved plan is malformed: 'segments' must be a list of "
                             "{'provider': str, 'nodes': [node identity, ...]} objects")
    by_name = {p.name: p for p in providers}
    by_ident = {n.identity: n for n in graph.nodes}
    assign = {}
    order = []
    for seg in segments:
        prov = by_name.get(seg["provider"])
        if prov is None:
            raise PlacementError(f"saved plan uses provider {seg['provider']!r}, not among the "
                                 f"session's providers {list(by_name)}")
        for ident in seg["nodes"]:
            node = by_ident.get(ident)
            if node is None:
                raise PlacementError(f"saved plan names node {ident}, which the model does not have")
            if node in assign:
                raise PlacementError(f"saved plan places {ident} twice")
            if prov.is_device and (skipped(node) or not node_support(graph, node, prov)):
                raise PlacementError(f"saved plan places {ident} ({node.op_class}) on {prov.name}, "
                                     "which cannot run it")
            assign[node] = prov
            order.append(node)
    missing = [n.identity for n in graph.nodes if n not in assign]
    if missing:
        raise PlacementError(f"saved plan does not place {len(missing)} node(s): {missing[:5]}")
    position = {n: i for i, n in enumerate(order)}
    for node in order:  # the saved order must still be a valid topological order
        for name in node.inputs:
            p = graph.producer.get(name)
            if p is not None and position[p] > position[node]:
                raise PlacementError(f"saved plan runs {node.identity} before its producer {p.identity}")
    plan = build_plan(graph, order, assign, strategy=data.get("strategy", "saved"))
    plan.saved_cuts = _saved_cuts(data.get("stages"), len(plan.segments))
    return plan


def _saved_cuts(stages: Any, n_segments: int) -> list[int] | None:
    """The cuts of a saved plan's stages (None when it has none: plans saved before
    stages existed); a malformed list is an error."""
    if not stages:
        return None
    ok = isinstance(stages, list) and all(
        isinstance(st, dict) and isinstance(st.get("segments"), list) and st["segments"]
        for st in stages)
    flat = [i for st in stages for i in st["segments"]] if ok else []
    if not ok or flat != list(range(n_segments)):
        raise PlacementError("saved plan is malformed: 'stages' must list every segment id once, "
                             "in order, as [{'segments': [id, ...]}, ...]")
    from hetero_exec.placement.stages import cut_positions

    return cut_positions([st["segments"] for st in stages])


def plan_report(plan: PlacementPlan) -> str:
    from hetero_exec.placement.stages import stage_report

    lines = [f"placement ({plan.strategy}): {len(plan.segments)} segment(s), "
             f"{len(plan.seams)} seam(s), {plan.seam_bytes()} seam bytes known, "
             f"{len(plan.stages)} pipeline stage(s)"]
    for s in plan.segments:
        ops: dict[str, int] = {}
        for n in s.nodes:
            ops[n.op_type] = ops.get(n.op_type, 0) + 1
        top = ", ".join(f"{k}x{v}" for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:6])
        cost = f", predicted {s.predicted_cost * 1e3:.3f} ms" if s.predicted_cost is not None else ""
        mem = f", needs {s.mem_need} B" if s.mem_need is not None else ""
        lines.append(f"  {s.name} on {s.provider.name}: {len(s.nodes)} node(s) [{top}]{cost}{mem}")
    for seam in plan.seams:
        nb = f"{seam.nbytes} B" if seam.nbytes is not None else "? B"
        shape = list(seam.shape) if seam.shape is not None else "?"
        lines.append(f"  seam {seam.value!r}: segment#{seam.producer} -> "
                     f"{', '.join(f'segment#{c}' for c in seam.consumers)} ({seam.dtype} {shape}, {nb})")
    if plan.stages:
        lines.append("pipeline stages (an actor each on Ray):")
        lines += stage_report(plan.stages)
    return "\n".join(lines)


def plan_to_dot(plan: PlacementPlan) -> str:
    """Graphviz DOT: a cluster per stage (its actor) holding a cluster per segment,
    filled by provider; seams in red."""
    colour_of: dict[str, str] = {}
    shades = iter(DEVICE_SHADES)
    for name in plan.providers:
        kind = name.split(":")[0]
        colour_of[name] = COLOURS["cpu"] if kind == "cpu" else next(shades, COLOURS.get(kind, "#dddddd"))
    out = ["digraph placement {", "  rankdir=TB;", '  node [shape=box, style="rounded,filled", fontsize=10];']
    node_id: dict[Any, str] = {}
    by_id = {seg.id: seg for seg in plan.segments}
    groups = [(st, [by_id[i] for i in st.segments]) for st in plan.stages] or [
        (None, list(plan.segments))]
    for stage, segs in groups:
        indent = "  "
        if stage is not None:
            pred = (f"\\npredicted {stage.compute_s * 1e3:.2f} ms + hop {(stage.hop_s or 0) * 1e3:.2f} ms"
                    if stage.compute_s is not None else "")
            out.append(f"  subgraph cluster_stage{stage.id} {{")
            out.append(f'    label="{stage.name} on {stage.provider}{pred}"; style=bold;')
            indent = "    "
        for seg in segs:
            out.append(f"{indent}subgraph cluster_{seg.id} {{")
            out.append(f'{indent}  label="{seg.name} on {seg.provider.name}"; style=dashed;')
            for n in seg.nodes:
                nid = f"n{len(node_id)}"
                node_id[n] = nid
                label = f"{n.op_type}\\n{_esc(n.name or n.identity)}"
                out.append(f'{indent}  {nid} [label="{label}", '
                           f'fillcolor="{colour_of[seg.provider.name]}"];')
            out.append(f"{indent}}}")
        if stage is not None:
            out.append("  }")
    seam_values = {s.value for s in plan.seams}
    graph = plan.graph
    for seg in plan.segments:
        for n in seg.nodes:
            for name in n.inputs:
                p = graph.producer.get(name)
                if p in node_id:
                    style = ' [color=red, penwidth=2, label="seam"]' if name in seam_values else ""
                    out.append(f"  {node_id[p]} -> {node_id[n]}{style};")
    out.append("}")
    return "\n".join(out)


def _esc(s: str) -> str:
    return s.replace('"', '\\"')
