"""Thread policies side by side, interleaved with onnxruntime in one process.

Each round runs every policy once on the same feed, then onnxruntime (spin-waiting
off); figures are medians over rounds, as ratios to onnxruntime of the same rounds.

* ``adaptive``: what sessions do (kernels/_threads.run_threads): a run alone gives the
  BLAS its width; overlapping runs hold it at one thread and split over our pool;
* ``hold+split``: a run holds the BLAS at one thread, large conv GEMMs split over our
  pool;
* ``hold``: the same hold, nothing split (PARALLEL_FLOPS raised out of reach);
* ``blas``: no hold, the BLAS at its default threads (OpenBLAS: one per core).

These time one run at a time; ``--many N`` also times ``run_many`` of N requests (two
at a time in process), where runs overlap.

    python bench/bench_threads.py
    python bench/bench_threads.py --models resnet18,mobilenetv2_ts --batches 8 --rounds 9
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.bench_cpu import CATALOG, GROUPS, feed_for, make_sessions  # noqa: E402
from hetero_exec.kernels import _threads  # noqa: E402

POLICIES = ("adaptive", "hold+split", "hold", "blas")


@contextlib.contextmanager
def policy(name: str):
    import hetero_exec.exec.local as local

    saved_flops, saved_entry = _threads.PARALLEL_FLOPS, local.run_threads
    try:
        if name in ("hold", "hold+split"):
            local.run_threads = _threads.single_blas_thread
            if name == "hold":
                _threads.PARALLEL_FLOPS = float("inf")
        elif name == "blas":
            _threads.PARALLEL_FLOPS = float("inf")
            local.run_threads = contextlib.nullcontext
        yield
    finally:
        _threads.PARALLEL_FLOPS = saved_flops
        local.run_threads = saved_entry


def bench(name: str, batch: int, rounds: int, seq: int) -> dict:
    ours, theirs, _ = make_sessions(CATALOG[name](), ort_no_spin=True)
    feed = feed_for(name, batch, seq)
    for p in POLICIES:  # warm-up
        with policy(p):
            ours.run(None, feed)
    theirs.run(None, feed)
    times: dict[str, list[float]] = {p: [] for p in (*POLICIES, "ort")}
    for _ in range(rounds):
        for p in POLICIES:
            with policy(p):
                t = time.perf_counter()
                ours.run(None, feed)
                times[p].append(time.perf_counter() - t)
        t = time.perf_counter()
        theirs.run(None, feed)
        times["ort"].append(time.perf_counter() - t)
    ms = {p: 1e3 * statistics.median(ts) for p, ts in times.items()}
    ratio = {p: statistics.median(a / o for a, o in zip(times[p], times["ort"])) for p in POLICIES}
    return {"model": name, "batch": batch, "ms": ms, "ratio": ratio}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="mlp,resnet18,bert,mobilenetv2_ts,convnext_ts,vit_ts,llama_ts")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--many", type=int, default=0, metavar="N",
                    help="also time run_many of N batch-1 requests per policy (req/s)")
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args(argv)
    names = [n for m in args.models.split(",") if m for n in GROUPS.get(m, [m])]
    print(f"# median over {args.rounds} rounds; ratio = median of per-round ours/ort")
    print(f"{'model':<20} {'batch':>5} " + " ".join(f"{p:>16}" for p in POLICIES) + f" {'ort ms':>8}")
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        for name in names:
            r = bench(name, batch, args.rounds, args.seq)
            rows.append(r)
            cells = " ".join(f"{r['ms'][p]:8.2f} ({r['ratio'][p]:4.2f})" for p in POLICIES)
            print(f"{name:<20} {batch:>5} {cells} {r['ms']['ort']:8.2f}", flush=True)
    if args.many:
        print(f"\n# run_many of {args.many} batch-1 requests, req/s (median of 3)")
        print(f"{'model':<20} " + " ".join(f"{p:>10}" for p in POLICIES))
        for name in names:
            r = many(name, args.many, args.seq)
            rows.append(r)
            print(f"{name:<20} " + " ".join(f"{r['req_per_s'][p]:10.1f}" for p in POLICIES),
                  flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


def many(name: str, n: int, seq: int) -> dict:
    """run_many throughput per policy: runs overlap there (two at a time in process)."""
    ours, _, _ = make_sessions(CATALOG[name](), ort_no_spin=True)
    feeds = [feed_for(name, 1, seq) for _ in range(n)]
    rate = {}
    for p in POLICIES:
        with policy(p):
            ours.run_many(feeds[:4])
            times = []
            for _ in range(3):
                t = time.perf_counter()
                ours.run_many(feeds)
                times.append(time.perf_counter() - t)
        rate[p] = n / statistics.median(times)
    return {"model": name, "many": n, "req_per_s": rate}


if __name__ == "__main__":
    sys.exit(main())
