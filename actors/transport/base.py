"""The seam transport interface: how one stage's output reaches a later stage.

A transport runs inside the stage actors (and the driver, for feeds and graph
outputs). The producer calls ``write`` with the
value and returns what it gives back (the *carried* value) from its Ray method; the
coordinator passes that on as an ObjectRef; the consumer calls ``read`` with what
arrived. Transports differ in what is carried: the array itself (object store), a
msgpack frame (wire), or a small descriptor of a shared-memory buffer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SeamKey:
    """One value of one request: what a transport files a seam value under."""

    request: int
    value: str


class Transport:
    """write/read/close over seam values (the ``Channel`` shape of Ray's compiled graphs).

    >>> t = Transport()
    >>> t.read(SeamKey(0, "x"), t.write(SeamKey(0, "x"), 3))
    3
    """

    name = "base"

    def write(self, key: SeamKey, value: Any) -> Any:
        """Hand ``value`` over; returns what travels to the reader in its place."""
        return value

    def read(self, key: SeamKey, carried: Any) -> Any:
        """The value back from what travelled."""
        return carried

    def take(self, key: SeamKey, carried: Any) -> Any:
        """Like `read`, for a value that leaves the transport (a graph output handed to
        the caller): it must not depend on memory the transport reuses."""
        return self.read(key, carried)

    def release_below(self, floor: int) -> None:
        """Every request older than ``floor`` has finished: release what they hold."""

    def drop(self, request: int) -> None:
        """Forget whatever is kept for ``request`` (it finished or failed)."""

    def close(self) -> None:
        """Release everything the transport holds."""
