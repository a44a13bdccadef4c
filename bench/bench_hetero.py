"""Heterogeneous in-process runs against cpu-only runs, and multi-GPU strategies.

1. Each benchmark model with 1-2 nodes pinned to cpu (affinity) on a sim-gpu + cpu
   session: 2-4 seams, copies at every seam. Goal: <= 1.05x the cpu-only run (geomean).
   (sim-gpu kernels run on NumPy, so the ratio measures the heterogeneous machinery:
   segment dispatch and seam copies. Every segment gets its provider's fusions after
   placement, so both sides run fused kernels; a chain cut by a seam stays unfused.)
   The C cpu kernels (kernels/native) are off by default here: sim-gpu's
   segments run the array-module kernels over host memory (what a GPU would run its
   own way), so with them on the ratio would weigh the C kernels against numpy on the
   "device" nodes rather than the heterogeneous machinery (``--native`` keeps them on:
   1.32x on 2026-12-01, against 1.02-1.1x off). Since 2026-12-02 strict sim-gpu's float32
   products accumulate in float64 (providers/sim_array.py: equal rows give equal results
   whatever the host's BLAS), about 2.3x a float32 GEMM's time, so the strict ratio of
   the GEMM-heavy models carries that too; ``--sim host`` does not.
   ``--sim host`` gives sim-gpu ``strict=False``: its segments then run the cpu's own
   kernels (compiled ones too) on plain numpy arrays, still with a copy at every seam
   and of every output, so the ratio is the machinery alone (1.038-1.039 in two runs on
   2026-12-01: the cut fusions and the copies; see bench/README.md).
2. A 4-device sim-gpu split by each strategy: predicted slowest stage, seam bytes, and
   the measured per-stage time.

    python bench/bench_hetero.py [--runs 15] [--batch 8] [--repeat 3] [--sim host]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.models import MODELS, inputs  # noqa: E402
from hetero_exec import InferenceSession  # noqa: E402

#: nodes pinned to cpu per model, chosen so the plans have 2 to 4 seams
PINS = {
    "mlp": [["Relu_1"], ["Relu_1", "Relu_2"]],
    "resnet18": [["Relu_4"], ["Relu_4", "Relu_10"]],
    "bert": [["MatMul_30"], ["LayerNormalization_3"]],
    "gpt2": [["Transpose_16"], ["LayerNormalization_5"]],
}


def interleaved(fns: dict, feed: dict, runs: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn(feed)
    for _ in range(runs):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn(feed)
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def hetero_table(runs: int, batch: int, strict: bool = True) -> list[float]:
    mode = "strict" if strict else "host kernels"
    print(f"\n== heterogeneous (sim-gpu {mode} + cpu, in process) vs cpu-only, batch {batch} ==")
    print("(cpu ms: the cpu session with its fusion pass; unfused: optimize=False; hetero ms:\n"
          " the mixed session, each segment fused after placement)")
    print(f"{'model':10s} {'pins':24s} {'seams':>5s} {'seam MB/run':>11s} {'cpu ms':>8s} {'unfused':>8s} "
          f"{'hetero ms':>9s} {'ratio':>6s} {'vs unfused':>10s}")
    ratios, plain = [], []
    for name, build in MODELS.items():
        model = build()
        feed = inputs(name, batch)
        cpu = InferenceSession(model, providers=["cpu"])
        unfused = InferenceSession(model, providers=["cpu"], optimize=False)
        for pins in PINS[name]:
            het = InferenceSession(model, providers=[("sim-gpu", {"strict": strict}), "cpu"], hetero=True,
                                   affinity=[(p, "cpu") for p in pins])
            ref = cpu.run(None, feed)
            got = het.run(None, feed)
            assert all(np.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(ref, got)), name
            ex = het._executor
            before = ex.copy_bytes
            het.run(None, feed)
            per_run = (ex.copy_bytes - before) / 1e6
            t = interleaved({"cpu": lambda f: cpu.run(None, f), "plain": lambda f: unfused.run(None, f),
                             "het": lambda f: het.run(None, f)}, feed, runs)
            ratio, vs_plain = t["het"] / t["cpu"], t["het"] / t["plain"]
            ratios.append(ratio)
            plain.append(vs_plain)
            print(f"{name:10s} {','.join(pins):24s} {len(het.placement.seams):5d} {per_run:11.2f} "
                  f"{t['cpu']:8.2f} {t['plain']:8.2f} {t['het']:9.2f} {ratio:6.2f} {vs_plain:10.2f}")
    gm = float(np.exp(np.mean(np.log(ratios))))
    gp = float(np.exp(np.mean(np.log(plain))))
    print(f"geomean ratio {gm:.3f} (max {max(ratios):.3f}); against the unfused cpu run {gp:.3f} "
          f"(max {max(plain):.3f})")
    return ratios


def strategies_table(runs: int, batch: int, model_name: str = "resnet18") -> None:
    """sim-gpu kernels run on the host, so the cost model is calibrated on this host first
    (a short profile of the cpu session): predictions and measurements are comparable."""
    from hetero_exec.placement.partition import calibrate

    print(f"\n== 4 x sim-gpu pipeline split of {model_name}, batch {batch} (cost model calibrated here) ==")
    model = MODELS[model_name]()
    feed = inputs(model_name, batch)
    bounds = {"N": batch}
    cost = calibrate(InferenceSession(model, providers=["cpu"], optimize=False), feed, runs=2)
    print(f"{'strategy':9s} {'stages (nodes)':18s} {'pred stage ms':>30s} {'seam MB':>8s} {'measured stage ms':>30s}")
    for strategy in ("greedy", "balanced", "memory"):
        provs = [(f"sim-gpu:{i}", {"mem_limit": 128 * 2**20}) if strategy == "memory" else f"sim-gpu:{i}"
                 for i in range(4)] + ["cpu"]
        try:
            sess = InferenceSession(model, providers=provs, hetero=True, strategy=strategy, dim_bounds=bounds,
                                    cost_model=cost)
        except Exception as e:  # noqa: BLE001 - report the refusal in the table
            print(f"{strategy:9s} refused: {e}")
            continue
        segs = sess.placement.segments
        for _ in range(runs):
            sess.run(None, feed)
        ex = sess._executor
        measured = [cs.seconds / max(cs.runs, 1) * 1e3 for cs in ex.segments]
        pred = [(s.predicted_cost or 0) * 1e3 for s in segs]
        nodes = "/".join(str(len(s.nodes)) for s in segs)
        print(f"{strategy:9s} {nodes:18s} {' '.join(f'{p:.1f}' for p in pred):>30s} "
              f"{sess.placement.seam_bytes() / 1e6:8.2f} {' '.join(f'{m:.1f}' for m in measured):>30s}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=1, help="rounds of the hetero table")
    ap.add_argument("--no-strategies", action="store_true", help="skip the multi-GPU table")
    ap.add_argument("--native", action="store_true",
                    help="keep the compiled cpu kernels on (see the module docstring)")
    ap.add_argument("--sim", choices=("strict", "host"), default="strict",
                    help="host: sim-gpu with strict=False, whose segments run the cpu's own "
                         "kernels (compiled ones included) on plain numpy arrays, so the ratio "
                         "is the machinery alone: dispatch, seam copies, cut fusions")
    args = ap.parse_args()
    strict = args.sim == "strict"
    if strict and not args.native:
        from hetero_exec.kernels import native
        from hetero_exec.kernels.native import library

        os.environ[native.ENV] = "0"
        library.reset()
    geomeans = []
    for _ in range(args.repeat):
        ratios = hetero_table(args.runs, args.batch, strict)
        geomeans.append(float(np.exp(np.mean(np.log(ratios)))))
    if args.repeat > 1:
        print(f"\ngeomean per round: {', '.join(f'{g:.3f}' for g in geomeans)}; "
              f"median {statistics.median(geomeans):.3f}")
    if not args.no_strategies:
        strategies_table(max(args.runs // 3, 3), args.batch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
