"""How many cores this process may use: `cores`, the one count every split starts from.

The affinity mask is read once per process (and again in a forked child): every split
asks, and reading it cost 2.5 us a call. ``HETERO_EXEC_INTRA_OP_THREADS`` caps it (1:
nothing is split)."""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

#: at most this many threads for any split (read on every call)
CAP_ENV = "HETERO_EXEC_INTRA_OP_THREADS"

_affinity: int | None = None  # the cores of this process's affinity mask, once read


def _after_fork_in_child() -> None:
    global _affinity
    _affinity = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def affinity_changed() -> None:
    """This process's affinity mask was just set: `cores` reads it again."""
    global _affinity
    _affinity = None


def cores() -> int:
    """Threads a product or a kernel's blocks are split over: the cores this process may
    use, at most HETERO_EXEC_INTRA_OP_THREADS when set (1: never split).

    >>> cores() >= 1
    True
    """
    global _affinity
    cap = os.environ.get(CAP_ENV, "")
    if _affinity is None:
        try:
            _affinity = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            _affinity = os.cpu_count() or 1
    n = _affinity
    if cap.strip():
        try:
            n = min(n, max(1, int(cap)))
        except ValueError:
            log.warning("%s=%r is not a number: ignored", CAP_ENV, cap)
    return n
