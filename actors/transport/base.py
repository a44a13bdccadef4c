"""The seam transport interface: how one stage's output reaches a later stage.

A transport runs inside the stage actors (and the driver, for feeds and graph
outputs). The producer calls ``write`` with the value and returns what it gives back
(the *carried* value) from its Ray method; the coordinator passes that on as an
ObjectRef; the consumer calls ``read`` with what arrived. Transports differ in what is
carried: the array itself (object store), a msgpack frame (wire), or a small
descriptor of a shared-memory buffer.

Every end of a session's seams builds its transport from one `SeamConfig`
(`Transport.from_config`, as Ray's ``ChannelOutputType.create_channel`` builds a
channel from its type): the coordinator makes the config, and the driver and each
stage actor build their own end from it, so no caller knows what one transport needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SeamKey:
    """One value of one request: what a transport files a seam value under."""

    request: int
    value: str


@dataclass(frozen=True)
class SeamConfig:
    """What each end of a session's seams builds its transport from.

    ``name`` picks the transport (`actors.transport.SEAM_TRANSPORTS`); the others are
    read only by transports that keep buffers of their own (shared memory): the names
    of the files they create, and the most buffer bytes one process keeps.

    >>> SeamConfig("shared_memory", prefix="hetero_exec-1a2b").for_owner("s0").prefix
    'hetero_exec-1a2b-s0'
    """

    name: str = "object_store"
    prefix: str = "hetero_exec"
    budget: int = 1 << 30

    def for_owner(self, owner: str) -> "SeamConfig":
        """The config of one end (``owner``: "driver", "s0", ...), its files named apart."""
        return SeamConfig(self.name, f"{self.prefix}-{owner}", self.budget)


class SeamUnreachable(LookupError):
    """A carried value can no longer be read where it arrived (its buffer is on another
    node, or went with a writer that restarted): a fault, so the request is replayed."""


class Transport:
    """write/read/close over seam values (the ``Channel`` shape of Ray's compiled graphs).

    The contract every transport keeps:

    * ``write`` never fails a run: what it cannot carry its own way (too small, not
      an array, out of room) it returns as the value itself, which Ray carries;
    * ``read`` gives back the value that was written, or raises `SeamUnreachable`
      (a fault: the coordinator replays the request); a read value may be a read-only
      view of memory the transport reuses once its request is released;
    * ``take`` is ``read`` for a value that leaves the transport (a graph output
      handed to the caller): it never shares the transport's memory;
    * ``release_below``, ``drop`` and ``close`` only release memory: they never
      block, never raise, and may be called any number of times (``close`` too);
    * every method may be called from several threads at once.

    >>> t = Transport()
    >>> t.read(SeamKey(0, "x"), t.write(SeamKey(0, "x"), 3))
    3
    >>> t.close(); t.close()  # idempotent
    """

    #: the name a session asks for it by (``seam_transport=...``)
    name = "base"
    #: what profile spans call it
    label = "base"

    @classmethod
    def from_config(cls, config: SeamConfig) -> "Transport":
        """This transport's end of a session's seams, built from ``config``; the
        transports without settings ignore it."""
        return cls()

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

    def carries(self, carried: Any) -> bool:
        """Whether ``carried`` is this transport's own form of a value (a descriptor, a
        frame) rather than the value itself: its write and read did work worth a
        profile span."""
        return False

    def release_below(self, floor: int) -> None:
        """Every request older than ``floor`` has finished: release what they hold."""

    def drop(self, request: int) -> None:
        """Forget whatever is kept for ``request`` (it finished or failed)."""

    def close(self) -> None:
        """Release everything the transport holds."""
