"""What a compiled plan is made of: Steps over integer value slots, and the RunPlan
that holds them with its slot list's template. The compiler (plan.py) makes them, the
run loop (executor.py) runs them; both import this module, neither imports the other's
(a plan's bodies reach the run loop through plan.py, which sits above both).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from hetero_exec.ir.graph import Node

NONE_SLOT = 0  # always None: omitted optional inputs read it
TRASH_SLOT = 1  # written by omitted optional outputs, never read

#: ops never folded at compile time (their outputs change from run to run)
NONDETERMINISTIC = frozenset(
    {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Bernoulli",
     "Multinomial", "Dropout"}
)


@dataclass(frozen=True)
class Step:
    fn: Callable
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    kwargs: dict[str, Any]
    release: tuple[int, ...]
    node: Node
    wants_scope: bool = False
    xp: Any = None  # the step's array module when it differs from the plan's (host steps)
    on_host: bool = False  # a host step inside a device plan (exec.host_steps)


@dataclass
class RunPlan:
    steps: list[Step]
    template: list[Any]  # the slot list a run starts from: constants in place
    input_slots: list[tuple[str, int]]
    output_slots: list[int]
    output_names: list[str]
    #: (slot in the enclosing plan, slot here) for values read from outer scopes
    captures: list[tuple[int, int]] = field(default_factory=list)
    slot_of: dict[str, int] = field(default_factory=dict)
    xp: Any = np
    provider: str = "cpu"
    #: the steps as plain tuples for the run loop (see `fast_step`)
    fast_steps: list[tuple] = field(default_factory=list)
    #: outputs that are the same on every run (folded from constants, or constants
    #: themselves), by name: the plan's own values, on its provider
    constant_outputs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.fast_steps = [fast_step(st) for st in self.steps]


#: run-loop modes: how a step's inputs are read
NO_INPUTS, ONE_INPUT, MANY_INPUTS, WITH_SCOPE = 0, 1, 2, 3


def fast_step(st: Step) -> tuple:
    """(fn, inputs, output, kwargs, release, mode, outputs, xp): ``inputs`` is a slot (one
    input), an itemgetter (several) or a slot tuple (scope); ``output`` is the slot of a
    single output, or -1 when ``outputs`` lists several."""
    ins = st.inputs
    if st.wants_scope:
        mode, a = WITH_SCOPE, ins
    elif not ins:
        mode, a = NO_INPUTS, None
    elif len(ins) == 1:
        mode, a = ONE_INPUT, ins[0]
    else:
        mode, a = MANY_INPUTS, operator.itemgetter(*ins)
    b = st.outputs[0] if len(st.outputs) == 1 else -1
    return (st.fn, a, b, st.kwargs, st.release, mode, st.outputs, st.xp)
