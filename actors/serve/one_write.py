"""A replica's HTTP answer in one write.

uvicorn (the HTTP server inside a Serve replica on the HAProxy ingress) writes a
response's status line and headers when the app starts it, and its body when the app
sends it: two writes. A replica killed between them leaves HAProxy holding headers it
has already forwarded, so the client gets a cut answer (IncompleteRead) that nothing can
retry. Held until the first body message and written with it, an answer reaches HAProxy
whole or not at all, and HAProxy sends a request that got nothing to another replica
(`actors.connect.HAPROXY_RETRY_ENVS`). A stream's headers go out with its first chunk.

`answer_in_one_write` changes uvicorn's response cycles in the process it runs in (a
replica: the deployments call it as they start) and says whether it found them.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any, Awaitable, Callable

log = logging.getLogger(__name__)

#: uvicorn's HTTP implementations whose RequestResponseCycle writes an answer
_CYCLES = ("uvicorn.protocols.http.httptools_impl", "uvicorn.protocols.http.h11_impl")


class _HeldWrites:
    """A response cycle's transport whose writes wait in ``held`` until `flush` (or a
    close, which writes them first); everything else is the transport's."""

    def __init__(self, transport: Any, held: list[bytes]):
        self.transport = transport
        self.held = held

    def write(self, data: bytes) -> None:
        self.held.append(bytes(data))

    def flush(self) -> None:
        if self.held:
            data = b"".join(self.held)
            self.held.clear()
            self.transport.write(data)

    def close(self) -> None:
        self.flush()
        self.transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


Send = Callable[[Any, dict], Awaitable[None]]


def _holding(send: Send) -> Send:
    async def send_in_one_write(self: Any, message: dict) -> None:
        held = self.__dict__.get("_held_writes")
        starting = message.get("type") == "http.response.start" and not self.response_started
        if held is None and not starting:
            return await send(self, message)
        real = self.transport
        hold = _HeldWrites(real, held if held is not None else [])
        self.transport = hold
        self._held_writes = None
        try:
            await send(self, message)
        finally:
            self.transport = real
        if starting:
            self._held_writes = hold.held  # until the first body message
        else:
            hold.flush()

    send_in_one_write.__wrapped__ = send  # type: ignore[attr-defined]
    send_in_one_write._one_write = True  # type: ignore[attr-defined]
    return send_in_one_write


def answer_in_one_write() -> bool:
    """Make uvicorn's response cycles here write an answer's headers with its first body
    chunk; True when at least one implementation is (or already was) changed."""
    found = False
    for name in _CYCLES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # that implementation's parser is not installed
            continue
        cycle = getattr(module, "RequestResponseCycle", None)
        if cycle is None or not hasattr(cycle, "send"):
            continue
        found = True
        if not getattr(cycle.send, "_one_write", False):
            cycle.send = _holding(cycle.send)
    if not found:
        log.debug("no uvicorn response cycle found: answers keep uvicorn's writes")
    return found
