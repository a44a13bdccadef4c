"""PlacementPlan: segments (a provider and its nodes) and the seams between them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hetero_exec.ir.graph import Graph, Node
from hetero_exec.providers.base import Provider


@dataclass
class Segment:
    """A maximal same-provider region, run as one compiled RunPlan."""

    id: int
    provider: Provider
    nodes: list[Node]
    inputs: list[str] = field(default_factory=list)  # graph inputs, initializers and seams it reads
    outputs: list[str] = field(default_factory=list)  # seams it produces and graph outputs
    predicted_cost: float | None = None  # its nodes plus the seams it reads (link model)
    compute_cost: float | None = None  # its nodes only
    #: the part of compute_cost that host threads shorten (large products), and the
    #: threads it was costed at (None: a device's, not the host's)
    product_cost: float = 0.0
    cost_threads: int | None = None
    mem_need: int | None = None

    @property
    def name(self) -> str:
        return f"segment#{self.id}"

    @property
    def provider_name(self) -> str:
        return self.provider.name


@dataclass
class Seam:
    """A value produced in one segment and read in others."""

    value: str
    producer: int  # segment id (-1: a graph input or initializer, fed from the host)
    consumers: list[int]
    dtype: str
    shape: tuple[Any, ...] | None
    nbytes: int | None


@dataclass
class PlacementPlan:
    segments: list[Segment]
    seams: list[Seam]
    graph: Graph
    strategy: str = "single"
    #: node -> provider name, for every top-level node
    assignment: dict[Node, str] = field(default_factory=dict)
    #: pipeline stages (placement.stages): contiguous runs of segments, an actor each
    stages: list[Any] = field(default_factory=list)
    #: stage cuts read from a saved plan (used when the session asks for "auto")
    saved_cuts: list[int] | None = None

    @property
    def providers(self) -> list[str]:
        out: list[str] = []
        for s in self.segments:
            if s.provider.name not in out:
                out.append(s.provider.name)
        return out

    @property
    def is_single(self) -> bool:
        return len(self.segments) <= 1

    def seam_bytes(self) -> int:
        return sum(s.nbytes or 0 for s in self.seams)

    # -- artifacts -------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        from hetero_exec.placement.artifacts import plan_to_dict

        return plan_to_dict(self)

    def to_json(self, path: str | None = None) -> str:
        """The plan as JSON (written to ``path`` too when given); reload it with
        ``InferenceSession(model, providers, placement=path)``."""
        import json

        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    def report(self) -> str:
        from hetero_exec.placement.artifacts import plan_report

        return plan_report(self)

    def to_dot(self) -> str:
        from hetero_exec.placement.artifacts import plan_to_dot

        return plan_to_dot(self)

    def summary(self) -> str:
        segs = ", ".join(f"{s.name}={s.provider.name}({len(s.nodes)})" for s in self.segments)
        stages = f", {len(self.stages)} stage(s)" if self.stages else ""
        return (f"{len(self.segments)} segments [{segs}], {len(self.seams)} seams, "
                f"{self.seam_bytes()} B{stages}")
