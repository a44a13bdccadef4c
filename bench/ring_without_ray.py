"""The stage ring without Ray: the two `GenerationStage`s of a decoder in two plain
processes joined by the stage link's Unix sockets (`actors/generation/channel.py`),
4 groups in flight, against one in-process single-threaded generator running the same
sequences one after another. Separates what Ray's actor processes cost the ring (their
threads, their timer, the driver's calls) from what the split and the sockets cost.

    python bench/ring_without_ray.py [llama_optimum|gpt2_optimum] [--new 200]

The stages are built as the stage actors build them (`split_decoder`, `_compile`) on
sim-gpu:0 and sim-gpu:1, one intra-op thread each; stage 0 starts the 4 prefills, the
last stage's sampled ids go straight back to stage 0 over its socket, and the clock
stops when the last group reaches its length (no driver reads the tokens).
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


def _stage(k: int, name: str, new: int, ring: str, ready: Any, go: Any, out: Any) -> None:
    import numpy as np
    import onnx
    import uvloop
    from bench_generate import MODELS, prompt_rows

    from actors.generation.group import GroupSpec, Job
    from actors.generation.split import split_decoder
    from actors.generation.stage import GenerationStage
    from hetero_exec.genai.layout import discover
    from hetero_exec.genai.rewrite import rewrite

    proto = onnx.load(os.path.join(MODELS, f"{name}.onnx"))
    layout = discover(proto, name)
    stage = GenerationStage(k, 2, layout, [f"sim-gpu:{k}"], {"intra_op_num_threads": 1})
    stage._compile(split_decoder(rewrite(proto, layout), layout, 2)[k])
    ended: list[float] = []

    def finish(gid: str, g: Any, epoch: int) -> None:  # no other actor to tell
        g.free()
        ended.append(time.perf_counter())

    stage._finish = finish  # type: ignore[method-assign]
    stage.ring = [None, None]  # no actor handles: every step goes over the sockets
    cap = PROMPT + new

    async def main() -> None:
        await stage.link.listen(f"\0{ring}/{k}")
        ready.wait()  # both listen
        await stage.link.connect("node", "node", f"\0{ring}/{(k + 1) % 2}")
        for i in range(GROUPS):
            stage.open(f"g{i}", GroupSpec(1, cap, 0, np.zeros(1, np.int64),
                                          {"max_length": cap, "batch_size": 1}), 1)
        go.wait()
        t0 = time.perf_counter()
        if k == 0:
            for i in range(GROUPS):
                stage.step(f"g{i}", 1, Job(0, prompt_rows(1, PROMPT) + i, [(0, PROMPT)],
                                           rewind=(0, 0), end=np.full(1, -1), draws=0,
                                           start=np.zeros(1, np.int64)), [{}])
        while (len(ended) < GROUPS) if k == 1 else not os.path.exists(f"/dev/shm/{ring}"):
            await asyncio.sleep(0.005)
        if k == 1:
            out.put(GROUPS * new / (ended[-1] - t0))
            open(f"/dev/shm/{ring}", "w").close()  # stage 0 may stop
        else:
            os.remove(f"/dev/shm/{ring}")

    uvloop.run(main())


def ring_tokens_per_s(name: str, new: int) -> float:
    ctx = mp.get_context("spawn")
    ready, go, out = ctx.Barrier(3), ctx.Barrier(3), ctx.Queue()
    ring = f"hetero_exec_ring_bench_{os.getpid()}_{time.monotonic_ns()}"
    procs = [ctx.Process(target=_stage, args=(k, name, new, ring, ready, go, out))
             for k in range(2)]
    for p in procs:
        p.start()
    ready.wait()
    time.sleep(0.2)  # both connected
    go.wait()
    import queue

    deadline = time.monotonic() + 300
    while True:
        try:
            tps = out.get(timeout=1)
            break
        except queue.Empty:
            if time.monotonic() > deadline or not all(p.is_alive() for p in procs):
                for p in procs:
                    p.kill()
                raise RuntimeError("a stage process failed or the ring stalled") from None
    for p in procs:
        p.join(60)
    return tps


def alone_tokens_per_s(name: str, new: int) -> float:
    from bench_generate import MODELS, prompt_rows
    from bench_generate_ray import _tokens_per_s

    import hetero_exec.genai as hg

    model = hg.Model(os.path.join(MODELS, f"{name}.onnx"), providers=["sim-gpu:0"],
                     intra_op_num_threads=1)
    prompts = [prompt_rows(1, PROMPT) + i for i in range(GROUPS)]
    _tokens_per_s(model, prompts, new, False, True)  # plans bound for these shapes
    return _tokens_per_s(model, prompts, new, False, True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="llama_optimum")
    ap.add_argument("--new", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    ring, alone = [], []
    for _ in range(args.rounds):  # interleaved
        ring.append(ring_tokens_per_s(args.model, args.new))
        alone.append(alone_tokens_per_s(args.model, args.new))
    r, a = statistics.median(ring), statistics.median(alone)
    print(f"{args.model}: 4 groups on two stage processes joined by sockets, no Ray: "
          f"{r:.1f} tok/s; one in-process thread one after another: {a:.1f} tok/s: "
          f"{r / a:.2f}x (medians of {args.rounds})")


if __name__ == "__main__":
    main()
