"""GPU coverage, declines and the grouped FallbackReport (SEMANTICS.md section 1)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

from hetero_exec.ir.graph import Graph, Node
from hetero_exec.providers import Provider

log = logging.getLogger(__name__)


def decide_placement(graph: Graph, provs: Sequence[Provider], requested: Provider, options):
    from hetero_exec.placement.decide import SessionBuild, reject_unsupported_operators
    from hetero_exec.placement.segments import build_plan

    if requested.kind == "cpu":
        reject_unsupported_operators(graph, requested)
        plan = build_plan(graph, graph.nodes, {n: requested for n in graph.nodes})
        return SessionBuild(placement=plan, providers=[requested], requested=requested.name)
    raise NotImplementedError("gpu placement")
