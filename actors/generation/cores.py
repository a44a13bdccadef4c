"""Which cores a stage actor's process runs on (``stage_cores``).

By default the OS places the stage processes. With ``stage_cores="auto"`` the stages
that share a node each get their own even run of the cores the node's workers may use
(stage order; the remainder unused; nothing pinned where the node has fewer cores than
stages, or one stage alone). An explicit list gives each stage its cores
(``[[0, 1], [2, 3]]``), as onnxruntime's ``session.intra_op_thread_affinities`` gives its
threads theirs. The driver is never pinned.

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
from typing import Any, Sequence

from hetero_exec.kernels._cores import affinity_changed

log = logging.getLogger(__name__)

AUTO = "auto"


def check_option(value: Any, stages: int) -> Any:
    """``value`` when it is None, "auto", or one non-empty list of core ids per stage;
    ValueError naming what is wrong otherwise."""
    if value is None or value == AUTO:
        return value
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ValueError(f"stage_cores must be None, 'auto' or a list of core lists, one per "
                         f"stage, got {value!r}")
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


def usable_cores() -> list[int]:
    """The cores this process may run on ([] where the OS does not say)."""
    try:
        return sorted(os.sched_getaffinity(0))
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
