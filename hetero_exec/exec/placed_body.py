"""Control-flow bodies in a heterogeneous session: the If/Loop/Scan node runs on the
host, and its body is placed with the same rules as the top-level graph (its own
segments and seams, copies at seams)."""

from __future__ import annotations

from typing import Any, Sequence

from hetero_exec.exec.chain import SegmentChain
from hetero_exec.exec.subgraph import declared_dtype, static_shape
from hetero_exec.ir.graph import Graph


class PlacedSubgraph:
    """Duck-types exec.subgraph.Subgraph: ``run(scope, inputs) -> outputs``."""

    def __init__(self, body: Graph, outer_slots: dict[str, int], providers: Sequence[Any],
                 fold_constants: bool = True):
        from hetero_exec.exec.plan import Compiler
        from hetero_exec.placement.planner import classify_placement, single_plan

        plan = classify_placement(body, providers)
        if plan is None:
            plan = single_plan(body, providers[0])
        self.placement = plan
        self.body = body
        self.captures = [(name, outer_slots[name]) for name in body.captures if name in outer_slots]
        self.output_dtypes = [body.value(o).dtype for o in body.outputs]
        self.output_shapes = [body.value(o).shape for o in body.outputs]
        self.segments = []
        for seg in plan.segments:
            prov = seg.provider
            placer = make_body_placer(providers, fold_constants)
            compiler = Compiler.for_provider(prov, fold_constants, placer)
            self.segments.append((prov, compiler.compile(body, seg.nodes, seg.inputs, seg.outputs)))
        self.chain = SegmentChain(self.segments)

    @property
    def input_count(self) -> int:
        return len(self.body.inputs)

    @property
    def output_count(self) -> int:
        return len(self.body.outputs)

    def output_dtype(self, i: int):
        return declared_dtype(self.output_dtypes, i)

    def output_shape(self, i: int) -> tuple | None:
        return static_shape(self.output_shapes, i)

    def reads_input(self, i: int) -> bool:
        return True

    def start(self, scope: list[Any] | None):
        """The runs of one Loop/Scan call (Subgraph.start's interface)."""
        return lambda inputs: self.run(scope, inputs)

    def run(self, scope: list[Any] | None, inputs: Sequence[Any]) -> list[Any]:
        env: dict[str, Any] = dict(zip(self.body.inputs, inputs))
        if scope is not None:
            for name, slot in self.captures:
                env[name] = scope[slot]
        return self.chain.run_inside(env, self.body.outputs)

    __call__ = run


def make_body_placer(providers: Sequence[Any], fold_constants: bool = True):
    def place(body: Graph, outer_slots: dict[str, int]) -> PlacedSubgraph:
        return PlacedSubgraph(body, outer_slots, providers, fold_constants)

    return place
