"""Ray Data batch inference: rows per second, side by side.

    python bench/bench_data.py                       # bench/models.py's mlp, 8192 rows, 3 rounds
    python bench/bench_data.py --rows 16384 --rounds 5 --json bench/results/data.json

Four pipelines read the same ``ray.data.from_numpy`` dataset and map it with
``batch_size`` rows per batch on ``--concurrency`` replicas:

* ``infer``: ``actors.data.infer`` (our `HeteroPredictor`);
* ``predictor``: `HeteroPredictor` through a plain ``map_batches`` with the by-hand
  pipeline's arguments (the model's bytes its only constructor argument);
* ``predictor-kw``: the same with the bytes as a keyword beside the providers
  (``fn_constructor_kwargs``): Ray Data then starts each replica ~0.3 s later, which is
  why `infer` passes an ObjectRef of the bytes;
* ``by-hand``: a hand-written ``map_batches`` class over our own session (the
  overhead goal: ``infer`` within 5% of it);
* ``ort``: the same hand-written class over onnxruntime.

After one warm-up run of each, each round runs the four in turn, a different one
first each round (so load from other jobs hits them alike); each run includes its
replicas' start-up, as a job's would; the table gives the median
rows/s over rounds. BLAS and onnxruntime use ``--blas-threads`` threads per replica.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


class OurSessionByHand:
    """What one writes by hand around our session."""

    def __init__(self, model: bytes):
        from hetero_exec import InferenceSession

        self.sess = InferenceSession(model, ["cpu"])

    def __call__(self, batch: dict) -> dict:
        batch["y"] = self.sess.run(None, {"x": batch["x"]})[0]
        return batch


class OrtByHand:
    """The same over onnxruntime (one intra-op thread, no spinning)."""

    def __init__(self, model: bytes, threads: int = 1):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.sess = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])

    def __call__(self, batch: dict) -> dict:
        batch["y"] = self.sess.run(None, {"x": batch["x"]})[0]
        return batch


def consume(ds: Any) -> int:
    rows = 0
    for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
        rows += len(batch["y"])
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="mlp", help="a bench/models.py model with input x")
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--blas-threads", type=int, default=1)
    ap.add_argument("--json", help="write every round's numbers here")
    args = ap.parse_args(argv)
    env = {"OPENBLAS_NUM_THREADS": str(args.blas_threads), "OMP_NUM_THREADS": str(args.blas_threads),
           "MKL_NUM_THREADS": str(args.blas_threads)}
    os.environ.update(env)

    import numpy as np
    import ray

    from actors.data import HeteroPredictor, infer
    from bench.models import MODELS, inputs

    model = MODELS[args.model]().SerializeToString()
    x = np.concatenate([inputs(args.model, 64, seed=s)["x"] for s in
                        range(-(-args.rows // 64))])[: args.rows]
    ray.init(address="local", num_cpus=max(2, args.concurrency + 1), include_dashboard=False,
             log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": ROOT, **env}})
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    base = ray.data.from_numpy(x).rename_columns({"data": "x"}).materialize()
    common = {"batch_size": args.batch_size, "batch_format": "numpy",
              "compute": ray.data.ActorPoolStrategy(size=args.concurrency)}
    pipelines = {
        "infer": lambda: infer(base, model, providers=["cpu"], batch_size=args.batch_size,
                               concurrency=args.concurrency),
        "predictor": lambda: base.map_batches(
            HeteroPredictor, fn_constructor_args=(model,), **common),
        "predictor-kw": lambda: base.map_batches(
            HeteroPredictor, fn_constructor_kwargs={"model": model, "providers": ["cpu"]},
            **common),
        "by-hand": lambda: base.map_batches(OurSessionByHand, fn_constructor_args=(model,),
                                            **common),
        "ort": lambda: base.map_batches(OrtByHand, fn_constructor_args=(model, args.blas_threads),
                                        **common),
    }
    for make in pipelines.values():  # warm up: worker processes, imports
        consume(make())
    rounds: list[dict[str, float]] = []
    names = list(pipelines)
    for r in range(args.rounds):
        row = {}
        k = r % len(names)
        for name in names[k:] + names[:k]:  # each goes first in turn
            make = pipelines[name]
            t = time.perf_counter()
            n = consume(make())
            row[name] = n / (time.perf_counter() - t)
            assert n == args.rows, (name, n)
        rounds.append(row)
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v:.0f}" for k, v in row.items()),
              file=sys.stderr, flush=True)
    ray.shutdown()
    med = {k: statistics.median(rd[k] for rd in rounds) for k in pipelines}
    print(f"\nmodel {args.model}, {args.rows} rows, batch {args.batch_size}, "
          f"{args.concurrency} replica(s), median of {args.rounds} rounds; "
          f"os.cpu_count()={os.cpu_count()}")
    print(f"{'pipeline':<10}{'rows/s':>10}{'vs by-hand':>12}")
    for name, v in med.items():
        print(f"{name:<10}{v:>10.0f}{v / med['by-hand']:>11.2f}x")
    overhead = (med["by-hand"] / med["infer"] - 1) * 100
    print(f"\ninfer's overhead over the hand-written map_batches: {overhead:+.1f}% (goal <= 5%)")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rounds": rounds, "medians": med}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
