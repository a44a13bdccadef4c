"""A Ray Job: batch inference over a dataset with `actors.data.infer`, outputs to Parquet.

    ray job submit --address http://127.0.0.1:8290 --working-dir . -- \\
        python cluster/infer_job.py --model model.onnx --input data/ --output out/ \\
        --providers sim-gpu,cpu --hetero --concurrency 2 --num-gpus 1

``--input`` is Parquet (a file or folder) with a column per model input; without it
the job makes ``--rows`` random rows for the model's inputs (and an ``id`` column). Without ``--model`` it
serves a small built-in MLP. Each output becomes a column; the other columns pass
through; ``--output`` gets the Parquet files. Ray Data's progress bars show on the
job's log. A JSON summary closes the log:

    {"rows": 4096, "seconds": 3.1, "rows_per_s": 1321.3, "output": "out/", ...}

It also runs as a plain driver: ``python cluster/infer_job.py --address local``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # a plain driver run from a checkout; a job has its working_dir
    sys.path.insert(0, ROOT)

# imported before connecting: lazy imports from a job's working_dir are flaky (README)
import ray  # noqa: E402
import ray.data  # noqa: E402

from actors.data import HeteroPredictor, infer  # noqa: E402,F401
from hetero_exec import InferenceSession  # noqa: E402

log = logging.getLogger("hetero_exec.infer_job")


def builtin_model(width: int = 64) -> bytes:
    """x [N, width] -> Gemm, Relu, Gemm -> y [N, width] (seeded weights)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((width, width)) * 0.1).astype(
        np.float32), n) for n in ("w0", "w1")]
    nodes = [helper.make_node("Gemm", ["x", "w0"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Gemm", ["r", "w1"], ["y"])]
    g = helper.make_graph(nodes, "builtin_mlp",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", width])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", width])],
                          inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def random_rows(model: bytes, rows: int, seed: int = 0) -> dict[str, np.ndarray]:
    """``rows`` random rows for each input (dim 0 is the batch; other dims must be static)."""
    rng = np.random.default_rng(seed)
    sess = InferenceSession(model)
    cols = {}
    for arg in sess.get_inputs():
        v = sess.graph.value(arg.name)
        rest = tuple(v.shape[1:]) if v.shape else ()
        if not all(isinstance(d, int) for d in rest):
            raise SystemExit(f"input {arg.name!r} has symbolic dims {list(v.shape)}: pass --input")
        dt = v.dtype
        cols[arg.name] = (rng.standard_normal((rows, *rest)) if dt.kind == "f" else
                          rng.integers(0, 4, (rows, *rest))).astype(dt)
    return cols


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="an ONNX file (read here, shipped to the replicas)")
    ap.add_argument("--input", help="Parquet file or folder (default: --rows random rows)")
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--output", default="/tmp/hetero_exec_infer_out")
    ap.add_argument("--providers", default="cpu", help="comma-separated, in preference order")
    ap.add_argument("--hetero", action="store_true", help="opt in to mixed placement")
    ap.add_argument("--executor", choices=["local", "ray"], default="local",
                    help="ray: each replica drives its plan's stage actors")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--num-gpus", type=float, default=0, help="GPUs per replica")
    ap.add_argument("--address", default=None,
                    help="Ray to join (default: the job's cluster, RAY_ADDRESS or 'auto'); "
                         "'local' starts one")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    model = open(args.model, "rb").read() if args.model else builtin_model()
    ray.init(address=args.address or os.environ.get("RAY_ADDRESS") or "auto",
             **({"num_gpus": int(max(args.num_gpus, 1) * args.concurrency)}
                if args.address == "local" and args.providers != "cpu" else {}))
    ray.data.DataContext.get_current().enable_progress_bars = True
    if args.input:
        ds = ray.data.read_parquet(args.input)
    else:
        cols = random_rows(model, args.rows)
        ds = ray.data.from_items([{"id": i, **{n: c[i] for n, c in cols.items()}}
                                  for i in range(args.rows)])
    opts = {"hetero": True} if args.hetero else {}
    if args.executor == "ray":
        opts["executor"] = "ray"
    providers = [p.strip() for p in args.providers.split(",") if p.strip()]
    t = time.perf_counter()
    out = infer(ds, model, providers=providers, batch_size=args.batch_size,
                concurrency=args.concurrency, num_gpus=args.num_gpus, **opts)
    out.write_parquet(args.output, mode=ray.data.SaveMode.OVERWRITE)  # a rerun replaces, not appends
    seconds = time.perf_counter() - t
    rows = ray.data.read_parquet(args.output).count()
    summary = {"rows": rows, "seconds": round(seconds, 3), "rows_per_s": round(rows / seconds, 1),
               "output": args.output, "providers": providers, "hetero": args.hetero,
               "executor": args.executor, "replicas": args.concurrency}
    print(json.dumps(summary), flush=True)
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
