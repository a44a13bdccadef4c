"""What the Ray tests check the cluster with: live stage actors and placement groups."""

from __future__ import annotations

import time
from typing import Callable

import ray


def live_stage_actors() -> set[str]:
    """Ids of StageActors not DEAD (from the GCS; no dashboard needed)."""
    from ray._private import state

    return {
        aid
        for aid, a in state.actors().items()
        if a["ActorClassName"].endswith("StageActor") and a["State"] != "DEAD"
    }


def live_placement_groups() -> set[str]:
    return {pid for pid, pg in ray.util.placement_group_table().items() if pg["state"] != "REMOVED"}


def eventually(check: Callable[[], bool], timeout: float = 15.0) -> bool:
    """Poll ``check`` until true (the GCS learns of deaths asynchronously)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return check()


def actor_ids(handles) -> set[str]:
    return {h._actor_id.hex() for h in handles}
