"""Bringing stage actors back after a fault, deciding where a replay starts, and
collecting a request's outputs through its replays.

Each actor reports an *incarnation* (a fresh id per start). A request records the
incarnation of every actor it dispatched to; after a fault, the actors whose
incarnation changed since (Ray restarted them, or they were re-created here) lost
whatever they were doing, so the request is replayed from the earliest such stage
(its first segment), with the seam refs it kept for the stages before.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Sequence

import ray

from actors.dispatch import Dispatcher
from actors.options import RayOptions
from actors.remote_errors import is_fault, root_cause, user_error
from actors.request import Request
from actors.reservation import ActorSlot, Reservation, send_stage
from hetero_exec.errors import ActorError

log = logging.getLogger(__name__)


class Replay:
    """Fault handling for one RayExecutor's stage actors (needs them started, so its
    example does not run here).

    >>> dispatcher.dispatch([request], 0)  # doctest: +SKIP
    >>> replay.collect(request)  # its outputs, replayed as often as faults need  # doctest: +SKIP
    [array([...], dtype=float32)]
    """

    def __init__(
        self,
        slots: Sequence[ActorSlot],
        reservation: Reservation,
        dispatcher: Dispatcher,
        opts: RayOptions,
        is_closed: Callable[[], bool],
    ):
        self.slots = slots  # one per stage, in stage order
        self.reservation = reservation
        self.dispatcher = dispatcher
        self.opts = opts
        self.is_closed = is_closed
        self.replays = 0  # requests replayed after faults, over the session's life
        self._lock = threading.Lock()

    def collect(self, req: Request) -> list[Any]:
        """The outputs of a dispatched request; after a fault, the actors are brought
        back and the request replayed (`after_failure`) until it answers or gives up."""
        while True:
            try:
                return self.dispatcher.collect(req)
            except Exception as e:
                self.dispatcher.dispatch([req], self.after_failure(req, e))

    def recover(self, req: Request, failure: BaseException) -> list[Any]:
        """The outputs of a request whose dispatch failed with ``failure`` (a fault is
        replayed; the request's own error raises)."""
        self.dispatcher.dispatch([req], self.after_failure(req, failure))
        return self.collect(req)

    def after_failure(self, req: Request, error: BaseException) -> int:
        """Raise the error a caller should see, or recover and return the stage to
        replay ``req`` from."""
        log.debug("request %d failed: %s", req.id, type(root_cause(error)).__name__)
        self.settle(req)
        typed = user_error(error)
        if typed is not None:
            raise typed from None
        if self.is_closed():  # the actors were released under this request
            raise ActorError(f"request {req.id} was in flight when the session closed") from error
        if not is_fault(error):
            raise ActorError(f"request {req.id} failed: {root_cause(error)!r}") from error
        start = self.replay_start(req)  # even if this request gives up: the next ones need them
        req.replays += 1
        cause = root_cause(error)
        if req.replays > self.opts.max_replays:
            raise ActorError(
                f"request {req.id} failed after {self.opts.max_replays} replay(s): "
                f"{type(cause).__name__}: {cause}"
            ) from error
        with self._lock:
            self.replays += 1
        log.warning("request %d hit %s; replaying from %s (replay %d of %d)", req.id,
                    type(cause).__name__, self.slots[start].spec.label, req.replays,
                    self.opts.max_replays)
        return start

    def settle(self, req: Request) -> None:
        """Wait until every task of the latest dispatch has finished or failed, so no
        stale task of the failed attempt runs beside its replay."""
        if req.attempt:
            ray.wait(
                req.attempt,
                num_returns=len(req.attempt),
                timeout=self.opts.recovery_timeout_s,
                fetch_local=False,
            )

    def replay_start(self, req: Request) -> int:
        """Bring every actor back; the stage index the replay of ``req`` starts at."""
        restarted = [
            slot.index
            for slot in self.slots
            if self.await_alive(slot) != req.incarnations.get(slot.index, slot.incarnation)
        ]
        if not restarted:
            return 0  # an object was lost without an actor restart: replay it all
        return min(restarted)

    def await_alive(self, slot: ActorSlot) -> str:
        """The slot's incarnation once its actor answers; a permanently dead actor is re-created."""
        deadline = time.monotonic() + self.opts.recovery_timeout_s
        with slot.lock:  # one recovery per actor at a time; the others then find it alive
            while True:
                if self.is_closed():
                    raise ActorError("the session is closed")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ActorError(
                        f"the stage actor of {slot.labels} did not come back within "
                        f"{self.opts.recovery_timeout_s:g}s"
                    )
                try:
                    incarnation = ray.get(slot.handle.ping.remote(), timeout=remaining)
                    if not incarnation:  # restarted by Ray without its stage: send it
                        send_stage(slot, slot.handle)
                        continue
                    slot.incarnation = incarnation
                    return slot.incarnation
                except ray.exceptions.GetTimeoutError:
                    continue
                except ray.exceptions.ActorDiedError:
                    if actor_state(slot.handle) in ("DEAD", None):
                        # restarts used up, or killed for good: a new actor, which the
                        # next ping waits for (and which is re-created again if it dies
                        # before it answers)
                        self.reservation.recreate(slot)
                        continue
                    time.sleep(0.05)
                except ray.exceptions.RayActorError:  # unavailable: restarting or unreachable
                    time.sleep(0.05)


def actor_state(handle: Any) -> str | None:
    """The GCS's state of an actor ("ALIVE", "RESTARTING", "DEAD"...), None if unknown."""
    try:
        from ray._private import state

        info = state.actors(handle._actor_id.hex())
        return info.get("State") if info else None
    except Exception:  # a private API: when it is not there, treat the actor as dead
        return None
