"""A Ray Job entrypoint: a built-in model through InferenceSession(executor="ray").

Joins the cluster it runs in (``ray_address="auto"``), builds the demo detector
(conv backbone on the GPU provider, NonMaxSuppression on cpu) with heterogeneous
placement, runs it, checks it against a cpu session, and prints the placement
report (its pipeline stages too), per-stage and per-segment timings and where the
stage actors run. Submit it with
(see cluster/README.md):

    ray job submit --address http://127.0.0.1:8290 --working-dir . -- python cluster/job.py

It also runs as a plain driver: ``RAY_ADDRESS=127.0.0.1:6390 python cluster/job.py``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # a plain driver run from a checkout; a job has its working_dir
    sys.path.insert(0, ROOT)

from hetero_exec import InferenceSession  # noqa: E402
from hetero_exec.demo import demo_inputs, detector_model  # noqa: E402

log = logging.getLogger("hetero_exec.job")


def gpu_provider() -> str:
    """``gpu`` when the cluster has GPUs and CuPy imports here, else the ``sim-gpu`` emulation."""
    import ray

    if ray.cluster_resources().get("GPU", 0) >= 1:
        try:
            import cupy

            if cupy.cuda.runtime.getDeviceCount() > 0:
                return "gpu"
        except Exception:  # noqa: BLE001 - no CuPy or no device on the driver's node
            pass
    return "sim-gpu"


def warm_imports() -> None:
    """Import the modules hetero_exec and the Ray layer load lazily."""
    import actors.compiled  # noqa: F401
    import actors.coordinator  # noqa: F401
    from hetero_exec.kernels.registry import registered
    from hetero_exec.providers import parse_provider

    registered()  # imports every kernel module
    for name in ("cpu", "sim-gpu", "gpu"):
        parse_provider(name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--address", default="auto", help="Ray address (default: the job's cluster)")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--strategy", default="SPREAD", help="placement group strategy")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    # Everything is imported (and the cpu reference computed) before ray.init: with Ray
    # 2.60, a job driver's lazy imports from its working_dir failed now and then right
    # after ray.init ("No module named 'hetero_exec.placement'", the files being there),
    # as if the working_dir were being unpacked again under the running driver.
    warm_imports()
    model, feed = detector_model(), demo_inputs(batch=a.batch)
    expected = InferenceSession(model, ["cpu"]).run(None, feed)
    import ray

    ray.init(address=a.address, log_to_driver=False)
    importlib.invalidate_caches()
    provider = gpu_provider()
    with InferenceSession(
        model,
        [provider, "cpu"],
        hetero=True,
        executor="ray",
        ray_address=a.address,
        placement_strategy=a.strategy,
    ) as sess:
        print(sess.placement.report())
        outs = sess.run(None, feed)
        started = time.perf_counter()
        results = sess.run_many([feed] * a.runs)
        per_run = (time.perf_counter() - started) / a.runs
        ok = all(
            np.allclose(x, y, rtol=1e-4, atol=1e-5)
            for r in [outs, *results]
            for x, y in zip(r, expected)
        )
        ex = sess._executor
        where = ray.get([h.ready.remote() for h in sess.stage_actors])
        for line in ex.segment_timings():
            print(line)
        summary = {
            "provider": provider,
            "segments": len(sess.placement.segments),
            "stages": len(sess.placement.stages),
            "actors": len(where),
            "nodes": len({w["node"] for w in where}),
            "ms_per_run_pipelined": round(per_run * 1e3, 2),
            "matches_cpu": ok,
        }
    print(json.dumps(summary))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
