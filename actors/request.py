"""One request's state in the coordinator, how a group of requests is laid out in one
actor task, and how its outputs are put together (`graph_outputs`, for both ways of
running the pipeline)."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

from actors.remote_errors import FailedValue

#: A value a request carries into a segment: (index into the task's flat arguments,
#: index into that argument's list, or None when the argument is the value itself).
Entry = tuple[int, int | None]
#: For each segment input, one Entry per request of the group.
Layout = tuple[tuple[Entry, ...], ...]


def pick(flat: Sequence[Any], entry: Entry) -> Any:
    """The value ``entry`` names among a group task's (resolved) arguments.

    >>> pick([[10, 11], 5], (0, 1)), pick([[10, 11], 5], (1, None))
    (11, 5)
    """
    pos, index = entry
    value = flat[pos]
    return value if index is None else value[index]


@dataclass
class Request:
    """A run in flight: its feeds, the refs of its values and what it saw at dispatch.

    The coordinator keeps the feeds and every seam ref until the request is answered,
    so a replay after a fault restarts from the segments that were lost, not from
    scratch. Requests dispatched together share their tasks: a produced value is the
    group task's output ref and this request's index in it.

    >>> Request(1, ["y"], {"x": 0}).replays
    0
    """

    id: int
    names: list[str]
    feeds: dict[str, Any]  # graph input -> array (large ones move to refs at dispatch)
    refs: dict[str, tuple[Any, int]] = field(default_factory=dict)  # value -> (ref, index)
    attempt: list[Any] = field(default_factory=list)  # the refs of the latest dispatch
    incarnations: dict[int, str] = field(default_factory=dict)  # slot -> actor incarnation used
    replays: int = 0
    started_ns: int = 0  # when it was dispatched (profiling)


class InflightLimit:
    """At most ``limit`` requests in flight; a group takes all its places at once (so
    two groups waiting for places can never each hold part of what they need).

    >>> lim = InflightLimit(4); lim.acquire(3); lim.free
    1
    >>> lim.release(3); lim.free
    4
    """

    def __init__(self, limit: int):
        self.limit = limit
        self._free = limit
        self._cond = threading.Condition()

    @property
    def free(self) -> int:
        return self._free

    def acquire(self, n: int = 1) -> None:
        if n > self.limit:
            raise ValueError(f"a group of {n} exceeds max_inflight={self.limit}")
        with self._cond:
            self._cond.wait_for(lambda: self._free >= n)
            self._free -= n

    def release(self, n: int = 1) -> None:
        with self._cond:
            self._free += n
            self._cond.notify_all()


def graph_outputs(
    names: Sequence[str],
    produced: Mapping[str, Any],
    feeds: Mapping[str, Any],
    initializers: Mapping[str, Any],
    take: Callable[[str, Any], Any] | None = None,
) -> list[Any]:
    """The requested outputs in order: a value a stage produced, else a graph input that
    is also an output, else an initializer that is. ``take(name, carried)`` brings a
    carried value back (the seam transport's ``take``). A produced `FailedValue` raises
    the request's own error.

    >>> graph_outputs(["y", "x", "w"], {"y": 2}, {"x": 1}, {"w": 0})
    [2, 1, 0]
    """
    out: list[Any] = []
    for name in names:
        if name in produced:
            value = produced[name]
            if isinstance(value, FailedValue):
                raise value.error
        elif name in feeds:
            value = feeds[name]
        else:
            out.append(initializers.get(name))
            continue
        out.append(take(name, value) if take is not None else value)
    return out
