"""One request's state in the coordinator: what it needs to be replayed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Request:
    """A run in flight: its feeds, the refs of its values and what it saw at dispatch.

    The coordinator keeps the feeds and every seam ref until the request is answered,
    so a replay after a fault restarts from the segments that were lost, not from
    scratch.

    >>> Request(1, ["y"], {"x": 0}).replays
    0
    """

    id: int
    names: list[str]
    feeds: dict[str, Any]  # graph input -> array, or the ObjectRef of a large one
    refs: dict[str, Any] = field(default_factory=dict)  # produced value -> ObjectRef
    attempt: list[Any] = field(default_factory=list)  # the refs of the latest dispatch
    incarnations: dict[int, str] = field(default_factory=dict)  # slot -> actor incarnation used
    replays: int = 0
    started_ns: int = 0  # when it was dispatched (profiling)
