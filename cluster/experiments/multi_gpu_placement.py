"""The planner's multi-GPU strategies on Ray: predicted against measured stage times.

Builds an MLP whose layers differ in width (so equal node counts are not equal
work), places it over ``sim-gpu:0..3`` (+ cpu) with each strategy (greedy, balanced,
memory), runs requests through the pipelined Ray executor, and prints, per stage,
the planner's predicted cost next to the time measured inside the stage's actor,
plus the slowest stage and the pipeline's throughput.

    python cluster/experiments/multi_gpu_placement.py                 # a local Ray
    python cluster/experiments/multi_gpu_placement.py --ray-address auto  # a cluster

Each device is one pipeline stage (one actor). The predicted costs come from the
planner's cost model for the provider: for sim-gpu, which runs NumPy on host cores,
the host's (its GEMM rate, memory bandwidth and per-node overhead, probed once), so
the four stages, sharing the host's cores, run slower than predicted when they run at
once; compare the shape (which stage is slowest, the ratios between stages). Needs 4
GPUs in the cluster (logical ones are fine: the local start declares them).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from hetero_exec import InferenceSession  # noqa: E402

log = logging.getLogger("multi_gpu_placement")

WIDTHS = [256, 1024, 256, 512, 2048, 512, 256, 1024, 256]  # layer i maps WIDTHS[i] -> WIDTHS[i+1]
DEVICES = [f"sim-gpu:{i}" for i in range(4)]
STRATEGIES = ("greedy", "balanced", "memory")


def uneven_mlp(seed: int = 0) -> onnx.ModelProto:
    """Gemm + Relu per layer over WIDTHS: x [N, 256] -> y [N, 256]."""
    rng = np.random.default_rng(seed)
    nodes, inits, x = [], [], "x"
    for i, (a, b) in enumerate(zip(WIDTHS, WIDTHS[1:])):
        w = (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32)
        inits += [
            numpy_helper.from_array(w, f"w{i}"),
            numpy_helper.from_array(np.zeros(b, np.float32), f"b{i}"),
        ]
        nodes.append(helper.make_node("Gemm", [x, f"w{i}", f"b{i}"], [f"h{i}"], name=f"fc{i}"))
        x = f"r{i}"
        nodes.append(helper.make_node("Relu", [f"h{i}"], [x], name=f"relu{i}"))
    nodes.append(helper.make_node("Identity", [x], ["y"], name="out"))
    g = helper.make_graph(
        nodes,
        "uneven_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", WIDTHS[0]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", WIDTHS[-1]])],
        inits,
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def providers_for(strategy: str, model: onnx.ModelProto, batch: int) -> list[Any]:
    """The four devices (+ cpu); for ``memory``, each holds about a third of the weights."""
    if strategy != "memory":
        return DEVICES + ["cpu"]
    weights = sum(np.prod(t.dims) * 4 for t in model.graph.initializer)
    per_device = int(weights / 3) + 4 * batch * max(WIDTHS) * 4  # + a few activations
    return [(d, {"mem_limit": per_device}) for d in DEVICES] + ["cpu"]


def run_strategy(
    model: onnx.ModelProto, strategy: str, batch: int, requests: int, ray_options: dict[str, Any]
) -> dict[str, Any]:
    feeds = [
        {"x": np.random.default_rng(i).standard_normal((batch, WIDTHS[0])).astype(np.float32)}
        for i in range(requests)
    ]
    with InferenceSession(
        model,
        providers_for(strategy, model, batch),
        hetero=True,
        strategy=strategy,
        executor="ray",
        dim_bounds={"N": batch},
        max_inflight=requests,
        **ray_options,
    ) as sess:
        sess.run_many(feeds[:4])
        started = time.perf_counter()
        sess.run_many(feeds)
        elapsed = time.perf_counter() - started
        measured = sess._executor.stage_stats()  # one stage (an actor) per device
        by_id = {seg.id: seg for seg in sess.placement.segments}
        rows = []
        for stage, (label, stats) in zip(sess.placement.stages, measured.items()):
            rows.append(
                {
                    "stage": label,
                    "nodes": sum(len(by_id[i].nodes) for i in stage.segments),
                    "predicted_ms": (stage.compute_s or 0.0) * 1e3,
                    "measured_ms": stats["mean_ms"],
                }
            )
    return {"strategy": strategy, "rows": rows, "req_per_s": requests / elapsed}


def print_report(results: list[dict[str, Any]]) -> None:
    for r in results:
        stages, rate = len(r["rows"]), r["req_per_s"]
        print(f"\n{r['strategy']}: {stages} stage(s), {rate:.1f} requests/s pipelined")
        head = ("stage", "nodes", "predicted ms", "measured ms", "pred share", "meas share")
        print("  {:<24} {:>5} {:>13} {:>12} {:>10} {:>10}".format(*head))
        ptot = sum(x["predicted_ms"] for x in r["rows"]) or 1.0
        mtot = sum(x["measured_ms"] for x in r["rows"]) or 1.0
        for x in r["rows"]:
            pred, meas = x["predicted_ms"], x["measured_ms"]
            print(
                f"  {x['stage']:<24} {x['nodes']:>5} {pred:>13.3f} {meas:>12.3f} "
                f"{pred / ptot:>10.0%} {meas / mtot:>10.0%}"
            )
        slow_p = max(r["rows"], key=lambda x: x["predicted_ms"])["stage"]
        slow_m = max(r["rows"], key=lambda x: x["measured_ms"])["stage"]
        print(f"  slowest stage: predicted {slow_p}, measured {slow_m}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--ray-address", default=None, help="join this cluster (default: start a local Ray)"
    )
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--strategies", nargs="*", default=list(STRATEGIES))
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    import ray

    if a.ray_address:
        ray.init(address=a.ray_address, log_to_driver=False)
    else:  # a small local Ray of its own with 4 logical GPUs, one BLAS thread per actor
        ray.init(
            address="local",
            num_cpus=4,
            num_gpus=4,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={
                "env_vars": {
                    "PYTHONPATH": ROOT,
                    "OMP_NUM_THREADS": "1",
                    "OPENBLAS_NUM_THREADS": "1",
                }
            },
        )
    model = uneven_mlp()
    results = [
        run_strategy(model, s, a.batch, a.requests, {"ray_address": a.ray_address,
                                                     "stage_threads": 1})
        for s in a.strategies
    ]
    print(f"uneven MLP widths {WIDTHS}, batch {a.batch}, {a.requests} requests per strategy")
    print_report(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
