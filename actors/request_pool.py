"""The requests in flight: where each takes its slot, and the one place it is answered.

Shaped like Ray's ``ActorPool.submit`` / ``_return_actor``: `RequestPool.admit` takes
an in-flight slot per request (blocking beyond ``max_inflight``) and gives each a
Future; `RequestPool.answer` is the only place a request is completed, whichever way
it ends (outputs, its own error, a fault given up on, the session closing, its caller
cancelling): it forgets the request, gives its slot back, then sets its Future, once.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any, Callable

from actors.request import InflightLimit, Request
from hetero_exec.errors import ActorError


class RequestPool:
    """Slots and Futures of the requests in flight.

    >>> answered = []
    >>> pool = RequestPool(2, forget=lambda req: answered.append(req.id))
    >>> [fut] = pool.admit([Request(1, ["y"], {})]); pool.inflight.free
    1
    >>> pool.answer(Request(1, ["y"], {}), result=[3]); fut.result(), pool.inflight.free, answered
    ([3], 2, [1])
    >>> pool.answer(Request(1, ["y"], {}), result=[4]); fut.result()  # answered once only
    [3]
    """

    def __init__(self, limit: int, forget: Callable[[Request], None]):
        self.inflight = InflightLimit(limit)
        self._forget = forget  # what a request held beyond its slot (its seam buffers...)
        self._open: dict[int, tuple[Request, concurrent.futures.Future]] = {}
        self._lock = threading.Lock()

    def admit(self, reqs: list[Request]) -> list[concurrent.futures.Future]:
        """Take a slot for each of ``reqs`` (all at once: see `InflightLimit`), waiting
        while the pool is full; a Future for each, which `answer` sets."""
        self.inflight.acquire(len(reqs))
        futures = [concurrent.futures.Future() for _ in reqs]
        with self._lock:
            self._open.update((req.id, (req, fut)) for req, fut in zip(reqs, futures))
        return futures

    def answer(self, req: Request, result: list[Any] | None = None,
               error: BaseException | None = None) -> None:
        """Complete ``req``: forget it, give its slot back, then set its Future (unless
        its caller cancelled it). A request already answered is left as it is."""
        with self._lock:
            entry = self._open.pop(req.id, None)
        if entry is None:
            return
        fut = entry[1]
        try:
            self._forget(req)
        finally:
            self.inflight.release(1)  # before the answer: a caller it wakes may submit again
            if not fut.cancelled():
                if error is not None:
                    fut.set_exception(error)
                else:
                    fut.set_result(result)

    def open_count(self) -> int:
        """Requests admitted and not yet answered."""
        with self._lock:
            return len(self._open)

    def close(self) -> None:
        """Answer every request still open with an ActorError: the session closed under
        them (those that land later find them answered)."""
        with self._lock:
            pending = [req for req, _ in self._open.values()]
        for req in pending:
            self.answer(req, error=ActorError(f"request {req.id} was in flight when the "
                                              f"session closed"))
