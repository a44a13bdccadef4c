"""Ray Serve over the Open Inference Protocol: latency and throughput, side by side.

    python bench/bench_serve.py                       # bench/models.py's mlp, 3 rounds
    python bench/bench_serve.py --rounds 5 --requests 300 --json bench/results/serve.json

Five targets serve the same model, one request of ``--rows`` rows at a time, from
1, 8 and 32 concurrent clients (threads with keep-alive connections, msgpack bodies):

* ``in-process``: our session's ``run`` called from the client threads (no HTTP);
* ``ours``: ``actors.serve.build_app`` with dynamic batching (``max_batch_size`` 32);
* ``ours-nobatch``: the same app with ``max_batch_size=1``;
* ``ort-serve``: a hand-written Serve deployment over onnxruntime (msgpack in and out,
  no batching: what one writes by hand);
* ``serve-floor``: a Serve deployment that reads the request and returns a fixed reply,
  no model: what any Serve app pays for the HTTP proxy and the hop to its replica.

All apps run at once on one local Ray; each round measures every target at every
concurrency in turn, so load from other jobs hits them alike; the tables give the
medians over rounds of each round's p50, p99 and requests/s. BLAS and onnxruntime
run one thread per replica (``--blas-threads``), since on a shared 2-core machine
more threads per process mostly fight each other.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import threading
import time
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wide_mlp(width: int, layers: int = 4):
    """``layers`` dense layers of ``width`` with Relu, input x [N, width]: at batch 1 each
    run reads every weight once (memory-bound), so stacking requests pays."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i in range(layers):
        w = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"w{i}"),
                  numpy_helper.from_array(np.zeros(width, np.float32), f"b{i}")]
        nodes += [helper.make_node("Gemm", [x, f"w{i}", f"b{i}"], [f"h{i}"]),
                  helper.make_node("Relu", [f"h{i}"], [f"r{i}" if i < layers - 1 else "y"])]
        x = f"r{i}"
    g = helper.make_graph(nodes, "wide_mlp",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", width])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", width])],
                          inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def chain_model(n: int, width: int = 16):
    """``n`` element-wise ops (Add, Mul, Relu in turn) on x [N, width]: a run costs about
    the same for 1 row or 32 (per-op overhead, as kernel launches are on a GPU)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    inits = [numpy_helper.from_array(np.full(width, 0.5, np.float32), "add"),
             numpy_helper.from_array(np.full(width, 0.999, np.float32), "mul")]
    nodes, x = [], "x"
    for i in range(n):
        out = "y" if i == n - 1 else f"t{i}"
        op, ins = [("Add", [x, "add"]), ("Mul", [x, "mul"]), ("Relu", [x])][i % 3]
        nodes.append(helper.make_node(op, ins, [out]))
        x = out
    g = helper.make_graph(nodes, "chain",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", width])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", width])],
                          inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def ort_deployment(model_path: str, threads: int):
    """The hand-written baseline: onnxruntime behind a plain Serve deployment."""
    from ray import serve

    @serve.deployment(max_ongoing_requests=64, ray_actor_options={"num_cpus": 1},
                      logging_config={"enable_access_log": False})
    class OrtModel:
        def __init__(self, model: str):
            import onnxruntime as ort

            so = ort.SessionOptions()
            so.intra_op_num_threads = threads
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
            self.sess = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])

        async def __call__(self, request):
            import asyncio

            from starlette.responses import Response

            from actors.transport.wire import decode_request, encode_response

            msg = decode_request(await request.body())
            outs = await asyncio.to_thread(self.sess.run, None, msg.tensors)
            names = [o.name for o in self.sess.get_outputs()]
            return Response(encode_response(dict(zip(names, outs)), "ort"),
                            media_type="application/msgpack")

    return OrtModel.bind(model_path)


def floor_deployment(reply: bytes):
    """Serve's own floor: a deployment that reads the request and returns a fixed reply
    (no decoding, no model), which every Serve app pays on top of its work."""
    from ray import serve

    @serve.deployment(max_ongoing_requests=64, ray_actor_options={"num_cpus": 1},
                      logging_config={"enable_access_log": False})
    class Floor:
        async def __call__(self, request):
            from starlette.responses import Response

            await request.body()
            return Response(reply, media_type="application/msgpack")

    return Floor.bind()


def load(fn: Callable[[], Any], concurrency: int, requests: int) -> dict[str, float]:
    """p50/p99 latency (ms) and requests/s of ``requests`` calls from ``concurrency`` threads."""
    per_thread = max(requests // concurrency, 2)
    lat: list[float] = []
    lock = threading.Lock()
    start = threading.Barrier(concurrency + 1)

    def worker():
        mine = []
        start.wait()
        for _ in range(per_thread):
            t = time.perf_counter()
            fn()
            mine.append(time.perf_counter() - t)
        with lock:
            lat.extend(mine)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    lat.sort()
    return {"p50_ms": lat[len(lat) // 2] * 1e3, "p99_ms": lat[int(len(lat) * 0.99)] * 1e3,
            "rps": len(lat) / wall}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="mlp", help="a bench/models.py model (default mlp)")
    ap.add_argument("--width", type=int, default=0,
                    help="serve a 4-layer mlp of this width instead of --model")
    ap.add_argument("--chain", type=int, default=0,
                    help="serve a chain of this many element-wise ops instead of --model")
    ap.add_argument("--rows", type=int, default=1, help="rows per request")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=200, help="requests per measurement")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--blas-threads", type=int, default=1)
    ap.add_argument("--ingress", choices=("haproxy", "proxy"), default="haproxy",
                    help="Serve's HTTP ingress: HAProxy, as on a Ray that hetero-exec starts "
                         "(actors/connect.py serve_ingress_env), or Serve's own proxy actor")
    ap.add_argument("--json", help="write every round's numbers here")
    args = ap.parse_args(argv)
    env = {"OPENBLAS_NUM_THREADS": str(args.blas_threads), "OMP_NUM_THREADS": str(args.blas_threads),
           "MKL_NUM_THREADS": str(args.blas_threads)}
    os.environ.update(env)  # before numpy loads its BLAS

    import numpy as np
    import ray
    from ray import serve

    from actors.client import InferenceClient
    from actors.serve import build_app
    from bench.models import MODELS, inputs
    from hetero_exec import InferenceSession

    if args.chain:
        model = chain_model(args.chain).SerializeToString()
        feed = {"x": np.random.default_rng(0).standard_normal((args.rows, 16)).astype(np.float32)}
        args.model = f"chain{args.chain}"
    elif args.width:
        model = wide_mlp(args.width).SerializeToString()
        feed = {"x": np.random.default_rng(0).standard_normal((args.rows, args.width)).astype(
            np.float32)}
        args.model = f"mlp{args.width}x4"
    else:
        model = MODELS[args.model]().SerializeToString()
        feed = {k: v[: args.rows] for k, v in inputs(args.model, args.rows).items()}
    levels = [int(c) for c in args.concurrency.split(",")]
    # replicas read the model from a file: bytes would travel in every app's deployment
    # config through the GCS, which refuses messages over 512 MB
    import tempfile

    tmp = tempfile.NamedTemporaryFile(suffix=".onnx", delete=False)
    tmp.write(model)
    tmp.close()
    # in process at the threads a replica runs with (it reserves one CPU: `build_app`)
    session = InferenceSession(model, ["cpu"], intra_op_num_threads=args.blas_threads)
    from actors.connect import HAPROXY_ENV, forget_haproxy_files, serve_ingress_env

    ingress = serve_ingress_env() if args.ingress == "haproxy" else {HAPROXY_ENV: "0"}
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT, **env, **ingress}})
    node = ray.get_runtime_context().get_node_id()
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    apps = {"ours": build_app(tmp.name, ["cpu"], name="ours", max_batch_size=32),
            "ours-nobatch": build_app(tmp.name, ["cpu"], name="nobatch", max_batch_size=1),
            "ort-serve": ort_deployment(tmp.name, args.blas_threads)}
    from actors.transport.wire import decode_response, encode_request, encode_response

    apps["serve-floor"] = floor_deployment(encode_response(
        dict(zip(session.graph.outputs, session.run(None, feed))), "floor"))
    serve.run_many([serve.RunTarget(a, name=n, route_prefix=f"/{n}") for n, a in apps.items()])
    model_of = {"ours": "ours", "ours-nobatch": "nobatch", "ort-serve": "ort",
                "serve-floor": "floor"}
    clients = {n: InferenceClient(f"http://127.0.0.1:{port}/{n}", model_of[n]) for n in apps}
    body = encode_request(feed)

    def raw_call(name: str, model_name: str) -> Callable[[], Any]:
        client = clients[name]

        def call():
            reply = client._request("POST", f"/v2/models/{model_name}/infer", body,
                                    {"content-type": "application/msgpack"})[2]
            return decode_response(reply).tensors
        return call

    calls = {"in-process": lambda: dict(zip(session.graph.outputs, session.run(None, feed))),
             "ours": lambda: clients["ours"].infer(feed),
             "ours-nobatch": lambda: clients["ours-nobatch"].infer(feed),
             "ort-serve": raw_call("ort-serve", "ort"),
             "serve-floor": raw_call("serve-floor", "floor")}
    ref = session.run(None, feed)[0]
    for fn in calls.values():  # warm up, and check every target answers the same
        for _ in range(20):
            got = next(iter(fn().values()))
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        row = {}
        for conc in levels:
            for name, fn in calls.items():
                row[f"{name}@{conc}"] = load(fn, conc, args.requests)
        rounds.append(row)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    serve.shutdown()
    ray.shutdown()
    forget_haproxy_files(node)
    os.unlink(tmp.name)

    med = {k: {m: statistics.median(rd[k][m] for rd in rounds) for m in ("p50_ms", "p99_ms", "rps")}
           for k in rounds[0]}
    print(f"\nmodel {args.model}, {args.rows} row(s) per request, {args.rounds} rounds of "
          f"{args.requests} requests, medians; os.cpu_count()={os.cpu_count()}; ingress: "
          f"{'HAProxy' if ingress.get(HAPROXY_ENV) == '1' else 'Serve proxy actor'}")
    print(f"{'target':<14}{'conc':>5}{'p50 ms':>9}{'p99 ms':>9}{'req/s':>9}")
    for conc in levels:
        for name in calls:
            m = med[f"{name}@{conc}"]
            print(f"{name:<14}{conc:>5}{m['p50_ms']:>9.2f}{m['p99_ms']:>9.2f}{m['rps']:>9.1f}")
    c1 = levels[0]
    added = med[f"ours@{c1}"]["p50_ms"] - med[f"in-process@{c1}"]["p50_ms"]
    top = levels[-1]
    gain = med[f"ours@{top}"]["rps"] / med[f"ours-nobatch@{top}"]["rps"]
    floor = med[f"serve-floor@{c1}"]["p50_ms"]
    print(f"\np50 added over in-process at concurrency {c1}: {added:.2f} ms (goal <= 2 ms); "
          f"Serve's own floor (a deployment returning a fixed reply): {floor:.2f} ms, so ours "
          f"adds {med[f'ours@{c1}']['p50_ms'] - floor - med[f'in-process@{c1}']['p50_ms']:.2f} ms "
          f"over floor + in-process")
    print(f"dynamic batching at concurrency {top}: {gain:.2f}x the throughput of no batching "
          f"(goal >= 2x)")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rounds": rounds, "medians": med}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
