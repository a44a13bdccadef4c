"""A compiled body (an If branch, a Loop or Scan body, a function body) as the kernels
that run bodies call it: its plan, bound to its input shapes once they repeat."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from hetero_exec.exec.bound import BoundBody, ShapeBoundPlans
from hetero_exec.exec.executor import BodyRuns
from hetero_exec.exec.steps import RunPlan
from hetero_exec.ir.graph import node_reads


def declared_dtype(dtypes: Sequence[Any], i: int) -> Any:
    """A body's declared dtype of output i (float32 when the body does not say)."""
    dt = dtypes[i] if i < len(dtypes) else None
    return dt if dt is not None else np.float32


def static_shape(shapes: Sequence[Any], i: int) -> tuple | None:
    sh = shapes[i] if i < len(shapes) else None
    return tuple(sh) if sh is not None and all(isinstance(d, int) for d in sh) else None


class Subgraph:
    """A compiled body (If branch, Loop/Scan body, function body): what kernels call.

    ``run(scope, inputs)`` runs it once; ``start(scope)`` returns a callable for the many
    runs of one Loop or Scan (`exec.executor.BodyRuns`: one slot list for all of them).
    """

    def __init__(self, plan: RunPlan, output_dtypes: list | None = None,
                 output_shapes: list | None = None):
        self.plan = plan
        self.output_dtypes = output_dtypes or []
        self.output_shapes = output_shapes or []
        self._plans: ShapeBoundPlans | None = None  # bound to repeating shapes, made lazily
        # a step's reads include its bodies' captures (an If in a Loop body may read i)
        read = {plan.slot_of[r] for st in plan.steps for r in node_reads(st.node)
                if r in plan.slot_of} | set(plan.output_slots)
        self._reads = [s in read for _, s in plan.input_slots]

    @property
    def input_count(self) -> int:
        return len(self.plan.input_slots)

    @property
    def output_count(self) -> int:
        return len(self.plan.output_slots)

    def output_dtype(self, i: int):
        return declared_dtype(self.output_dtypes, i)

    def output_shape(self, i: int) -> tuple | None:
        """The declared shape of output ``i`` when every dim is static, else None."""
        return static_shape(self.output_shapes, i)

    def reads_input(self, i: int) -> bool:
        """Whether any step (or output) reads input ``i``: a Loop need not make the
        iteration number for a body that ignores it."""
        return i >= len(self._reads) or self._reads[i]

    def _bound(self) -> ShapeBoundPlans:
        plans = self._plans
        if plans is None:
            plans = self._plans = ShapeBoundPlans(self.plan)
        return plans

    def run(self, scope: list[Any] | None, inputs: Sequence[Any]) -> list[Any]:
        """One run of the body (an If's branch): bound once its shapes repeat."""
        return self._bound().run(inputs, scope)

    def start(self, scope: list[Any] | None):
        """A callable for the many runs of one Loop or Scan call."""
        plans = self._bound()
        return BoundBody(plans, scope) if plans.worth_it else BodyRuns(self.plan, scope)

    __call__ = run
