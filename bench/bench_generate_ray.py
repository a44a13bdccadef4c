"""``bench_generate.py --executor ray``: the two-stage generator on Ray (actors/generation)
against the in-process generator and onnxruntime's loop, interleaved in one run.

Figures per model:
* decode ms per token at batch 1, prompts 32 and 512 (after the first token: the ring
  runs ahead of the driver, so a single ``generate_next_token`` call is no measure;
  (time of the last token - time of the first) / (tokens - 1) is), with the ring's hops
  over the stages' Unix sockets (the default on one node) and as Ray actor calls
  (``stage_link="ray"``, the path across nodes), and the socket ring again with its
  stages polling for their next step (``stage_spin_ms``, off by default where two
  stages share 2 cores: actors/generation/spin.py);
* 4 groups in flight (batch 1 each, round robin) on two single-threaded stages:
  tokens/s against an in-process single-threaded generator running the same 4
  sequences one after the other; and the same with default threads on both sides;
  each counting the generators' opening (the driver's admission; each stage opens a
  group with its first step), and with them open before the clock starts (what the
  ring itself sustains);
* a chat's next turn: the time from appending 8 tokens (5 ms after 8 generated, the
  ring running ahead) to the first token after them, on the ring and in process;
* a scoring loop: get_logits after every token, ms a token, on the ring and in process;
* an answer made again: ms from rewind_to a 320-token prompt's end (16 tokens after it)
  to the first token after it, on the ring and in process;
* continuous batching (actors/generation/batcher.py): 8 requests of different lengths
  submitted at once to a ContinuousBatcher of 4 rows on the two single-threaded stages,
  against one in-process thread running them one after another and as static batches
  of 4.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import numpy as np
import onnx

import hetero_exec.genai as hg
from hetero_exec.genai.layout import discover

DEVICES = ["sim-gpu:0", "sim-gpu:1"]
#: the batch-1 rows' spinning ring (its default is off where two stages share 2 cores)
SPIN_MS = 5.0
#: rounds of the 4-groups figure, each a pair (the ring and in process, `in_turn`): on a
#: shared 2-core host one round's tokens/s moves +-15% either side, the pair's ratio
#: less; on 2026-12-07 a round's ratio ranged 0.8-1.7 as the host's speed moved
PAIRED_ROUNDS = 15


def in_turn(ring: Any, alone: Any, k: int) -> tuple[Any, Any]:
    """(ring(), alone()) of the k-th round: the ring first in even rounds and second in
    odd ones, so a host speeding up or slowing down over a round weighs on both
    sides alike (the ring always first put it on one side)."""
    if k % 2:
        second = alone()
        return ring(), second
    first = ring()
    return first, alone()


def paired_row(name: str, what: str, rounds: int, ring: Any, alone: Any) -> None:
    """Print the medians of ``rounds`` pairs (`in_turn`), the ring's and in process's,
    and of their ratios with the range."""
    pairs = [in_turn(ring, alone, k) for k in range(rounds)]
    ratios = sorted(a / b for a, b in pairs)
    print(f"{name:14} {what}: ray {statistics.median(a for a, _ in pairs):.2f}, in process "
          f"{statistics.median(b for _, b in pairs):.2f} ({statistics.median(ratios):.2f}x; "
          f"{ratios[0]:.2f}-{ratios[-1]:.2f})", flush=True)


def decode_ms(model, rows: np.ndarray, new: int) -> float:
    params = hg.GeneratorParams(model)
    params.set_search_options(batch_size=rows.shape[0], max_length=rows.shape[1] + new)
    with hg.Generator(model, params) as gen:
        gen.append_tokens(rows)
        gen.generate_next_token()
        t0 = time.perf_counter()
        n = 0
        while not gen.is_done():
            gen.generate_next_token()
            n += 1
        return (time.perf_counter() - t0) / max(n, 1) * 1e3


def turn_ms(model, rows: np.ndarray, made: int = 8, appended: int = 8,
            pause_s: float = 0.005) -> float:
    """A chat's next turn: ms from appending ``appended`` tokens, ``pause_s`` after the
    last of ``made`` tokens generated (the caller's own work between: printing the
    answer, encoding the next prompt; the ring runs ahead meanwhile), to the first
    token after them."""
    params = hg.GeneratorParams(model)
    params.set_search_options(batch_size=1, max_length=rows.shape[1] + made + appended + 200)
    with hg.Generator(model, params) as gen:
        gen.append_tokens(rows)
        for _ in range(made):
            gen.generate_next_token()
        time.sleep(pause_s)
        t0 = time.perf_counter()
        gen.append_tokens(rows[:, :appended] + 1)
        gen.generate_next_token()
        return (time.perf_counter() - t0) * 1e3


def again_ms(model, rows: np.ndarray, made: int = 16) -> float:
    """An answer made again: ms from `rewind_to` the prompt's end, ``made`` tokens after
    it, to the first token after the rewind (the prompt's cache stays on each side)."""
    params = hg.GeneratorParams(model)
    params.set_search_options(batch_size=1, max_length=rows.shape[1] + made + 200)
    with hg.Generator(model, params) as gen:
        gen.append_tokens(rows)
        for _ in range(made):
            gen.generate_next_token()
        t0 = time.perf_counter()
        gen.rewind_to(rows.shape[1])
        gen.generate_next_token()
        return (time.perf_counter() - t0) * 1e3


def scoring_ms(model, rows: np.ndarray, new: int = 32) -> float:
    """A scoring loop: ``get_logits`` after the prompt and after every token; ms a token
    (generate_next_token and get_logits), the first call (which runs the last token
    again on either side) included."""
    params = hg.GeneratorParams(model)
    params.set_search_options(batch_size=rows.shape[0], max_length=rows.shape[1] + new)
    with hg.Generator(model, params) as gen:
        gen.append_tokens(rows)
        t0 = time.perf_counter()
        gen.get_logits()
        n = 0
        while not gen.is_done():
            gen.generate_next_token()
            gen.get_logits()
            n += 1
        return (time.perf_counter() - t0) / max(n, 1) * 1e3


def cpu_ms_per_token(model, rows: np.ndarray, new: int,
                     spun: list[float] | None = None) -> list[float]:
    """CPU ms per decoded token: [the driver, each stage actor] (the stages' from /proc:
    one node; every thread's time on a core, in ns, not /proc/<pid>/stat's 10 ms ticks,
    which over a 64-token generation were +-0.15 ms a token), or [the process] in
    process. ``spun``: filled with each stage's ms a token of that spent polling for its
    next step (`actors/generation/spin.py`)."""
    import ray

    pids = []
    spun_before: list[float] = []
    if model.remote is not None:
        pids = [i["pid"] for i in ray.get([a.info.remote() for a in model.remote.actors])]
        spun_before = [st["spun_s"] for st in model.remote.stats()]
    params = hg.GeneratorParams(model)
    params.set_search_options(batch_size=rows.shape[0], max_length=rows.shape[1] + new)
    with hg.Generator(model, params) as gen:
        gen.append_tokens(rows)
        gen.generate_next_token()
        before, own, n = [_sched_s(p)[0] for p in pids], time.process_time(), 0
        while not gen.is_done():
            gen.generate_next_token()
            n += 1
        # the ring ran ahead of the driver: the stages' CPU is spent by now
        spent = [time.process_time() - own] + [_sched_s(p)[0] - b for p, b in zip(pids, before)]
    if spun is not None and spun_before:
        spun[:] = [(st["spun_s"] - b) / max(n, 1) * 1e3
                   for st, b in zip(model.remote.stats(), spun_before)]
    return [s / max(n, 1) * 1e3 for s in spent]


def _sched_s(pid: int) -> tuple[float, float]:
    """A process's (seconds on a core, seconds runnable but waiting for one), all its
    threads (Linux /proc/<pid>/task/*/schedstat)."""
    on = wait = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = open(f"/proc/{pid}/task/{tid}/schedstat").read().split()
        except OSError:  # the thread ended
            continue
        on, wait = on + int(fields[0]), wait + int(fields[1])
    return on / 1e9, wait / 1e9


def stage_pids(model) -> list[int]:
    import ray

    return [i["pid"] for i in ray.get([a.info.remote() for a in model.remote.actors])]


def tokens_per_s(model, prompts: list[np.ndarray], new: int, in_flight: bool
                 ) -> tuple[float, float]:
    """Tokens/s over ``prompts`` (batch 1 each): all in flight, round robin, or one after
    the other; (counting the groups' opening, with the groups already open). Opening
    is the driver's admission and the first step's trip through the ring (until
    2026-12-05 it was a Ray call to every stage, which waited behind the running
    groups' steps: 15-40 ms each on a 2-core host)."""
    return _tokens_per_s(model, prompts, new, in_flight, False), \
        _tokens_per_s(model, prompts, new, in_flight, True)


def _tokens_per_s(model, prompts: list[np.ndarray], new: int, in_flight: bool,
                  opened: bool) -> float:
    def generator() -> Any:
        params = hg.GeneratorParams(model)
        params.set_search_options(batch_size=1, max_length=prompts[0].shape[1] + new)
        return hg.Generator(model, params)

    ready = [generator() for _ in prompts] if opened else []  # untimed
    t0 = time.perf_counter()
    gens = []
    total = 0
    for k, rows in enumerate(prompts):
        gen = ready[k] if opened else generator()
        gen.append_tokens(rows)
        if in_flight:
            gens.append(gen)
            continue
        while not gen.is_done():
            gen.generate_next_token()
            total += 1
        gen.close()
    while gens:
        for gen in list(gens):
            gen.generate_next_token()
            total += 1
            if gen.is_done():
                gen.close()
                gens.remove(gen)
    return total / (time.perf_counter() - t0)


def _ceiling_worker(path: str, prompts: list[np.ndarray], new: int, conn: Any) -> None:
    """One process of `TwoWayCeiling`: the in-process single-threaded generator, warm,
    running ``prompts`` one after another each time it is told to."""
    model = hg.Model(path, providers=["sim-gpu:0"], intra_op_num_threads=1)
    _tokens_per_s(model, prompts, new, False, True)  # warm: plans bound for these shapes
    conn.send("ready")
    while conn.recv() == "go":
        t0 = time.perf_counter()
        tps = _tokens_per_s(model, prompts, new, False, True)
        conn.send((tps, t0, time.perf_counter()))


class TwoWayCeiling:
    """What two-way parallelism of this work gives on this host at a given moment: two
    processes each running the in-process single-threaded generator, one alone and
    then both at once (no pipeline, no messages between them). The pipeline's figure is
    to be read against this one, measured in the same rounds, not against 2x: on a
    shared host the second core's share moves with the neighbours."""

    def __init__(self, path: str, prompts: list[np.ndarray], new: int):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for _ in range(2):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_ceiling_worker, args=(path, prompts, new, theirs))
            proc.start()
            self.conns.append(ours)
            self.procs.append(proc)
        for c in self.conns:
            if not c.poll(600) or c.recv() != "ready":
                raise RuntimeError("a ceiling worker did not start")

    def round(self) -> tuple[float, float]:
        """(tokens/s of one alone, tokens/s of the two at once together)."""
        result = []
        for n in (1, 2):
            for c in self.conns[:n]:
                c.send("go")
            got = [c.recv() for c in self.conns[:n]]
            wall = max(e for _, _, e in got) - min(b for _, b, _ in got)
            result.append(sum(tps * (e - b) for tps, b, e in got) / wall)
        return result[0], result[1]

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send("stop")
            except OSError:
                pass
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()

    def __enter__(self) -> "TwoWayCeiling":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def parallel_ceiling(path: str, prompts: list[np.ndarray], new: int) -> tuple[float, float]:
    """One round of `TwoWayCeiling`: (one alone, two at once together), tokens/s."""
    with TwoWayCeiling(path, prompts, new) as ceiling:
        return ceiling.round()


def batcher_tokens_per_s(model, requests: list[tuple[np.ndarray, int]], slots: int
                         ) -> tuple[float, dict]:
    """Tokens/s of ``requests`` ((prompt [1, n], new tokens)) submitted at once to a
    ContinuousBatcher of ``slots`` rows (continuous batching on the stage ring)."""
    from actors.generation.batcher import ContinuousBatcher, wait_all

    cap = max(r.shape[1] + n for r, n in requests) + max(n for _, n in requests)
    with ContinuousBatcher(model, slots=slots, max_length=cap) as batcher:
        t0 = time.perf_counter()
        handles = [batcher.submit(r[0], n) for r, n in requests]
        total = sum(len(t) for t in wait_all(handles, timeout=600))
        took = time.perf_counter() - t0
        return total / took, batcher.stats()


def alone_tokens_per_s(model, requests: list[tuple[np.ndarray, int]], batch: int = 1) -> float:
    """Tokens/s of ``requests`` in process, ``batch`` at a time (batch 1: one after another)."""
    t0, total = time.perf_counter(), 0
    for k in range(0, len(requests), batch):
        part = requests[k:k + batch]
        new = max(n for _, n in part)
        params = hg.GeneratorParams(model)
        params.set_search_options(batch_size=len(part),
                                  max_length=max(r.shape[1] for r, _ in part) + new)
        with hg.Generator(model, params) as gen:
            gen.append_tokens([list(r[0]) for r, _ in part])
            for _ in range(new):
                if gen.is_done():
                    break
                gen.generate_next_token()
        total += sum(n for _, n in part)
    return total / (time.perf_counter() - t0)


class _Echo:
    """A bare ring member: what a step costs in Ray alone (an async actor calling the next)."""

    def __init__(self):
        import asyncio

        self.made, self.changed, self.ring, self.index = 0, asyncio.Event(), [], 0

    def connect(self, ring: list, index: int) -> None:
        self.ring, self.index = ring, index

    async def step(self, left: int, payload: dict) -> None:
        if self.index == len(self.ring) - 1:
            self.made += 1
            self.changed.set()
            if left == 0:
                return
            left -= 1
        self.ring[(self.index + 1) % len(self.ring)].step.remote(left, payload)

    async def wait(self, made: int) -> int:
        while self.made < made:
            self.changed.clear()
            await self.changed.wait()
        return self.made


def ring_floor_ms(rounds: int = 200) -> float:
    """ms per round of a bare two-actor ring carrying a hidden state's bytes."""
    import ray

    echo = ray.remote(_Echo)
    ring = [echo.remote(), echo.remote()]
    ray.get([a.connect.remote(ring, i) for i, a in enumerate(ring)])
    payload = {"hidden": np.zeros((1, 1, 64), np.float32)}
    t0 = time.perf_counter()
    ring[0].step.remote(rounds, payload)
    ray.get(ring[1].wait.remote(rounds + 1))
    for a in ring:
        ray.kill(a)
    return (time.perf_counter() - t0) / (rounds + 1) * 1e3


def ray_main(args, models_dir: str, prompt_rows, ort_session, time_ort_loop) -> None:
    import ray

    names = [m for m in args.models if not m.endswith("_genai")]
    if names == ["llama_optimum", "llama_dynamo", "gpt2_optimum", "gpt2_dynamo"]:
        names = ["llama_optimum", "gpt2_optimum"]  # the default list: one export each
    rounds = max(args.rounds, PAIRED_ROUNDS)
    print(f"{'model':14} {'P':>4} {'ray 2 stages':>12} {'ray calls':>9} {'in process':>10} "
          f"{'ort loop':>9} {'ray/in-proc':>11} {'calls/in-proc':>13}   (decode ms per token, "
          f"batch 1, medians of {rounds}; ray/in-proc: the median of the rounds' ratios, "
          f"their range after it; 'ray calls': stage_link=\"ray\"; then the same ring "
          f"with its stages polling for their next step, stage_spin_ms={SPIN_MS:g})")
    throughput, batching, ceilings = [], [], []
    try:
        for name in names:
            path = os.path.join(models_dir, f"{name}.onnx")
            remote = hg.Model(path, executor="ray", stages=2, providers=DEVICES)
            calls = hg.Model(path, executor="ray", stages=2, providers=DEVICES, stage_link="ray")
            spin = hg.Model(path, executor="ray", stages=2, providers=DEVICES,
                            stage_spin_ms=SPIN_MS)
            local = hg.Model(path, providers=["sim-gpu:0"])
            sess, layout = ort_session(path), discover(onnx.load(path))
            per_prompt = {}
            for plen in args.prompt:
                rows = prompt_rows(1, plen)
                res: dict[str, list[float]] = {"ray": [], "calls": [], "local": [], "ort": [],
                                               "spin": []}
                for _ in range(rounds):  # the ring and in process back to back each round
                    res["ray"].append(decode_ms(remote, rows, args.new))
                    res["local"].append(decode_ms(local, rows, args.new))
                    res["spin"].append(decode_ms(spin, rows, args.new))
                    res["calls"].append(decode_ms(calls, rows, args.new))
                    res["ort"].append(time_ort_loop(sess, layout, rows, args.new)[1])
                med = {k: statistics.median(v) for k, v in res.items()}
                per_prompt[plen] = med
                paired = sorted(a / b for a, b in zip(res["ray"], res["local"]))
                print(f"{name:14} {plen:4d} {med['ray']:12.3f} {med['calls']:9.3f} "
                      f"{med['local']:10.3f} {med['ort']:9.3f} {statistics.median(paired):10.2f}x "
                      f"{med['calls'] / med['local']:12.2f}x   ({paired[0]:.2f}-{paired[-1]:.2f})",
                      flush=True)
                spun = sorted(a / b for a, b in zip(res["spin"], res["local"]))
                against = sorted(a / b for a, b in zip(res["spin"], res["ray"]))
                print(f"{name:14} {plen:4d} polling stages {med['spin']:.3f} ms: "
                      f"{statistics.median(spun):.2f}x in process ({spun[0]:.2f}-{spun[-1]:.2f}),"
                      f" {statistics.median(against):.2f}x the default ring (faster in "
                      f"{sum(x < 1 for x in against)} of {rounds} rounds)", flush=True)
            if len(per_prompt) > 1:
                lo, hi = min(per_prompt), max(per_prompt)
                print(f"{name:14} growth P{hi}/P{lo}: ray {per_prompt[hi]['ray'] / per_prompt[lo]['ray']:.2f}x, "
                      f"in process {per_prompt[hi]['local'] / per_prompt[lo]['local']:.2f}x, "
                      f"ort loop {per_prompt[hi]['ort'] / per_prompt[lo]['ort']:.2f}x", flush=True)
            stats = remote.remote.stats()
            print(f"{name:14} compute per decode step: " + ", ".join(
                f"{st['stage']} {st['decode_ms']:.3f} ms" for st in stats)
                + " (the rest of a token's time: the ring's two hops)", flush=True)
            rows = prompt_rows(1, 32)
            spun: list[float] = []
            ray_cpu = cpu_ms_per_token(remote, rows, max(args.new, 64), spun)
            local_cpu = cpu_ms_per_token(local, rows, max(args.new, 64))
            print(f"{name:14} CPU ms per token: driver {ray_cpu[0]:.3f}, " + ", ".join(
                f"stage#{k} {c:.3f} (of it polling for the next step {w:.3f})"
                for k, (c, w) in enumerate(zip(ray_cpu[1:], spun)))
                + f" (sum {sum(ray_cpu):.3f}); in process {local_cpu[0]:.3f}", flush=True)
            paired_row(name, "a chat's next turn (8 tokens appended 5 ms after 8 made, the ring "
                       "running ahead), ms to its first token", rounds,
                       lambda: turn_ms(remote, rows), lambda: turn_ms(local, rows))
            paired_row(name, "a scoring loop (get_logits after every token), ms a token", rounds,
                       lambda: scoring_ms(remote, rows), lambda: scoring_ms(local, rows))
            long_rows = prompt_rows(1, 320)
            paired_row(name, "an answer made again (rewind_to the end of a 320-token prompt, "
                       "16 tokens after it), ms to its first token", rounds,
                       lambda: again_ms(remote, long_rows), lambda: again_ms(local, long_rows))
            calls.close()
            spin.close()
            # 4 groups in flight on two single-threaded stages vs one thread in process
            remote1 = hg.Model(path, executor="ray", stages=2, providers=DEVICES,
                               intra_op_num_threads=1)
            local1 = hg.Model(path, providers=["sim-gpu:0"], intra_op_num_threads=1)
            prompts = [prompt_rows(1, 32) + i for i in range(4)]
            r, lo_ = [], []
            pids = stage_pids(remote1)
            sched: dict[str, Any] = {}

            def ring_round() -> tuple[float, float]:
                sched["before"], t0 = [_sched_s(p) for p in pids], time.perf_counter()
                out = tokens_per_s(remote1, prompts, args.new, in_flight=True)
                sched["wall"] = time.perf_counter() - t0
                sched["after"] = [_sched_s(p) for p in pids]
                return out

            for k in range(max(args.rounds, PAIRED_ROUNDS)):
                a, b = in_turn(ring_round, lambda: tokens_per_s(local1, prompts, args.new,
                                                                in_flight=False), k)
                r.append(a)
                lo_.append(b)
            r, lo_ = list(zip(*r)), list(zip(*lo_))  # (with opening, opened) each
            # the last round's: a full pipeline keeps each stage on a core or waiting for one
            wall = sched["wall"]
            print(f"{name:14} 4 groups in flight, 1 thread per stage, share of the time each "
                  "stage was on a core / runnable but waiting for one: " + ", ".join(
                      f"stage#{k} {(a[0] - b[0]) / wall:.2f} / {(a[1] - b[1]) / wall:.2f}"
                      for k, (a, b) in enumerate(zip(sched["after"], sched["before"]))),
                  flush=True)
            # continuous batching: 8 requests of different lengths sharing 4 rows
            requests = [(prompt_rows(1, 32) + i, args.new // 2 + i * args.new // 8)
                        for i in range(8)]
            cb, alone, static, st = [], [], [], {}
            for _ in range(args.rounds):
                tps, st = batcher_tokens_per_s(remote1, requests, slots=4)
                cb.append(tps)
                alone.append(alone_tokens_per_s(local1, requests))
                static.append(alone_tokens_per_s(local1, requests, batch=4))
            batching.append((name, statistics.median(cb), statistics.median(alone),
                             statistics.median(static), st))
            remote1.close()
            throughput.append((name, "1 thread per stage", "1 thread", r, lo_))
            # the same with each stage pinned to a core of its own and a driver that
            # does not preempt them (a throughput job's settings)
            pinned1 = hg.Model(path, executor="ray", stages=2, providers=DEVICES,
                               intra_op_num_threads=1, stage_cores="auto",
                               yield_to_stages=True)
            tokens_per_s(pinned1, prompts, args.new, in_flight=True)  # plans bound
            r, lo_, two_way = [], [], []
            # the CPU a token costs each side: the stages' and the driver's, against the
            # in-process generator's (a bound on two cores that does not move with the
            # host's speed as tokens/s does; Ray's own processes are not counted)
            cpu = {"ring": [0.0, 0], "alone": [0.0, 0]}
            pids1 = stage_pids(pinned1)

            def counted(key: str, fn: Any, pids: list[int]) -> Any:
                def run() -> Any:
                    before, own = [_sched_s(p)[0] for p in pids], time.process_time()
                    out = fn()
                    cpu[key][0] += time.process_time() - own + sum(
                        _sched_s(p)[0] - b for p, b in zip(pids, before))
                    cpu[key][1] += 2 * len(prompts) * args.new  # tokens_per_s: two passes
                    return out
                return run

            with TwoWayCeiling(path, prompts, args.new) as ceiling:
                for k in range(max(args.rounds, PAIRED_ROUNDS)):
                    a, b = in_turn(
                        counted("ring", lambda: tokens_per_s(pinned1, prompts, args.new,
                                                             in_flight=True), pids1),
                        counted("alone", lambda: tokens_per_s(local1, prompts, args.new,
                                                              in_flight=False), []), k)
                    r.append(a)
                    lo_.append(b)
                    one, two = ceiling.round()
                    two_way.append(two / one)
            ring_ms, alone_ms = (cpu[k][0] / max(cpu[k][1], 1) * 1e3 for k in ("ring", "alone"))
            print(f"{name:14} 4 groups in flight, pinned: CPU a token, the stages and the driver "
                  f"{ring_ms:.3f} ms against in process {alone_ms:.3f} ({ring_ms / alone_ms:.2f}x):"
                  f" two cores doing nothing else bound the ring at {2 * alone_ms / ring_ms:.2f}x "
                  "in process's tokens/s", flush=True)
            cores = pinned1.remote.cores
            pinned1.close()
            ceilings.append((name, two_way, [a / b for (a, _), (b, _) in zip(r, lo_)]))
            r, lo_ = list(zip(*r)), list(zip(*lo_))
            throughput.append((name, f"1 thread per stage, stage_cores {cores}, yield_to_stages",
                               "1 thread", r, lo_))
            # the same with default threads on both sides
            r, lo_ = [], []
            for k in range(max(args.rounds, PAIRED_ROUNDS)):
                a, b = in_turn(lambda: tokens_per_s(remote, prompts, args.new, in_flight=True),
                              lambda: tokens_per_s(local, prompts, args.new, in_flight=False), k)
                r.append(a)
                lo_.append(b)
            remote.close()
            r, lo_ = list(zip(*r)), list(zip(*lo_))
            throughput.append((name, "default threads", "default threads", r, lo_))
        print(f"bare two-actor Ray ring on this host (no compute): {ring_floor_ms():.3f} ms per "
              "round, the floor of a token on two stages with stage_link=\"ray\"", flush=True)
        for name in names:
            one, two = parallel_ceiling(os.path.join(models_dir, f"{name}.onnx"),
                                        [prompt_rows(1, 32) + i for i in range(4)], args.new)
            print(f"{name:14} the ceiling of two-way parallelism here: two processes each "
                  f"running the in-process generator (1 thread) at once make {two:7.1f} tok/s "
                  f"together, one alone {one:7.1f}: {two / one:.2f}x (no Ray, no pipeline)",
                  flush=True)
        for name, ours, theirs, r, lo_ in throughput:
            for k, what in enumerate(("opening them too", "already open")):
                ratios = sorted(a / b for a, b in zip(r[k], lo_[k]))
                print(f"{name:14} 4 groups in flight ({what}), {ours}: ray "
                      f"{statistics.median(r[k]):7.1f} tok/s, in process ({theirs}, one after "
                      f"another) {statistics.median(lo_[k]):7.1f} tok/s: "
                      f"{statistics.median(ratios):.2f}x (the median of {len(ratios)} rounds' "
                      f"ratios; {ratios[0]:.2f}-{ratios[-1]:.2f})", flush=True)
        for name, two_way, ratios in ceilings:
            share = sorted(r / c for r, c in zip(ratios, two_way))
            print(f"{name:14} in the rounds of the pinned 4-groups figure, two in-process "
                  f"generators at once made {statistics.median(two_way):.2f}x one alone "
                  f"({min(two_way):.2f}-{max(two_way):.2f}): the pipeline (counting the "
                  f"opening) reached {statistics.median(share):.0%} of that ceiling "
                  f"({share[0]:.0%}-{share[-1]:.0%})", flush=True)
        for name, cb, alone, static, st in batching:
            print(f"{name:14} continuous batching, 8 requests ({args.new // 2}-"
                  f"{args.new // 2 + 7 * args.new // 8} new tokens) in 4 rows on two "
                  f"single-threaded stages: {cb:7.1f} tok/s ({st['groups']} groups, "
                  f"{st['joins']} joins); in process, 1 thread: one after another "
                  f"{alone:7.1f} tok/s ({cb / alone:.2f}x), "
                  f"batches of 4 {static:7.1f} tok/s ({cb / static:.2f}x)", flush=True)
    finally:
        if ray.is_initialized():
            ray.shutdown()
