"""The Serve app's pieces that need no cluster: dynamic batching's grouping, the app
builder's arguments and a replica's resources, the protocol codec (pure: no ray.init)."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from onnx import TensorProto, helper

from actors.batching import BatchRule, Job, RunQueue, run_jobs
from actors.oip import (
    HEADER_LENGTH,
    ProtocolError,
    infer_request_body,
    infer_response,
    parse_infer_request,
    parse_infer_response,
)
from actors.serve import app, build_app, replica_resources
from hetero_exec import InferenceSession
from hetero_exec.errors import DtypeMismatchError
from tests.ray.models import gather_model, mlp


def relu_model():
    """y = Relu(x) with x [N, M]: the trailing dim varies between requests too."""
    g = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "M"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "M"])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


class Recording:
    """A real session that also records the shapes each run was fed."""

    def __init__(self, session):
        self.session, self.runs = session, []

    def run(self, names, feed):
        self.runs.append({k: v.shape for k, v in feed.items()})
        return self.session.run(names, feed)

    def __getattr__(self, name):
        return getattr(self.session, name)


def test_requests_of_different_shapes_are_never_stacked_together():
    sess = Recording(InferenceSession(relu_model()))
    rule = BatchRule(sess)
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(s).astype(np.float32) for s in [(1, 2), (2, 3), (3, 2), (1, 3)]]
    results = run_jobs(sess, [rule.job({"x": x}, ["y"]) for x in xs])
    for x, out in zip(xs, results):
        np.testing.assert_array_equal(out[0], np.maximum(x, 0))
    assert sorted(r["x"] for r in sess.runs) == [(3, 3), (4, 2)]  # one run per trailing shape


def test_a_failing_request_fails_alone():
    sess = InferenceSession(mlp(8, layers=1))
    rule = BatchRule(sess)
    good = np.ones((2, 8), np.float32)
    jobs = [rule.job({"x": good}, ["y"]), rule.job({"x": good.astype(np.float64)}, ["y"]),
            rule.job({"x": good[:1]}, ["y"])]
    results = run_jobs(sess, jobs)
    assert isinstance(results[1], DtypeMismatchError)
    assert results[0][0].shape == (2, 8) and results[2][0].shape == (1, 8)


def test_batch_dim_only_when_inputs_and_outputs_share_it():
    assert BatchRule(InferenceSession(mlp(8, layers=1))).symbol == "N"
    assert BatchRule(InferenceSession(gather_model())).symbol is None  # static shapes


def test_app_builder_reads_serve_run_arguments(tmp_path):
    import onnx

    path = tmp_path / "tiny.onnx"
    onnx.save(mlp(8, layers=1), str(path))
    application = app({"model": str(path), "providers": "sim-gpu,cpu", "max_batch_size": "8",
                       "batch_wait_timeout_s": "0.001", "name": "tiny"})
    dep = application._bound_deployment
    spec = dep.init_args[0]
    assert dep.name == "tiny" and spec.max_batch_size == 8 and spec.batch_wait_timeout_s == 0.001
    assert spec.providers == ["sim-gpu", "cpu"]
    assert dep.ray_actor_options["num_gpus"] == 1  # the plan runs on sim-gpu:0, in process
    with pytest.raises(ValueError, match="needs model=PATH"):
        app({})


def test_replica_resources_come_from_the_plan():
    import ray

    started_before = ray.is_initialized()  # another test file's session Ray, if any
    m = mlp(8, layers=1)
    assert replica_resources(m, ["cpu"], {}).ray_actor_options == {"num_cpus": 1, "num_gpus": 0}
    # a fallback to cpu (hetero off, Relu excluded): the replica needs no GPU
    excl = [("sim-gpu", {"exclude_ops": ["Relu"]}), "cpu"]
    assert replica_resources(m, excl, {}).ray_actor_options["num_gpus"] == 0
    # one stage (given, so no Ray is asked for the hop cost): run in the replica's process
    mixed = replica_resources(m, excl, {"hetero": True, "stages": 1})
    assert mixed.ray_actor_options["num_gpus"] == 1 and mixed.placement_group_bundles is None
    # two stages: on stage actors in the replica's placement group, bundle 0 its own
    staged = replica_resources(m, excl, {"hetero": True, "stages": [1]}, num_cpus=0.5)
    assert staged.placement_group_bundles == [{"CPU": 0.5}, {"CPU": 0.25, "GPU": 1.0},
                                              {"CPU": 0.25}]
    assert staged.session_options == {"hetero": True, "stages": [1], "executor": "ray",
                                      "placement_group": "current"}
    # a replica that runs its plan itself splits a run over the CPUs it reserved
    assert replica_resources(m, ["cpu"], {}).session_options["intra_op_num_threads"] == 1
    assert replica_resources(m, ["cpu"], {}, num_cpus=2).session_options == \
        {"intra_op_num_threads": 2}
    assert replica_resources(m, ["cpu"], {"intra_op_num_threads": 3}, num_cpus=2)\
        .session_options["intra_op_num_threads"] == 3
    assert build_app(m, ["cpu"]).\
        _bound_deployment._deployment_config.max_ongoing_requests >= 64
    with pytest.raises(ValueError, match="max_concurrent_runs must be at least 1"):
        build_app(m, ["cpu"], max_concurrent_runs=0)
    assert ray.is_initialized() == started_before, "planning a replica must not start a Ray here"


def test_protocol_roundtrip_and_refusals():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    s = np.array(["a", "héllo"], dtype=object)
    body, headers = infer_request_body([("x", x), ("s", s)], ["y"], binary=True, id="7")
    req = parse_infer_request(body, headers["content-type"], headers[HEADER_LENGTH])
    assert req.id == "7" and [o.name for o in req.outputs] == ["y"] and req.outputs[0].binary
    np.testing.assert_array_equal(req.inputs[0][1], x)
    assert req.inputs[1][1].tolist() == ["a", "héllo"]
    for binary in (True, False):
        req.binary_output, req.outputs = binary, None
        out, resp_headers = infer_response("m", "1", req, [("y", x), ("s", s)])
        tensors, head = parse_infer_response(out, resp_headers["content-type"],
                                             resp_headers.get(HEADER_LENGTH))
        assert head["model_name"] == "m" and head["id"] == "7"
        np.testing.assert_array_equal(tensors["y"], x)
        assert tensors["s"].tolist() == ["a", "héllo"]
    bad = [
        ({"inputs": [{"name": "x", "shape": [2], "datatype": "UINT8", "data": [1, 300]}]},
         "out of range for UINT8"),
        ({"inputs": [{"name": "x", "shape": [2], "datatype": "BOOL", "data": [1, 0]}]},
         "BOOL data holds"),
        ({"inputs": [{"name": "x", "shape": [2, 2], "datatype": "FP32", "data": [[1, 2], [3]]}]},
         "holds 4 elements, 'data' has 3"),
        ({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32"}]}, "no 'data'"),
        ({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}],
          "outputs": [{"name": "y", "parameters": {"classification": 3}}]}, "classification"),
        ({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}],
          "outputs": [{"name": "y"}, {"name": "y"}]}, "requested twice"),
        ({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}], "id": 5},
         "'id' must be a string"),
    ]
    for obj, says in bad:
        with pytest.raises(ProtocolError) as e:
            parse_infer_request(json.dumps(obj).encode(), "application/json")
        assert says in str(e.value) and e.value.status == 400, (obj, str(e.value))
    nested = {"inputs": [{"name": "x", "shape": [2, 2], "datatype": "INT32",
                          "data": [[1, 2], [3, 4]]}]}
    assert parse_infer_request(json.dumps(nested).encode(), None).inputs[0][1].tolist() == [
        [1, 2], [3, 4]]


def _queue_jobs(rows_and_keys):
    return [Job({"x": np.full((r, 2), i, np.float32)}, ["y"], r, (k,))
            for i, (r, k) in enumerate(rows_and_keys)]


def test_run_queue_stacks_what_waits_while_a_run_is_busy():
    runs: list[list[int]] = []
    gate = asyncio.Event()

    async def run(jobs):
        runs.append([int(j.feed["x"][0, 0]) for j in jobs])
        if len(runs) == 1:
            await gate.wait()  # the first run is busy while the others arrive
        return [[j.feed["x"] + 1] for j in jobs]

    async def main():
        q = RunQueue(run, max_rows=4)
        jobs = _queue_jobs([(1, "a"), (2, "a"), (1, "b"), (1, "a"), (2, "a"), (1, "a")])
        jobs.append(Job({"x": np.full((3, 2), 6, np.float32)}, ["y"], None, ("a",)))
        first = asyncio.ensure_future(q.submit(jobs[0]))
        await asyncio.sleep(0)
        rest = [asyncio.ensure_future(q.submit(j)) for j in jobs[1:]]
        await asyncio.sleep(0)
        assert q.busy == 1 and runs == [[0]]  # an idle queue ran the lone request at once
        gate.set()
        results = await asyncio.gather(first, *rest)
        return jobs, results, q

    jobs, results, q = asyncio.run(main())
    # one key and at most 4 rows a run, in arrival order; the unstackable job alone
    assert runs == [[0], [1, 3], [2], [4, 5], [6]] and q.runs == 5
    for job, result in zip(jobs, results):
        np.testing.assert_array_equal(result[0], job.feed["x"] + 1)


def test_run_queue_answers_a_broken_run_and_keeps_running():
    calls = []

    async def run(jobs):
        calls.append(len(jobs))
        if len(calls) == 1:
            raise RuntimeError("the pool is gone")
        return [["ok"] for _ in jobs]

    async def main():
        q = RunQueue(run, max_rows=8, runners=2)
        broken = await q.submit(_queue_jobs([(1, "a")])[0])
        after = await asyncio.gather(*(q.submit(j) for j in _queue_jobs([(1, "a")] * 3)))
        return broken, after

    broken, after = asyncio.run(main())
    assert isinstance(broken, RuntimeError) and "pool is gone" in str(broken)
    assert after == [["ok"]] * 3


def test_run_queue_wait_fills_a_batch():
    runs = []

    async def run(jobs):
        runs.append(len(jobs))
        return [[None] for _ in jobs]

    async def main():
        q = RunQueue(run, max_rows=8, wait_s=0.05)
        jobs = _queue_jobs([(1, "a")] * 3)
        first = asyncio.ensure_future(q.submit(jobs[0]))
        await asyncio.sleep(0.01)  # within the wait: joins the first request's run
        await asyncio.gather(first, *(q.submit(j) for j in jobs[1:]))

    asyncio.run(main())
    assert runs == [3]
