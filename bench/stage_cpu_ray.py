"""Where a stage actor's CPU goes inside the running ring: 4 groups in flight (``--groups``) on two
single-threaded stages with the throughput settings, and per decode step of each stage
the CPU of the thread that runs its steps (from /proc), split into the runner's, the
rest of the step's (`GenerationStage._step`: bookkeeping, sampling, the sends) and what
the thread spends outside steps (the event loop, the frame's read and decode).

The timers go in through Ray's ``__ray_call__`` (nothing in the library is changed);
each costs a few syscalls a step, so the figures run slightly high.

Each round then runs the in-process single-threaded generator over the same prompts
(one after another) and prints its CPU a token beside the sum of the stages' runners.
With ``--groups 1`` each stage waits for the other between its steps (a whole step's
time), and its next step starts cold (why: ``--rerun`` below): 2026-12-06, on a
2-core Intel VM, Llama's two runners took 3.4-4.6 ms a token with 1 group against
3.1-3.9 with 4 in the same minutes (4 of 5 pairs), and the in-process loop made to
sleep 2 ms between its tokens spent 1.22-1.31x the CPU a token of the same loop without
(three runs, `idle_cost.py`; spinning those 2 ms instead 1.02-1.16x; 0.5 ms pauses
0.94-1.13x either way).

``--rerun`` runs each runner call again at once on the same feeds and prints the step's
runner against that warm repeat: on the same host on 2026-12-07, with 1 group 1.13-1.20x
(stage 0 and 1, three rounds), with 4 groups 0.99-1.09x. A thread in each stage that spun
under SCHED_IDLE between steps (so that no vCPU halted; an ad-hoc C loop, not kept) left
the 1-group figure as it was (1.08-1.30x with it and without, pinned or not): in the
ring, what a stage finds cold after the other stage's step is its caches, which the
other processes used meanwhile, more than a halted vCPU (which alone, in process, costs
as much: `idle_cost.py`).

    python bench/stage_cpu_ray.py [--model gpt2_optimum] [--new 200] [--rounds 4] [--groups 1]
                                  [--rerun]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from bench_generate import MODELS, prompt_rows  # noqa: E402
from bench_generate_ray import DEVICES, _tokens_per_s  # noqa: E402

import hetero_exec.genai as hg  # noqa: E402

_KEYS = ("run_cpu", "run_wall", "runs", "step_cpu", "rerun_cpu")


def _install_timers(stage: Any, rerun: bool = False) -> None:
    """In the stage actor: time each runner call and each step (thread CPU, wall); with
    ``rerun``, run each call again at once on the same feeds (its caches warm) and time
    that apart (the repeat writes the same cache entries again: the tokens stay)."""
    import threading
    import time

    acc = stage._bench_timers = {k: 0 for k in _KEYS}
    acc["tid"] = 0
    run, step = stage.runner.run, stage._step

    def timed_run(feeds: Any) -> Any:
        c, w = time.thread_time_ns(), time.perf_counter_ns()
        out = run(feeds)
        acc["run_cpu"] += time.thread_time_ns() - c
        acc["run_wall"] += time.perf_counter_ns() - w
        acc["runs"] += 1
        if rerun:
            c = time.thread_time_ns()
            run(feeds)
            acc["rerun_cpu"] += time.thread_time_ns() - c
        return out

    def timed_step(*args: Any) -> None:
        acc["tid"] = threading.get_native_id()
        c = time.thread_time_ns()
        step(*args)
        acc["step_cpu"] += time.thread_time_ns() - c

    stage.runner.run, stage._step = timed_run, timed_step


def _take_timers(stage: Any) -> dict[str, int]:
    """In the stage actor: the sums since the last call (and the stepping thread's id)."""
    acc = stage._bench_timers
    out = dict(acc)
    for k in _KEYS:
        acc[k] = 0
    return out


def _thread_cpu_ns(pid: int, tid: int) -> int:
    with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
        return int(f.read().split()[0])


def main() -> None:
    import ray

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama_optimum")
    ap.add_argument("--new", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--groups", type=int, default=4, help="groups in flight")
    ap.add_argument("--rerun", action="store_true",
                    help="run each runner call again at once on the same feeds (warm), and "
                         "print the step's runner against that")
    args = ap.parse_args()
    model = hg.Model(os.path.join(MODELS, f"{args.model}.onnx"), executor="ray", stages=2,
                     providers=DEVICES, intra_op_num_threads=1, stage_cores="auto",
                     yield_to_stages=True)
    local = hg.Model(os.path.join(MODELS, f"{args.model}.onnx"), providers=DEVICES[:1],
                     intra_op_num_threads=1)
    try:
        actors = model.remote.actors
        prompts = [prompt_rows(1, 32) + i for i in range(args.groups)]
        ray.get([a.__ray_call__.remote(_install_timers, args.rerun) for a in actors])
        _tokens_per_s(model, prompts, args.new, True, True)  # warm, and each thread known
        _tokens_per_s(local, prompts, args.new, False, True)
        pids = [i["pid"] for i in ray.get([a.info.remote() for a in actors])]
        print(f"{args.model}: per decode step of each stage, us of the stepping thread's CPU "
              "(runner's wall in brackets)")
        for _ in range(args.rounds):
            tids = [t["tid"] for t in ray.get([a.__ray_call__.remote(_take_timers)
                                               for a in actors])]
            before = [_thread_cpu_ns(p, t) for p, t in zip(pids, tids)]
            tps = _tokens_per_s(model, prompts, args.new, True, True)
            sums = ray.get([a.__ray_call__.remote(_take_timers) for a in actors])
            after = [_thread_cpu_ns(p, t) for p, t in zip(pids, tids)]
            cells = []
            for k, (s, b, a) in enumerate(zip(sums, before, after)):
                n = max(s["runs"], 1)
                rest = s["step_cpu"] - s["run_cpu"] - s["rerun_cpu"]
                again = (f" [again at once {s['rerun_cpu'] / n / 1e3:3.0f}: the step's "
                         f"{s['run_cpu'] / max(s['rerun_cpu'], 1):.2f}x]" if args.rerun else "")
                cells.append(f"stage#{k} {(a - b - s['rerun_cpu']) / n / 1e3:4.0f} = runner "
                             f"{s['run_cpu'] / n / 1e3:3.0f} ({s['run_wall'] / n / 1e3:3.0f})"
                             f"{again} + rest of step {rest / n / 1e3:3.0f} "
                             f"+ outside steps {(a - b - s['step_cpu']) / n / 1e3:3.0f}")
            own = time.thread_time()
            local_tps = _tokens_per_s(local, prompts, args.new, False, True)
            local_us = (time.thread_time() - own) / (len(prompts) * args.new) * 1e6
            runners = sum(s["run_cpu"] / max(s["runs"], 1) for s in sums) / 1e3
            print(f"{tps:6.0f} tok/s | " + " | ".join(cells) + f" | in process {local_tps:4.0f} "
                  f"tok/s, {local_us:4.0f} us a token: the runners {runners / local_us:.2f}x "
                  "that", flush=True)
    finally:
        model.close()
        if ray.is_initialized():
            ray.shutdown()


if __name__ == "__main__":
    main()
