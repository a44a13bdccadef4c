"""Lowerings: how a step becomes records, by (domain, op type).

A lowering is ``fn(b, step, ins, outs) -> list[Place]``: ``b`` the ProgramBuilder, ``ins``
the places of the step's inputs (None for an omitted one), ``outs`` the values the step
made when the plan was bound (their shapes and dtypes hold on every run). It emits records
into ``b`` and returns its outputs' places, or raises NotLowered: the step then stays a
Python step. Each lowering is the native twin of a kernel in hetero_exec/kernels, and is
tested against it (tests/exec/program/).
"""

from __future__ import annotations

from typing import Callable

LOWERINGS: dict[tuple[str, str], Callable] = {}


def lowers(*ops: str, domain: str = "") -> Callable[[Callable], Callable]:
    def register(fn: Callable) -> Callable:
        for op in ops:
            key = (domain, op)
            if key in LOWERINGS:
                raise ValueError(f"two lowerings for {domain or 'ai.onnx'}::{op}")
            LOWERINGS[key] = fn
        return fn

    return register


def lowering_for(domain: str, op: str) -> Callable | None:
    """The lowering of ``domain::op`` (the lowerings register themselves when
    exec/program/lowerings.py imports them)."""
    return LOWERINGS.get(("" if domain == "ai.onnx" else domain, op))
