"""intra_op_num_threads: the BLAS threads of one session's runs, and no other's.

threadpoolctl finds the BLAS libraries loaded in the process (NumPy's OpenBLAS, MKL,
BLIS) and sets their thread count; it is the right tool for that, not for isolation.
The count is process-wide (OpenBLAS's pthreads build has no per-thread setting), so a
limit cannot simply wrap one run while another session runs beside it, and for that
reason threadpoolctl lets only one "controlling" thread change OpenBLAS's count (other
threads' calls silently do nothing). `BlasGate` makes it exact instead: runs are
admitted in groups of one thread count at a time; the limit is set when a group starts
and restored when its last run ends, by whichever thread that is (the gate, holding its
lock, hands threadpoolctl's control to it); a waiting group gets its turn before
newcomers of the running one. Sessions of the same count still run concurrently.

>>> gate = BlasGate()
>>> with gate.limit(1):
...     pass
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Iterator

log = logging.getLogger(__name__)


class BlasGate:
    """Admits runs of one BLAS thread count at a time (None: the process default)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active: int | None = None  # the running group's count
        self._running = 0
        self._waiting: dict[int | None, int] = {}
        self._limiter: Any = None
        self._controller: Any = None

    @contextlib.contextmanager
    def limit(self, threads: int | None) -> Iterator[None]:
        self._enter(threads)
        try:
            yield
        finally:
            self._leave()

    def _may_enter(self, threads: int | None) -> bool:
        if self._running == 0:
            return True
        others_wait = any(n for k, n in self._waiting.items() if k != threads)
        return self._active == threads and not others_wait

    def _enter(self, threads: int | None) -> None:
        with self._cond:
            self._waiting[threads] = self._waiting.get(threads, 0) + 1
            while not self._may_enter(threads):
                self._cond.wait()
            self._waiting[threads] -= 1
            if self._running == 0:
                self._active = threads
                self._set(threads)
            self._running += 1

    def _leave(self) -> None:
        with self._cond:
            self._running -= 1
            if self._running == 0:
                self._restore()
                self._cond.notify_all()

    def _set(self, threads: int | None) -> None:
        if threads is None:
            return
        if self._controller is None:
            from threadpoolctl import ThreadpoolController

            self._controller = ThreadpoolController()
        self._take_control()
        self._limiter = self._controller.limit(limits=threads, user_api="blas")

    def _restore(self) -> None:
        if self._limiter is not None:
            self._take_control()
            self._limiter.restore_original_limits()
            self._limiter = None

    def _take_control(self) -> None:
        """Let this thread change the limits (called under the gate's lock, so no
        other thread of ours is changing them)."""
        for lib in self._controller.lib_controllers:
            clear = getattr(type(lib), "clear_controlling_thread", None)
            if clear is not None:
                clear(force=True)

    def current_blas_threads(self) -> list[int]:
        """The thread counts the BLAS libraries report now (for tests and reports)."""
        from threadpoolctl import threadpool_info

        return [i["num_threads"] for i in threadpool_info() if i.get("user_api") == "blas"]


#: one per process: the BLAS thread count is a process-wide setting
GATE = BlasGate()
