"""A bound plan lowered to a program: the runs of steps that have lowerings become
regions of records, each one step of the new plan; the rest stay Python steps between
them.

Only steps whose outputs have shapes fixed by the input-shape signature are lowered
(exec/bound.py's analysis): a record's buffers and strides are fixed when it is made.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Sequence

from hetero_exec.exec.program import lowerings, record  # noqa: F401 (registers the lowerings)
from hetero_exec.exec.program.builder import ALIGN, ProgramBuilder
from hetero_exec.exec.program.lower_elementwise import merged_run
from hetero_exec.exec.program.place import NotLowered
from hetero_exec.exec.program.registry import lowering_for
from hetero_exec.exec.program.run import Export, Program, Region
from hetero_exec.exec.steps import RunPlan, Step
from hetero_exec.ir.graph import node_reads

log = logging.getLogger(__name__)


def lower_plan(plan: RunPlan, vals: Sequence[Any], known_value: set[int],
               known_shape: set[int]) -> RunPlan | None:
    """``plan`` (bound to one input-shape signature; ``vals``: every slot's value from a
    run at that signature) with its lowerable steps run as programs, or None when no
    run of steps is worth one."""
    wanted = set(range(len(plan.steps)))
    for _ in range(3):  # a step left out can leave its neighbours short of a run
        b, lowered, nodes = _lower(plan, vals, known_value, known_shape, wanted)
        keep = _worth(lowered)
        if keep == {i for i, x in enumerate(lowered) if x is not None}:
            break
        wanted = keep
    else:
        return None
    if not keep:
        return None
    runs = _runs(lowered)
    exports = _exports(plan, b, lowered, runs)
    arena = _layout(b)
    program = Program(record.pack(b.records), b.buffers, arena, nodes)
    steps = _steps(plan, b, program, lowered, runs, exports)
    log.debug("program of %d records for %d of %d steps (%d regions), arena %d bytes",
              len(b.records), sum(1 for x in lowered if x), len(plan.steps), len(runs), arena)
    return replace(plan, steps=_relive(plan, steps, runs), fast_steps=[])


def _lower(plan: RunPlan, vals, known_value, known_shape, wanted: set[int]):
    """One pass: the builder, each step's records (or None), the record's nodes."""
    b = ProgramBuilder(known_value, vals)
    lowered: list[tuple[int, int] | None] = []
    nodes: list[Any] = []
    for idx, st in enumerate(plan.steps):
        b.step = idx
        lowered.append(_lower_step(b, st, vals, known_value, known_shape)
                       if idx in wanted else None)
        if lowered[-1] is not None:
            nodes.extend([st.node] * (lowered[-1][1] - lowered[-1][0]))
    return b, lowered, nodes


def _worth(lowered: list) -> set[int]:
    """The lowered steps worth a program: all of them when no step is left in Python;
    else those in runs of two steps or more (a lone step's region costs its call and
    its copies out, what its Python kernel would have cost)."""
    done = {i for i, x in enumerate(lowered) if x is not None}
    if len(done) == len(lowered):
        return done
    return {i for s, e in _runs(lowered) if e - s >= 2 for i in range(s, e)}


def _lower_step(b: ProgramBuilder, st: Step, vals, known_value, known_shape) -> tuple[int, int] | None:
    fn = merged_run if hasattr(st.fn, "merged") else lowering_for(st.node.domain, st.node.op_type)
    if fn is None or st.wants_scope or st.on_host or not all(o in known_shape for o in st.outputs):
        return None
    if any(vals[o] is None for o in st.outputs if o > 1):  # (not an array: a sequence, a map)
        return None
    mark = b.mark()
    try:
        ins = [b.input(s, s in known_value) for s in st.inputs]
        outs = fn(b, st, ins, [vals[o] for o in st.outputs])
        for slot, place in zip(st.outputs, outs):
            if place is not None:
                b.set_place(slot, place)
    except NotLowered as e:
        log.debug("%s stays in Python: %s", st.node.identity, e)
        b.rollback(mark)
        return None
    return mark.records, len(b.records)


def _runs(lowered: list) -> list[tuple[int, int]]:
    """[start, end) of each run of consecutive lowered steps."""
    runs, start = [], None
    for i, x in enumerate(lowered + [None]):
        if x is not None and start is None:
            start = i
        elif x is None and start is not None:
            runs.append((start, i))
            start = None
    return runs


def _exports(plan: RunPlan, b: ProgramBuilder, lowered, runs) -> dict[int, list[int]]:
    """For each run (by its start): the slots it makes that a Python step or the plan's
    caller reads; their buffers kept alive until then."""
    run_of = {}
    for s, e in runs:
        for i in range(s, e):
            for o in plan.steps[i].outputs:
                run_of[o] = (s, e)
    out: dict[int, list[int]] = {s: [] for s, _ in runs}
    for i, st in enumerate(plan.steps):
        if lowered[i] is not None:
            continue
        # (a step with bodies reads their captures too)
        reads = list(st.inputs) + [plan.slot_of[r] for r in node_reads(st.node) if r in plan.slot_of]
        for slot in reads:
            r = run_of.get(slot)
            if r is not None and slot in b.place_of:
                if slot not in out[r[0]]:
                    out[r[0]].append(slot)
                b.use(b.place_of[slot], step=i)
    for slot in plan.output_slots:
        r = run_of.get(slot)
        if r is not None and slot in b.place_of:
            if slot not in out[r[0]]:
                out[r[0]].append(slot)
            b.use(b.place_of[slot], step=r[1])
    return out


def _layout(b: ProgramBuilder) -> int:
    """Offsets of the scratch buffers in one arena, two buffers sharing bytes only when
    their lifetimes do not overlap (largest first, each at the lowest offset that fits)."""
    scratch = sorted((x for x in b.buffers if x.kind == "scratch"), key=lambda x: -x.nbytes)
    placed: list = []
    end = 0
    for buf in scratch:
        size = -(-buf.nbytes // ALIGN) * ALIGN
        clashes = sorted((p.offset, p.offset + -(-p.nbytes // ALIGN) * ALIGN) for p in placed
                         if not (p.last < buf.first or buf.last < p.first))
        at = 0
        for lo, hi in clashes:
            if at + size <= lo:
                break
            at = max(at, hi)
        buf.offset = at
        placed.append(buf)
        end = max(end, at + size)
    return end


def _steps(plan: RunPlan, b: ProgramBuilder, program: Program, lowered, runs,
           exports: dict[int, list[int]]) -> list[Step]:
    starts = {s: e for s, e in runs}
    steps: list[Step] = []
    patched: set[int] = set()
    i = 0
    while i < len(plan.steps):
        end = starts.get(i)
        if end is None:
            steps.append(plan.steps[i])
            i += 1
            continue
        first, last = lowered[i][0], lowered[end - 1][1]
        outs = exports[i]
        # the feeds the records read, and those an export is a view of
        read = [t[0] for rec in b.records[first:last] for t in rec["t"] if t is not None]
        read += [b.place_of[s].buf for s in outs]
        feeds, feed_slots = [], []
        for idx in read:
            if idx in patched or idx < 0 or b.buffers[idx].kind != "feed":
                continue
            buf = b.buffers[idx]
            patched.add(idx)
            example = b.vals[buf.slot]
            feeds.append((idx, tuple(example.shape), example.dtype))
            feed_slots.append(buf.slot)
        # a value in scratch leaves as a copy: a Python step may return a view of it (a
        # Reshape), which the arena's lifetimes do not follow
        ex = [_export(b, b.place_of[s]) for s in outs]
        region = Region(program, first, last - first, feeds, ex)
        steps.append(Step(region, tuple(feed_slots), tuple(outs), {}, (), plan.steps[i].node))
        i = end
    return steps


def _export(b: ProgramBuilder, place) -> Export:
    buf = b.buffers[place.buf] if place.buf >= 0 else None
    whole = (buf is not None and buf.kind == "feed" and place.off == 0 and place.contiguous
             and place.shape == tuple(b.vals[buf.slot].shape))
    return Export(place, buf is not None and buf.kind == "scratch", whole)


def _relive(plan: RunPlan, steps: list[Step], runs) -> list[Step]:
    """Releases as the plan had them: a region frees what its steps freed (a Python step
    keeps its own, which count the captures of its bodies)."""
    out, i = [], 0
    starts = dict(runs)
    for st in steps:
        end = starts.get(i)
        if end is None:
            out.append(st)
            i += 1
            continue
        freed = sorted({s for k in range(i, end) for s in plan.steps[k].release})
        out.append(replace(st, release=tuple(freed)))
        i = end
    return _after_last_reader(out)


def _after_last_reader(steps: list[Step]) -> list[Step]:
    """A slot a step releases that a later step still reads moves to that reader's
    releases: a region reads the array under a view its own steps made (a Reshape of a
    value whose last reader, in the plan, ran inside an earlier region)."""
    last: dict[int, int] = {}
    for k, st in enumerate(steps):
        for s in st.inputs:
            last[s] = k
    moved: dict[int, set[int]] = {}
    out = []
    for k, st in enumerate(steps):
        keep = tuple(s for s in st.release if last.get(s, -1) <= k)
        for s in st.release:
            if last.get(s, -1) > k:
                moved.setdefault(last[s], set()).add(s)
        out.append(st if len(keep) == len(st.release) else replace(st, release=keep))
    for k, slots in moved.items():
        out[k] = replace(out[k], release=tuple(sorted(set(out[k].release) | slots)))
    return out
