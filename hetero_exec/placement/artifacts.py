"""Plans as artifacts: a dict (saved as JSON), a text report, and Graphviz DOT.

`PlacementPlan`'s methods (``to_dict``, ``report``, ``to_dot``) call these, so this
module reads plans without importing `placement.plan`; a saved plan is read back by
`placement.saved_plan`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hetero_exec.placement.stages import stage_report

if TYPE_CHECKING:
    from hetero_exec.placement.plan import PlacementPlan

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


def plan_report(plan: PlacementPlan) -> str:
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
