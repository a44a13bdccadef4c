"""What the fusion passes buy, per model: ours fused, ours with the fusion families this
project had before issue 12 only, ours unfused, and onnxruntime, interleaved in one
process (so a noisy neighbour slows all four alike).

* ``fused``: the session as built by default (placement/fusions/, every family);
* ``old``: the families that existed before (BatchNormalization fold, Conv + Add +
  activation, MatMul/Gemm + bias + activation, GELU chains); they match today's wider
  activation set and spellings, so this is an upper bound of the old code's speed;
* ``unfused``: ``optimize=False``, no provider passes;
* ``ort``: onnxruntime's CPU provider, spin-waiting off.

The calls rotate their order every cycle; each figure is the median over ``--repeat``
rounds of the median of ``4 * --runs`` calls; the ratios' range over the rounds says
how noisy the machine was.

    python bench/bench_fusions.py                         # arch models, batch 1 and 8
    python bench/bench_fusions.py --models llama_ts,vit_dynamo --batches 8 --runs 5
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.bench_cpu import CATALOG, GROUPS, environment, feed_for, print_environment  # noqa: E402

VARIANTS = ("fused", "old", "unfused", "ort")


#: the clock: wall time, or the process's CPU time (all its threads), which a loaded
#: machine disturbs far less (it does not count the time others' processes hold a core)
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = time.perf_counter


def rotated(fns: list, runs: int, warmup: int) -> list[list[float]]:
    """Seconds per call of each fn, called in turn, the order rotated every cycle (so no
    variant always runs right after onnxruntime, or first after a pause)."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    n = len(fns)
    for r in range(runs * n):  # every variant in every position, ``runs`` times
        for k in [(r + i) % n for i in range(n)]:
            t = clock()
            fns[k]()
            times[k].append(clock() - t)
    return times


def sessions(name: str) -> dict[str, Any]:
    import onnxruntime as ort

    from hetero_exec.placement import fusions
    from hetero_exec.session import InferenceSession

    data = CATALOG[name]().SerializeToString()
    so = ort.SessionOptions()
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    out = {"fused": InferenceSession(data, providers=["cpu"])}
    every = fusions.FUSIONS
    fusions.FUSIONS = (fusions.fold_batchnorm, fusions.fuse_conv, fusions.fuse_matmul, fusions.fuse_gelu)
    try:
        out["old"] = InferenceSession(data, providers=["cpu"])
    finally:
        fusions.FUSIONS = every
    out["unfused"] = InferenceSession(data, providers=["cpu"], optimize=False)
    out["ort"] = ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])
    return out


def fused_counts(sess) -> dict[str, int]:
    c = collections.Counter(n.op_type for s in sess.placement.segments for n in s.nodes
                            if n.domain == "hetero_exec")
    return dict(sorted(c.items()))


def measure(name: str, batch: int, runs: int, warmup: int, repeat: int) -> dict[str, Any]:
    sess = sessions(name)
    feed = feed_for(name, batch, 128)
    want = sess["ort"].run(None, feed)
    for k in VARIANTS[:3]:
        for a, b in zip(sess[k].run(None, feed), want):
            np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4, err_msg=f"{name} {k}")
    fns = [lambda s=sess[k]: s.run(None, feed) for k in VARIANTS]
    rounds = []
    for _ in range(repeat):
        t = rotated(fns, runs, warmup)
        rounds.append({k: statistics.median(ts) for k, ts in zip(VARIANTS, t)})
    med = {k: statistics.median(r[k] for r in rounds) for k in VARIANTS}
    ratio = {k: [r[k] / r["ort"] for r in rounds] for k in VARIANTS[:3]}
    return {"model": name, "batch": batch, "ms": {k: 1e3 * v for k, v in med.items()},
            "ratio": {k: med[k] / med["ort"] for k in VARIANTS[:3]},
            "ratio_range": {k: [min(v), max(v)] for k, v in ratio.items()},
            "nodes": {k: sum(len(s.nodes) for s in sess[k].placement.segments) for k in VARIANTS[:3]},
            "fused_nodes": fused_counts(sess["fused"])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="arch", help="names, or own / arch / all")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args(argv)
    global clock
    clock = CLOCKS[args.clock]
    names = GROUPS.get(args.models) or args.models.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    env = environment()
    print_environment(env)
    print(f"\n{'model':20s} {'b':>2s} {'nodes f/o/u':>13s} {'ort ms':>8s} "
          f"{'fused':>13s} {'old':>13s} {'unfused':>13s}   fused nodes")
    rows = []
    for batch in batches:
        for name in names:
            r = measure(name, batch, args.runs, args.warmup, args.repeat)
            rows.append(r)
            cells = " ".join(f"{r['ratio'][k]:5.2f} ({r['ratio_range'][k][0]:.2f}-{r['ratio_range'][k][1]:.2f})"
                             .replace(" (", "(") for k in VARIANTS[:3])
            n = r["nodes"]
            print(f"{name:20s} {batch:2d} {n['fused']:4d}/{n['old']:3d}/{n['unfused']:3d} "
                  f"{r['ms']['ort']:8.2f} {cells}   {r['fused_nodes']}", flush=True)
    for batch in batches:
        sel = [r for r in rows if r["batch"] == batch]
        g = {k: math.exp(statistics.fmean(math.log(r["ratio"][k]) for r in sel)) for k in VARIANTS[:3]}
        worst = max(sel, key=lambda r: r["ratio"]["fused"])
        print(f"geomean ours/ort, batch {batch}: fused {g['fused']:.2f}, old {g['old']:.2f}, "
              f"unfused {g['unfused']:.2f}; worst fused {worst['ratio']['fused']:.2f} ({worst['model']})")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"environment": env, "args": vars(args), "rows": rows},
                                              indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
