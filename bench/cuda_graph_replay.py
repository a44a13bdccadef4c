"""CUDA-graph replay of a static gpu plan against its eager per-op launches, for the
benchmark models (`bench/gpu_check.py --cuda-graph`). The capture itself is
`hetero_exec.providers.gpu_graphs`; this measures it, so it lives with the benchmarks."""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np

from bench.models import MODELS, inputs
from hetero_exec import InferenceSession
from hetero_exec.exec.executor import execute
from hetero_exec.providers.gpu_graphs import CapturedPlan, graph_support


def _time(fn, runs: int) -> float:
    fn()
    ts = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts) * 1e3)


def compare_replay(models: Sequence[str], runs: int = 10, batch: int = 1) -> dict:
    """Eager per-op launches against graph replay for the benchmark models on gpu:0
    (each a single static segment), outputs compared. Used by bench/gpu_check.py."""
    sup = graph_support()
    if not sup:
        return {"unavailable": sup.reason}
    import cupy as cp


    rows = []
    for name in models:
        row: dict[str, Any] = {"model": name, "batch": batch}
        try:
            sess = InferenceSession(MODELS[name](), providers=["gpu"], require_gpu=True)
            segs = sess._executor.segments  # one segment: the whole model on gpu:0
            plan = segs[0].plan
            feed = inputs(name, batch, seq=32) if name in ("bert", "gpt2") else inputs(name, batch)
            dev = [cp.asarray(feed[n]) if n in feed else None for n, _ in plan.input_slots]
            stream = cp.cuda.Stream(non_blocking=True)

            def eager():
                with stream:
                    out = execute(plan, dev)
                    stream.synchronize()
                return out

            row["eager_ms"] = _time(eager, runs)
            try:
                cap = CapturedPlan(plan, dev)
            except Exception as e:  # noqa: BLE001 - not capturable: say why
                row["captured"] = False
                row["reason"] = f"{type(e).__name__}: {str(e)[:300]}"
                rows.append(row)
                continue
            row["captured"] = True
            row["replay_ms"] = _time(lambda: cap.run(dev), runs)
            ref = [o.get() for o in eager()]
            got = [o.get() for o in cap.run(dev)]
            row["match"] = all(np.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(ref, got))
            row["speedup"] = row["eager_ms"] / row["replay_ms"]
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
    return {"rows": rows}
