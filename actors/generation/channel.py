"""StageLink: the ring's stage-to-stage hop over a Unix socket when two stage actors
share a node, and the Ray actor call otherwise.

Why a socket: a Ray actor call costs ~1.5-2 ms a hop on a loaded 2-core host (the
caller's submit, the raylet-free direct call, the callee's task queue and event-loop
hand-off), which is most of a decode step of a small decoder. A step message is small
(the group id, the epoch, a `Job` of a few ids, and the hidden states of one token), so
what matters is the fixed cost per message, not bandwidth: shared memory
(`actors/transport/shared_memory.py`) still needs a wake-up per message, and a Compiled
Graph fixes the topology at compile time (no per-group epochs, no actor restart without
tearing it down). A stream socket gives both the bytes and the wake-up in one syscall.

How: each stage listens on a Linux abstract-namespace Unix socket (the name starts with
"\\0", so no file is ever left behind; it names the pipeline, the stage index and the
actor's incarnation, so a restarted actor never answers for its predecessor), served by
an `asyncio.Protocol` on the actor's own event loop: a received step runs on the same
loop as the actor's methods (open/close/halt/tokens), one at a time, with no new locking.
A frame is a 4-byte length and a msgpack list (gid, epoch, the Job's fields, the carried
arrays in `actors.transport.wire`'s compact form, ``[dtype, shape, data]``: never pickle,
anything on the host can connect to an abstract socket). A frame that does not decode
drops its connection. A group's close goes the same way, from stage to stage
(`encode_close`): from the driver when it closes a generator, from the last stage to
the earlier ones when it ends a group; and so does a rewind's halt (`encode_halt`).

The sender keeps one connection to its successor (stage i+1, the last stage's is stage
0), made by `connect` only when the successor's node id is this actor's; otherwise, when
the link is off (``stage_link="ray"``), or when a send finds the connection gone (the
peer died), the step goes by ``.remote()``. A message to a dead peer is lost either way;
the driver sees no progress and replays the groups (`RayDecoder.recover`), which
connects every stage again. The driver connects to stage 0's socket the same way
(`DriverLink`) for the steps it starts.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import sys
import threading
from typing import Any, Callable

import msgpack
import numpy as np

from actors.generation.group import GroupSpec, Job, Join
from actors.transport.wire import (
    WireFormatError,
    pack,
    tensor_from_list,
    tensor_to_list,
    unpack_frame,
)

log = logging.getLogger(__name__)

#: the largest step frame a stage accepts (a prefill's hidden states at batch x prompt)
MAX_FRAME_BYTES = 1 << 30
_HEADER = struct.Struct("<I")
#: the ways a stage passes a step on: the socket where it can, or always the Ray call
LINKS = ("socket", "ray")

#: a frame's kind -> the stage method it calls with the frame's fields: "step" (gid,
#: epoch, job, carried), "join" (gid, join), "close" (gid, epoch or None, until:
#: `GenerationStage.close_ring`), "halt" (gid, epoch, until: `GenerationStage.halt_ring`)
Handlers = dict[str, Callable[..., Any]]


def socket_name(ring_id: str, index: int, incarnation: str) -> str:
    """The abstract-namespace address of one stage actor's incarnation."""
    return f"\0hetero_exec/generation/{ring_id}/{index}/{incarnation}"


def supported() -> bool:
    """Abstract Unix sockets are Linux's."""
    return sys.platform.startswith("linux")


# -- frames ---------------------------------------------------------------------------------


def _opt(arr: Any) -> Any:
    return None if arr is None else tensor_to_list(arr)


def encode_step(gid: str, epoch: int, job: Job, carried: list[dict[str, Any]]) -> bytes:
    """One step message as a length-prefixed msgpack frame."""
    rewind = job.rewind
    body = pack(
        [gid, int(epoch), int(job.at), tensor_to_list(job.ids), [[int(p), int(t)] for p, t in job.pieces],
         None if rewind is None else [int(rewind[0]), int(rewind[1])],
         None if job.draws is None else int(job.draws), _opt(job.end), _opt(job.start),
         [{name: tensor_to_list(v) for name, v in c.items()} if c else {} for c in carried],
         bool(job.logits), [_join_fields(j) for j in job.joins] if job.joins else [],
         None if job.spec is None else _spec_fields(job.spec),
         None if job.rows is None else int(job.rows)])
    return _HEADER.pack(len(body)) + body


def _join_fields(j: Join) -> list[Any]:
    return [int(j.row), j.key, tensor_to_list(j.prompt), int(j.max_new), int(j.epoch), int(j.at),
            bool(j.ok), int(j.seed)]


def encode_join(gid: str, join: Join) -> bytes:
    """A request joining ``gid``'s next decode step (continuous batching), for stage 0."""
    body = msgpack.packb(["join", gid, _join_fields(join)], use_bin_type=True)
    return _HEADER.pack(len(body)) + body


def encode_close(gid: str, epoch: int | None, until: int) -> bytes:
    """A group's close, passed round the ring from stage to stage up to stage ``until``
    (`GenerationStage.close_ring`): ``epoch`` None from the driver (closed for good),
    else the epoch the last stage ended. A frame on the link in place of a Ray call to
    each stage: such a call cost the callee 0.7-0.9 ms of CPU and the caller 0.7-1.1 on
    a 2-core VM (a frame 25-70 us each end), and 3 of them ended each group."""
    body = pack(["close", gid, None if epoch is None else int(epoch), int(until)])
    return _HEADER.pack(len(body)) + body


def encode_halt(gid: str, epoch: int, until: int) -> bytes:
    """A rewind's halt: each stage up to ``until`` drops ``gid``'s messages of epochs
    before ``epoch`` (`GenerationStage.halt_ring`), so the ring stops running ahead."""
    body = pack(["halt", gid, int(epoch), int(until)])
    return _HEADER.pack(len(body)) + body


def decode_frame(body: bytes) -> tuple[str, tuple[Any, ...]]:
    """("step", (gid, epoch, job, carried)), ("join", (gid, join)), ("close", (gid,
    epoch, until)) or ("halt", (gid, epoch, until)) of a frame's body; WireFormatError
    when malformed."""
    obj = unpack_frame(body, MAX_FRAME_BYTES)
    if isinstance(obj, list) and len(obj) == 3 and obj[0] == "join":
        if not isinstance(obj[1], str):
            raise WireFormatError("join frame: the group id must be a string")
        return "join", (obj[1], _join(obj[2]))
    if isinstance(obj, list) and len(obj) == 4 and obj[0] == "close":
        _, gid, epoch, until = obj
        if not isinstance(gid, str) or (epoch is not None and type(epoch) is not int) \
                or type(until) is not int:
            raise WireFormatError("close frame: [\"close\", group id, epoch or nil, until]")
        return "close", (gid, epoch, until)
    if isinstance(obj, list) and len(obj) == 4 and obj[0] == "halt":
        _, gid, epoch, until = obj
        if not isinstance(gid, str) or type(epoch) is not int or type(until) is not int:
            raise WireFormatError("halt frame: [\"halt\", group id, epoch, until]")
        return "halt", (gid, epoch, until)
    return "step", _step(obj)


def _int(v: Any, what: str) -> int:
    if type(v) is not int:
        raise WireFormatError(f"step frame {what} must be an int, got {type(v).__name__}")
    return v


def _pair(v: Any, what: str) -> tuple[int, int]:
    if type(v) is not list or len(v) != 2:
        raise WireFormatError(f"step frame {what} must be a pair of ints")
    return _int(v[0], what), _int(v[1], what)


def decode_step(body: bytes) -> tuple[str, int, Job, list[dict[str, Any]]]:
    """The (gid, epoch, job, carried) of a step frame's body; WireFormatError when
    malformed."""
    return _step(unpack_frame(body, MAX_FRAME_BYTES))


def _step(obj: Any) -> tuple[str, int, Job, list[dict[str, Any]]]:
    if not isinstance(obj, list) or len(obj) != 14:
        raise WireFormatError("a step frame is a list of 14 fields")
    gid, epoch, at, ids, pieces, rewind, draws, end, start, carried, logits, joins, spec, rows \
        = obj
    if not isinstance(gid, str) or not isinstance(pieces, list) or not isinstance(carried, list) \
            or not isinstance(logits, bool) or not isinstance(joins, list):
        raise WireFormatError("step frame: gid, pieces, carried, logits or joins of the wrong type")
    job = Job(_int(at, "at"), tensor_from_list(ids), [_pair(p, "piece") for p in pieces],
              None if rewind is None else _pair(rewind, "rewind"),
              None if draws is None else _int(draws, "draws"),
              None if end is None else tensor_from_list(end),
              None if start is None else tensor_from_list(start), logits,
              [_join(j) for j in joins] if joins else [], None if spec is None else _spec(spec),
              None if rows is None else _int(rows, "rows"))
    values: list[dict[str, Any]] = []
    for c in carried:
        if type(c) is not dict:
            raise WireFormatError("step frame: carried values are maps")
        values.append({name: tensor_from_list(m) for name, m in c.items()} if c else {})
    if len(values) not in (len(job.pieces), len(job.pieces) + len(job.joins)):
        raise WireFormatError(f"step frame: {len(values)} carried maps for {len(job.pieces)} "
                              f"pieces and {len(job.joins)} joins")
    return gid, _int(epoch, "epoch"), job, values


def _spec_fields(spec: GroupSpec) -> list[Any]:
    return [int(spec.batch), int(spec.capacity), int(spec.pad),
            tensor_to_list(np.asarray(spec.start, dtype=np.int64)),
            dict(spec.search), [int(e) for e in spec.eos],
            None if spec.inbox is None else [str(spec.inbox[0]), str(spec.inbox[1])],
            bool(spec.batched),
            None if spec.row_seeds is None else [[int(s), int(f)] for s, f in spec.row_seeds],
            None if spec.row_stops is None else [int(s) for s in spec.row_stops]]


#: a search option's value on the wire (SearchOptions' fields: numbers, flags, None)
_OPTION_TYPES = (int, float, bool, type(None))


def _spec(v: Any) -> GroupSpec:
    if not isinstance(v, list) or len(v) != 10:
        raise WireFormatError("step frame: a group spec is [batch, capacity, pad, start, search, "
                              "eos, inbox, batched, row_seeds, row_stops]")
    batch, capacity, pad, start, search, eos, inbox, batched, seeds, stops = v
    if stops is not None and not (isinstance(stops, list) and len(stops) == batch):
        raise WireFormatError("step frame: a group spec's row_stops must be a list of ints, "
                              "one a row")
    if not isinstance(search, dict) or not all(
            isinstance(k, str) and isinstance(x, _OPTION_TYPES) for k, x in search.items()):
        raise WireFormatError("step frame: a group spec's search options are a map of "
                              "names to numbers")
    if not isinstance(eos, list) or not isinstance(batched, bool) or not (
            inbox is None or (isinstance(inbox, list) and len(inbox) == 2
                              and all(isinstance(x, str) for x in inbox))):
        raise WireFormatError("step frame: a group spec's eos, inbox or batched of the "
                              "wrong type")
    rows = tensor_from_list(start)
    if rows.ndim != 1 or rows.dtype != np.int64:
        raise WireFormatError(f"step frame: a group spec's start must be int64 [batch], got "
                              f"{rows.dtype} {rows.shape}")
    return GroupSpec(_int(batch, "spec batch"), _int(capacity, "spec capacity"),
                     _int(pad, "spec pad"), rows, search,
                     tuple(_int(e, "spec eos") for e in eos),
                     None if inbox is None else (inbox[0], inbox[1]), batched,
                     None if seeds is None else tuple(_pair(s, "spec row seed") for s in seeds),
                     None if stops is None else tuple(_int(s, "spec row stop") for s in stops))


def _join(v: Any) -> Join:
    if not isinstance(v, list) or len(v) != 8 or not isinstance(v[1], str) \
            or not isinstance(v[6], bool):
        raise WireFormatError("step frame: a join is [row, key, prompt, max_new, epoch, at, ok, "
                              "seed]")
    prompt = tensor_from_list(v[2])
    if prompt.ndim != 1 or prompt.dtype != "int64":
        raise WireFormatError(f"step frame: a join's prompt must be int64 [n], got {prompt.dtype} "
                              f"{prompt.shape}")
    return Join(_int(v[0], "join row"), v[1], prompt, _int(v[3], "join max_new"),
                _int(v[4], "join epoch"), _int(v[5], "join at"), v[6], _int(v[7], "join seed"))


# -- the two ends ---------------------------------------------------------------------------


class _Receiver(asyncio.Protocol):
    """One incoming connection: frames in, each run as a step (or a join queued, a
    group closed or halted) on the actor's loop."""

    def __init__(self, handlers: Handlers, label: str):
        self.label = label
        self.handlers = handlers
        self.buffer = bytearray()
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.buffer:  # the rest of a frame begun in an earlier read
            self.buffer += data
            data = bytes(self.buffer)
            self.buffer.clear()
        at, end, head = 0, len(data), _HEADER.size
        while end - at >= head:  # each whole frame, sliced from the read (one copy)
            (n,) = _HEADER.unpack_from(data, at)
            if n > MAX_FRAME_BYTES:
                return self._refuse(f"frame of {n} bytes over {MAX_FRAME_BYTES}")
            if end - at - head < n:
                break
            body = data[at + head:at + head + n]
            at += head + n
            try:
                kind, message = decode_frame(body)
            except WireFormatError as e:
                return self._refuse(str(e))
            try:
                self.handlers[kind](*message)
            except Exception:  # a step's failure is the step's: the link stays
                log.exception("%s: a %s received over its socket failed", self.label, kind)
        if at < end:
            self.buffer += data[at:]

    def _refuse(self, why: str) -> None:
        log.warning("%s: dropped a stage link connection: %s", self.label, why)
        self.buffer.clear()
        self.transport.close()


class _Sender(asyncio.Protocol):
    def __init__(self) -> None:
        self.lost = False

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True


class DriverLink:
    """The driver's connection to stage 0's socket, on stage 0's node: a group's steps
    from the driver (a prompt, a rewind's tokens) go in as the ring's own do, without
    a Ray call that waits behind the running groups' steps on the actor's loop.
    Thread-safe (generators on several threads share it); a send that fails closes it,
    and the caller sends by Ray until `RayDecoder` connects again after a recovery."""

    def __init__(self, address: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.connect(address)
        except OSError:
            self.sock.close()
            raise
        self.lock = threading.Lock()
        self.sent = 0

    @classmethod
    def connect(cls, address: str) -> "DriverLink | None":
        """A link to stage 0 at ``address``, or None (no address: not on this node, the
        link off; or the socket refused: steps go by Ray calls)."""
        if not (address and supported()):
            return None
        try:
            return cls(address)
        except OSError as e:
            log.warning("cannot connect to stage 0's socket (%s): the driver's steps go by "
                        "Ray calls", e)
            return None

    @property
    def up(self) -> bool:
        return self.sock.fileno() >= 0

    def send(self, gid: str, epoch: int, job: Job, carried: list[dict[str, Any]]) -> bool:
        """Write the step whole; False when the link is down (then it stays closed)."""
        return self._write(encode_step(gid, epoch, job, carried))

    def send_join(self, gid: str, join: Join) -> bool:
        """Write a join for ``gid``'s next decode step (as `GenerationStage.join`)."""
        return self._write(encode_join(gid, join))

    def send_close(self, gid: str, until: int) -> bool:
        """Close ``gid`` for good on stage 0 and, passed on, on each stage up to
        ``until``. Never waits for the lock: a generator collected while this thread
        writes (its ``__del__`` closes it) would wait on itself; the caller then closes
        by Ray calls."""
        return self._write(encode_close(gid, None, until), wait=False)

    def send_halt(self, gid: str, epoch: int, until: int) -> bool:
        """Halt ``gid``'s epochs before ``epoch`` on stage 0 and, passed on, on each stage
        up to ``until`` (`encode_halt`)."""
        return self._write(encode_halt(gid, epoch, until))

    def _write(self, frame: bytes, wait: bool = True) -> bool:
        if not self.lock.acquire(blocking=wait):
            return False
        try:
            if not self.up:
                return False
            try:
                self.sock.sendall(frame)
            except OSError as e:
                log.warning("the driver's link to stage 0 failed (%s): Ray calls from now on", e)
                self.sock.close()
                return False
            self.sent += 1
            return True
        finally:
            self.lock.release()

    def close(self) -> None:
        with self.lock:
            self.sock.close()


class StageLink:
    """A stage's listening socket and its connection to its successor."""

    def __init__(self, label: str, handlers: Handlers, enabled: bool = True):
        """``handlers``: what each kind of frame received calls (`Handlers`)."""
        self.label, self.handlers = label, dict(handlers)
        self.enabled = enabled and supported()
        self.address = ""
        self.server: Any = None
        self.transport: Any = None
        self.sender: _Sender | None = None
        self.sent_socket = 0
        self.sent_ray = 0

    async def listen(self, address: str) -> str:
        """Serve ``address`` on the running loop (once); returns it, or "" when off."""
        if not self.enabled or self.server is not None:
            return self.address
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:  # bound here: an event loop's own path handling may not know abstract names
            sock.bind(address)
            sock.listen(64)
            self.server = await loop.create_unix_server(
                lambda: _Receiver(self.handlers, self.label), sock=sock)
            self.address = address
        except OSError as e:
            sock.close()
            log.warning("%s: no stage link socket (%s): steps go by Ray calls", self.label, e)
        return self.address

    async def connect(self, own_node: str, node: str, address: str) -> bool:
        """Connect to the successor at ``address`` when it runs on this node; returns
        whether steps now go over the socket."""
        self._drop()
        if not (self.enabled and address and node == own_node):
            return False
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:  # a listening Unix socket accepts at once: a blocking connect does not wait
            sock.connect(address)
            sock.setblocking(False)
            self.transport, self.sender = await loop.create_unix_connection(_Sender, sock=sock)
        except OSError as e:
            sock.close()
            log.warning("%s: cannot connect to its successor's socket (%s): steps go by Ray "
                        "calls", self.label, e)
            return False
        return True

    def send(self, successor: Any, gid: str, epoch: int, job: Job,
             carried: list[dict[str, Any]]) -> None:
        """Pass a step on: over the socket while it is up, else by ``successor.step.remote``."""
        if self._write(lambda: encode_step(gid, epoch, job, carried)):
            self.sent_socket += 1
            return
        self.sent_ray += 1
        successor.step.remote(gid, epoch, job, carried)

    def send_close(self, successor: Any, gid: str, epoch: int | None, until: int) -> None:
        """Pass a group's close on (`encode_close`): over the socket while it is up, else
        by ``successor.close_ring.remote``."""
        if not self._write(lambda: encode_close(gid, epoch, until)):
            successor.close_ring.remote(gid, epoch, until)

    def send_halt(self, successor: Any, gid: str, epoch: int, until: int) -> None:
        """Pass a rewind's halt on (`encode_halt`): over the socket while it is up, else
        by ``successor.halt_ring.remote``."""
        if not self._write(lambda: encode_halt(gid, epoch, until)):
            successor.halt_ring.remote(gid, epoch, until)

    def _write(self, frame: Callable[[], bytes]) -> bool:
        """Write ``frame()`` to the successor's socket; False when it is not up (then it
        stays closed until `connect`)."""
        if self.transport is not None and not (self.sender.lost or self.transport.is_closing()):
            try:
                self.transport.write(frame())
                return True
            except (OSError, RuntimeError) as e:
                log.warning("%s: its stage link failed (%s): Ray calls until reconnected",
                            self.label, e)
        if self.transport is not None:
            self._drop()
        return False

    def _drop(self) -> None:
        if self.transport is not None:
            self.transport.close()
        self.transport, self.sender = None, None

    def close(self) -> None:
        self._drop()
        if self.server is not None:
            self.server.close()
            self.server = None

