"""Per-node and per-run overhead: hetero_exec against onnxruntime on tiny tensors.

``tiny_ops(n)`` chains n element-wise ops on a [1, 16] tensor, so the kernels' own work
is negligible and the time is the runtime's: the run loop, argument passing, output
bookkeeping. The 1-node graph measures what one ``run()`` costs around the nodes
(feed checks, slot lists, output collection). ``loop_if`` is a Loop of 64 iterations
over a 9-node body with an If inside (bench/models.py): what a control-flow body costs
per iteration.

Both run interleaved in one process, onnxruntime with spin-waiting off
(``session.intra_op.allow_spinning=0``); each figure is the median over ``--repeat``
rounds of the median of ``--runs`` calls, and the spread of the rounds is printed.
``--clock cpu`` times the process's CPU instead of the wall (steadier under load).

    python bench/bench_overhead.py                    # 1000 nodes, 200 runs, 3 rounds
    python bench/bench_overhead.py --nodes 300 --runs 50 --json bench/results/overhead.json

Reading it: ``us/node`` is (t(n nodes) - t(1 node)) / (n - 1), the cost of one more node;
``per run`` is t(1 node), the fixed cost of a call; the loop's ``us/iteration`` is
(t(loop) - t(1 node)) / 64, and its ``us/body node`` that over the 9 body nodes run per
iteration (MatMul, Add, Tanh, ReduceSum, Greater, If + its one branch node, ReduceSum,
Identity).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.bench_cpu import environment, interleaved, print_environment  # noqa: E402
from bench.models import loop_if, tiny_ops  # noqa: E402

LOOP_TRIPS = 64
LOOP_BODY_NODES = 9


#: wall time, or the process's CPU time: steadier on a loaded machine (it does not count
#: the time other processes hold the core), and on tiny graphs both runtimes run on the
#: calling thread, so it is the same work either way
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = time.perf_counter


def ort_session(data: bytes):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])


def measure(data: bytes, feed: dict, runs: int, warmup: int) -> dict[str, Any]:
    """Median seconds per run for ours and onnxruntime on one model, interleaved."""
    from hetero_exec.session import InferenceSession

    ours = InferenceSession(data, providers=["cpu"])
    theirs = ort_session(data)
    a, b = ours.run(None, feed), theirs.run(None, feed)
    t_ours, t_ort = interleaved([lambda: ours.run(None, feed), lambda: theirs.run(None, feed)],
                                runs, warmup, clock)
    return {"ours_s": statistics.median(t_ours), "ort_s": statistics.median(t_ort),
            "max_abs_diff": max(float(np.abs(np.asarray(x) - y).max()) for x, y in zip(a, b))}


def one_round(args) -> dict[str, dict[str, Any]]:
    x = {"x": np.linspace(-1, 1, 16, dtype=np.float32)[None]}
    out = {"one": measure(tiny_ops(1).SerializeToString(), x, args.runs, args.warmup),
           "chain": measure(tiny_ops(args.nodes).SerializeToString(), x,
                            max(args.runs // 10, 5), args.warmup)}
    loop = loop_if(LOOP_TRIPS).SerializeToString()
    for batch in (1, 8):
        h0 = {"h0": np.random.default_rng(batch).standard_normal((batch, 64)).astype(np.float32)}
        out[f"loop_b{batch}"] = measure(loop, h0, max(args.runs // 4, 5), args.warmup)
    return out


def per_unit(r: dict[str, dict[str, Any]], nodes: int) -> dict[str, dict[str, float]]:
    """Derived figures in microseconds, ours and onnxruntime's."""
    d: dict[str, dict[str, float]] = {}
    for k in ("ours_s", "ort_s"):
        one = r["one"][k]
        d.setdefault("per_node_us", {})[k] = 1e6 * (r["chain"][k] - one) / (nodes - 1)
        for b in (1, 8):
            it = 1e6 * (r[f"loop_b{b}"][k] - one) / LOOP_TRIPS
            d.setdefault(f"loop_b{b}_us_per_iteration", {})[k] = it
            d.setdefault(f"loop_b{b}_us_per_body_node", {})[k] = it / LOOP_BODY_NODES
    return d


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=1000, help="length of the op chain")
    ap.add_argument("--runs", type=int, default=200, help="timed runs (the chain gets runs // 10)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=3, help="rounds; figures are their medians")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args(argv)
    global clock
    clock = CLOCKS[args.clock]

    env = environment()
    print_environment(env)
    rounds = [one_round(args) for _ in range(args.repeat)]
    derived = [per_unit(r, args.nodes) for r in rounds]
    rows = [("per run, 1-node graph (us)", [r["one"] for r in rounds], 1e6, 1),
            (f"run of {args.nodes} nodes (ms)", [r["chain"] for r in rounds], 1e3, 2),
            ("loop_if batch 1 (ms)", [r["loop_b1"] for r in rounds], 1e3, 2),
            ("loop_if batch 8 (ms)", [r["loop_b8"] for r in rounds], 1e3, 2)]
    rows += [(f"{k.replace('_', ' ')}", [{"ours_s": d[k]["ours_s"], "ort_s": d[k]["ort_s"]} for d in derived],
              1.0, 2) for k in derived[0]]
    print(f"\n{'':<34} {'hetero_exec':>12} {'onnxruntime':>12} {'ratio':>7} {'ratio range':>13}")
    for label, ts, scale, digits in rows:
        ours = statistics.median(t["ours_s"] for t in ts)
        ort = statistics.median(t["ort_s"] for t in ts)
        ratios = [t["ours_s"] / t["ort_s"] for t in ts]
        print(f"{label:<34} {scale * ours:>12.{digits}f} {scale * ort:>12.{digits}f} "
              f"{ours / ort:>7.2f} {min(ratios):>6.2f}-{max(ratios):<6.2f}")
    worst = max(t["max_abs_diff"] for r in rounds for t in r.values())
    print(f"max abs diff of the outputs: {worst:.2e}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(
            {"environment": env, "args": vars(args), "rounds": rounds, "derived": derived}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
