"""A saved plan (``PlacementPlan.to_json``) read back for a graph: every node placed
on a provider of the session that can run it, in a valid order, with its stage cuts."""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

from hetero_exec.errors import PlacementError
from hetero_exec.ir.graph import Graph
from hetero_exec.placement.artifacts import PLAN_FORMAT
from hetero_exec.placement.coverage import node_support, skipped
from hetero_exec.placement.plan import PlacementPlan
from hetero_exec.placement.segments import build_plan
from hetero_exec.placement.stages import cut_positions
from hetero_exec.providers.base import Provider


def load_plan(source: Any, graph: Graph, providers: Sequence[Provider]) -> PlacementPlan:
    """Rebuild a saved plan for ``graph``; every node must be placed on a provider of the
    session that can run it."""
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
    return cut_positions([st["segments"] for st in stages])
