"""Same-node seams through shared memory: one copy in, zero-copy reads out.

On the 2-core reference host Ray's object store costs its writer about 2.7 ms of CPU and
the raylet 1.4 ms for one 2 MB object (create, copy, seal, pin and release are IPC
round trips), against 0.07 ms to copy the same bytes into memory that is already
mapped. So when the segment actors and the driver share one node, a seam value goes
into a reused buffer that its writer owns and what travels through Ray is a small
`ShmArray` (where, dtype, shape), which Ray passes inline.

A buffer is a /dev/shm file unlinked as soon as it is allocated: the writer keeps its
descriptor, readers open it as ``/proc/<writer pid>/fd/<fd>``, and the kernel frees it
when the last process holding it exits, so a killed actor or driver leaves nothing
behind in /dev/shm (the inode, recorded in the descriptor, guards against a reused
pid or fd number).

Lifetime: a buffer belongs to its request until every request before it has finished
too. Each task tells its actor the oldest request still in flight (``release_below``);
the buffers of older requests go back to the pool. So later segments and replays read
a seam zero-copy while its request is in flight, and the driver copies graph outputs
out (`take`). A writer that is at its byte budget, cannot grow /dev/shm, or gets a small
or non-numeric value hands the value itself to Ray instead: this transport never fails
a run.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from actors.transport.base import SeamConfig, SeamKey, SeamUnreachable, Transport

__all__ = ["SharedMemoryTransport", "ShmArray", "ShmPool", "SeamUnreachable", "SHM_DIR"]

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
#: below this many bytes Ray passes the value inline anyway (no object store)
MIN_BYTES = 64 * 1024
#: the smallest buffer; larger ones are powers of two
MIN_BUFFER = 64 * 1024


@dataclass(frozen=True)
class ShmArray:
    """What travels through Ray in place of an array written to shared memory."""

    path: str  # /proc/<writer pid>/fd/<fd>
    inode: int  # the buffer's, checked when a reader opens the path
    dtype: str
    shape: tuple[int, ...]
    node: str  # the writer's Ray node: the buffer exists only there


def _size_class(nbytes: int) -> int:
    return max(MIN_BUFFER, 1 << (int(nbytes) - 1).bit_length())


def _shareable(value: Any) -> bool:
    return (
        isinstance(value, np.ndarray)
        and value.nbytes >= MIN_BYTES
        and value.dtype.kind in "biufc"
        and np.dtype(value.dtype.str) == value.dtype  # rebuilt from its string
    )


class _Buffer:
    __slots__ = ("path", "inode", "size", "fd", "mm")

    def __init__(self, name: str, size: int):
        fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.unlink(name)  # nameless from here on: freed with the last holder
            # allocated now, not on first write: a full /dev/shm fails here (OSError, so
            # the object store carries the value) instead of a SIGBUS in the middle of a copy
            os.posix_fallocate(fd, 0, size)
            self.mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self.fd, self.size = fd, size
        self.path = f"/proc/{os.getpid()}/fd/{fd}"
        self.inode = os.fstat(fd).st_ino

    def close(self) -> None:
        try:
            self.mm.close()
        except BufferError:  # a view is still alive; the mapping goes with it
            pass
        os.close(self.fd)


class ShmPool:
    """The writer's buffers: held per request, reused by size class, bounded in bytes.

    >>> pool = ShmPool(f"hetero_exec-doctest-{os.getpid()}", budget=1 << 20)
    >>> a = pool.take(5, 100_000); b = pool.take(6, 100_000); a.path != b.path
    True
    >>> pool.release_below(6); pool.take(7, 90_000).path == a.path  # reused
    True
    >>> pool.close()
    """

    def __init__(self, prefix: str, budget: int):
        self.prefix = prefix
        self.budget = budget
        self.total = 0
        self._free: dict[int, list[_Buffer]] = {}
        self._held: dict[int, list[_Buffer]] = {}
        self._count = 0
        self._lock = threading.Lock()
        self._warned = False

    def take(self, request: int, nbytes: int) -> _Buffer | None:
        """A buffer of at least ``nbytes`` held for ``request``; None when none can be had."""
        size = _size_class(nbytes)
        with self._lock:
            free = self._free.get(size)
            if free:
                buf = free.pop()
            else:
                if self.total + size > self.budget:
                    return None
                self._count += 1
                try:
                    buf = _Buffer(f"{SHM_DIR}/{self.prefix}-{self._count}", size)
                except OSError as e:  # no /dev/shm, or it is full: the object store it is
                    if not self._warned:
                        log.warning("shared-memory seams unavailable (%s); using Ray's object store", e)
                        self._warned = True
                    return None
                self.total += size
            self._held.setdefault(request, []).append(buf)
            return buf

    def release_below(self, floor: int) -> None:
        """Buffers of requests older than ``floor`` go back to the pool."""
        with self._lock:
            self._release([r for r in self._held if r < floor])

    def release(self, request: int) -> None:
        with self._lock:
            self._release([request])

    def _release(self, requests: list[int]) -> None:
        for request in requests:
            for buf in self._held.pop(request, []):
                self._free.setdefault(buf.size, []).append(buf)

    def held(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._held.values())

    def close(self) -> None:
        with self._lock:
            buffers = [b for bs in self._free.values() for b in bs]
            buffers += [b for bs in self._held.values() for b in bs]
            self._free.clear()
            self._held.clear()
            self.total = 0
        for buf in buffers:
            buf.close()


class _Mappings:
    """The reader's side: buffers mapped once, read-only, the most recent 256 kept."""

    LIMIT = 256

    def __init__(self) -> None:
        self._maps: OrderedDict[tuple[str, int], mmap.mmap] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, carried: ShmArray) -> mmap.mmap:
        key = (carried.path, carried.inode)
        with self._lock:
            mm = self._maps.get(key)
            if mm is not None:
                self._maps.move_to_end(key)
                return mm
        try:
            fd = os.open(carried.path, os.O_RDONLY)
        except FileNotFoundError:
            raise SeamUnreachable(
                f"shared-memory seam at {carried.path} is gone (its writer exited)"
            ) from None
        except PermissionError as e:
            raise SeamUnreachable(
                f"cannot open the shared-memory seam at {carried.path} ({e}); "
                f"use seam_transport='object_store'"
            ) from None
        try:
            if os.fstat(fd).st_ino != carried.inode:
                raise SeamUnreachable(
                    f"shared-memory seam at {carried.path} is gone (its writer exited)"
                )
            mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        with self._lock:
            self._maps[key] = mm
            while len(self._maps) > self.LIMIT:
                _, old = self._maps.popitem(last=False)
                try:
                    old.close()
                except BufferError:  # still viewed; freed with its last view
                    pass
        return mm


class SharedMemoryTransport(Transport):
    """Seams in /dev/shm buffers owned by the writer (see the module docstring).

    >>> w = SharedMemoryTransport(f"hetero_exec-doctest-{os.getpid()}-w", node="n")
    >>> x = np.arange(1 << 16, dtype=np.float32)
    >>> carried = w.write(SeamKey(3, "h"), x); type(carried).__name__
    'ShmArray'
    >>> r = SharedMemoryTransport(f"hetero_exec-doctest-{os.getpid()}-r", node="n")
    >>> bool((r.read(SeamKey(3, "h"), carried) == x).all())
    True
    >>> w.write(SeamKey(3, "s"), np.ones(4)).shape  # small values travel as themselves
    (4,)
    >>> w.close(); r.close(); w.close()  # idempotent
    """

    name = "shared_memory"
    label = "shared memory"

    def __init__(self, prefix: str, node: str = "", budget: int = 1 << 30):
        self.node = node
        self.pool = ShmPool(prefix, budget)
        self.maps = _Mappings()

    @classmethod
    def from_config(cls, config: SeamConfig) -> "SharedMemoryTransport":
        """The end of this process: its files named by ``config.prefix``, its buffers
        within ``config.budget``, on this Ray node (readers elsewhere get a fault)."""
        import ray

        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
        return cls(config.prefix, node=node, budget=int(config.budget))

    def write(self, key: SeamKey, value: Any) -> Any:
        if not _shareable(value):
            return value
        buf = self.pool.take(key.request, value.nbytes)
        if buf is None:
            return value
        np.copyto(np.ndarray(value.shape, value.dtype, buffer=buf.mm), value, casting="no")
        return ShmArray(buf.path, buf.inode, value.dtype.str, tuple(value.shape), self.node)

    def read(self, key: SeamKey, carried: Any) -> Any:
        if not isinstance(carried, ShmArray):
            return carried
        if self.node and carried.node and carried.node != self.node:
            raise SeamUnreachable(
                f"shared-memory seam {key.value!r} was written on node {carried.node[:12]} "
                f"and read on {self.node[:12]}"
            )
        mm = self.maps.get(carried)
        return np.ndarray(carried.shape, np.dtype(carried.dtype), buffer=mm)

    def take(self, key: SeamKey, carried: Any) -> Any:
        value = self.read(key, carried)
        return np.array(value) if isinstance(carried, ShmArray) else value

    def carries(self, carried: Any) -> bool:
        return isinstance(carried, ShmArray)

    def release_below(self, floor: int) -> None:
        self.pool.release_below(floor)

    def drop(self, request: int) -> None:
        self.pool.release(request)

    def close(self) -> None:
        self.pool.close()

