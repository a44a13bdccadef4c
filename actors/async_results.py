"""Asynchronous results: groups of requests answered from Ray's callbacks, no thread per
request.

`run_async` and `run_many` hand their admitted requests here (`actors.request_pool`).
A group is dispatched at once and Ray calls back as each output lands; the last one
hands the group to the executor's thread pool, which answers it (or, after a fault,
recovers and replays each request there). A thread waiting per request costs the
driver a core's worth of wake-ups on a small host; this costs one pool task per group.

Concurrent `run_async` callers share tasks: whoever finds the dispatcher free
dispatches everything queued, its own request first if it is alone (so a lone request
waits for nothing); requests other threads queue meanwhile go out together in the
next group, up to ``group_limit``.

What it is given is what it uses: the dispatcher, the replay's ``recover``, the thread
pool, and the request pool's ``answer`` (the one place a request is completed).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from typing import Any, Callable

from actors.dispatch import Dispatcher
from actors.remote_errors import SegmentRunError, user_error
from actors.request import Request
from actors.transport.base import SeamUnreachable

log = logging.getLogger(__name__)

Pair = tuple[Request, concurrent.futures.Future]
#: answer(request, result=..., error=...): `actors.request_pool.RequestPool.answer`
Answer = Callable[..., None]


class AsyncResults:
    """Dispatches groups of admitted requests and answers them as their outputs land.

    Needs started stage actors, so its example does not run here:

    >>> results.start(list(zip(reqs, request_pool.admit(reqs))))  # doctest: +SKIP
    """

    def __init__(
        self,
        dispatcher: Dispatcher,
        recover: Callable[[Request, BaseException], list[Any]],
        threads: Callable[[], concurrent.futures.Executor],
        answer: Answer,
        group_limit: int,
    ):
        self.dispatcher = dispatcher
        self.recover = recover  # replays a request after a fault: its outputs, or raises
        self.threads = threads  # the executor's pool; raises ActorError once it closed
        self.answer = answer
        self.group_limit = group_limit
        self._queue: collections.deque[Pair] = collections.deque()  # not yet dispatched
        self._drain_lock = threading.Lock()  # held by the thread dispatching the queue

    # -- submitting --------------------------------------------------------------------

    def enqueue(self, pair: Pair) -> None:
        """Queue one admitted request; dispatch what is queued."""
        self._queue.append(pair)
        self._drain()

    def _drain(self) -> None:
        """Dispatch what was queued, up to the group limit per task. A caller that finds
        the dispatcher busy leaves its request to it: the dispatcher looks at the queue
        again after letting go, so nothing is stranded."""
        while self._queue:
            if not self._drain_lock.acquire(blocking=False):
                return
            try:
                while self._queue:
                    group = []
                    while self._queue and len(group) < self.group_limit:
                        group.append(self._queue.popleft())
                    self.start(group)
            finally:
                self._drain_lock.release()

    def start(self, group: list[Pair]) -> None:
        """Dispatch a group; its requests are answered when their outputs land. A
        dispatch that fails answers them with its error; a request its caller cancelled
        meanwhile is answered (its slot given back) without running."""
        reqs = []
        for req, fut in group:
            try:
                running = fut.set_running_or_notify_cancel()
            except RuntimeError:  # answered already: the session closed under it
                continue
            if running:
                reqs.append(req)
            else:
                self.answer(req, error=concurrent.futures.CancelledError())
        if not reqs:
            return
        started = time.time_ns()
        for req in reqs:
            req.started_ns = started
        try:
            self.threads()  # the session is still open: it will have a thread to answer on
            self.dispatcher.dispatch(reqs, 0)
        except BaseException as e:
            for req in reqs:
                self.answer(req, error=e)
            return
        needed = dict.fromkeys(ref for r in reqs for ref in self.dispatcher.output_refs(r))
        landed = {ref: ref.future() for ref in needed}
        remaining = [len(landed)]
        count_lock = threading.Lock()

        def on_landed(_: concurrent.futures.Future | None) -> None:
            with count_lock:
                remaining[0] -= 1
                if remaining[0] > 0:
                    return
            self._on_threads(reqs, self._finish, reqs, landed)

        if not landed:
            remaining[0] = 1
            on_landed(None)
        for f in landed.values():
            f.add_done_callback(on_landed)

    def _on_threads(self, reqs: list[Request], fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on the pool; when the session closed, answer ``reqs`` with why."""
        try:
            self.threads().submit(fn, *args)
        except Exception as e:  # the session closed under these requests
            for req in reqs:
                self.answer(req, error=e)

    # -- answering ---------------------------------------------------------------------

    def _finish(self, reqs: list[Request], landed: dict[Any, concurrent.futures.Future]) -> None:
        """Answer a group whose outputs all landed; after a fault, recover each request."""
        failure = next((f.exception() for f in landed.values() if f.exception()), None)
        if failure is not None:
            log.debug("a group of %d request(s) failed: %s", len(reqs), type(failure).__name__)
            for req in reqs:
                self._on_threads([req], self._recover, req, failure)
            return
        values = {ref: f.result() for ref, f in landed.items()}
        for req in reqs:
            try:
                out = self.dispatcher.assemble(req, values)
            except SegmentRunError as e:  # this request's own run failed; not the others'
                self.answer(req, error=user_error(e) or e)
            except SeamUnreachable as e:  # its writer died after answering: a fault
                self._on_threads([req], self._recover, req, e)
            except BaseException as e:
                self.answer(req, error=e)
            else:
                self.answer(req, result=out)

    def _recover(self, req: Request, failure: BaseException) -> None:
        """Recover and replay ``req`` (on the pool: it blocks on Ray), each request apart."""
        try:
            out = self.recover(req, failure)
        except BaseException as e:
            self.answer(req, error=e)
        else:
            self.answer(req, result=out)
