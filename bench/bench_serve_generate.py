"""Serve's generate extension: time to first token and inter-token latency over real
HTTP, at 1 and 8 concurrent streams, beside the same generation in process.

    python bench/bench_serve_generate.py                 # the tiny builder Llama, 2 rounds
    python bench/bench_serve_generate.py --model tests/genai/models/gpt2_optimum.onnx

Three targets generate the same greedy tokens from the same prompts (``--prompt``
tokens, ``--new`` new ones; with ``--sample``, top-k sampling, each prompt its own
``random_seed``):

* ``ort-genai``: onnxruntime-genai's Generator in this process (the anchor; builder
  folders only);
* ``in-process``: our Generator in this process (`hetero_exec.genai`);
* with ``--stages``, ``in-process-sim``: the same on strict sim-gpu:0, the device the
  stage actors run on (their rows' anchor: the cpu rows run the C kernels, the
  stages the array module's kernels on simulated devices);

at 1 stream, and at 8 as 8 generators stepped in turn in one thread (each prefilled,
then a token each in turn: what a replica's pool does with 8 streams);
* ``serve``: ``POST /v2/models/{name}/generate_stream`` to a Serve app of one replica
  (`actors.serve.build_app`), the server-sent events read as they arrive by
  http.client, one connection a stream; at 1 and at 8 streams at once (threads).

Time to first token: from sending the request (or, in process, from creating the
generator) to the first token; inter-token: between consecutive tokens of a stream.
Each round measures every target in turn; the table gives each figure's median over
rounds (p50 and p99 over each round's streams and tokens). The in-process targets and
the replica run one BLAS thread and one intra-op thread (a replica reserves 1 CPU).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import sys
import threading
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
DEFAULT_MODEL = os.path.join(ROOT, "tests", "genai", "models", "llama_genai")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


#: --sample's search options (and each prompt's random_seed); {} greedy
SEARCH: dict[str, Any] = {}
SEEDS: dict[tuple[int, ...], int] = {}


def search_for(prompt: list[int]) -> dict[str, Any]:
    return {**SEARCH, "random_seed": SEEDS[tuple(prompt)]} if SEARCH else {}


def timed_tokens(make: Any, prompt: list[int], new: int) -> tuple[list[int], list[float]]:
    """A generator API's (ours or onnxruntime-genai's) tokens and each one's time."""
    import numpy as np

    mod, model = make
    t0 = time.perf_counter()
    params = mod.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + new, **search_for(prompt))
    gen = mod.Generator(model, params)
    gen.append_tokens(np.asarray([prompt], np.int64))
    tokens, times = [], []
    while not gen.is_done():
        gen.generate_next_token()
        tokens.append(int(gen.get_next_tokens()[0]))
        times.append(time.perf_counter() - t0)
    return tokens, times


def round_robin(make: Any, prompts: list[list[int]], new: int) -> list[tuple[list[int], list[float]]]:
    """Several generators in one thread, prefilled in turn and then stepped a token each
    in turn (what a replica's one pool thread does with concurrent streams); every
    stream's times from the common start."""
    import numpy as np

    mod, model = make
    t0 = time.perf_counter()
    gens, out = [], []
    for p in prompts:
        params = mod.GeneratorParams(model)
        params.set_search_options(max_length=len(p) + new, **search_for(p))
        gen = mod.Generator(model, params)
        gen.append_tokens(np.asarray([p], np.int64))
        gens.append(gen)
        out.append(([], []))
    while not all(g.is_done() for g in gens):
        for gen, (tokens, times) in zip(gens, out):
            if not gen.is_done():
                gen.generate_next_token()
                tokens.append(int(gen.get_next_tokens()[0]))
                times.append(time.perf_counter() - t0)
    return out


def http_stream(port: int, path: str, prompt: list[int], new: int) -> tuple[list[int], list[float]]:
    from actors.serve.generate_request import parse_sse

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        t0 = time.perf_counter()
        body = {"input_ids": prompt, "max_tokens": new, **search_for(prompt)}
        conn.request("POST", path, json.dumps(body).encode(), {"content-type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"{r.status}: {r.read()!r}")
        tokens, times = [], []
        for event in parse_sse(r):
            if "error" in event:
                raise RuntimeError(event["error"])
            tokens += event["output_ids"]
            times.append(time.perf_counter() - t0)
        return tokens, times
    finally:
        conn.close()


def figures(runs: list[tuple[list[int], list[float]]]) -> dict[str, float]:
    ttft = [times[0] * 1e3 for _, times in runs]
    gaps = [(b - a) * 1e3 for _, times in runs for a, b in zip(times, times[1:])]
    return {"ttft_p50_ms": pct(ttft, 0.5), "ttft_p99_ms": pct(ttft, 0.99),
            "itl_p50_ms": pct(gaps, 0.5), "itl_p99_ms": pct(gaps, 0.99)}


def concurrently(fn: Any, prompts: list[list[int]]) -> list[Any]:
    out: list[Any] = [None] * len(prompts)
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            out[i] = fn(prompts[i])
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL,
                    help="a decoder: a genai folder or an .onnx (default: tests' tiny Llama)")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    ap.add_argument("--new", type=int, default=64, help="new tokens a stream")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--streams", default="1,8", help="concurrent streams")
    ap.add_argument("--json", help="write every round's figures here")
    ap.add_argument("--stages", type=int, default=0,
                    help="also serve the model split over this many stage actors on "
                         "sim-gpu:0.. (executor=\"ray\"): 'stages' with continuous batching "
                         "(4 rows a group), 'stages-1by1' with a generator a request")
    ap.add_argument("--stage-spin-ms", type=float, default=None,
                    help="the stage actors' stage_spin_ms (default: the generator's, 5 ms "
                         "where a node has a core beyond its stages, else off; 0: off)")
    ap.add_argument("--stage-cores", default=None, choices=["os", "auto"],
                    help="the stage actors' stage_cores (default: the generator's, the OS "
                         "placing them but for one group's turn core, cores.TurnCore)")
    ap.add_argument("--sample", action="store_true",
                    help="sampled streams (top_k 20, temperature 0.8, a seed a prompt) "
                         "instead of greedy ones")
    args = ap.parse_args(argv)
    env = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    os.environ.update(env)  # before numpy loads its BLAS

    import numpy as np
    import ray
    from ray import serve

    import hetero_exec.genai as hg
    from actors.connect import forget_haproxy_files, serve_ingress_env
    from actors.serve import build_app

    levels = [int(c) for c in args.streams.split(",")]
    ours = hg.Model(args.model, intra_op_num_threads=1)
    vocab = ours.vocab_size or 256
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, vocab, args.prompt)] for _ in range(max(levels))]
    if args.sample:
        SEARCH.update(do_sample=True, top_k=20, temperature=0.8)
        SEEDS.update({tuple(p): i for i, p in enumerate(prompts)})
    targets: dict[str, Any] = {"in-process": (hg, ours)}
    if os.path.isdir(args.model):
        try:
            import onnxruntime_genai as og

            targets = {"ort-genai": (og, og.Model(args.model)), **targets}
        except ImportError:
            print("onnxruntime-genai is not installed: no anchor", file=sys.stderr)
    if args.stages:  # the stages' anchor: the same generator on the same kind of device
        targets["in-process-sim"] = (hg, hg.Model(args.model, providers=["sim-gpu:0"],
                                                  intra_op_num_threads=1))
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT, **env, **serve_ingress_env()}})
    node = ray.get_runtime_context().get_node_id()
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = build_app(args.model, name="gen", num_cpus=1)
    serve.run(app, name="gen", route_prefix="/gen")
    path = "/gen/v2/models/gen/generate_stream"
    apps = {"serve": path}
    if args.stages:
        devices = [f"sim-gpu:{i}" for i in range(args.stages)]
        for label, slots in (("stages", 4), ("stages-1by1", 0)):
            serve.run(build_app(args.model, name=label, num_cpus=0.25, executor="ray",
                                stages=args.stages, providers=devices, batch_slots=slots,
                                batch_max_length=4 * (args.prompt + args.new),
                                **({} if args.stage_spin_ms is None
                                   else {"stage_spin_ms": args.stage_spin_ms}),
                                **({} if args.stage_cores is None
                                   else {"stage_cores": args.stage_cores})),
                      name=label, route_prefix=f"/{label}")
            apps[label] = f"/{label}/v2/models/{label}/generate_stream"
    try:
        want = {i: timed_tokens(targets["in-process"], p, args.new)[0]
                for i, p in enumerate(prompts)}
        for i, p in enumerate(prompts[:2]):  # warm up, and check every target's tokens
            for label, route in apps.items():
                assert http_stream(port, route, p, args.new)[0] == want[i], \
                    f"{label}'s tokens differ"
            for name, make in targets.items():
                got = timed_tokens(make, p, args.new)[0]
                if got != want[i]:
                    print(f"{name}'s tokens differ from in-process's", file=sys.stderr)
        rounds: list[dict[str, dict[str, float]]] = []
        for r in range(args.rounds):
            row = {}
            for name, make in targets.items():  # one stream at a time, 4 streams a round
                row[f"{name}@1"] = figures([timed_tokens(make, p, args.new) for p in prompts[:4]])
                for n in levels[1:]:
                    row[f"{name}@{n}"] = figures(round_robin(make, prompts[:n], args.new))
            for label, route in apps.items():
                for n in levels:
                    runs = []
                    for _ in range(max(1, 4 // n)):  # at least 4 streams a figure
                        runs += concurrently(lambda p: http_stream(port, route, p, args.new),
                                             prompts[:n])
                    assert all(t == want[i % n] for i, (t, _) in enumerate(runs))
                    row[f"{label}@{n}"] = figures(runs)
            rounds.append(row)
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
        forget_haproxy_files(node)
    keys = list(rounds[0]["serve@1"])
    med = {k: {m: statistics.median(rd[k][m] for rd in rounds) for m in keys} for k in rounds[0]}
    print(f"\n{os.path.basename(args.model.rstrip('/'))}: prompt {args.prompt}, {args.new} new "
          f"tokens a stream, {'sampled' if args.sample else 'greedy'}, {args.rounds} rounds "
          "(medians)")
    print(f"{'target':<16}" + "".join(f"{m:>14}" for m in keys))
    for k, v in med.items():
        print(f"{k:<16}" + "".join(f"{v[m]:>14.2f}" for m in keys))
    base = med.get("ort-genai@1") or med["in-process@1"]
    anchor = "ort-genai" if "ort-genai@1" in med else "in-process"
    for k, v in med.items():
        label, streams = k.rsplit("@", 1)
        sim = med.get(f"in-process-sim@{streams}")
        if label.startswith("stages") and sim is not None:  # against the same device's
            print(f"{k:<16} inter-token p50 {v['itl_p50_ms'] / sim['itl_p50_ms']:.2f}x "
                  f"in-process-sim@{streams}'s, first token "
                  f"{v['ttft_p50_ms'] / sim['ttft_p50_ms']:.2f}x")
            continue
        print(f"{k:<16} inter-token p50 {v['itl_p50_ms'] / base['itl_p50_ms']:.2f}x {anchor}'s, "
              f"first token {v['ttft_p50_ms'] / base['ttft_p50_ms']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rounds": rounds, "median": med}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
