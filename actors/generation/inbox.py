"""Token columns pushed from the last stage to the driver over a Unix socket, when both
run on one node: the driver's per-token Ray long poll (`GenerationStage.tokens`) cost a
Ray call each way per token, on the driver and on the last stage's event loop while
stage 0 computed the next step (0.5-1 ms of CPU a token on a 2-core host, as much as a
stage's compute); a frame written after each sample costs one syscall, and one read by
the driver takes every column that came since (several when the ring ran ahead).

The driver's generator listens on an abstract-namespace socket of its own (named after
the ring and the group; nothing in the file system) and names it in the group's
`GroupSpec`. The last stage connects when it opens the group on the same node and
writes, after each token it samples, a frame: a 4-byte length and a msgpack list
``[epoch, at, ids (a compact wire tensor, [batch, 1]), done, acks]``; when a step of the
group fails on a stage, that stage writes ``["failed", epoch]`` (`encode_failed`), and
the driver asks the last stage for the error at once. Logits come the same way
(``["logits", epoch, column, logits or None]``, `encode_logits`, before the column they
chose): those a ``get_logits`` step kept, and from then on every step's, so that the
driver's next ``get_logits`` finds the logits the ring ran ahead with rather than running
the last token again. The socket only speeds
things up; the Ray poll stays the truth: a frame that does not follow what the driver
has (a column lost, a connection made late) makes the driver poll, and so does a
silent socket (a fault is found there, as before). A stage never blocks on the driver:
a write that does not go through whole closes the connection (the driver sees the end
and polls from then on).
"""

from __future__ import annotations

import logging
import os
import select
import socket
import struct
import threading
import time

import numpy as np

from actors.generation.channel import supported
from actors.transport.wire import (
    WireFormatError,
    pack,
    tensor_from_list,
    tensor_to_list,
    unpack_frame,
)

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<I")
#: a token frame is a few hundred bytes at most (ids of one column); more is not ours
MAX_FRAME_BYTES = 1 << 20
#: one read's size: a short read has drained the socket
_READ_BYTES = 1 << 16
#: the largest logits pushed (batch x vocab): under a Unix socket's default buffer (208 KiB)
#: so that one write goes whole; larger ones stay on the last stage for the driver's poll
PUSHED_LOGITS_BYTES = 128 << 10
#: pushed logits an inbox keeps (the ring runs ahead of a driver that asks for them)
KEPT_LOGITS = 64


#: Linux's batch policy: a thread woken under it does not preempt the one on its core
_SCHED_BATCH = getattr(os, "SCHED_BATCH", None)
#: set off for good the first time the policy cannot be changed (not Linux, a sandbox)
_yield_on_wake = _SCHED_BATCH is not None
#: the threads yielding inboxes put under SCHED_BATCH (native id -> the inboxes that
#: waited on it, by id()); a thread goes back to SCHED_OTHER when the last one lets go
_batched: dict[int, set[int]] = {}
_batched_lock = threading.Lock()


def yield_thread(holder: int) -> None:
    """Put the calling thread under SCHED_BATCH for ``holder`` (an inbox's id) until
    `release_threads(holder)`: woken by a token frame, the driver does not preempt a
    stage mid-step; it runs when a core frees up or the stage's time slice ends. On a
    host whose cores the stages keep busy (4 groups in flight on 2 cores) each such
    wake-up cost the stage its warm caches and two context switches: +7-8% tokens/s
    alone (10 of 12 paired rounds); with the stages pinned too (`cores.py`, which gains
    nothing without it) 1.06-1.09x the defaults in one A/B. The price is the token's
    hand-over, up to a scheduler slice later: Serve's inter-token p50 on the same host
    rose ~25%, hence a generator's option (``yield_to_stages``), off by default.

    The thread stays under the policy between its waits (the caller's code between two
    tokens runs under it too) rather than switching for each wait: two policy changes
    a token cost the driver 15-45 us of CPU on a nested VM (4 groups on 2 cores: driver
    157 -> 114 us a token and tokens/s 1.07x in a slow phase, 91 -> 76 and 1.00-1.02x in
    a quieter one). A thread with
    a policy of its own (real-time, idle) is left as it is. A thread already held only
    records ``holder`` (no syscall)."""
    global _yield_on_wake
    tid = threading.current_thread().native_id
    if not _yield_on_wake or tid is None:
        return
    with _batched_lock:
        holders = _batched.get(tid)
        if holders is None:
            try:
                if os.sched_getscheduler(0) != os.SCHED_OTHER:
                    return
                os.sched_setscheduler(0, _SCHED_BATCH, os.sched_param(0))
            except (OSError, AttributeError) as e:
                log.debug("token waits keep their scheduling policy: %s", e)
                _yield_on_wake = False
                return
            holders = _batched[tid] = set()
        holders.add(holder)


def release_threads(holder: int) -> None:
    """``holder`` lets go of the threads it put under SCHED_BATCH; each that no other
    inbox holds goes back to SCHED_OTHER (if it still runs under SCHED_BATCH: a policy
    its owner set since is left alone; an ended thread has nothing to restore)."""
    with _batched_lock:
        for tid in [t for t, holders in _batched.items() if holder in holders]:
            holders = _batched[tid]
            holders.discard(holder)
            if holders:
                continue
            del _batched[tid]
            try:
                if os.sched_getscheduler(tid) == _SCHED_BATCH:
                    os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            except OSError:  # the thread ended
                pass


def inbox_name(ring_id: str, gid: str) -> str:
    return f"\0hetero_exec/generation/{ring_id}/tokens/{gid}"


def encode_column(epoch: int, at: int, ids: np.ndarray, done: bool,
                  acks: list[tuple[int, str, int, bool]] = ()) -> bytes:
    body = pack([int(epoch), int(at), tensor_to_list(ids), bool(done),
                 [[int(c), k, int(r), bool(ok)] for c, k, r, ok in acks] if acks else []])
    return _HEADER.pack(len(body)) + body


def encode_failed(epoch: int) -> bytes:
    """A step of the group's ``epoch`` failed on a stage: the driver asks the last stage
    for the error (`GenerationStage.tokens`) rather than waiting out a poll."""
    body = pack(["failed", int(epoch)])
    return _HEADER.pack(len(body)) + body


def encode_logits(epoch: int, column: int, logits: np.ndarray | None) -> bytes:
    """The logits ([batch, vocab]) a step of ``epoch`` chose ``column`` from; None in
    their place when they stay on the last stage (larger than `PUSHED_LOGITS_BYTES`)."""
    body = pack(["logits", int(epoch), int(column),
                 None if logits is None else tensor_to_list(logits)])
    return _HEADER.pack(len(body)) + body


def decode_column(body: bytes) -> tuple[int, int, np.ndarray, bool, list]:
    return _column(unpack_frame(body, MAX_FRAME_BYTES))


def _column(obj: object) -> tuple[int, int, np.ndarray, bool, list]:
    if not isinstance(obj, list) or len(obj) != 5:
        raise WireFormatError("a token frame is a list of 5 fields")
    epoch, at, ids, done, acks = obj
    if type(epoch) is not int or type(at) is not int or not isinstance(done, bool) \
            or not isinstance(acks, list):
        raise WireFormatError("token frame: epoch, at, done or acks of the wrong type")
    for a in acks:
        if not (isinstance(a, list) and len(a) == 4 and type(a[0]) is int and isinstance(a[1], str)
                and type(a[2]) is int and isinstance(a[3], bool)):
            raise WireFormatError("token frame: an ack is [column, key, row, ok]")
    arr = tensor_from_list(ids)
    if arr.ndim != 2 or arr.dtype != np.int64:
        raise WireFormatError(f"token frame: ids must be [batch, n] int64, got {arr.dtype} "
                              f"{arr.shape}")
    return epoch, at, arr, done, [tuple(a) for a in acks]


class TokenInbox:
    """The driver's end, one per generator: a listening socket and the connections the
    last stage made to it (a restarted stage connects again)."""

    def __init__(self, address: str, yielding: bool = False):
        self.address = address
        self.yielding = yielding  # wait under SCHED_BATCH (`yield_thread`)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.listener.bind(address)
            self.listener.listen(4)
            self.listener.setblocking(False)
        except OSError:
            self.listener.close()
            raise
        self.conns: dict[socket.socket, bytearray] = {}
        self.ended = False  # a connection ended without a done frame (polls from then on)
        self.failed: set[int] = set()  # the epochs a stage said a step of failed
        #: the latest epoch's pushed logits by the column they chose ([batch, vocab]; None:
        #: too big, kept on the stage), the latest `KEPT_LOGITS`
        self.logits: dict[tuple[int, int], np.ndarray | None] = {}
        #: columns read while waiting for logits (`wait_logits`), for the next `columns`
        self.backlog: list[tuple[int, int, np.ndarray, bool, list]] = []

    @classmethod
    def open(cls, address: str, yielding: bool = False) -> "TokenInbox | None":
        """An inbox at ``address``, or None where there can be none (not Linux, or the
        socket cannot be made: the generator polls); ``yielding``: wait for frames
        without preempting the stages (`yield_thread`)."""
        if not supported():
            return None
        try:
            return cls(address, yielding)
        except OSError as e:
            log.warning("no token socket for a generator (%s): it polls the last stage", e)
            return None

    def columns(self, timeout: float) -> list[tuple[int, int, np.ndarray, bool, list]]:
        """The columns that came, waiting up to ``timeout`` for the first frame (a
        failure notice ends the wait too: it goes to ``failed``; a yielding inbox waits
        under SCHED_BATCH: `yield_thread`)."""
        if self.yielding:
            yield_thread(id(self))
        out, self.backlog = self.backlog, []
        deadline = time.monotonic() + (0.0 if out else timeout)
        failures = len(self.failed)
        while True:
            left = self._wait(deadline, out)
            if out or left <= 0 or len(self.failed) != failures:
                return out

    def wait_logits(self, epoch: int, column: int, timeout: float) -> np.ndarray | None:
        """The logits a step of ``epoch`` pushed for ``column``, waiting up to ``timeout``;
        None when the driver must ask the last stage: too big to push, a failure notice,
        the connection's end, or the group's last column first (the ring ended it before
        that step got there, and dropped the step). Columns that come meanwhile wait for
        the next `columns`."""
        if self.yielding:
            yield_thread(id(self))
        deadline = time.monotonic() + timeout
        while True:
            if (epoch, column) in self.logits:
                return self.take_logits(epoch, column)
            if epoch in self.failed or self.ended \
                    or any(c[0] == epoch and c[3] for c in self.backlog):
                return None
            if self._wait(deadline, self.backlog) <= 0:
                return self.take_logits(epoch, column)

    def take_logits(self, epoch: int, column: int) -> np.ndarray | None:
        """The logits pushed for ``column`` of ``epoch`` if they came (those of earlier
        columns go: the driver is past them)."""
        got = self.logits.pop((epoch, column), None)
        for key in [k for k in self.logits if k[1] < column]:
            del self.logits[key]
        return got

    def _wait(self, deadline: float, out: list[tuple[int, int, np.ndarray, bool, list]]
              ) -> float:
        """One wait (until ``deadline``) for frames, read into ``out``; the time that was
        left."""
        left = deadline - time.monotonic()
        readable, _, _ = select.select([self.listener, *self.conns], [], [], max(left, 0.0))
        for s in readable:
            if s is self.listener:
                self._accept()
            else:
                self._read(s, out)
        return left

    def release(self) -> None:
        """Let go of the threads this inbox put under SCHED_BATCH (its group is done)."""
        release_threads(id(self))

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            conn.setblocking(False)
            self.conns[conn] = bytearray()
            self.ended = False

    def _read(self, conn: socket.socket,
              out: list[tuple[int, int, np.ndarray, bool, list]]) -> None:
        buf = self.conns[conn]
        while True:
            try:
                data = conn.recv(_READ_BYTES)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                data = b""
            if not data:
                self._drop(conn, ended=True)
                break
            buf += data
            if len(data) < _READ_BYTES:
                break  # drained (no read to EAGAIN: a syscall a token); select tells of more
        while len(buf) >= _HEADER.size:
            (n,) = _HEADER.unpack_from(buf)
            if n > MAX_FRAME_BYTES:
                log.warning("token socket: a frame of %d bytes: connection dropped", n)
                return self._drop(conn, ended=True)
            if len(buf) < _HEADER.size + n:
                break
            body = bytes(buf[_HEADER.size:_HEADER.size + n])
            del buf[:_HEADER.size + n]
            try:
                obj = unpack_frame(body, MAX_FRAME_BYTES)
                if isinstance(obj, list) and len(obj) == 2 and obj[0] == "failed":
                    if type(obj[1]) is not int:
                        raise WireFormatError('a failure frame is ["failed", epoch]')
                    self.failed.add(obj[1])
                elif isinstance(obj, list) and len(obj) == 4 and obj[0] == "logits":
                    self._logits(obj[1], obj[2], obj[3])
                else:
                    out.append(_column(obj))
            except WireFormatError as e:
                log.warning("token socket: %s: connection dropped", e)
                return self._drop(conn, ended=True)

    def _logits(self, epoch: object, column: object, value: object) -> None:
        if type(epoch) is not int or type(column) is not int:
            raise WireFormatError('a logits frame is ["logits", epoch, column, logits or None]')
        arr = None if value is None else np.array(tensor_from_list(value))  # the caller's
        if arr is not None and (arr.ndim != 2 or arr.dtype.kind != "f"):
            raise WireFormatError(f"logits frame: [batch, vocab] floats, got {arr.dtype} "
                                  f"{arr.shape}")
        newest = next(iter(self.logits))[0] if self.logits else epoch  # all one epoch's
        if epoch < newest:
            return  # an older epoch's run-ahead: nobody's
        if epoch > newest:
            self.logits.clear()
        self.logits[epoch, column] = arr
        while len(self.logits) > KEPT_LOGITS:
            del self.logits[next(iter(self.logits))]

    def _drop(self, conn: socket.socket, ended: bool) -> None:
        if self.conns.pop(conn, None) is not None:
            conn.close()
        if ended and not self.conns:
            self.ended = True

    def close(self) -> None:
        for conn in list(self.conns):
            self._drop(conn, ended=False)
        self.listener.close()
        self.release()


class TokenOutlet:
    """The last stage's end for one group: a frame per sampled column, never blocking."""

    def __init__(self, address: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:  # a listening Unix socket accepts at once (its backlog): nothing waits here
            self.sock.connect(address)
            self.sock.setblocking(False)
        except OSError:
            self.sock.close()
            raise

    @classmethod
    def connect(cls, address: str, label: str) -> "TokenOutlet | None":
        try:
            return cls(address)
        except OSError as e:
            log.info("%s: cannot reach a generator's token socket (%s): it polls", label, e)
            return None

    @property
    def up(self) -> bool:
        return self.sock is not None

    def send(self, epoch: int, at: int, ids: np.ndarray, done: bool,
             acks: list[tuple[int, str, int, bool]] = ()) -> bool:
        """Write one column's frame (with the joins taken at it: ``acks``); on a short or
        failed write, close (the driver polls)."""
        return self._write(encode_column(epoch, at, ids, done, acks))

    def _write(self, frame: bytes) -> bool:
        if self.sock is None:
            return False
        try:
            sent = self.sock.send(frame)
        except OSError:
            sent = -1
        if sent != len(frame):
            self.close()
            return False
        return True

    def send_logits(self, epoch: int, column: int, logits: np.ndarray) -> bool:
        """Push the logits a step chose ``column`` from (`encode_logits`); None in their
        place when larger than `PUSHED_LOGITS_BYTES` (a write that would not go whole)."""
        small = logits.nbytes <= PUSHED_LOGITS_BYTES
        return self._write(encode_logits(epoch, column, logits if small else None))

    def send_failed(self, epoch: int) -> bool:
        """Tell the driver a step of ``epoch`` failed (`encode_failed`)."""
        return self._write(encode_failed(epoch))

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

