"""Generation, side by side in one run: prefill ms and decode ms per token for

* ours: ``hetero_exec.genai`` on the Optimum/dynamo exports (cpu, and mixed placement
  on strict sim-gpu with Softmax declined: the machinery, not a device's speed);
* onnxruntime's greedy loop over the same export, presents fed back through IO binding;
* onnxruntime-genai's own generator on its builder's folder of the same Llama
  (tests/genai/models/llama_genai: GroupQueryAttention, fused norms), when installed.

Rounds are interleaved; onnxruntime's spinning is off. Ratios are against onnxruntime's
loop on the same export, and against onnxruntime-genai.

    python bench/bench_generate.py [--batch 1 8] [--prompt 32 512] [--new 32] [--rounds 3]

``--executor ray``: generation with the decoder split over two stage actors
(sim-gpu:0, sim-gpu:1; actors/generation) against the in-process generator on
sim-gpu and onnxruntime's loop, in one run: decode ms per token at batch 1 (prompts 32
and 512: the growth), and tokens/s of 4 groups in flight on two single-threaded stages
against an in-process single-threaded generator running the same 4 sequences.

    python bench/bench_generate.py --executor ray [--models llama_optimum gpt2_optimum]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import onnx
import onnxruntime as ort

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import hetero_exec.genai as hg  # noqa: E402
from hetero_exec.genai.layout import discover  # noqa: E402

MODELS = os.path.join(os.path.dirname(HERE), "tests", "genai", "models")


def prompt_rows(batch: int, length: int) -> np.ndarray:
    return np.random.default_rng(0).integers(3, 256, (batch, length)).astype(np.int64)


def time_generator(api, model, rows: np.ndarray, new: int) -> tuple[float, float]:
    """(prefill ms, median decode ms per token) of one greedy generation through ``api``:
    ours (hetero_exec.genai) or onnxruntime_genai, the same calls on both."""
    params = api.GeneratorParams(model)
    params.set_search_options(batch_size=rows.shape[0], max_length=rows.shape[1] + new)
    gen = api.Generator(model, params)
    t0 = time.perf_counter()
    gen.append_tokens(rows)
    prefill = time.perf_counter() - t0
    steps = []
    while not gen.is_done():
        t0 = time.perf_counter()
        gen.generate_next_token()
        steps.append(time.perf_counter() - t0)
    return prefill * 1e3, statistics.median(steps[1:]) * 1e3


def ort_session(path: str) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def time_ort_loop(sess: ort.InferenceSession, layout, rows: np.ndarray,
                  new: int) -> tuple[float, float]:
    """onnxruntime's loop: each step's presents bound back as the next step's pasts."""
    batch = rows.shape[0]
    ids, mask = rows, np.ones_like(rows)
    past = {e.past: ort.OrtValue.ortvalue_from_numpy(
        np.zeros((batch, e.kv_heads, 0, e.head_size), np.float32)) for e in layout.entries}
    times = []
    for _ in range(new):
        t0 = time.perf_counter()
        io = sess.io_binding()
        pos = (np.cumsum(mask, 1) - 1)[:, -ids.shape[1]:]
        io.bind_cpu_input(layout.input_ids, ids)
        io.bind_cpu_input(layout.attention_mask, mask)
        if layout.position_ids:
            io.bind_cpu_input(layout.position_ids, pos)
        for name, v in past.items():
            io.bind_ortvalue_input(name, v)
        io.bind_output(layout.logits, "cpu")
        for e in layout.entries:
            io.bind_output(e.present, "cpu")
        sess.run_with_iobinding(io)
        outs = io.get_outputs()
        nxt = outs[0].numpy()[:, -1].argmax(-1)
        past = {e.past: v for e, v in zip(layout.entries, outs[1:])}
        ids = nxt[:, None].astype(np.int64)
        mask = np.concatenate([mask, np.ones((batch, 1), np.int64)], 1)
        times.append(time.perf_counter() - t0)
    return times[0] * 1e3, statistics.median(times[2:]) * 1e3


def ortgenai_model(folder: str):
    """onnxruntime-genai's model of the builder folder, or None when it is not installed."""
    try:
        import onnxruntime_genai as og
    except ImportError:
        return None
    return og, og.Model(folder)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["llama_genai", "llama_optimum", "llama_dynamo",
                                                      "gpt2_optimum", "gpt2_dynamo"])
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--prompt", nargs="+", type=int, default=[32, 512])
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2,
                    help="untimed rounds first (each runtime's first generations bind or "
                         "compile their plans for these shapes)")
    ap.add_argument("--mixed", action="store_true", help="also ours on strict sim-gpu + cpu")
    ap.add_argument("--executor", choices=["local", "ray"], default="local",
                    help="ray: the two-stage generator on Ray against the in-process one")
    args = ap.parse_args()
    if args.executor == "ray":
        from bench_generate_ray import ray_main

        return ray_main(args, MODELS, prompt_rows, ort_session, time_ort_loop)
    genai = ortgenai_model(os.path.join(MODELS, "llama_genai"))
    print(f"{'model':14} {'B':>2} {'P':>4} {'ours':>14} {'ort loop':>14} {'ort-genai':>14}"
          f" {'/ort':>6} {'/genai':>7}   (prefill ms / decode ms per token, medians)")
    for name in args.models:
        folder = name.endswith("_genai")  # the builder's folder: ours against onnxruntime-genai
        path = os.path.join(MODELS, name if folder else f"{name}.onnx")
        ours = hg.Model(path)
        mixed = hg.Model(path, providers=[("sim-gpu", {"exclude_ops": ["Softmax"]}), "cpu"],
                         hetero=True) if args.mixed else None
        sess, layout = (None, None) if folder else (ort_session(path), discover(onnx.load(path)))
        for batch in args.batch:
            for plen in args.prompt:
                rows = prompt_rows(batch, plen)
                res: dict[str, list] = {"ours": [], "ort": [], "genai": [], "mixed": []}
                for r in range(args.warmup + args.rounds):  # interleaved
                    if r == args.warmup:  # what came before was warm-up
                        res = {k: [] for k in res}
                    res["ours"].append(time_generator(hg, ours, rows, args.new))
                    if sess is not None:
                        res["ort"].append(time_ort_loop(sess, layout, rows, args.new))
                    if name.startswith("llama") and genai is not None:
                        res["genai"].append(time_generator(genai[0], genai[1],
                                                           rows.astype(np.int32), args.new))
                    if mixed is not None:
                        res["mixed"].append(time_generator(hg, mixed, rows, args.new))
                med = {k: (statistics.median(p for p, _ in v), statistics.median(d for _, d in v))
                       for k, v in res.items() if v}

                def cell(k: str) -> str:
                    return f"{med[k][0]:6.2f}/{med[k][1]:6.3f}" if k in med else f"{'-':>13}"

                r_ort = f"{med['ours'][1] / med['ort'][1]:5.2f}x" if "ort" in med else "    -"
                r_genai = f"{med['ours'][1] / med['genai'][1]:6.2f}x" if "genai" in med else "      -"
                line = (f"{name:14} {batch:2d} {plen:4d} {cell('ours'):>14} {cell('ort'):>14} "
                        f"{cell('genai'):>14} {r_ort} {r_genai}")
                if "mixed" in med:
                    ratio = f" ({med['mixed'][1] / med['ort'][1]:.2f}x)" if "ort" in med else ""
                    line += f"   mixed {cell('mixed')}{ratio}"
                print(line, flush=True)


if __name__ == "__main__":
    main()
