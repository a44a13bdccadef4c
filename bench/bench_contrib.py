"""onnxruntime's contrib ops, ours against onnxruntime's CPU provider, interleaved.

    python bench/bench_contrib.py [--reps 30]

Cases: a BERT block as onnxruntime's transformer optimizer writes it (SkipLayerNormalization,
MatMul, BiasGelu) at batch 8 x 128 tokens, hidden 256; GroupQueryAttention alone, a
prompt of 128 tokens and one decode step at position 511 of a 1024-capacity cache (16
query heads over 4 kv heads of 64, rotary on). Prints the median time of each side and
the ratio ours / onnxruntime (below 1: we are faster).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hetero_exec  # noqa: E402
from tests.kernels.contrib import test_tooling as tooling  # noqa: E402
from tests.kernels.contrib._ort import one_node, run_ort, with_output_shapes  # noqa: E402


def _bert_block(H=256, F=1024):
    tooling.H, tooling.F = H, F
    m = tooling._block(tooling._gelu_erf)
    with tempfile.TemporaryDirectory() as d:
        made = tooling._transformers_optimized(m, Path(d), "bert")
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((8, 128, H)).astype(np.float32),
             "skip": rng.standard_normal((8, 128, H)).astype(np.float32)}
    return made.SerializeToString(), feeds


def _gqa(seq, total, capacity, N=16, Nkv=4, H=64):
    rng = np.random.default_rng(1)
    r = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    inv = 1.0 / (10000 ** (np.arange(0, H, 2) / H))
    ang = np.arange(4096)[:, None] * inv[None, :]
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    pk = r(1, Nkv, capacity, H) if capacity else None
    pv = r(1, Nkv, capacity, H) if capacity else None
    inputs = [r(1, seq, N * H), r(1, seq, Nkv * H), r(1, seq, Nkv * H), pk, pv,
              np.array([total - 1], np.int32), np.array(total, np.int32), cos, sin]
    model, feeds = one_node("GroupQueryAttention", inputs, n_outputs=3, num_heads=N,
                            kv_num_heads=Nkv, do_rotary=1, initializers=(7, 8),
                            out_types=[np.float32] * 3)
    return with_output_shapes(model, run_ort(model, feeds)), feeds


def _time(run, reps):
    run()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        run()
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    cases = {"bert block (optimizer) 8x128": _bert_block(),
             "GQA prompt 128": _gqa(128, 128, 0),
             "GQA decode @511 cap 1024": _gqa(1, 512, 1024)}
    so = ort.SessionOptions()
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    for name, (model, feeds) in cases.items():
        theirs = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
        ours = hetero_exec.InferenceSession(model, providers=["cpu"])
        a, b = [], []
        for _ in range(3):  # interleaved rounds
            a += _time(lambda: ours.run(None, feeds), args.reps // 3)
            b += _time(lambda: theirs.run(None, feeds), args.reps // 3)
        ma, mb = statistics.median(a) * 1e3, statistics.median(b) * 1e3
        print(f"{name:32s} ours {ma:8.3f} ms   onnxruntime {mb:8.3f} ms   ratio {ma / mb:5.2f}")


if __name__ == "__main__":
    main()
