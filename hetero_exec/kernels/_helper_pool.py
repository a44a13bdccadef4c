"""The helper pool that takes the other parts of a split product or kernel: threads that
block when idle (no spinning), and the hand-off both splits share (`run_parts`): a part
goes to a helper only when one is free, else it runs on the calling thread (a busy
helper, such as one working for a concurrent run, is skipped)."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_free: threading.Semaphore | None = None


def _after_fork_in_child() -> None:
    """A forked child has none of the parent's threads: a split there would wait for ever
    on the old pool's."""
    global _lock, _pool, _free
    _lock = threading.Lock()
    _pool, _free = None, None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def helper_pool(n: int) -> tuple[ThreadPoolExecutor, threading.Semaphore] | None:
    """The pool of ``n`` helpers (made at the first call; None for n < 1) and the count of
    its idle ones."""
    global _pool, _free
    if _pool is None:
        if n < 1:
            return None
        with _lock:
            if _pool is None:
                _free = threading.Semaphore(n)
                _pool = ThreadPoolExecutor(n, thread_name_prefix="hetero_exec-gemm")
    return _pool, _free


def run_parts(helpers: tuple[ThreadPoolExecutor, threading.Semaphore],
              bounds: list[int], part: Callable[[int, int], None]) -> None:
    """``part(i0, i1)`` for each range between consecutive ``bounds``: the first here, each
    other on an idle helper or here when none is idle; returns when all are done."""
    pool, free = helpers
    pieces = list(zip(bounds[:-1], bounds[1:]))
    mine, futures = [pieces[0]], []
    for piece in pieces[1:]:
        if free.acquire(blocking=False):
            futures.append(pool.submit(_released, free, part, *piece))
        else:
            mine.append(piece)
    for i0, i1 in mine:
        part(i0, i1)
    for f in futures:
        f.result()


def _released(free: threading.Semaphore, part: Callable[[int, int], None], i0: int, i1: int):
    try:
        part(i0, i1)
    finally:
        free.release()
