"""Ray Serve over the Open Inference Protocol: real apps on 127.0.0.1 (on the session's
``ray_session``), driven over HTTP by tritonclient and by our client; every bad request
answered with a 4xx naming what is wrong, and a good request after each; the CLI."""

from __future__ import annotations

import http.client
import json
import threading

import msgpack
import numpy as np
import onnx
import pytest

from actors.client import AsyncInferenceClient, InferenceClient, InferenceServerError
from actors.transport.wire import encode_request, encode_tensor
from tests.ray.helpers import eventually, free_port, live_placement_groups, live_stage_actors
from tests.ray.models import gather_model, mlp

# a hang (a replica that cannot be scheduled) fails instead of blocking the suite
pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

WIDTH = 16
LIMIT = 1 << 16  # the main app's body limit, small enough to test
MIXED = [("sim-gpu", {"exclude_ops": ["Relu"]}), "cpu"]
CPU = 0.25  # what each replica reserves


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve")
    paths = {"mlp": str(d / "mlp.onnx"), "mixed": str(d / "mixed.onnx"),
             "gather": str(d / "gather.onnx"), "stages": str(d / "stages.onnx")}
    onnx.save(mlp(WIDTH, layers=2), paths["mlp"])
    onnx.save(mlp(WIDTH, layers=2, seed=1), paths["mixed"])
    onnx.save(gather_model(), paths["gather"])
    onnx.save(mlp(WIDTH, layers=2, seed=2), paths["stages"])
    return paths


@pytest.fixture(scope="module")
def server(ray_session, models):
    """Four apps on one Serve: mlp at /, a mixed plan run in its replica at /mixed,
    gather at /gather, a two-stage mixed plan on stage actors its replica drives at
    /stages. Serve is shut down at the end, so later tests find the Ray as it was.
    Replicas take a quarter CPU each: the session's Ray may have only 2 CPUs (the
    embedded default sizes it to the machine when a test started it first)."""
    from ray import serve

    from actors.serve import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run_many([
            serve.RunTarget(build_app(models["mlp"], ["cpu"], max_batch_size=16,
                                      max_request_bytes=LIMIT, num_cpus=CPU),
                            name="mlp", route_prefix="/"),
            serve.RunTarget(build_app(models["mixed"], MIXED, hetero=True, name="mixed",
                                      num_cpus=CPU), name="mixed", route_prefix="/mixed"),
            serve.RunTarget(build_app(models["gather"], name="gather", num_cpus=CPU),
                            name="gather", route_prefix="/gather"),
            serve.RunTarget(build_app(models["stages"], MIXED, hetero=True, stages=2,
                                      name="stages", num_cpus=CPU),
                            name="stages", route_prefix="/stages"),
        ])
        yield f"127.0.0.1:{port}"
    finally:
        serve.shutdown()


def ort(path, feed, outputs=None):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"]).run(outputs, feed)


def rand(rows, seed=0):
    return np.random.default_rng(seed).standard_normal((rows, WIDTH)).astype(np.float32)


def close(got, want):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# -- tritonclient -----------------------------------------------------------------------


def test_tritonclient_health_metadata_and_infer(server, models):
    import tritonclient.http as th

    tc = th.InferenceServerClient(server)
    assert tc.is_server_live() and tc.is_server_ready() and tc.is_model_ready("mlp")
    assert "binary_tensor_data" in tc.get_server_metadata()["extensions"]
    meta = tc.get_model_metadata("mlp")
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, WIDTH]}]
    assert meta["placement"]["providers"] == ["cpu"] and "segment#0 on cpu" in \
        meta["placement"]["report"]
    x = rand(3)
    for binary in (True, False):  # the binary tensor extension, and plain JSON
        inp = th.InferInput("x", list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=binary)
        out = th.InferRequestedOutput("y", binary_data=binary)
        r = tc.infer("mlp", [inp], outputs=[out], request_id="r1")
        close(r.as_numpy("y"), ort(models["mlp"], {"x": x})[0])
        assert r.get_response()["id"] == "r1"
    inp = th.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    close(tc.infer("mlp", [inp]).as_numpy("y"), ort(models["mlp"], {"x": x})[0])  # no outputs


def test_tritonclient_sees_errors_as_its_own_exceptions(server):
    import tritonclient.http as th
    from tritonclient.utils import InferenceServerException

    tc = th.InferenceServerClient(server)
    inp = th.InferInput("x", [2, WIDTH], "FP64")
    inp.set_data_from_numpy(np.zeros((2, WIDTH)))
    with pytest.raises(InferenceServerException) as e:
        tc.infer("mlp", [inp])
    assert e.value.status() == "400" and "datatype FP64, the model takes FP32" in e.value.message()
    assert not tc.is_model_ready("nope")


# -- our client ------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["msgpack", "binary", "json"])
def test_our_client_each_protocol(server, models, protocol):
    client = InferenceClient(f"http://{server}", "mlp", protocol=protocol)
    assert client.live() and client.ready() and client.model_ready()
    x = rand(4, seed=2)
    close(client.infer(x)["y"], ort(models["mlp"], {"x": x})[0])
    close(client.infer({"x": x}, outputs=["y"])["y"], ort(models["mlp"], {"x": x})[0])
    close(client.infer(x.tolist())["y"], ort(models["mlp"], {"x": x})[0])  # lists take FP32


def test_mixed_plan_app_reports_its_placement(server, models):
    client = InferenceClient(f"http://{server}/mixed", "mixed")
    placement = client.model_metadata()["placement"]
    assert placement["heterogeneous"] and placement["providers"] == ["sim-gpu:0", "cpu"]
    assert [s["provider"] for s in placement["plan"]["segments"]] == [
        "sim-gpu:0", "cpu", "sim-gpu:0", "cpu"]
    x = rand(5, seed=3)
    close(client.infer(x)["y"], ort(models["mixed"], {"x": x})[0])


def test_multi_stage_replica_drives_stage_actors_in_its_placement_group(server, models):
    import ray
    from ray import serve

    from actors.serve import replica_resources

    res = replica_resources(models["stages"], MIXED, {"hetero": True, "stages": 2}, CPU)
    assert res.placement_group_bundles == [{"CPU": CPU}, {"CPU": 0.25, "GPU": 1.0},
                                           {"CPU": 0.25}]
    assert res.session_options["placement_group"] == "current"
    client = InferenceClient(f"http://{server}/stages", "stages")
    placement = client.model_metadata()["placement"]
    assert placement["heterogeneous"] and "stage" in placement["report"]
    stage_actors = live_stage_actors()
    assert len(stage_actors) >= 2
    bundles = [pg["bundles"] for pg in ray.util.placement_group_table().values()
               if pg["state"] == "CREATED"]
    assert [{"CPU": CPU}, {"CPU": 0.25, "GPU": 1.0}, {"CPU": 0.25}] in [
        list(b.values()) for b in bundles]
    for rows in (1, 3, 8):
        x = rand(rows, seed=rows)
        close(client.infer(x)["y"], ort(models["stages"], {"x": x})[0])
    pgs = live_placement_groups()
    serve.delete("stages")  # the replica goes, and its stage actors and group with it
    assert eventually(lambda: not (live_stage_actors() & stage_actors), 60)
    assert eventually(lambda: len(live_placement_groups() & pgs) < len(pgs), 60)


def test_concurrent_clients_are_batched_and_each_gets_its_own_rows(server, models):
    """16 threads, requests of 1-4 rows: stacked along the batch dim, cut back right."""
    errors, done = [], []
    client = InferenceClient(f"http://{server}", "mlp")
    before = client.model_stats()

    def worker(k):
        try:
            for i in range(6):
                x = rand(1 + (k + i) % 4, seed=100 * k + i)
                close(client.infer(x)["y"], ort(models["mlp"], {"x": x})[0])
                done.append(1)
        except Exception as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:3]
    assert len(done) == 96
    after = client.model_stats()
    requests = after["request_count"] - before["request_count"]
    runs = after["execution_count"] - before["execution_count"]
    assert requests == 96 and runs < requests, (requests, runs)  # some were stacked


def test_async_client(server, models):
    import asyncio

    async def main():
        client = AsyncInferenceClient(f"http://{server}", "mlp")
        xs = [rand(2, seed=s) for s in range(8)]
        outs = await asyncio.gather(*(client.infer(x) for x in xs))
        for x, out in zip(xs, outs):
            close(out["y"], ort(models["mlp"], {"x": x})[0])

    asyncio.run(main())


# -- every bad request, and the server keeps serving ---------------------------------------


def post(server, path, body, headers=None):
    host, port = server.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", path, body=body, headers=headers or {"content-type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, data


def tensor(data, shape=(1, WIDTH), datatype="FP32", name="x"):
    return {"name": name, "shape": list(shape), "datatype": datatype, "data": data}


ONE = [0.5] * WIDTH
MSGPACK = {"content-type": "application/msgpack"}


def binary_body(size, payload):
    """The binary tensor extension: a JSON header, then ``payload`` raw bytes."""
    head = json.dumps({"inputs": [{"name": "x", "shape": [1, WIDTH], "datatype": "FP32",
                                   "parameters": {"binary_data_size": size}}]}).encode()
    return head + b"\0" * payload, {"inference-header-content-length": str(len(head))}


def twice_named():
    """A msgpack request whose inputs map holds 'x' twice (msgpack allows it)."""
    frame = msgpack.unpackb(encode_tensor(np.ones((1, WIDTH), np.float32)))
    one = msgpack.packb("x") + msgpack.packb(frame, use_bin_type=True)
    head = msgpack.packb({"v": 1, "inputs": {}})  # ends with the empty map, 0x80
    return head[:-1] + b"\x82" + one + one


BAD_REQUESTS = [
    ("malformed JSON", "/v2/models/mlp/infer", b"{not json", None, 400, "malformed JSON"),
    ("not an object", "/v2/models/mlp/infer", b"[1]", None, 400, "JSON object"),
    ("no inputs", "/v2/models/mlp/infer", b'{"inputs": []}', None, 400, "non-empty list"),
    ("malformed msgpack", "/v2/models/mlp/infer", b"\xc1garbage", MSGPACK, 400,
     "malformed msgpack request"),
    ("shape [-1] frame", "/v2/models/mlp/infer",
     msgpack.packb({"v": 1, "inputs": {"x": {"v": 1, "dtype": "float32", "shape": [-1],
                                              "data": b"\0" * 64}}}), MSGPACK, 400,
     "non-negative"),
    ("unknown model", "/v2/models/nope/infer", json.dumps({"inputs": [tensor(ONE)]}), None,
     404, "unknown model 'nope'"),
    ("unknown version", "/v2/models/mlp/versions/7/infer",
     json.dumps({"inputs": [tensor(ONE)]}), None, 404, "unknown version '7'"),
    ("unknown input", "/v2/models/mlp/infer",
     json.dumps({"inputs": [tensor(ONE), tensor(ONE, name="z")]}), None, 400,
     "unknown input 'z'"),
    ("duplicate input", "/v2/models/mlp/infer",
     json.dumps({"inputs": [tensor(ONE), tensor(ONE)]}), None, 400, "duplicate input 'x'"),
    ("duplicate input (msgpack)", "/v2/models/mlp/infer", twice_named(), MSGPACK, 400,
     "duplicate key 'x'"),
    ("missing input", "/gather/v2/models/gather/infer",
     json.dumps({"inputs": [tensor([1, 2, 3, 4], shape=[4])]}), None, 400,
     "missing required input 'idx'"),
    ("wrong datatype", "/v2/models/mlp/infer",
     json.dumps({"inputs": [tensor(list(range(WIDTH)), datatype="INT64")]}), None, 400,
     "datatype INT64, the model takes FP32"),
    ("unknown datatype", "/v2/models/mlp/infer",
     json.dumps({"inputs": [tensor(ONE, datatype="FP33")]}), None, 400, "unknown datatype 'FP33'"),
    ("wrong rank", "/v2/models/mlp/infer",
     json.dumps({"inputs": [tensor(ONE, shape=[WIDTH])]}), None, 400, "rank mismatch"),
    ("wrong static dim", "/v2/models/mlp/infer",
     json.dumps({"inputs": [tensor([0.5] * 8, shape=[1, 8])]}), None, 400, "static dim mismatch"),
    ("negative dim", "/v2/models/mlp/infer",
     json.dumps({"inputs": [tensor(ONE, shape=[-1, WIDTH])]}), None, 400, "non-negative"),
    ("data shorter than shape", "/v2/models/mlp/infer",
     json.dumps({"inputs": [tensor(ONE[:-1])]}), None, 400, "holds 16 elements, 'data' has 15"),
    ("floats for INT64", "/gather/v2/models/gather/infer",
     json.dumps({"inputs": [tensor([1, 2, 3, 4], shape=[4]),
                            tensor([0.5, 1], shape=[2], datatype="INT64", name="idx")]}),
     None, 400, "non-integer"),
    ("strings for FP32", "/v2/models/mlp/infer",
     json.dumps({"inputs": [tensor(["a"] * WIDTH)]}), None, 400, "must be numbers"),
    ("binary size past the body", "/v2/models/mlp/infer", *binary_body(64, 10), 400,
     "runs past"),
    ("binary size not matching shape", "/v2/models/mlp/infer", *binary_body(60, 60), 400,
     "needs 64 bytes, got 60"),
    ("binary bytes left over", "/v2/models/mlp/infer", *binary_body(64, 70), 400,
     "6 bytes of binary data"),
    ("header length past the body", "/v2/models/mlp/infer", b"{}",
     {"inference-header-content-length": "99"}, 400, "Inference-Header-Content-Length"),
    ("unknown output", "/v2/models/mlp/infer",
     json.dumps({"inputs": [tensor(ONE)], "outputs": [{"name": "q"}]}), None, 400,
     "unknown output 'q'"),
    ("body too large", "/v2/models/mlp/infer", b"{" + b" " * LIMIT + b"}", None, 413,
     f"exceeds the limit of {LIMIT} bytes"),
    ("frame too large", "/v2/models/mlp/infer",
     encode_request({"x": np.ones((LIMIT // 64, WIDTH), np.float32)}), MSGPACK, 413,
     f"exceeds the limit of {LIMIT} bytes"),
    ("no such route", "/v3/x", b"", None, 404, "no route"),
]


def _good(server, models, i):
    x = rand(2, seed=1000 + i)
    close(InferenceClient(f"http://{server}", "mlp").infer(x)["y"],
          ort(models["mlp"], {"x": x})[0])


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request_is_named_and_the_server_keeps_serving(server, models, case):
    what, path, body, headers, status, says = case
    if isinstance(body, str):
        body = body.encode()
    if headers is not None and "content-type" not in headers:
        headers = {"content-type": "application/octet-stream", **headers}
    got, data = post(server, path, body, headers)
    assert got == status, (what, got, data[:300])
    error = json.loads(data)["error"]
    assert says in error, (what, error)
    _good(server, models, BAD_REQUESTS.index(case))


def test_wrong_method_and_unknown_model_metadata(server, models):
    host, port = server.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("GET", "/v2/models/mlp/infer")
    resp = conn.getresponse()
    assert resp.status == 405 and "use POST" in json.loads(resp.read())["error"]
    conn.request("GET", "/v2/models/other")
    resp = conn.getresponse()
    assert resp.status == 404 and "unknown model 'other'" in json.loads(resp.read())["error"]
    _good(server, models, 0)


def test_a_fault_in_the_replica_is_a_5xx_and_it_keeps_serving(server, models):
    client = InferenceClient(f"http://{server}/gather", "gather")
    x = np.arange(4, dtype=np.float32) - 1
    with pytest.raises(InferenceServerError) as e:  # index 9 of 4: the Gather kernel fails
        client.infer({"x": x, "idx": np.array([0, 9], np.int64)})
    assert e.value.status == 500 and "KernelError" in e.value.message and "Gather" in \
        e.value.message
    got = client.infer({"x": x, "idx": np.array([3, 0], np.int64)})["y"]
    close(got, ort(models["gather"], {"x": x, "idx": np.array([3, 0], np.int64)})[0])
    with pytest.raises(InferenceServerError) as e:  # our client refuses nothing itself
        client.infer({"x": x.astype(np.float64), "idx": np.array([0, 1], np.int64)})
    assert e.value.status == 400


def test_msgpack_body_carries_strings_and_frames(server):
    """A raw msgpack frame (what any language's msgpack library can write)."""
    body = msgpack.packb({"v": 1, "inputs": {"x": msgpack.unpackb(
        encode_tensor(np.ones((1, WIDTH), np.float32)))}, "outputs": ["y"], "id": "m1"})
    status, data = post(server, "/v2/models/mlp/infer", body, MSGPACK)
    reply = msgpack.unpackb(data)
    assert status == 200 and reply["id"] == "m1" and list(reply["outputs"]) == ["y"]


# -- the CLI ------------------------------------------------------------------------------------
