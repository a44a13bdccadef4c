"""Building a program: buffers, places and records, for the lowerings to emit into.

Buffers are of three kinds: constants (arrays the plan holds: weights, folded values,
packed weights), scratch (values the records make, laid out in one arena by lifetime:
two values whose steps do not overlap share bytes) and feeds (values made outside the
program, by a Python step or given to the run: their addresses are written into the
table when a run reaches the records that read them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from hetero_exec.exec.program import record
from hetero_exec.exec.program.place import (
    NotLowered,
    Place,
    coalesce,
    contiguous_strides,
    dtype_code,
)

ALIGN = 64


@dataclass
class Buffer:
    kind: str  # "const", "scratch" or "feed"
    nbytes: int = 0
    array: np.ndarray | None = None  # a constant's array (C-contiguous)
    source: Any = None  # the array it was made from (kept: its id keys the constants)
    slot: int = -1  # a feed's slot
    first: int = 0  # steps (of the whole plan) from which to which a scratch buffer lives
    last: int = 0
    offset: int = 0  # in the arena


@dataclass
class Emitted:
    """What the builder holds at a mark, to roll a failed lowering back."""
    records: int
    buffers: int
    places: list[int] = field(default_factory=list)


def dense_order(x: Place) -> list[int] | None:
    """The dims of ``x`` from outermost to innermost in memory, when ``x`` is a dense
    array seen through a permutation (no gaps, no broadcast), else None."""
    dims = sorted(range(len(x.shape)), key=lambda i: (-x.strides[i], i))
    acc = 1
    for i in reversed(dims):
        if x.shape[i] != 1 and x.strides[i] != acc:
            return None
        acc *= x.shape[i]
    return dims


class ProgramBuilder:
    def __init__(self, known_value: set[int], vals: Sequence[Any]):
        self.codes = record.codes()
        self.records: list[dict[str, Any]] = []
        self.buffers: list[Buffer] = []
        self.place_of: dict[int, Place] = {}
        self.known_value = known_value
        self.vals = vals
        self.step = 0  # the plan step being lowered (lifetimes)
        self._added: list[int] = []  # slots given places since the last mark
        self._materialized: dict[Place, Place] = {}
        self._const_ids: dict[int, int] = {}

    # -- marks ---------------------------------------------------------------------

    def mark(self) -> Emitted:
        self._added = []
        return Emitted(len(self.records), len(self.buffers))

    def rollback(self, m: Emitted) -> None:
        del self.records[m.records:]
        del self.buffers[m.buffers:]
        for slot in self._added:
            self.place_of.pop(slot, None)
        self._added = []
        self._materialized = {k: v for k, v in self._materialized.items()
                              if v.buf < m.buffers and k.buf < m.buffers}
        self._const_ids = {k: v for k, v in self._const_ids.items() if v < m.buffers}

    # -- places ----------------------------------------------------------------------

    def const(self, array: np.ndarray) -> Place:
        """A constant's place (the array kept, C-contiguous)."""
        idx = self._const_ids.get(id(array))
        if idx is None:
            a = np.ascontiguousarray(array).reshape(np.shape(array))  # a 0-d stays 0-d
            dtype_code(a.dtype)
            idx = len(self.buffers)
            self.buffers.append(Buffer("const", a.nbytes, array=a, source=array))
            self._const_ids[id(array)] = idx
        a = self.buffers[idx].array
        return Place(idx, 0, tuple(a.shape), contiguous_strides(tuple(a.shape)), a.dtype)

    def scratch(self, shape: Sequence[int], dtype: Any) -> Place:
        """A new C-contiguous value made by this step's records."""
        shape = tuple(int(d) for d in shape)
        dt = np.dtype(dtype)
        dtype_code(dt)
        idx = len(self.buffers)
        nbytes = max(math.prod(shape) * dt.itemsize, 1)
        self.buffers.append(Buffer("scratch", nbytes, first=self.step, last=self.step))
        return Place(idx, 0, shape, contiguous_strides(shape), dt)

    def like(self, example: np.ndarray, layout: Sequence[Place | None] = ()) -> Place:
        """A new value shaped like ``example``; laid out as the first of ``layout`` of its
        shape that is a transposed dense array (numpy's order K: an element-wise step
        over a transposed view reads and writes both in memory order), else C order."""
        shape = tuple(int(d) for d in example.shape)
        for x in layout:
            if x is None or x.shape != shape or x.contiguous:
                continue
            order = dense_order(x)
            if order is not None:
                base = self.scratch(tuple(shape[i] for i in order), example.dtype)
                inverse = tuple(order.index(i) for i in range(len(order)))
                return base.transpose(inverse)
        return self.scratch(shape, example.dtype)

    def feed(self, slot: int, example: Any) -> Place:
        """The place of a value made outside the program (fed C-contiguous at run time)."""
        if not hasattr(example, "shape") or not isinstance(example.dtype, np.dtype) \
                or example.dtype.hasobject:  # (an array, or the shape of one a run released)
            raise NotLowered(f"a feed of type {type(example).__name__}")
        dtype_code(example.dtype)
        idx = len(self.buffers)
        self.buffers.append(Buffer("feed", example.nbytes, slot=slot))
        # (a broadcast placeholder: a zero stride along a dim of more than one value)
        shape_only = any(st == 0 and d > 1 for d, st in zip(example.shape, example.strides))
        return Place(idx, 0, tuple(example.shape), contiguous_strides(tuple(example.shape)),
                     example.dtype, shape_only)

    def input(self, slot: int, from_template: bool) -> Place | None:
        """The place of slot ``slot`` read by the step being lowered."""
        if slot == 0:  # NONE_SLOT: an omitted optional input
            return None
        place = self.place_of.get(slot)
        if place is None:
            v = self.vals[slot]
            if v is None:
                return None
            place = self.const(v) if from_template else self.feed(slot, v)
            self.set_place(slot, place)
        self.use(place)
        return place

    def set_place(self, slot: int, place: Place) -> None:
        self.place_of[slot] = place
        self._added.append(slot)

    def use(self, place: Place | None, step: int | None = None) -> None:
        """``place``'s buffer is read at ``step`` (the current one by default)."""
        if place is None or place.buf < 0:
            return
        b = self.buffers[place.buf]
        if b.kind == "scratch":
            b.last = max(b.last, self.step if step is None else step)

    def static(self, slot: int) -> np.ndarray:
        """A host input's value, the same on every run (else the step is not lowered)."""
        if slot not in self.known_value or self.vals[slot] is None:
            raise NotLowered("a host input that changes from run to run")
        return np.asarray(self.vals[slot])

    def readable(self, place: Place | None) -> Place | None:
        if place is not None and place.shape_only:
            raise NotLowered("reads a feed given only for its shape")
        return place

    def contiguous(self, place: Place) -> Place:
        """``place`` itself when C-contiguous, else a copy made by a record."""
        self.readable(place)
        if place.contiguous:
            return place
        done = self._materialized.get(place)
        if done is not None:
            return done
        out = self.scratch(place.shape, place.dtype)
        self.elementwise("OP_COPY", 0, out, [place])
        self._materialized[place] = out
        return out

    # -- records ---------------------------------------------------------------------

    def emit(self, op: str, *, code: int = 0, dims: Sequence[int] = (),
             tensors: Sequence[Place | None] = (), strides: Sequence[Sequence[int]] | None = None,
             p: Sequence[int] = (), f: Sequence[float] = (), parts: int = 1) -> None:
        """One record. ``strides`` (one per tensor) default to each place's own."""
        if len(dims) > self.codes["HE_ND"] or len(tensors) > self.codes["HE_NT"]:
            raise NotLowered(f"{len(dims)} dims or {len(tensors)} operands in one record")
        ts = []
        for i, t in enumerate(tensors):
            if t is None:
                ts.append(None)
                continue
            self.use(t)
            st = t.strides if strides is None else strides[i]
            ts.append((t.buf, dtype_code(t.dtype), t.off, tuple(int(s) for s in st)))
        self.records.append({"op": self.codes[op], "code": int(code), "ndim": len(dims),
                             "parts": int(parts), "dims": tuple(int(d) for d in dims),
                             "t": ts, "p": tuple(int(x) for x in p),
                             "f": tuple(float(x) for x in f)})

    def elementwise(self, op: str, code: int, out: Place, ins: Sequence[Place]) -> None:
        """An element-wise record over ``out``'s shape, the inputs broadcast to it."""
        for x in ins:
            self.readable(x)
        if out.size == 0:
            return
        shape = out.shape
        strides = [out.strides] + [x.broadcast(shape).strides for x in ins]
        # walk the output in memory order (a transposed output: its unit-stride dim last)
        order = sorted(range(len(shape)), key=lambda i: (-abs(out.strides[i]), i))
        shape = tuple(shape[i] for i in order)
        strides = [tuple(st[i] for i in order) for st in strides]
        dims, merged = coalesce(shape, strides)
        if not dims:
            dims, merged = (1,), [(1,) for _ in strides]
        if op == "OP_COPY" and len(dims) >= 2 and merged[1][-1] != 1 and 1 in merged[1][:-1]:
            self._transpose_copy(out, ins[0], dims, merged)
            return
        self.emit(op, code=code, dims=dims, tensors=[out, *ins], strides=merged,
                  parts=self.parts(math.prod(dims[:-1]), out.size))

    TILE = 16

    def _transpose_copy(self, out: Place, x: Place, dims, strides) -> None:
        """A copy whose source is contiguous along another dim than the output (a
        transpose made dense): in tiles of TILE along the source's unit-stride dim k, the
        innermost loop reading TILE consecutive values, the next writing consecutive
        ones, so both stay in cache lines already loaded."""
        k = list(strides[1][:-1]).index(1)
        n, tile = dims[k], self.TILE
        main = n - n % tile
        so, si = strides
        for lo, hi in ((0, main), (main, n)):
            if hi <= lo:
                continue
            t = tile if hi - lo >= tile else hi - lo
            outer = (hi - lo) // t
            d = list(dims[:k]) + [outer] + list(dims[k + 1:]) + [t]
            st_o = list(so[:k]) + [so[k] * t] + list(so[k + 1:]) + [so[k]]
            st_i = list(si[:k]) + [si[k] * t] + list(si[k + 1:]) + [si[k]]
            o = Place(out.buf, out.off + lo * so[k] * out.itemsize, (), (), out.dtype)
            i = Place(x.buf, x.off + lo * si[k] * x.itemsize, (), (), x.dtype)
            if len(d) > self.codes["HE_ND"]:
                raise NotLowered("a transposing copy over too many dims")
            self.emit("OP_COPY", dims=d, tensors=[o, i], strides=[st_o, st_i],
                      parts=self.parts(math.prod(d[:-1]), out.size))

    @staticmethod
    def parts(rows: int, flops: float) -> int:
        """Parts to split ``rows`` of ``flops`` work over the library's workers (as its
        other kernels decide, once, when the plan is bound)."""
        from hetero_exec.kernels.native import library

        return library.parts(rows, flops) if rows > 1 and flops >= 1 << 16 else 1

    def constant_code(self, name: str) -> int:
        return self.codes[name]
