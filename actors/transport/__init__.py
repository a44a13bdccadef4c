"""Seam transports behind one interface (`Transport`: write / read / drop / close).

A seam between two stages travels through one of these; a seam between two segments
of one stage never leaves its actor (an in-process move, `hetero_exec.exec.chain`)."""

from __future__ import annotations

from typing import Any

from actors.transport.base import SeamKey, Transport
from actors.transport.object_store import ObjectStoreTransport
from actors.transport.shared_memory import SharedMemoryTransport, ShmArray
from actors.transport.wire import WireTransport

#: seam transports a session may ask for (``seam_transport=...``; "auto" picks
#: shared_memory on a one-node cluster, object_store otherwise)
SEAM_TRANSPORTS = {
    "object_store": ObjectStoreTransport,
    "shared_memory": SharedMemoryTransport,
    "wire": WireTransport,
}


def make_transport(name: str, **config: Any) -> Transport:
    """The transport called ``name``; ``config`` goes to those that take any
    (shared_memory: ``prefix``, ``node``, ``budget``).

    >>> make_transport("wire").name
    'wire'
    """
    try:
        cls = SEAM_TRANSPORTS[name]
    except KeyError:
        raise ValueError(
            f"unknown seam transport {name!r}; known: {sorted(SEAM_TRANSPORTS)}"
        ) from None
    return cls(**config) if name == "shared_memory" else cls()


__all__ = [
    "SeamKey",
    "Transport",
    "ObjectStoreTransport",
    "SharedMemoryTransport",
    "ShmArray",
    "WireTransport",
    "make_transport",
    "SEAM_TRANSPORTS",
]
