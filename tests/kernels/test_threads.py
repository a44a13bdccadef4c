"""kernels/_threads.py: the run-wide BLAS hold and the split products."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from hetero_exec.kernels import _c_workers_split, _threads
from hetero_exec.kernels._threads import blas_threads, matmul, single_blas_thread


def test_single_blas_thread_holds_one_and_restores():
    before = blas_threads()
    if before is None:
        pytest.skip("no controllable BLAS (threadpoolctl) here")
    with single_blas_thread():
        assert blas_threads() == 1
        with single_blas_thread():  # nested (a body's run inside a run)
            assert blas_threads() == 1
        assert blas_threads() == 1
    assert blas_threads() == before


def test_concurrent_holds_restore_once_the_last_leaves():
    before = blas_threads()
    if before is None:
        pytest.skip("no controllable BLAS (threadpoolctl) here")
    inside, leave = threading.Barrier(3), threading.Event()

    def run():
        with single_blas_thread():
            inside.wait()
            leave.wait()

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        inside.wait(timeout=30)
        assert blas_threads() == 1
    finally:
        leave.set()
        for t in threads:
            t.join()
    assert blas_threads() == before


@pytest.mark.parametrize("sa, sb", [
    ((96, 40), (40, 24)),  # split by rows
    ((24, 40), (40, 96)),  # by columns
    ((3, 64, 20), (3, 20, 48)),  # batched
    ((40, 20), (5, 20, 64)),  # a broadcast over b's batch
    ((5, 64, 20), (20, 33)),  # b broadcast
])
def test_split_products_match(monkeypatch, sa, sb):
    monkeypatch.setattr(_threads, "PARALLEL_FLOPS", 0)
    monkeypatch.setattr(_threads, "_MIN_PART", 4)
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(sa, np.float32), rng.standard_normal(sb, np.float32)
    with single_blas_thread():
        got = matmul(np, a, b)
        out = np.full(got.shape, np.nan, np.float32)
        assert matmul(np, a, b, out=out) is out
    np.testing.assert_allclose(got, a @ b, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out, a @ b, rtol=1e-5, atol=1e-5)


def test_busy_helpers_leave_the_work_to_the_caller(monkeypatch):
    monkeypatch.setattr(_threads, "PARALLEL_FLOPS", 0)
    helpers = _threads._helpers()
    if helpers is None:
        pytest.skip("one core: nothing is split")
    _, free = helpers
    taken = 0
    while free.acquire(blocking=False):  # every helper busy
        taken += 1
    try:
        a, b = np.ones((64, 8), np.float32), np.ones((8, 64), np.float32)
        with single_blas_thread():
            np.testing.assert_array_equal(matmul(np, a, b), np.full((64, 64), 8, np.float32))
    finally:
        for _ in range(taken):
            free.release()


@pytest.mark.parametrize("busy", [False, True])
def test_parallel_for_covers_every_item_once(monkeypatch, busy):
    monkeypatch.setattr(_threads, "PARALLEL_FLOPS", 0)
    seen = np.zeros(37, np.int64)
    lock = threading.Lock()

    def work(i0, i1):
        with lock:
            seen[i0:i1] += 1

    helpers = _threads._helpers()
    taken = 0
    if busy and helpers is not None:
        while helpers[1].acquire(blocking=False):
            taken += 1
    try:
        with single_blas_thread():
            _threads.parallel_for(np, 37, work, flops=1.0, least=4)
    finally:
        for _ in range(taken):
            helpers[1].release()
    np.testing.assert_array_equal(seen, 1)


def test_compiled_work_splits_in_a_lone_run_only():
    """``alone`` work (the compiled kernels, which call no BLAS) is split over the helper
    in a run alone in the process, and not while another run overlaps it: those runs
    already keep the cores busy."""
    if _threads.cores() < 2:
        pytest.skip("one core: nothing to split over")

    def parts_of(flops: float) -> set[str]:
        names, lock = set(), threading.Lock()

        def work(i0, i1):
            with lock:
                names.add(threading.current_thread().name)

        _threads.parallel_for(np, 64, work, flops=flops, least=4, alone=True)
        return names

    with _threads.run_threads():
        assert len(parts_of(_threads.ALONE_FLOPS)) == 2
        assert len(parts_of(_threads.ALONE_FLOPS / 2)) == 1  # too little work
    inside, leave = threading.Event(), threading.Event()

    def other_run():
        with _threads.run_threads():
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=other_run)
    t.start()
    try:
        assert inside.wait(10)
        with _threads.run_threads():
            assert len(parts_of(_threads.ALONE_FLOPS * 100)) == 1
    finally:
        leave.set()
        t.join()


def test_parallel_for_errors_reach_the_caller(monkeypatch):
    monkeypatch.setattr(_threads, "PARALLEL_FLOPS", 0)

    def work(i0, i1):
        if i0 > 0:
            raise ValueError("part failed")

    with single_blas_thread(), pytest.raises(ValueError, match="part failed"):
        _threads.parallel_for(np, 40, work, flops=1.0)


def test_intra_op_threads_cap(monkeypatch, caplog):
    monkeypatch.setenv("HETERO_EXEC_INTRA_OP_THREADS", "1")
    assert _threads.cores() == 1
    monkeypatch.setenv("HETERO_EXEC_INTRA_OP_THREADS", "lots")
    assert _threads.cores() >= 1
    assert "not a number" in caplog.text


def test_outside_a_run_it_is_plain_matmul():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(matmul(np, a, a.T), a @ a.T)


@pytest.mark.timeout(30)  # a stale pool would hang the child, and waitpid with it
@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="no fork here")
def test_a_forked_child_gets_its_own_pool(monkeypatch):
    """After a split has started the pool, a forked child splits too (on a new pool)."""
    import os

    monkeypatch.setattr(_threads, "PARALLEL_FLOPS", 0)
    a, b = np.ones((64, 8), np.float32), np.ones((8, 64), np.float32)
    with single_blas_thread():
        matmul(np, a, b)  # the pool exists now
        pid = os.fork()
        if pid == 0:  # the child: a split must finish, whatever happens exit
            code = 1
            try:
                with single_blas_thread():
                    code = 0 if matmul(np, a, b)[0, 0] == 8 else 2
            finally:
                os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_run_alone_gives_the_blas_its_width_and_overlapping_runs_hold_it(monkeypatch):
    import threading

    from hetero_exec.kernels._threads import intra_op_threads, run_threads

    before = blas_threads()
    if before is None:
        pytest.skip("no BLAS thread control here")
    monkeypatch.setattr(_threads, "cores", lambda: 2)
    # (with one pool a lone run holds the BLAS at one thread too: tests/kernels/test_blas_split.py)
    monkeypatch.setattr(_c_workers_split, "_split_on_c_workers", False)
    with run_threads():
        assert blas_threads() == 2  # alone: the BLAS splits the run's products itself
    with intra_op_threads(1), run_threads():
        assert blas_threads() == 1  # a run that asks for one thread
    inside, go, seen = threading.Event(), threading.Event(), []

    def other():
        with run_threads():
            inside.set()
            go.wait(10)

    with run_threads():
        t = threading.Thread(target=other)
        t.start()
        assert inside.wait(10)
        seen.append(blas_threads())  # two runs overlap: held at one thread
        with run_threads():  # nested on this thread: still one run
            seen.append(blas_threads())
        go.set()
        t.join(10)
        seen.append(blas_threads())  # held until the last run leaves
    assert seen == [1, 1, 1] and blas_threads() == before
    # overlapping runs do not split their products over the pool: the cores are busy
    a = np.ones((512, 512), np.float32)
    calls = []
    monkeypatch.setattr(_threads, "_product", lambda *args: calls.append(args))
    with run_threads():
        _threads.matmul(np, a, a)
    assert calls == []


_IDLE_CPU = r"""
import json, os, sys, threading, time
import numpy as np                       # numpy (and OpenBLAS) first, as in user scripts
import onnx.helper as h
from hetero_exec import InferenceSession
from hetero_exec.kernels import _threads
w = h.make_tensor("w", 1, [512, 512], np.ones(512 * 512, np.float32).tolist())
g = h.make_graph([h.make_node("MatMul", ["x", "w"], ["y"])], "g",
                 [h.make_tensor_value_info("x", 1, [512, 512])],
                 [h.make_tensor_value_info("y", 1, [512, 512])], [w])
sess = InferenceSession(h.make_model(g), providers=["cpu"])
x = np.ones((512, 512), np.float32)


def runnable_workers():
    # threads other than this one that are running or waiting for a core: a worker
    # spinning is one whether or not the scheduler lets it run, a sleeping one is not
    n = 0
    for tid in os.listdir("/proc/self/task"):
        if int(tid) == threading.get_native_id():
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:  # the thread ended
            continue
        n += state == "R"
    return n


idle = []
for _ in range(3):
    sess.run(None, {"x": x})
    c0 = time.process_time()
    time.sleep(0.15)
    idle.append(time.process_time() - c0)
# the workers' state 10-50 ms after a run: long after a 2**20-cycle spin (~0.4 ms of
# wall time: OpenBLAS counts its timeout in TSC cycles, whatever the load), well inside
# a 2**28-cycle one (~0.1 s). A sample the scheduler delayed out of that window is
# not counted; the run is repeated instead.
late = []
for _ in range(40):
    sess.run(None, {"x": x})
    end = time.perf_counter()
    time.sleep(0.01)
    n = runnable_workers()
    if 0.01 <= time.perf_counter() - end <= 0.05:
        late.append(n)
    if len(late) == 3:
        break
    time.sleep(0.15)  # the longest spin is over before the next run
print(json.dumps({"idle_cpu_s": min(idle), "runnable_late": late,
                  "blas": _threads.blas_threads(),
                  "timeout": os.environ.get("OPENBLAS_THREAD_TIMEOUT")}))
"""


def _idle_cpu(env_extra: dict) -> dict:
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items()
           if k not in ("OPENBLAS_THREAD_TIMEOUT", _threads.SPIN_ENV, "OPENBLAS_NUM_THREADS",
                        "OMP_NUM_THREADS", _threads.SPLIT_ENV)}
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", _IDLE_CPU], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _spinning(measured: dict) -> bool:
    """Whether OpenBLAS's workers were still spinning 10-50 ms after every run sampled
    (runnable, whether or not they had a core: load cannot hide it)."""
    late = measured["runnable_late"]
    assert late, f"no sample 10-50 ms after a run in 40 runs: {measured}"
    return all(n >= 1 for n in late)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="threads' states from /proc")
def test_idle_blas_workers_sleep_soon_after_a_run():
    """OpenBLAS's workers spin ~0.1 s (a whole core) after each threaded call; after ours
    they sleep within 2**20 cycles, so a sleeping driver burns (almost) no CPU. With the
    setting off the spin shows, which is what makes this test able to fail. (The runs
    here split their products on the BLAS's own threads: HETERO_EXEC_BLAS_SPLIT=0.)

    Load only lowers the CPU a spin burns (the cores are shared), so the spin is seen
    by the workers' state instead: still runnable 10-50 ms after a run, or asleep. The
    CPU an idle driver burns is checked where load can only make it smaller."""
    if _threads.cores() < 2:
        pytest.skip("one core: OpenBLAS runs no workers")
    own = {_threads.SPLIT_ENV: "0", "HETERO_EXEC_PACKED_GEMM": "0"}
    short = _idle_cpu(own)
    if short["blas"] is None or short["blas"] < 2:
        pytest.skip("no threaded, controllable OpenBLAS here")
    assert short["timeout"] == str(_threads.DEFAULT_SPIN_EXPONENT)
    assert short["idle_cpu_s"] < 0.03 and not _spinning(short), short
    spinning = _idle_cpu({**own, _threads.SPIN_ENV: "off"})
    assert spinning["timeout"] is None
    assert _spinning(spinning), spinning
    # the user's own setting wins over ours
    assert _spinning(_idle_cpu({**own, "OPENBLAS_THREAD_TIMEOUT": "28"}))
    # one pool (the default): gemm.c's workers take the products and spin 0.4 ms at most
    on_c_workers = _idle_cpu({})
    assert on_c_workers["idle_cpu_s"] < 0.03 and not _spinning(on_c_workers), on_c_workers
