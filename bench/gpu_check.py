"""The prepared device check: one short script for a machine with a real GPU.

Runs the `gpu` provider (CuPy) on the benchmark models (outputs against cpu, speed
against cpu) and on the ONNX node suite with the GPU required (pass counts over the
cases the GPU claims), then a gpu + cpu heterogeneous plan in process and on Ray.
Writes a JSON summary to $OUT (or the current folder) and prints a table.

    pip install -e ".[test,gpu]" && python bench/gpu_check.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _median_ms(fn, runs: int) -> float:
    fn()
    ts = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def check_models(runs: int, batches: list[int]) -> list[dict]:
    from bench.models import MODELS, inputs
    from hetero_exec import InferenceSession

    rows = []
    for name, build in MODELS.items():
        model = build()
        cpu = InferenceSession(model, providers=["cpu"])
        gpu = InferenceSession(model, providers=["gpu"], require_gpu=True)
        for batch in batches:
            feed = inputs(name, batch)
            ref = cpu.run(None, feed)
            got = gpu.run(None, feed)
            diff = max(float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))) for a, b in zip(ref, got))
            rows.append({"model": name, "batch": batch, "max_abs_diff": diff,
                         "cpu_ms": _median_ms(lambda: cpu.run(None, feed), runs),
                         "gpu_ms": _median_ms(lambda: gpu.run(None, feed), runs)})
            print(f"{name:10s} b={batch:<2d} cpu {rows[-1]['cpu_ms']:8.2f} ms  gpu {rows[-1]['gpu_ms']:8.2f} ms"
                  f"  max|diff| {diff:.2e}", flush=True)
    return rows


def check_node_suite() -> dict:
    from hetero_exec.errors import HeterogeneousPlacementRequired
    from tests.backend_cases import known_failures, node_cases, run_case

    cases, known = node_cases(), known_failures()
    claimed = passed = 0
    failures = {}
    for name, case in sorted(cases.items()):
        try:
            run_case(case, providers=["gpu"], require_gpu=True)
        except HeterogeneousPlacementRequired:
            continue
        except Exception as e:  # noqa: BLE001 - every failure is reported
            claimed += 1
            if name not in known:
                failures[name] = f"{type(e).__name__}: {str(e)[:200]}"
            continue
        claimed += 1
        passed += 1
    print(f"node suite on gpu: {passed} passed of {claimed} claimed ({len(cases)} cases)", flush=True)
    return {"claimed": claimed, "passed": passed, "failures": failures}


def check_hetero() -> dict:
    from hetero_exec import InferenceSession
    from hetero_exec.demo import demo_inputs, detector_model

    model, feed = detector_model(), demo_inputs()
    ref = InferenceSession(model).run(None, feed)
    out = {}
    for executor in ("local", "ray"):
        with InferenceSession(model, providers=["gpu", "cpu"], hetero=True, executor=executor) as s:
            got = s.run(None, feed)
            out[executor] = {"segments": [seg.provider.name for seg in s.placement.segments],
                             "match": all(np.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(ref, got)),
                             "ms": _median_ms(lambda: s.run(None, feed), 10)}
        print(f"gpu+cpu hetero on {executor}: {out[executor]}", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer runs, batch 1 and 8 only")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    summary: dict = {}
    for key, fn in (("models", lambda: check_models(5 if args.quick else 20, [1, 8])),
                    ("node_suite", check_node_suite), ("hetero", check_hetero)):
        try:
            summary[key] = fn()
        except Exception:  # noqa: BLE001 - keep going: one section must not hide the others
            summary[key] = {"error": traceback.format_exc()}
            print(summary[key]["error"], flush=True)
    path = os.path.join(os.environ.get("OUT", "."), "gpu_check.json")
    with open(path, "w") as f:
        json.dump(summary, f, indent=2)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
