"""The stage ring without Ray: the two `GenerationStage`s of a decoder in two plain
processes joined by the stage link's Unix sockets (`actors/generation/channel.py`),
4 groups in flight (``--groups``), against one in-process single-threaded generator
running the same sequences one after another. Separates what Ray's actor processes
cost the ring (their threads, their timer, the driver's calls) from what the split and
the sockets cost. The stages here do not poll between steps (`actors/generation/spin.py`
is set up by an actor's `share`, which this bench does not call).

    python bench/ring_without_ray.py [llama_optimum|gpt2_optimum] [--new 200] [--groups 4]
                                     [--in-ray]

The stages are built as the stage actors build them (`split_decoder`, `_compile`) on
sim-gpu:0 and sim-gpu:1, one intra-op thread each; stage 0 starts the 4 prefills, the
last stage's sampled ids go straight back to stage 0 over its socket, and the clock
stops when the last group reaches its length (no driver reads the tokens). Each pair of
processes runs a round first untimed (its plans bind to the step's shapes then, as an
actor's do once), then the timed one.

``--in-ray`` runs the same self-driving ring in two Ray async actors too, each round
(on the actor's event-loop thread, as `GenerationStage` runs its steps, with Ray's
threads and main-thread timer beside it), and prints its ratio to the plain processes'
by round: what hosting the stages in Ray actors costs, apart from the driver.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

GROUPS = 4
PROMPT = 32


def _build(k: int, name: str) -> Any:
    """Stage ``k`` of 2, compiled as a stage actor compiles it; its steps go to the
    next stage over the socket only (no actor handles)."""
    import onnx
    from bench_generate import MODELS

    from actors.generation.split import split_decoder
    from actors.generation.stage import GenerationStage
    from hetero_exec.genai.layout import discover
    from hetero_exec.genai.rewrite import rewrite

    proto = onnx.load(os.path.join(MODELS, f"{name}.onnx"))
    layout = discover(proto, name)
    stage = GenerationStage(k, 2, layout, [f"sim-gpu:{k}"], {"intra_op_num_threads": 1})
    stage._compile(split_decoder(rewrite(proto, layout), layout, 2)[k])
    stage.ring = [None, None]
    return stage


async def _ring_round(stage: Any, new: int, ring: str, ready: Any = None,
                      go: Any = None, groups: int = GROUPS) -> float | None:
    """One round of the ring at ``ring``'s sockets: ``groups`` groups of ``new`` tokens each;
    the last stage returns the tokens/s (stage 0: None). ``ready`` / ``go``: barriers
    with the other stage (else: connect until it listens, start after a pause)."""
    import numpy as np
    from bench_generate import prompt_rows

    from actors.generation.group import GroupSpec, Job

    k = stage.index
    ended: list[float] = []

    def finish(gid: str, g: Any, epoch: int) -> None:  # no other actor to tell
        g.free()
        ended.append(time.perf_counter())

    stage._finish = finish
    stage.link.close()
    await stage.link.listen(f"\0{ring}/{k}")
    if ready is not None:
        ready.wait()  # both listen
    while not await stage.link.connect("node", "node", f"\0{ring}/{(k + 1) % 2}"):
        await asyncio.sleep(0.01)
    cap = PROMPT + new
    for i in range(groups):
        stage.groups.pop(f"g{i}", None)
        stage.open(f"g{i}", GroupSpec(1, cap, 0, np.zeros(1, np.int64),
                                      {"max_length": cap, "batch_size": 1}), 1)
    if go is not None:
        go.wait()
    else:
        await asyncio.sleep(0.3)  # the other stage open too
    t0 = time.perf_counter()
    if k == 0:
        for i in range(groups):
            stage.step(f"g{i}", 1, Job(0, prompt_rows(1, PROMPT) + i, [(0, PROMPT)],
                                       rewind=(0, 0), end=np.full(1, -1), draws=0,
                                       start=np.zeros(1, np.int64)), [{}])
    flag = f"/dev/shm/{ring}"
    while (len(ended) < groups) if k == 1 else not os.path.exists(flag):
        await asyncio.sleep(0.005)
    if k == 0:
        os.remove(flag)
        return None
    open(flag, "w").close()  # stage 0 may stop
    return groups * new / (ended[-1] - t0)


def _stage(k: int, name: str, new: int, ring: str, ready: Any, go: Any, out: Any,
           groups: int) -> None:
    import uvloop

    stage = _build(k, name)

    async def rounds() -> None:
        for tag in ("warm", "timed"):  # the first binds the plans to these shapes
            tps = await _ring_round(stage, new, f"{ring}_{tag}", ready, go, groups)
            if tps is not None:
                out.put(tps)

    uvloop.run(rounds())


def ring_tokens_per_s(name: str, new: int, groups: int = GROUPS) -> float:
    ctx = mp.get_context("spawn")
    ready, go, out = ctx.Barrier(3), ctx.Barrier(3), ctx.Queue()
    ring = f"hetero_exec_ring_bench_{os.getpid()}_{time.monotonic_ns()}"
    procs = [ctx.Process(target=_stage, args=(k, name, new, ring, ready, go, out, groups))
             for k in range(2)]
    for p in procs:
        p.start()
    import queue
    import threading

    deadline = time.monotonic() + 300
    got: list[float] = []
    try:
        for _ in ("warm", "timed"):  # the stages' processes stay, as actors do
            ready.wait(timeout=300)
            time.sleep(0.2)  # both connected
            go.wait(timeout=300)
            while True:
                try:
                    got.append(out.get(timeout=1))
                    break
                except queue.Empty:
                    if time.monotonic() > deadline or not all(p.is_alive() for p in procs):
                        raise RuntimeError("a stage process failed or the ring stalled") \
                            from None
    except (RuntimeError, threading.BrokenBarrierError):
        for p in procs:
            p.kill()
        raise
    for p in procs:
        p.join(60)
    return got[-1]


class RingHost:
    """A stage of the self-driving ring in a Ray async actor (made remote in `main`)."""

    def __init__(self, k: int, name: str):
        self.stage = _build(k, name)

    async def run(self, new: int, ring: str, groups: int = GROUPS) -> float | None:
        return await _ring_round(self.stage, new, ring, groups=groups)


def alone_tokens_per_s(name: str, new: int, groups: int = GROUPS) -> float:
    from bench_generate import MODELS, prompt_rows
    from bench_generate_ray import _tokens_per_s

    import hetero_exec.genai as hg

    model = hg.Model(os.path.join(MODELS, f"{name}.onnx"), providers=["sim-gpu:0"],
                     intra_op_num_threads=1)
    prompts = [prompt_rows(1, PROMPT) + i for i in range(groups)]
    _tokens_per_s(model, prompts, new, False, True)  # plans bound for these shapes
    return _tokens_per_s(model, prompts, new, False, True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="llama_optimum")
    ap.add_argument("--new", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--groups", type=int, default=GROUPS,
                    help="groups in flight (1: batch 1's latency, a stage waiting on the other)")
    ap.add_argument("--in-ray", action="store_true",
                    help="also the same ring in two Ray actors, each round")
    args = ap.parse_args()
    hosts: list[Any] = []
    if args.in_ray:
        import ray

        path = os.pathsep.join([HERE, os.path.dirname(HERE)])
        ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR",
                 runtime_env={"env_vars": {"PYTHONPATH": path}})
        host = ray.remote(num_cpus=0)(RingHost)
        hosts = [host.remote(k, args.model) for k in range(2)]
    ring, alone, in_ray = [], [], []
    try:
        for r in range(args.rounds):  # interleaved
            ring.append(ring_tokens_per_s(args.model, args.new, args.groups))
            alone.append(alone_tokens_per_s(args.model, args.new, args.groups))
            if hosts:
                name = f"hetero_exec_ring_bench_ray_{os.getpid()}_{r}"
                runs = [h.run.remote(args.new, name, args.groups) for h in hosts]
                in_ray.append(ray.get(runs)[1])
    finally:
        if hosts:
            ray.shutdown()
    r, a = statistics.median(ring), statistics.median(alone)
    print(f"{args.model}: {args.groups} group(s) on two stage processes joined by sockets, "
          f"no Ray: {r:.1f} tok/s; one in-process thread one after another: {a:.1f} tok/s: "
          f"{r / a:.2f}x (medians of {args.rounds})")
    by_round = sorted(y / x for x, y in zip(ring, alone))
    print(f"{args.model}: time a token, the ring against in process, by round: "
          f"{statistics.median(by_round):.2f}x ({by_round[0]:.2f}-{by_round[-1]:.2f})")
    if in_ray:
        by_round = sorted(x / y for x, y in zip(in_ray, ring))
        print(f"{args.model}: the same ring in two Ray actors: {statistics.median(in_ray):.1f} "
              f"tok/s, {statistics.median(in_ray) / a:.2f}x in process; against the plain "
              f"processes {statistics.median(by_round):.2f}x by round "
              f"({by_round[0]:.2f}-{by_round[-1]:.2f}; ahead in "
              f"{sum(x > 1 for x in by_round)} of {len(by_round)})")


if __name__ == "__main__":
    main()
