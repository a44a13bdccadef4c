"""Which cores a stage actor's process runs on (``stage_cores``).

By default the OS places the stage processes, except that where a node has no core
beyond its stages, a stage running one group alone steps on the node's turn core, as
the node's other stages do then (`TurnCore`); ``"os"`` leaves all of it to the OS.
With ``stage_cores="auto"`` the stages that share a node each get their own even run
of the cores the node's workers may use (stage order; the remainder unused; nothing
pinned where the node has fewer cores than stages, or one stage alone). An explicit
list gives each stage its cores (``[[0, 1], [2, 3]]``), as onnxruntime's
``session.intra_op_thread_affinities`` gives its threads theirs. The driver is never
pinned.

Why: with as many busy stages as cores, a stage that loses its core to another process
starts its next step with cold caches on whichever core it gets. Pinned, and with the
driver not preempting them (``yield_to_stages=True``, `inbox.yield_thread`),
4 groups in flight on a 2-core host made 1.09x the tokens/s of the same unpinned (12 of
12 paired rounds), both together 1.06-1.09x the defaults; pinned with a driver that
preempts them, nothing (1.00x, 6 of 12).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Sequence

from hetero_exec.kernels._cores import affinity_changed

log = logging.getLogger(__name__)

AUTO = "auto"
#: ``stage_cores`` leaving the stages where the OS puts them, one group or several
OS = "os"


def check_option(value: Any, stages: int) -> Any:
    """``value`` when it is None, "auto", "os", or one non-empty list of core ids per
    stage; ValueError naming what is wrong otherwise."""
    if value is None or value in (AUTO, OS):
        return value
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ValueError(f"stage_cores must be None, 'auto', 'os' or a list of core lists, one "
                         f"per stage, got {value!r}")
    if len(value) != stages:
        raise ValueError(f"stage_cores names {len(value)} core list(s) for {stages} stages")
    out = []
    for k, cores in enumerate(value):
        if not isinstance(cores, (list, tuple, set, frozenset)) or not cores or not all(
                isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in cores):
            raise ValueError(f"stage_cores[{k}] must be a non-empty list of core ids (ints "
                             f">= 0), got {cores!r}")
        out.append(sorted(set(cores)))
    return out


def even_runs(cores: Sequence[int], n: int) -> list[list[int]] | None:
    """``cores`` cut into ``n`` even runs in order (the remainder left out); None when
    there are fewer cores than runs.

    >>> even_runs([0, 1, 2, 3, 4], 2)
    [[0, 1], [2, 3]]
    >>> even_runs([0], 2) is None
    True
    """
    cores = sorted(cores)
    if n < 1 or len(cores) < n:
        return None
    width = len(cores) // n
    return [cores[i * width:(i + 1) * width] for i in range(n)]


def usable_cores(pid: int = 0) -> list[int]:
    """The cores the calling thread (or the main thread of process ``pid``) may run on
    ([] where the OS does not say)."""
    try:
        return sorted(os.sched_getaffinity(pid))
    except (AttributeError, OSError):
        return []


def pin_process(cores: Sequence[int]) -> list[int]:
    """Run every thread of this process on ``cores`` (threads it starts later inherit
    it from theirs); returns the cores it runs on now. OSError when the OS refuses
    (a core this process may not use); [] where there is no affinity to set."""
    if not hasattr(os, "sched_setaffinity"):
        return []
    wanted = set(cores)
    try:
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), wanted)
            except ProcessLookupError:  # a thread that ended meanwhile
                continue
    finally:
        affinity_changed()  # the splits' width counts the cores left (_cores.cores)
    return usable_cores()


class TurnCore:
    """A stage's stepping thread on one core of its node (``core``, the same for every
    stage there) while the stage runs one group alone, and back on the cores it started
    with (``home``) when it runs several. ``core`` None: never moved.

    Why: one group's step runs one stage at a time, so its stages on a node take turns
    and one core serves them all. Each on its own core, every hand-over wakes a core that
    went idle, and on a VM whose idle vCPU halts the step then runs cold. On the 2-core
    AMD VM of bench/README.md (2026-12-08), batch-1 ms a token taking turns against the
    same stages placed by the OS (``"os"``), paired rounds in five runs: Llama
    0.81-1.00x (faster in 15 of 16 rounds at best, 6 of 12 at worst; most gained where
    the host was slow), GPT-2 0.94x and 0.99x; 4 groups in flight 0.99x the tokens/s.
    The cost: an append or a rewind that interrupts a ring running ahead waits for the
    other stage's step under way on the shared core (a chat's next turn 1.04-1.40x).
    With several groups the stages run at once and need their own cores; a stage moves
    back and forth only as groups open and end (a syscall each). Only the stepping
    thread moves: Ray's threads stay free to run on the other cores."""

    def __init__(self, core: int | None = None, home: Sequence[int] = ()):
        self.core = core
        self.home = set(home)
        self.tid = 0  # the thread last moved onto ``core`` (0: none yet)
        self.on = False  # that thread is on ``core`` now
        self.moves = 0  # times a thread went onto ``core`` (a stage's stats)

    def update(self, alone: bool) -> None:
        """After a step on this thread: on ``core`` when ``alone``, else back home."""
        if self.core is None:
            return
        if alone:
            tid = threading.get_native_id()
            if self.on and self.tid == tid:
                return
            self.leave()
            if self._set(tid, {self.core}):
                self.tid, self.on = tid, True
                self.moves += 1
            else:
                self.core = None
        elif self.on:
            self.leave()

    def leave(self) -> None:
        """The thread on ``core`` back on the cores it started with (a thread that ended
        meanwhile: nothing)."""
        if self.on:
            self._set(self.tid, self.home)
            self.on = False

    def _set(self, tid: int, cores: set[int]) -> bool:
        try:
            os.sched_setaffinity(tid, cores)
            return True
        except OSError as e:  # a core this process may no longer use; a thread that ended
            log.info("thread %d cannot run on cores %s: %s", tid, sorted(cores), e)
            return False
