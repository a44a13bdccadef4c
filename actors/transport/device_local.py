"""Device-local seams: segments hosted by the same actor pass arrays without a copy.

The producer files the array (device memory for a GPU segment) under its SeamKey and
returns a small `LocalSeam` marker; the consumer, on the same actor, takes the array
back. Nothing is serialized and nothing leaves the device. A value read by several
local segments stays until the coordinator drops the request (`drop`), so a replay
after a fault can read it again.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from actors.transport.base import SeamKey, Transport


@dataclass(frozen=True)
class LocalSeam:
    """What travels in place of a device-local value: the key to find it by."""

    key: SeamKey


class MissingLocalSeam(LookupError):
    """A device-local value was read that this actor does not hold (lost in a restart)."""


class DeviceLocalTransport(Transport):
    """Keeps values in this actor's memory, keyed by request and value name.

    >>> t = DeviceLocalTransport()
    >>> marker = t.write(SeamKey(7, "h"), [1, 2])
    >>> t.read(SeamKey(7, "h"), marker), t.held()
    ([1, 2], 1)
    >>> t.drop(7); t.held()
    0
    """

    name = "device_local"

    def __init__(self) -> None:
        self._values: dict[SeamKey, Any] = {}
        self._lock = threading.Lock()

    def write(self, key: SeamKey, value: Any) -> LocalSeam:
        with self._lock:
            self._values[key] = value
        return LocalSeam(key)

    def read(self, key: SeamKey, carried: Any) -> Any:
        if not isinstance(carried, LocalSeam):
            return carried
        with self._lock:
            if carried.key not in self._values:
                raise MissingLocalSeam(
                    f"device-local value {carried.key.value!r} of request "
                    f"{carried.key.request} is not held by this actor"
                )
            return self._values[carried.key]

    def drop(self, request: int) -> None:
        with self._lock:
            for key in [k for k in self._values if k.request == request]:
                del self._values[key]

    def held(self) -> int:
        with self._lock:
            return len(self._values)

    def close(self) -> None:
        with self._lock:
            self._values.clear()
