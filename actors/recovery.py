"""Bringing segment actors back after a fault, and deciding where a replay starts.

Each actor reports an *incarnation* (a fresh id per start). A request records the
incarnation of every actor it dispatched to; after a fault, the actors whose
incarnation changed since (Ray restarted them, or they were re-created here) lost
whatever they were doing, so the request is replayed from the first segment they
host, with the seam refs it kept for the segments before.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import ray

from actors.options import RayOptions
from actors.request import Request
from actors.reservation import ActorSlot, Reservation
from hetero_exec.errors import ActorError

log = logging.getLogger(__name__)


class Recovery:
    """Fault handling for one RayExecutor's slots.

    >>> start = recovery.replay_start(request)  # doctest: +SKIP
    """

    def __init__(
        self,
        slots: Sequence[ActorSlot],
        slot_of: Sequence[ActorSlot],
        reservation: Reservation,
        opts: RayOptions,
        is_closed: Callable[[], bool],
    ):
        self.slots = slots
        self.reservation = reservation
        self.opts = opts
        self.is_closed = is_closed
        self.first_segment = {
            sl.index: min(k for k, s in enumerate(slot_of) if s is sl) for sl in slots
        }

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
        """Bring every actor back; the segment index the replay of ``req`` starts at."""
        restarted = [
            slot
            for slot in self.slots
            if self.await_alive(slot) != req.incarnations.get(slot.index, slot.incarnation)
        ]
        if not restarted:
            return 0  # an object was lost without an actor restart: replay it all
        return min(self.first_segment[slot.index] for slot in restarted)

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
                        f"the segment actor of {slot.labels} did not come back within "
                        f"{self.opts.recovery_timeout_s:g}s"
                    )
                try:
                    slot.incarnation = ray.get(slot.handle.ping.remote(), timeout=remaining)
                    return slot.incarnation
                except ray.exceptions.GetTimeoutError:
                    continue
                except ray.exceptions.ActorDiedError:
                    if actor_state(slot.handle) in (
                        "DEAD",
                        None,
                    ):  # restarts used up, or killed for good
                        self.reservation.recreate(slot)
                        return slot.incarnation
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
