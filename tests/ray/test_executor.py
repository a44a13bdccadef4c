"""RayExecutor on a real local Ray (the session-scoped ``ray_session``): outputs equal
the local executor's under mixed placement, typed errors, pipelining over stages,
transports, profiles and teardown."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from hetero_exec import InferenceSession
from hetero_exec.demo import demo_inputs, detector_model
from hetero_exec.errors import (
    DimMismatchError,
    DtypeMismatchError,
    KernelError,
    MissingInputError,
    RankMismatchError,
    UnknownInputError,
)
from tests.ray.helpers import actor_ids, eventually, live_placement_groups, live_stage_actors
from tests.ray.models import SKIP_PLACEMENT, cnn, gather_model, hand_build, mlp, options, skip_model

pytestmark = pytest.mark.ray

MIXED = [("sim-gpu", {"exclude_ops": ["Relu"]}), "cpu"]  # Relu on cpu: alternating segments


def assert_same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def mlp_pair(ray_session):
    model = mlp(layers=2)
    # segments: dev, cpu, dev, cpu; stages: the device with the cpu segment between,
    # then the last cpu segment on an actor of its own
    with InferenceSession(model, MIXED, hetero=True, executor="ray", max_inflight=4,
                          stages=[3]) as sess:
        yield sess, InferenceSession(model, ["cpu"])


def rand(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def test_mlp_mixed_placement_matches_local(mlp_pair):
    sess, local = mlp_pair
    assert sess.is_heterogeneous
    assert [s.provider_name for s in sess.placement.segments] == [
        "sim-gpu:0",
        "cpu",
        "sim-gpu:0",
        "cpu",
    ]
    assert [s.segments for s in sess.placement.stages] == [[0, 1, 2], [3]]
    assert len(sess.stage_actors) == 2
    for batch in (1, 5):
        feed = {"x": rand((batch, 32), batch)}
        assert_same(sess.run(None, feed), local.run(None, feed))


def test_typed_input_errors_before_dispatch(mlp_pair):
    sess, _ = mlp_pair
    runs = lambda: sum(s["runs"] for s in sess._executor.stage_stats().values())  # noqa: E731
    before = runs()
    x = rand((2, 32), 0)
    cases = [
        ({"x": x, "z": x}, UnknownInputError),
        ({}, MissingInputError),
        ({"x": x.astype(np.float64)}, DtypeMismatchError),
        ({"x": x[0]}, RankMismatchError),
        ({"x": rand((2, 31), 0)}, DimMismatchError),
    ]
    for feed, error in cases:
        with pytest.raises(error):
            sess.run(None, feed)
        with pytest.raises(error):  # raised by run_async itself, not through the future
            sess.run_async(None, feed)
    assert runs() == before  # nothing reached an actor
    assert sess.run(None, {"x": x})[0].shape == (2, 32)  # and the session keeps working


def test_concurrent_run_async_run_many_and_threads(mlp_pair):
    sess, local = mlp_pair
    feeds = [{"x": rand((3, 32), i)} for i in range(24)]
    want = [local.run(None, f) for f in feeds]
    futures = [sess.run_async(None, f) for f in feeds[:12]]
    for fut, w in zip(futures, want[:12]):
        assert_same(fut.result(timeout=60), w)
    for got, w in zip(sess.run_many(feeds[12:]), want[12:]):
        assert_same(got, w)
    results: dict[int, list] = {}

    def worker(i):
        results[i] = sess.run(["y"], feeds[i])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    assert sorted(results) == list(range(8))
    for i in range(8):
        assert_same(results[i], want[i])


def test_back_pressure_bounds_requests_in_flight(mlp_pair):
    sess, _ = mlp_pair
    ex = sess._executor
    futures = [sess.run_async(None, {"x": rand((2, 32), i)}) for i in range(16)]
    # run_async returned 16 times with max_inflight=4: it blocked until slots freed
    assert ex.inflight.free >= 0
    assert all(f.result(timeout=60)[0].shape == (2, 32) for f in futures)
    assert ex.inflight.free == ex.opts.max_inflight


def test_actor_error_names_segment_node_and_op(ray_session):
    graph, build = hand_build(gather_model(), ["sim-gpu:0", "cpu", "sim-gpu:0"])
    from actors.coordinator import RayExecutor

    ex = RayExecutor(graph, build, options(seam_transport="wire"))
    try:
        x = np.array([1, -2, 3, -4], np.float32)
        out = ex.run(["y"], {"x": x, "idx": np.array([0, 2])})
        np.testing.assert_array_equal(out[0], [2, 4])
        with pytest.raises(KernelError) as info:
            ex.run(["y"], {"x": x, "idx": np.array([0, 9])})
        err = info.value
        assert err.segment == "segment#1 (cpu)"
        assert err.node == 'graph/node#1 "pick"' and err.op == "ai.onnx::Gather"
        assert "segment#1 (cpu)" in str(err) and "Gather" in str(err)
        np.testing.assert_array_equal(ex.run(["y"], {"x": x, "idx": np.array([3, 1])})[0], [1, 1])
    finally:
        ex.close()


def test_run_many_groups_requests_and_a_failure_stays_alone(ray_session):
    from onnx.reference import ReferenceEvaluator

    model = gather_model()
    reference = ReferenceEvaluator(model)
    graph, build = hand_build(model, ["sim-gpu:0", "cpu", "sim-gpu:1"])
    from actors.coordinator import RayExecutor

    ex = RayExecutor(graph, build, options(stages=3, coalesce=4, max_inflight=8))
    try:
        n = 64
        feeds = [
            {
                "x": rand((4,), i),
                "idx": np.array([i % 4, 9 if i % 5 == 0 else (i + 1) % 4]),
            }
            for i in range(n)
        ]
        before = ex.stage_stats()
        got = ex.run_many(["y"], feeds, return_exceptions=True)
        after = ex.stage_stats()
        assert ex.group_size(n) == 4 and len(after) == 3
        for label in after:  # 16 tasks of 4 requests per stage, not 64 of 1
            assert after[label]["tasks"] - before[label]["tasks"] == n // 4
        # a request whose Gather fails goes on failing alone (the last stage passes the
        # failure on without running it), and the other requests of its group still answer
        failing = sum(1 for i in range(n) if i % 5 == 0)
        last = "stage#2 (sim-gpu:1)"
        assert after[last]["runs"] - before[last]["runs"] == n - failing
        for i, (f, out) in enumerate(zip(feeds, got)):
            if i % 5 == 0:
                assert isinstance(out, KernelError), out
                assert out.segment == "segment#1 (cpu)" and out.op == "ai.onnx::Gather"
            else:
                np.testing.assert_allclose(out[0], reference.run(None, f)[0], rtol=1e-6)
        with pytest.raises(KernelError):  # without return_exceptions: the first error raises
            ex.run_many(["y"], feeds[:20])
        assert ex.inflight.free == 8  # every place came back
        np.testing.assert_allclose(ex.run(["y"], feeds[1])[0], reference.run(None, feeds[1])[0])
    finally:
        ex.close()


def test_cnn_as_one_stage_with_profile(ray_session, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = cnn()
    local = InferenceSession(model, ["cpu"])
    with InferenceSession(
        model, MIXED, hetero=True, executor="ray", stages=1, enable_profiling=True
    ) as sess:
        # five segments alternating device and cpu, one actor: no Ray hop between them
        assert len(sess.placement.segments) == 5 and len(sess.stage_actors) == 1
        feeds = [{"x": rand((2, 3, 16, 16), i)} for i in range(4)]
        for got, f in zip(sess.run_many(feeds), feeds):
            assert_same(got, local.run(None, f))
        stats = sess._executor.stage_stats()["stage#0 (sim-gpu:0)"]
        assert stats["runs"] == 4 and len(stats["segments"]) == 5
        path = sess.end_profiling()
    trace = json.load(open(path))["traceEvents"]
    lanes = {e["tid"]: e["args"]["name"] for e in trace if e.get("name") == "thread_name"}
    assert lanes[0] == "driver" and len(lanes) == 2
    assert lanes[1].startswith("actor 0: stage#0 (sim-gpu:0): segment#0..segment#4")
    spans = [e for e in trace if e["ph"] == "X"]
    runs = [e for e in spans if e["cat"] == "segment"]
    assert len(runs) == 5 * 4 and {e["tid"] for e in runs} == {1}  # a span per segment run
    assert {e["args"]["provider"] for e in runs} == {"sim-gpu:0", "cpu"}
    assert sum(e["cat"] == "stage" for e in spans) == 4
    assert sum(e["cat"] == "request" for e in spans) == 4


def test_two_stages_profile_a_lane_each_with_seams(mlp_pair, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = mlp(layers=2)
    with InferenceSession(model, MIXED, hetero=True, executor="ray", stages=[3],
                          enable_profiling=True) as sess:
        sess.run_many([{"x": rand((2, 32), i)} for i in range(3)])
        trace = json.load(open(sess.end_profiling()))["traceEvents"]
    lanes = {e["tid"]: e["args"]["name"] for e in trace if e.get("name") == "thread_name"}
    assert len(lanes) == 3 and lanes[2].startswith("actor 1: stage#1 (cpu): segment#3")
    spans = [e for e in trace if e["ph"] == "X"]
    seams = [e for e in spans if e["cat"] == "seam"]
    assert seams and all(e["args"]["bytes"] > 0 for e in seams)
    assert {e["tid"] for e in spans if e["cat"] == "segment"} == {1, 2}


def test_values_inside_a_stage_never_leave_it_and_detector(ray_session):
    from actors.coordinator import RayExecutor

    graph, build = hand_build(skip_model(), SKIP_PLACEMENT)
    ex = RayExecutor(graph, build, options())
    try:
        # dev, dev, cpu, dev: one stage, whose only output is the graph's
        assert len(ex.slots) == 1 and ex.specs[0].outputs == ("y",)
        x = rand((3, 8), 1)
        want = np.tanh(x) + np.maximum(-x, 0)
        for got in ex.run_many(["y"], [{"x": x}] * 6):
            np.testing.assert_allclose(got[0], want, rtol=1e-6)
    finally:
        ex.close()
    model, feed = detector_model(), demo_inputs(batch=2)
    with InferenceSession(model, ["sim-gpu", "cpu"], hetero=True, executor="ray") as sess:
        assert sess.is_heterogeneous
        assert_same(sess.run(None, feed), InferenceSession(model, ["cpu"]).run(None, feed))


def test_one_node_seams_go_through_shared_memory_and_leave_nothing(
    ray_session, tmp_path, monkeypatch
):
    import os

    from actors.transport.shared_memory import SHM_DIR

    model = mlp(width=256, layers=2)
    local = InferenceSession(model, ["cpu"])
    feeds = [{"x": rand((128, 256), i)} for i in range(8)]  # 128 KiB seams and feeds
    monkeypatch.chdir(tmp_path)
    sess = InferenceSession(model, MIXED, hetero=True, executor="ray", enable_profiling=True,
                            stages=[3])
    ex = sess._executor
    try:
        assert ex.opts.seam_transport == "shared_memory"  # "auto" on a one-node cluster
        for got, f in zip(sess.run_many(feeds), feeds):
            # sums of 256 float32 products: the placed plan adds in another order
            np.testing.assert_allclose(got[0], local.run(None, f)[0], rtol=1e-4, atol=1e-4)
            assert got[0].flags.writeable  # the caller's own copy, not a shared buffer
        pool = ex.driver_seam.pool  # the driver's: it wrote the feeds
        assert pool.total > 0 and pool.held() == 0  # every request answered: all released
        total = pool.total
        got = sess.run(None, feeds[0])  # buffers are reused, not piled up
        np.testing.assert_allclose(got[0], local.run(None, feeds[0])[0], rtol=1e-4, atol=1e-4)
        assert pool.total == total
        trace = json.load(open(sess.end_profiling()))["traceEvents"]
        seams = [e for e in trace if e.get("cat") == "seam"]
        written = [e for e in seams if "written (shared memory)" in e["name"]]
        read = [e for e in seams if "read (shared memory)" in e["name"]]
        assert written and read
        assert all(e["args"]["bytes"] == 128 * 256 * 4 for e in written + read)
    finally:
        sess.close()
    assert not [f for f in os.listdir(SHM_DIR) if f.startswith(ex.seam_config.prefix)]  # nameless


def test_teardown_leaves_no_actors(ray_session):
    before = live_placement_groups()
    sess = InferenceSession(mlp(layers=1), MIXED, hetero=True, executor="ray", stages=2)
    ids = actor_ids(sess.stage_actors)
    assert len(ids) == 2 and ids <= live_stage_actors()
    assert len(live_placement_groups() - before) == 1
    sess.close()
    sess.close()  # idempotent
    assert eventually(lambda: not (ids & live_stage_actors()))
    assert eventually(lambda: live_placement_groups() <= before)


def test_run_async_callers_that_arrive_together_share_tasks(mlp_pair):
    sess, local = mlp_pair
    ex = sess._executor
    feeds = [{"x": rand((3, 32), 100 + i)} for i in range(6)]
    before = ex.stage_stats()
    with ex.results._drain_lock:  # another caller is dispatching: these queue behind it
        futures = [sess.run_async(None, f) for f in feeds[:4]]
        assert all(not f.done() for f in futures)
    ex.results._drain()  # what the dispatching caller does once it lets go
    for fut, f in zip(futures, feeds):
        assert_same(fut.result(timeout=60), local.run(None, f))
    after = ex.stage_stats()
    # max_inflight=4 bounds the group: the four queued requests went out as one task
    assert all(after[k]["tasks"] - before[k]["tasks"] == 1 for k in after)
    assert all(after[k]["runs"] - before[k]["runs"] == 4 for k in after)
    lone = sess.run_async(None, feeds[5])  # a lone caller dispatches at once
    assert_same(lone.result(timeout=60), local.run(None, feeds[5]))
    assert ex.inflight.free == ex.opts.max_inflight


def test_close_answers_every_request_in_flight(ray_session):
    import concurrent.futures

    from hetero_exec.errors import ActorError

    model = mlp(width=512, layers=2)
    big = {"x": rand((4096, 512), 0)}
    sess = InferenceSession(model, MIXED, hetero=True, executor="ray", max_inflight=12)
    ex = sess._executor
    futures = [sess.run_async(None, big) for _ in range(12)]
    sess.close()
    done, pending = concurrent.futures.wait(futures, timeout=60)
    assert not pending  # none left waiting forever
    errors = [f.exception() for f in futures if f.exception() is not None]
    assert errors and all(isinstance(e, ActorError) for e in errors)
    assert "in flight when the session closed" in str(errors[0])
    assert ex.inflight.free == 12
    with pytest.raises(ActorError, match="closed"):
        sess.run_async(None, big)


@pytest.mark.parametrize("mode", ["soft", "hard"])
def test_a_driver_that_exits_leaves_nothing_running(ray_session, mode):
    import os
    import subprocess
    import sys

    import ray
    from ray._private import state

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run(
        [sys.executable, "-m", "tests.ray.exit_driver_main",
         ray.get_runtime_context().gcs_address, mode],
        cwd=root,
        env={**os.environ, "PYTHONPATH": root},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(report["actors"]) == 2

    def gone() -> bool:
        pg = ray.util.placement_group_table().get(report["placement_group"], {})
        return pg.get("state", "REMOVED") == "REMOVED" and all(
            state.actors(a)["State"] == "DEAD" for a in report["actors"]
        )

    assert eventually(gone, timeout=30)


def test_compiled_graph_path_matches_local(ray_session):
    model = mlp(layers=1)
    local = InferenceSession(model, ["cpu"])
    with InferenceSession(model, MIXED, hetero=True, executor="ray", ray_compiled=True,
                          stages=2) as sess:
        assert sess._executor.compiled is not None and len(sess.stage_actors) == 2
        feeds = [{"x": rand((2, 32), i)} for i in range(12)]
        kept = [sess.run(None, f) for f in feeds]  # outputs kept alive must not pin the channels
        kept += sess.run_many(feeds)
        for got, f in zip(kept, feeds + feeds):
            assert_same(got, local.run(None, f))


def test_a_host_value_crossing_a_device_seam_on_ray(ray_session):
    """The in-process case of tests/placement/test_local_hetero.py on stage actors: a
    value the first device segment made on the host, read as data by the second."""
    from tests.placement._models import ort as ort_run
    from tests.placement.test_local_hetero import _host_value_across_a_seam

    m = _host_value_across_a_seam()
    x = rand((3, 4), 1)
    with InferenceSession(m, [("sim-gpu", {"exclude_ops": ["Softmax"]}), "cpu"], hetero=True,
                          executor="ray") as sess:
        got = sess.run(None, {"x": x})
    np.testing.assert_allclose(got[0], ort_run(m, {"x": x})[0], rtol=1e-5, atol=1e-6)
