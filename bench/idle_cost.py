"""What an idle core costs the next decode step on this host: the in-process
single-threaded generator (strict sim-gpu, batch 1) timed by its thread's CPU a token,
in paired rounds: back to back; with a sleep of ``--pause`` seconds after each token;
and with a spin of the same length instead.

A stage of the two-stage ring waits for the other between its steps (at batch 1 a whole
step's time); on a VM whose idle vCPU halts at once (``haltpoll.guest_halt_poll_ns=0``)
its next step starts with cold caches. The sleeping loop shows that cost without Ray:
2026-12-06, 2-core Intel VM, Llama, 2 ms pauses: 1.22-1.31x the CPU a token (three runs
of 8-12 rounds), spinning 1.02-1.16x; 0.5 ms pauses: 0.94-1.13x either way.

    python bench/idle_cost.py [--model gpt2_optimum] [--pause 0.002] [--rounds 12]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_generate import MODELS, prompt_rows  # noqa: E402

import hetero_exec.genai as hg  # noqa: E402

WAYS = ("back to back", "sleep", "spin")


def cpu_us_per_token(model, rows, new: int, pause: float, way: str) -> float:
    """The generating thread's CPU a decode token (the pauses not counted)."""
    params = hg.GeneratorParams(model)
    params.set_search_options(batch_size=1, max_length=rows.shape[1] + new)
    with hg.Generator(model, params) as gen:
        gen.append_tokens(rows)
        gen.generate_next_token()
        spent, n = 0.0, 0
        while not gen.is_done():
            c = time.thread_time()
            gen.generate_next_token()
            spent += time.thread_time() - c
            n += 1
            if way == "sleep":
                time.sleep(pause)
            elif way == "spin":
                end = time.perf_counter() + pause
                while time.perf_counter() < end:
                    pass
        return spent / max(n, 1) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama_optimum")
    ap.add_argument("--pause", type=float, default=0.002, help="seconds after each token")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=12)
    args = ap.parse_args()
    model = hg.Model(os.path.join(MODELS, f"{args.model}.onnx"), providers=["sim-gpu:0"],
                     intra_op_num_threads=1)
    rows = prompt_rows(1, 32)
    cpu_us_per_token(model, rows, args.new, 0.0, WAYS[0])  # plans bound
    runs: dict[str, list[float]] = {w: [] for w in WAYS}
    for _ in range(args.rounds):  # interleaved: the host's phase moves between rounds
        for way in WAYS:
            runs[way].append(cpu_us_per_token(model, rows, args.new, args.pause, way))
    base = runs[WAYS[0]]
    print(f"{args.model}: CPU us a decode token, medians of {args.rounds} rounds: " + ", ".join(
        f"{w} {statistics.median(v):.0f}" for w, v in runs.items()))
    for way in WAYS[1:]:
        ratios = sorted(b / a for a, b in zip(base, runs[way]))
        print(f"  {args.pause * 1e3:g} ms {way} after each token: {statistics.median(ratios):.3f}x "
              f"back to back (the median of the rounds' ratios; {ratios[0]:.2f}-{ratios[-1]:.2f})")


if __name__ == "__main__":
    main()
