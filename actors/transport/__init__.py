"""Seam transports behind one interface (`Transport`: write / read / drop / close)."""

from __future__ import annotations

from actors.transport.base import SeamKey, Transport
from actors.transport.device_local import DeviceLocalTransport, LocalSeam
from actors.transport.object_store import ObjectStoreTransport
from actors.transport.wire import WireTransport

#: seam transports a session may ask for (``seam_transport=...``)
SEAM_TRANSPORTS = {"object_store": ObjectStoreTransport, "wire": WireTransport}


def make_transport(name: str) -> Transport:
    """The transport called ``name``.

    >>> make_transport("wire").name
    'wire'
    """
    try:
        return SEAM_TRANSPORTS[name]()
    except KeyError:
        raise ValueError(
            f"unknown seam transport {name!r}; known: {sorted(SEAM_TRANSPORTS)}"
        ) from None


__all__ = [
    "SeamKey",
    "Transport",
    "DeviceLocalTransport",
    "LocalSeam",
    "ObjectStoreTransport",
    "WireTransport",
    "make_transport",
    "SEAM_TRANSPORTS",
]
