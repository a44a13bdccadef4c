"""Asynchronous results: Futures answered from Ray's callbacks, no thread per request.

`run_async` and `run_many` hand their requests here. A group is dispatched at once
and Ray calls back as each output lands; the last one hands the group to the
executor's pool, which answers it (or, after a fault, recovers and replays each
request there). A thread waiting per request costs the driver a core's worth of
wake-ups on a small host; this costs one pool task per group.

Concurrent `run_async` callers share tasks: whoever finds the dispatcher free
dispatches everything queued, its own request first if it is alone (so a lone request
waits for nothing); requests other threads queue meanwhile go out together in the
next group, up to ``coalesce``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from actors.remote_errors import SegmentRunError, user_error
from actors.request import Request
from actors.transport.shared_memory import SeamUnreachable
from hetero_exec.errors import ActorError

if TYPE_CHECKING:
    from actors.coordinator import RayExecutor

log = logging.getLogger(__name__)

Pair = tuple[Request, concurrent.futures.Future]


class AsyncResults:
    """The executor's requests that have a Future (`run_async`, `run_many`)."""

    def __init__(self, executor: "RayExecutor"):
        self.ex = executor
        self._waiting: dict[int, Pair] = {}  # dispatched, not yet answered
        self._queue: collections.deque[Pair] = collections.deque()  # not yet dispatched
        self._drain_lock = threading.Lock()  # held by the thread dispatching the queue
        self._lock = threading.Lock()

    # -- submitting --------------------------------------------------------------------

    def enqueue(self, req: Request) -> concurrent.futures.Future:
        """Queue one request whose in-flight place is taken; dispatch what is queued."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.append((req, fut))
        self._drain()
        return fut

    def submit_group(self, reqs: list[Request]) -> list[concurrent.futures.Future]:
        """Dispatch requests whose places are taken as one group; their Futures."""
        group = [(r, concurrent.futures.Future()) for r in reqs]
        self.start(group)
        return [fut for _, fut in group]

    def _drain(self) -> None:
        """Dispatch what was queued, up to the group limit per task. A caller that finds
        the dispatcher busy leaves its request to it: the dispatcher looks at the queue
        again after letting go, so nothing is stranded."""
        limit = self.ex.group_limit()
        while self._queue:
            if not self._drain_lock.acquire(blocking=False):
                return
            try:
                while self._queue:
                    group = []
                    while self._queue and len(group) < limit:
                        group.append(self._queue.popleft())
                    self.start(group)
            finally:
                self._drain_lock.release()

    def start(self, group: list[Pair]) -> None:
        """Dispatch a group; its Futures answer when its outputs land. A dispatch that
        fails answers the group's Futures with the error."""
        reqs = [req for req, _ in group]
        futures = [fut for _, fut in group]
        with self._lock:
            for req, fut in group:
                fut.set_running_or_notify_cancel()
                self._waiting[req.id] = (req, fut)
        started = time.time_ns()
        for req in reqs:
            req.started_ns = started
        try:
            if self.ex.closed:
                raise ActorError("the session is closed")
            self.ex.dispatcher.dispatch(reqs, 0)
        except BaseException as e:
            for req, fut in group:
                self.settle(req, fut, error=e)
            return
        needed = dict.fromkeys(ref for r in reqs for ref in self.ex.dispatcher.output_refs(r))
        landed = {ref: ref.future() for ref in needed}
        remaining = [len(landed)]
        count_lock = threading.Lock()

        def on_landed(_: concurrent.futures.Future | None) -> None:
            with count_lock:
                remaining[0] -= 1
                if remaining[0] > 0:
                    return
            try:
                self.ex.pool().submit(self._finish, reqs, futures, landed)
            except Exception as e:  # the session closed under these requests
                for req, fut in zip(reqs, futures):
                    self.settle(req, fut, error=e)

        if not landed:
            remaining[0] = 1
            on_landed(None)
        for f in landed.values():
            f.add_done_callback(on_landed)

    # -- answering ---------------------------------------------------------------------

    def _finish(self, reqs: list[Request], futures: list[concurrent.futures.Future],
                landed: dict[Any, concurrent.futures.Future]) -> None:
        """Answer a group whose outputs all landed; after a fault, recover each request."""
        failure = next((f.exception() for f in landed.values() if f.exception()), None)
        if failure is not None:
            log.debug("a group of %d request(s) failed: %s", len(reqs), type(failure).__name__)
            for req, fut in zip(reqs, futures):
                self._recover_later(req, fut, failure)
            return
        values = {ref: f.result() for ref, f in landed.items()}
        for req, fut in zip(reqs, futures):
            try:
                out = self.ex.dispatcher.assemble(req, values)
            except SegmentRunError as e:  # this request's own run failed; not the others'
                self.settle(req, fut, error=user_error(e) or e)
            except SeamUnreachable as e:  # its writer died after answering: a fault
                self._recover_later(req, fut, e)
            except BaseException as e:
                self.settle(req, fut, error=e)
            else:
                self.settle(req, fut, result=out)

    def _recover_later(self, req: Request, fut: concurrent.futures.Future,
                       failure: BaseException) -> None:
        """Recover and replay ``req`` on the pool (it blocks on Ray), each request apart."""
        try:
            self.ex.pool().submit(self._recover, req, fut, failure)
        except Exception as e:  # the session closed: nothing left to replay on
            self.settle(req, fut, error=e)

    def _recover(self, req: Request, fut: concurrent.futures.Future, failure: Exception) -> None:
        try:
            self.ex.dispatcher.dispatch([req], self.ex.replay.after_failure(req, failure))
            out = self.ex.serve_collect(req)
        except BaseException as e:
            self.settle(req, fut, error=e)
        else:
            self.settle(req, fut, result=out)

    def settle(self, req: Request, fut: concurrent.futures.Future,
               result: list[Any] | None = None, error: BaseException | None = None) -> None:
        """Answer ``req`` once: forget it, give its place back, then set its Future."""
        with self._lock:
            if self._waiting.pop(req.id, None) is None:
                return  # close() already answered it
        try:
            self.ex.forget(req)
        finally:
            self.ex.inflight.release(1)  # before the answer: a caller woken may submit again
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)

    def close(self) -> None:
        """Answer every request still waiting or queued with an ActorError."""
        with self._lock:
            pending, self._waiting = list(self._waiting.values()), {}
        while True:
            try:
                pending.append(self._queue.popleft())
            except IndexError:
                break
        for req, fut in pending:
            self.ex.inflight.release(1)
            if not fut.done():
                fut.set_exception(ActorError(f"request {req.id} was in flight when the session closed"))
