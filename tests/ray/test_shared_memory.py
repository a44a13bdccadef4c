"""The shared-memory seam transport without Ray: buffers, their reuse and lifetime,
fallbacks to the object store, and what a reader on the wrong node gets."""

from __future__ import annotations

import os
import uuid

import ml_dtypes
import numpy as np
import pytest

from actors.remote_errors import is_fault
from actors.transport import SeamConfig, make_transport
from actors.transport.base import SeamKey
from actors.transport.shared_memory import (
    SHM_DIR,
    SeamUnreachable,
    SharedMemoryTransport,
    ShmArray,
)

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm")


@pytest.fixture
def prefix():
    p = f"hetero_exec-test-{uuid.uuid4().hex[:8]}"
    yield p
    assert files(p) == []  # buffers are nameless: nothing is ever left in /dev/shm


def files(prefix: str) -> list[str]:
    return sorted(f for f in os.listdir(SHM_DIR) if f.startswith(prefix))


def big(seed: int, shape=(128, 1024), dtype=np.float32) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def test_round_trip_is_zero_copy_for_readers_and_a_copy_for_the_caller(prefix):
    w = make_transport(SeamConfig("shared_memory", prefix=prefix).for_owner("w"))
    assert isinstance(w, SharedMemoryTransport) and w.pool.prefix == f"{prefix}-w"
    w.node = "n1"  # a writer on node n1 (whatever node this test process is on)
    r = SharedMemoryTransport(f"{prefix}-r", node="n1")
    x = big(0)
    carried = w.write(SeamKey(1, "h"), x)
    assert isinstance(carried, ShmArray) and carried.shape == x.shape
    assert carried.path == f"/proc/{os.getpid()}/fd/{w.pool._held[1][0].fd}"
    assert files(prefix) == []
    seen = r.read(SeamKey(1, "h"), carried)
    np.testing.assert_array_equal(seen, x)
    assert not seen.flags.writeable  # a reader cannot change what other readers see
    out = r.take(SeamKey(1, "y"), carried)
    assert out.flags.writeable and out.flags.owndata
    out[0, 0] = 123.0
    assert r.read(SeamKey(1, "h"), carried)[0, 0] == x[0, 0]
    w.close()
    r.close()


@pytest.mark.parametrize(
    "value",
    [
        np.ones(8, np.float32),  # small: Ray passes it inline
        np.array(["a"] * 40000, dtype=object),  # not plain numbers
        np.ones(70000, ml_dtypes.bfloat16),  # a dtype its string cannot rebuild
        "text",
    ],
    ids=["small", "object", "bfloat16", "not-an-array"],
)
def test_what_shared_memory_does_not_take_travels_as_itself(prefix, value):
    w = SharedMemoryTransport(prefix, node="n1")
    assert w.write(SeamKey(1, "v"), value) is value
    assert w.read(SeamKey(1, "v"), value) is value
    w.close()


def test_non_contiguous_and_big_endian_arrays(prefix):
    w = SharedMemoryTransport(prefix, node="n1")
    for x in (big(1).T, big(2, dtype=">f8")):
        np.testing.assert_array_equal(w.read(SeamKey(1, "v"), w.write(SeamKey(1, "v"), x)), x)
    w.close()


def x_bytes(x: np.ndarray) -> int:
    return 1 << (x.nbytes - 1).bit_length()


def test_buffers_are_held_until_every_earlier_request_finished_then_reused(prefix):
    w = SharedMemoryTransport(prefix, node="n1")
    a, b = big(3), big(4)
    ca = w.write(SeamKey(5, "h"), a)
    cb = w.write(SeamKey(6, "h"), b)
    assert ca.path != cb.path
    w.release_below(6)  # request 5 finished; 6 is still in flight
    c = w.write(SeamKey(7, "h"), big(5))
    assert c.path == ca.path  # 5's buffer, reused
    np.testing.assert_array_equal(w.read(SeamKey(6, "h"), cb), b)  # 6's is untouched
    assert w.pool.held() == 2
    w.drop(6)
    w.drop(7)
    assert w.pool.held() == 0 and w.pool.total == 2 * x_bytes(a)
    w.close()


def test_a_full_budget_falls_back_to_the_value_itself(prefix):
    x = big(6)  # 512 KiB: one buffer
    w = SharedMemoryTransport(prefix, node="n1", budget=x.nbytes)
    assert isinstance(w.write(SeamKey(1, "h"), x), ShmArray)
    assert w.write(SeamKey(2, "h"), x) is x  # over budget: the object store carries it
    w.release_below(2)
    assert isinstance(w.write(SeamKey(3, "h"), x), ShmArray)  # the buffer came back
    w.close()


def test_no_room_in_shared_memory_falls_back_to_the_value_itself(prefix, monkeypatch):
    import actors.transport.shared_memory as shm

    monkeypatch.setattr(shm, "SHM_DIR", "/nonexistent-hetero-exec-shm")
    w = SharedMemoryTransport(prefix, node="n1")
    x = big(9)
    assert w.write(SeamKey(1, "h"), x) is x  # the object store carries it; nothing fails
    assert w.pool.total == 0
    w.close()


def test_a_reader_on_another_node_or_after_the_writer_is_gone_gets_a_fault(prefix):
    w = SharedMemoryTransport(prefix, node="n1")
    carried = w.write(SeamKey(1, "h"), big(7))
    with pytest.raises(SeamUnreachable, match="written on node n1"):
        SharedMemoryTransport(f"{prefix}-r", node="n2").read(SeamKey(1, "h"), carried)
    w.close()  # the writer's files go with it
    with pytest.raises(SeamUnreachable, match="is gone") as info:
        SharedMemoryTransport(f"{prefix}-r2", node="n1").read(SeamKey(1, "h"), carried)
    assert is_fault(info.value)  # so the coordinator replays the request


def test_a_killed_writer_leaves_nothing_and_its_readers_get_a_fault(prefix):
    import subprocess
    import sys

    code = f"""
import sys, numpy as np
from actors.transport.base import SeamKey
from actors.transport.shared_memory import SharedMemoryTransport
w = SharedMemoryTransport({prefix!r}, node="n1")
c = w.write(SeamKey(1, "h"), np.full(1 << 16, 7, np.float32))
print(c.path, c.inode, flush=True)
sys.stdin.read()  # until killed
"""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=root, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True, env={**os.environ, "PYTHONPATH": root},
    )
    path, inode = proc.stdout.readline().split()
    carried = ShmArray(path, int(inode), "<f4", (1 << 16,), "n1")
    r = SharedMemoryTransport(f"{prefix}-r", node="n1")
    assert (r.take(SeamKey(1, "h"), carried) == 7).all()  # another process reads it
    proc.kill()
    proc.wait()
    with pytest.raises(SeamUnreachable, match="gone"):
        SharedMemoryTransport(f"{prefix}-r2", node="n1").read(SeamKey(1, "h"), carried)
    assert files(prefix) == []
    r.close()
