"""A program at run time: its records and buffers, an instance of its buffers per
thread (runs on two threads never share a scratch byte), and the regions a plan calls.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from hetero_exec.errors import KernelError
from hetero_exec.exec.program.builder import ALIGN, Buffer
from hetero_exec.exec.program.place import Place
from hetero_exec.kernels.native import library

#: what a failed record's code means (program.h's E_*)
_ERRORS = {"E_OP": "an unknown record", "E_TYPE": "an element type it does not take",
           "E_INDEX": "an index out of range", "E_CAPACITY": "positions past the cache's capacity",
           "E_MEMORY": "no memory for its scratch"}


class Instance:
    """One thread's buffers: the arena of scratch values and the table of addresses."""

    def __init__(self, program: Program):
        self.arena = np.empty(program.arena_bytes + ALIGN, np.uint8)
        base = self.arena.ctypes.data
        self.base = (-base) % ALIGN
        self.table = np.zeros(max(len(program.buffers), 1), np.uint64)
        self.feeds: dict[int, np.ndarray] = {}
        self.err = np.zeros(1, np.int32)
        for i, b in enumerate(program.buffers):
            if b.kind == "scratch":
                self.table[i] = base + self.base + b.offset
            elif b.kind == "const":
                self.table[i] = b.array.ctypes.data if b.array.size else 0
        self.table_addr = self.table.ctypes.data
        self.err_addr = self.err.ctypes.data
        self._views: dict[int, np.ndarray] = {}  # by id of a Place the program holds

    def view(self, program: Program, place: Place) -> np.ndarray:
        """``place`` as a numpy array over this instance's buffer (scratch or constant),
        or over the feed array this run gave."""
        b = program.buffers[place.buf]
        item = place.itemsize
        strides = tuple(s * item for s in place.strides)
        if b.kind == "feed":
            owner = self.feeds[place.buf]
            if place.off == 0 and owner.shape == place.shape and owner.strides == strides:
                return owner
            return np.ndarray(place.shape, place.dtype, owner, place.off, strides)
        v = self._views.get(id(place))
        if v is None:
            if b.kind == "const":
                v = np.ndarray(place.shape, place.dtype, b.array, place.off, strides)
            else:
                v = np.ndarray(place.shape, place.dtype, self.arena,
                               self.base + b.offset + place.off, strides)
            self._views[id(place)] = v
        return v


class Program:
    def __init__(self, records: np.ndarray, buffers: list[Buffer], arena_bytes: int,
                 nodes: Sequence[Any]):
        self.records = records
        self.records_addr = records.ctypes.data if len(records) else 0
        self.buffers = buffers
        self.arena_bytes = arena_bytes
        self.nodes = list(nodes)  # the node each record was lowered from
        # a record that calls OpenBLAS wants it at one thread (kernels/_threads.run_threads)
        blas = library.constant("OP_MATMUL")
        self.uses_blas = bool(len(records)) and bool(
            ((records["op"] == blas) & (records["p"][:, 11] != 0)).any())
        self._local = threading.local()
        self._run = library.lib().he_program_run
        self._codes = {v: _ERRORS[k] for k, v in library._state["constants"].items() if k in _ERRORS}

    def instance(self) -> Instance:
        inst = getattr(self._local, "inst", None)
        if inst is None:
            inst = self._local.inst = Instance(self)
        return inst

    def run(self, inst: Instance, first: int, count: int) -> None:
        bad = self._run(self.records_addr, first, count, inst.table_addr, inst.err_addr)
        if bad:
            node = self.nodes[bad - 1]
            raise KernelError(node.identity, node.op_class,
                              f"{self._codes.get(int(inst.err[0]), 'a failure')} (in a bound "
                              f"program's record {bad - 1})")


@dataclass(frozen=True)
class Export:
    place: Place
    copy: bool  # a value in a scratch buffer: the next run would overwrite it
    whole: bool = False  # a whole fed array (the generator's cache): returned as it is


class Region:
    """Records [first, first + count) as one step of a plan: fn(xp, *feeds) -> exports.
    ``feeds``: (buffer, shape, dtype) of each value the region is the first to read."""

    def __init__(self, program: Program, first: int, count: int,
                 feeds: Sequence[tuple[int, tuple, np.dtype]], exports: Sequence[Export]):
        self.program = program
        self.first, self.count = first, count
        self.feeds = list(feeds)
        self.exports = list(exports)
        self.__name__ = f"program[{first}:{first + count}]"

    def __call__(self, xp: Any, *values: Any) -> list[Any]:
        inst = self.enter(values)
        return [self.export(inst, e) for e in self.exports]

    def direct(self, values: Sequence[Any], index: int) -> Any:
        """A call running the records over these very arrays and returning export
        ``index`` (a fixed-shape decode step: nothing else to look up)."""
        values = list(values)
        e = self.exports[index]

        def call() -> Any:
            return self.export(self.enter(values), e)

        return call

    def export(self, inst: Instance, e: Export) -> Any:
        if e.whole:
            return inst.feeds[e.place.buf]
        v = inst.view(self.program, e.place)
        return v.copy() if e.copy else v

    def enter(self, values: Sequence[Any]) -> Instance:
        """Write the feeds' addresses and run the records; this thread's instance."""
        program = self.program
        inst = program.instance()
        table, kept = inst.table, inst.feeds
        for (buf, shape, dtype), v in zip(self.feeds, values):
            if kept.get(buf) is v:  # the same array as the last run (a generator's state)
                continue
            if v is None:  # (a slot released before its region: the table would keep 0)
                raise ValueError(f"a bound program's feed {np.dtype(dtype)}{list(shape)} "
                                 "was not given")
            if v.shape != shape or v.dtype != dtype:
                raise ValueError(f"a bound program's feed is {v.dtype}{list(v.shape)}, bound "
                                 f"to {np.dtype(dtype)}{list(shape)}")
            if type(v) is not np.ndarray:  # a numpy scalar a Python step made
                v = np.asarray(v)
            if not v.flags.c_contiguous:
                v = np.ascontiguousarray(v)
            kept[buf] = v
            table[buf] = library.address(v) if v.size else 0
        program.run(inst, self.first, self.count)
        return inst

