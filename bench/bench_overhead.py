"""Per-node and per-run overhead: hetero_exec against onnxruntime on tiny tensors.

``tiny_ops(n)`` chains n element-wise ops on a [1, 16] tensor, so the kernels' own work
is negligible and the time is the runtime's: the run loop, argument passing, output
bookkeeping. The 1-node graph measures what one ``run()`` costs around the nodes
(feed checks, slot lists, output collection).

    python bench/bench_overhead.py                    # 1000 nodes, 200 runs
    python bench/bench_overhead.py --nodes 300 --runs 50 --json bench/results/overhead.json

Reading it: ``us/node`` is (t(n nodes) - t(1 node)) / (n - 1), the cost of one more node;
``per run`` is t(1 node), the fixed cost of a call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.bench_cpu import environment, interleaved, print_environment  # noqa: E402
from bench.models import tiny_ops  # noqa: E402


def measure(nodes: int, runs: int, warmup: int) -> dict[str, Any]:
    """Median seconds per run for ours and onnxruntime on tiny_ops(nodes), interleaved."""
    import onnxruntime as ort

    from hetero_exec.session import InferenceSession

    data = tiny_ops(nodes).SerializeToString()
    ours = InferenceSession(data, providers=["cpu"])
    theirs = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    feed = {"x": np.linspace(-1, 1, 16, dtype=np.float32)[None]}
    a, b = ours.run(None, feed)[0], theirs.run(None, feed)[0]
    t_ours, t_ort = interleaved([lambda: ours.run(None, feed), lambda: theirs.run(None, feed)],
                                runs, warmup)
    return {"nodes": nodes, "ours_s": statistics.median(t_ours), "ort_s": statistics.median(t_ort),
            "max_abs_diff": float(np.abs(np.asarray(a) - b).max())}


def _line(label: str, t: dict[str, float], scale: float, digits: int) -> None:
    ours, ort = t["ours_s"], t["ort_s"]
    cells = f"{scale * ours:>12.{digits}f} {scale * ort:>12.{digits}f}"
    print(f"{label:<28} {cells} {ours / ort:>7.1f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=1000, help="length of the op chain")
    ap.add_argument("--runs", type=int, default=200, help="timed runs (the chain gets runs // 10)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args(argv)

    env = environment()
    print_environment(env)
    one = measure(1, args.runs, args.warmup)
    many = measure(args.nodes, max(args.runs // 10, 5), args.warmup)
    per_node = {k: (many[k] - one[k]) / (args.nodes - 1) for k in ("ours_s", "ort_s")}
    print(f"\n{'':<28} {'hetero_exec':>12} {'onnxruntime':>12} {'ratio':>7}")
    _line("per run, 1-node graph (us)", one, 1e6, 1)
    _line(f"run of {args.nodes} nodes (ms)", many, 1e3, 2)
    _line("per node (us)", per_node, 1e6, 2)
    print(f"max abs diff of the outputs: {max(one['max_abs_diff'], many['max_abs_diff']):.2e}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(
            {"environment": env, "args": vars(args), "one_node": one, "chain": many,
             "per_node_us": {k: 1e6 * v for k, v in per_node.items()}}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
