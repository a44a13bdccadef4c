"""Plans bound to their input shapes: a run whose input shapes repeat replays a plan
with its shape arithmetic already done.

Most of a small decoder's steps (Shape, Gather, Unsqueeze, Concat of dims, Range of
positions ...) compute values that depend only on the input *shapes*. For one shape
signature those values are the same on every run, so a plan bound to the signature
holds them as constants and keeps only the steps that read input data: the CPU
counterpart of a captured device graph (a decode step at fixed capacity replays).

Which slots are shape-only is found by a data-flow pass over the steps:

* a graph input has a known shape (the signature) and an unknown value, unless it was
  not fed (an initializer that is also an input, left at its value: a constant);
* ``Shape``/``Size`` of a value whose shape is known is known;
* any other step's outputs are known when all its inputs are; their shapes are known
  when the inputs' shapes are and the inputs that set the output shape (the kernel's
  declared host inputs: Reshape's shape, Slice's starts ...) are known values. Ops
  whose output shape follows their data (NonZero, Unique, control flow, ...) and
  random ops are never known.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import numpy as np

from hetero_exec.exec.executor import BodyRuns, execute, run_steps
from hetero_exec.exec.steps import NONDETERMINISTIC, NONE_SLOT, TRASH_SLOT, RunPlan
from hetero_exec.ir.graph import node_reads
from hetero_exec.kernels.registry import lookup

log = logging.getLogger(__name__)

#: "0" (or false/off): bound plans keep their steps in Python, no program (A/B runs)
PROGRAM_ENV = "HETERO_EXEC_PROGRAM"

#: ops whose output shape depends on input values beyond their declared host inputs
DATA_SHAPED = frozenset({"NonZero", "Unique", "Compress", "NonMaxSuppression", "If", "Loop",
                         "Scan", "StringSplit", "TfIdfVectorizer", "SequenceAt",
                         "SequenceConstruct", "SplitToSequence", "ConcatFromSequence",
                         "Optional", "OptionalGetElement", "OptionalHasElement"})
METADATA = frozenset({"Shape", "Size"})
#: ops whose host inputs do not set their output shape (the kernel reads them on the
#: host for another reason): the inputs that do, by position
SHAPE_SET_BY = {"KVAppend": (), "KVPrefix": ()}
_ANY_OPSET = 10**6


@dataclass(frozen=True)
class ShapeAnalysis:
    """What an input-shape signature fixes in a plan."""
    static_steps: list[int]  # the steps computable from input shapes alone
    static_slots: set[int]  # the slots they write
    known_value: set[int]  # slots whose values are the same on every run
    known_shape: set[int]  # slots whose shapes are


def analyse(plan: RunPlan, unfed: frozenset[int] = frozenset()) -> ShapeAnalysis:
    """The shape-only steps of ``plan`` when the input slots ``unfed`` keep their
    template values."""
    inputs = ({s for _, s in plan.input_slots} - unfed) | {inner for _, inner in plan.captures}
    constants = {NONE_SLOT} | {s for s, v in enumerate(plan.template)
                               if v is not None and s not in inputs}
    known_value = set(constants)
    known_shape = set(known_value) | inputs
    static_steps: list[int] = []
    for idx, st in enumerate(plan.steps):
        op = st.node.op_type
        ins = [s for s in st.inputs]
        if st.wants_scope or op in DATA_SHAPED or op in NONDETERMINISTIC:
            continue
        if op in METADATA:
            if ins and ins[0] in known_shape:
                static_steps.append(idx)
                known_value.update(st.outputs)
                known_shape.update(st.outputs)
            continue
        if all(s in known_value for s in ins):
            static_steps.append(idx)
            known_value.update(st.outputs)
            known_shape.update(st.outputs)
            continue
        kdef = lookup(st.node.domain, op, _ANY_OPSET)
        sets_shape = SHAPE_SET_BY.get(
            op, kdef.host_inputs if kdef is not None else range(len(ins)))
        if all(s in known_shape for s in ins) and all(
                ins[p] in known_value for p in sets_shape if p < len(ins)):
            known_shape.update(st.outputs)
    # a run's outputs are its caller's to keep (and mutate): never shared across runs
    outputs = set(plan.output_slots)
    static_steps = [i for i in static_steps if not outputs & set(plan.steps[i].outputs)]
    written = {s for i in static_steps for s in plan.steps[i].outputs} - {TRASH_SLOT}
    # (a slot a remaining step writes is computed on every run, whatever its value)
    return ShapeAnalysis(static_steps, written, constants | written, known_shape)


def shape_only_steps(plan: RunPlan) -> tuple[list[int], set[int]]:
    """(indices of the steps computable from input shapes alone, the slots they write)."""
    a = analyse(plan)
    return a.static_steps, a.static_slots


class ShapeBoundPlans:
    """A plan's bound variants, one per input-shape signature seen twice (a signature
    seen once is not worth binding: a growing context never repeats)."""

    def __init__(self, plan: RunPlan, max_bound: int = 16, program: bool | None = None):
        self.plan = plan
        self.static_steps, self.static_slots = shape_only_steps(plan)
        self.max_bound = max_bound
        # (programs run host plans only: a device plan binds for its shape steps alone)
        self.program = (_programs_on() if program is None else program) and plan.xp is np
        self._analyses: dict[frozenset[int], ShapeAnalysis] = {}
        self._bound: dict[tuple, RunPlan] = {}
        self._seen: set[tuple] = set()
        self._lock = threading.Lock()

    @property
    def worth_it(self) -> bool:
        return bool(self.static_steps) or self.program

    def _signature(self, inputs: Sequence[Any], scope: Sequence[Any] | None = None) -> tuple | None:
        """The inputs' shapes and dtypes (and the captured values' for a body)."""
        try:
            sig = tuple(None if v is None else (v.shape, v.dtype) for v in inputs)
            if scope is not None and self.plan.captures:
                sig += tuple(None if scope[o] is None else (scope[o].shape, scope[o].dtype)
                             for o, _ in self.plan.captures)
            return sig
        except AttributeError:  # a sequence or map: its shapes are not a signature
            return None

    def plan_for(self, inputs: Sequence[Any]) -> RunPlan:
        """The plan bound to these inputs' shapes when there is one, else the plan."""
        if not self.worth_it:
            return self.plan
        sig = self._signature(inputs)
        return self._bound.get(sig, self.plan) if sig is not None else self.plan

    def run(self, inputs: Sequence[Any], scope: Sequence[Any] | None = None,
            plain: Callable[[Sequence[Any]], list[Any]] | None = None) -> list[Any]:
        """Run ``inputs`` (a body: with its enclosing ``scope``) on the plan bound to their
        shapes; the second run of a signature binds it (that run's own values are what the
        binding keeps). ``plain`` runs the unbound plan (a body's reused slot list)."""
        if plain is None:
            def plain(args):
                return execute(self.plan, args, scope)
        if not self.worth_it:
            return plain(inputs)
        sig = self._signature(inputs, scope)
        if sig is None:
            return plain(inputs)
        bound = self._bound.get(sig)
        if bound is not None:
            return execute(bound, inputs, scope)
        with self._lock:
            later = sig in self._seen and len(self._bound) < self.max_bound
            self._seen.add(sig)
        if not later:
            return plain(inputs)
        outs, bound = self._bind(inputs, scope)
        with self._lock:
            self._bound.setdefault(sig, bound)
        return outs

    def _bind(self, inputs: Sequence[Any], scope: Sequence[Any] | None = None
              ) -> tuple[list[Any], RunPlan]:
        """Run the plan on ``inputs``, keeping what the shape-only steps made and what
        they read (a Shape may read a value a data step made), the shapes of the rest:
        (the run's outputs, the plan bound to these shapes)."""
        plan = self.plan
        unfed = frozenset(s for (_, s), v in zip(plan.input_slots, inputs)
                          if v is None and plan.template[s] is not None)
        a = self._analyses.get(unfed)
        if a is None:
            a = self._analyses[unfed] = analyse(plan, unfed)
        vals = plan.template.copy()
        if scope is not None:
            for outer, inner in plan.captures:
                vals[inner] = scope[outer]
        for (_, s), v in zip(plan.input_slots, inputs):
            if v is not None:
                vals[s] = v
        examples = _run_noting_shapes(plan, vals, a)
        outs = [vals[s] for s in plan.output_slots]
        template = plan.template.copy()
        for s in a.static_slots:
            template[s] = vals[s]
        keep = set(range(len(plan.steps))) - set(a.static_steps)
        steps = _live([st for i, st in enumerate(plan.steps) if i in keep], plan)
        log.debug("bound a plan of %d steps to %d for one input-shape signature",
                  len(plan.steps), len(steps))
        bound = replace(plan, steps=steps, template=template, fast_steps=[])
        if self.program and plan.xp is np:
            from hetero_exec.exec.program.lower import lower_plan

            lowered = lower_plan(bound, examples, a.known_value, a.known_shape)
            if lowered is not None:
                bound = lowered
        return outs, bound


class BoundBody:
    """A Loop's or Scan's body runs for one call: each iteration on the plan bound to its
    shapes, through a reused slot list (`executor.BodyRuns`) per plan."""

    __slots__ = ("plans", "scope", "plain", "_runs")

    def __init__(self, plans: ShapeBoundPlans, scope: Sequence[Any] | None):
        self.plans, self.scope = plans, scope
        self.plain = BodyRuns(plans.plan, scope)
        self._runs: dict[tuple, BodyRuns] = {}

    def __call__(self, inputs: Sequence[Any]) -> list[Any]:
        plans = self.plans
        sig = plans._signature(inputs, self.scope)
        runs = self._runs.get(sig) if sig is not None else None
        if runs is not None:
            return runs(inputs)
        bound = plans._bound.get(sig) if sig is not None else None
        if bound is not None:
            runs = self._runs[sig] = BodyRuns(bound, self.scope)
            return runs(inputs)
        return plans.run(inputs, self.scope, self.plain)


class ValueShape:
    """What a bound program needs of a value a run released: its shape and dtype."""

    __slots__ = ("shape", "dtype", "strides", "size", "ndim", "nbytes")

    def __init__(self, v: np.ndarray):
        self.shape, self.dtype, self.size, self.ndim = v.shape, v.dtype, v.size, v.ndim
        self.nbytes = v.nbytes
        strides, acc = [], v.itemsize
        for d in reversed(v.shape):
            strides.append(acc)
            acc *= d
        self.strides = tuple(reversed(strides))


def _run_noting_shapes(plan: RunPlan, vals: list[Any], a: ShapeAnalysis) -> list[Any]:
    """Run ``plan`` over ``vals`` releasing as it does, except what the shape-only steps
    read and make; each released array's shape noted: every slot's value or shape."""
    keep = set(a.static_slots) | set(plan.output_slots)
    for i in a.static_steps:
        keep.update(plan.steps[i].inputs)
        keep.update(plan.slot_of[r] for r in node_reads(plan.steps[i].node) if r in plan.slot_of)
    noted: dict[int, Any] = {}

    def noting(st):
        fn, outputs = st.fn, st.outputs

        def run(xp, *args, **kwargs):
            res = fn(xp, *args, **kwargs)
            for s, v in zip(outputs, res):
                if isinstance(v, (np.ndarray, np.generic)):
                    noted[s] = ValueShape(np.asarray(v))
            return res

        return replace(st, fn=run, release=tuple(r for r in st.release if r not in keep))

    run_steps(replace(plan, steps=[noting(st) for st in plan.steps], fast_steps=[]), vals)
    return [v if v is not None else noted.get(s) for s, v in enumerate(vals)]


#: ops with no effect but their outputs: a step of one whose outputs nothing reads any
#: more (its readers were shape steps, bound away) need not run
PURE = frozenset({"Reshape", "Expand", "Unsqueeze", "Squeeze", "Flatten", "Transpose", "Slice",
                  "Gather", "Concat", "Cast", "Identity", "Shape", "Size", "Range", "Where",
                  "Add", "Sub", "Mul", "Div", "Equal", "Less", "Greater", "And", "Or", "Not"})


def _live(steps: list, plan: RunPlan) -> list:
    """``steps`` less the pure ones whose outputs no later step reads and the plan does
    not return (a repeat_kv whose one reader left was a Shape)."""
    read = set(plan.output_slots)
    out = []
    for st in reversed(steps):
        if (st.node.op_type in PURE and st.node.domain in ("", "ai.onnx") and not st.wants_scope
                and not read & set(st.outputs) and not hasattr(st.fn, "merged")):
            continue
        read.update(st.inputs)
        read.update(plan.slot_of[r] for r in node_reads(st.node) if r in plan.slot_of)
        out.append(st)
    return out[::-1]


def _programs_on() -> bool:
    """Bound plans run as programs where the C library is loaded (HETERO_EXEC_PROGRAM=0:
    never)."""
    if os.environ.get(PROGRAM_ENV, "1").strip().lower() in ("0", "false", "off", "no"):
        return False
    from hetero_exec.kernels.native import library

    return library.available()
