"""The run loop: feed, step, release, collect. Nothing else happens per node."""

from __future__ import annotations

from typing import Any, Sequence

from hetero_exec.errors import HeteroExecError, KernelError
from hetero_exec.exec.steps import MANY_INPUTS, NO_INPUTS, ONE_INPUT, RunPlan, Step


def execute(plan: RunPlan, inputs: Sequence[Any], scope: list[Any] | None = None) -> list[Any]:
    """Run ``plan`` on ``inputs`` (in ``plan.input_slots`` order); returns its outputs.

    Each call has its own slot list, so concurrent calls on one plan are safe.
    """
    vals = plan.template.copy()
    if scope is not None:
        for outer, inner in plan.captures:
            vals[inner] = scope[outer]
    for (_, s), v in zip(plan.input_slots, inputs):
        if v is not None:
            vals[s] = v
    run_steps(plan, vals)
    return [vals[s] for s in plan.output_slots]


def run_steps(plan: RunPlan, vals: list[Any]) -> None:
    """The steps of ``plan`` over the slot list ``vals``, in order."""
    xp = plan.xp
    step = None
    try:
        for step in plan.fast_steps:
            fn, a, b, kw, rel, mode, outs, sxp = step
            if mode == ONE_INPUT:
                res = fn(sxp or xp, vals[a], **kw)
            elif mode == MANY_INPUTS:
                res = fn(sxp or xp, *a(vals), **kw)
            elif mode == NO_INPUTS:
                res = fn(sxp or xp, **kw)
            else:
                res = fn(sxp or xp, *[vals[i] for i in a], scope=vals, **kw)
            if b >= 0:
                vals[b] = res[0]
            else:
                for s, v in zip(outs, res):
                    vals[s] = v
            if rel:
                for s in rel:
                    vals[s] = None
    except HeteroExecError:
        raise
    except Exception as e:
        raise kernel_error(plan.steps[plan.fast_steps.index(step)], vals, e, plan) from e


class BodyRuns:
    """The runs of one body inside one Loop or Scan call: the slot list is made once
    (constants and outer captures in place) and every iteration reuses it.

    That is safe because iterations run one after another and every value a step reads
    is written earlier in the same iteration (inputs, constants and captures are never
    released); the outputs are read before the next iteration overwrites them.
    """

    __slots__ = ("plan", "vals", "slots", "defaults")

    def __init__(self, plan: RunPlan, scope: list[Any] | None):
        self.plan = plan
        self.vals = plan.template.copy()
        if scope is not None:
            for outer, inner in plan.captures:
                self.vals[inner] = scope[outer]
        self.slots = [s for _, s in plan.input_slots]
        self.defaults = [plan.template[s] for s in self.slots]

    def __call__(self, inputs: Sequence[Any]) -> list[Any]:
        vals = self.vals
        for s, v, d in zip(self.slots, inputs, self.defaults):
            vals[s] = d if v is None else v
        run_steps(self.plan, vals)
        return [vals[s] for s in self.plan.output_slots]


def kernel_error(step: Step, vals: list[Any], e: Exception, plan: RunPlan) -> KernelError:
    shapes = []
    for i in step.inputs:
        v = vals[i]
        shapes.append(f"{getattr(v, 'dtype', type(v).__name__)}{list(getattr(v, 'shape', ()))}"
                      if v is not None else "None")
    node = step.node
    detail = f"{type(e).__name__}: {e}; inputs: {', '.join(shapes) or 'none'} on {plan.provider}"
    return KernelError(node.identity, node.op_class, detail)
