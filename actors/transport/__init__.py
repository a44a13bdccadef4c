"""Seam transports behind one interface (`Transport`: write / read / take / release /
close; its docstring states the contract), one file each, each built from the
session's `SeamConfig` by `make_transport`.

A seam between two stages travels through one of these; a seam between two segments
of one stage never leaves its actor (an in-process move, `hetero_exec.exec.chain`).
"""

from __future__ import annotations

from actors.transport.base import SeamConfig, SeamKey, SeamUnreachable, Transport
from actors.transport.object_store import ObjectStoreTransport
from actors.transport.shared_memory import SharedMemoryTransport, ShmArray
from actors.transport.wire import WireTransport

#: seam transports a session may ask for (``seam_transport=...``; "auto" picks
#: shared_memory on a one-node cluster, object_store otherwise)
SEAM_TRANSPORTS: dict[str, type[Transport]] = {
    "object_store": ObjectStoreTransport,
    "shared_memory": SharedMemoryTransport,
    "wire": WireTransport,
}


def make_transport(config: SeamConfig) -> Transport:
    """This process's end of the seams ``config`` describes.

    >>> make_transport(SeamConfig("wire")).name
    'wire'
    >>> make_transport(SeamConfig("pigeon"))
    Traceback (most recent call last):
    ...
    ValueError: unknown seam transport 'pigeon'; known: ['object_store', 'shared_memory', 'wire']
    """
    try:
        cls = SEAM_TRANSPORTS[config.name]
    except KeyError:
        raise ValueError(
            f"unknown seam transport {config.name!r}; known: {sorted(SEAM_TRANSPORTS)}"
        ) from None
    return cls.from_config(config)


__all__ = [
    "SeamConfig",
    "SeamKey",
    "SeamUnreachable",
    "Transport",
    "ObjectStoreTransport",
    "SharedMemoryTransport",
    "ShmArray",
    "WireTransport",
    "make_transport",
    "SEAM_TRANSPORTS",
]
