"""Quantized and float16 variants of the benchmark models: ours / onnxruntime, side by side.

Each variant is made at startup by onnxruntime's own tooling from a model of
bench/models.py:

* ``dyn``: ``quantize_dynamic`` (int8 weights; DynamicQuantizeLinear + MatMulInteger);
* ``qdq``: ``quantize_static`` in QDQ format (uint8 activations, int8 weights,
  calibrated on a few random feeds);
* ``nbits``: every constant 2-D MatMul weight quantized to 4 bits (block 32, with zero
  points) by onnxruntime's blockwise quantizer (``quantize_matmul_4bits``, the function
  its MatMulNBitsQuantizer calls; the quantizer itself needs onnx_ir) into MatMulNBits;
* ``fp16``: ``convert_float_to_float16``;
* ``f32``: the float32 model itself, the anchor: our ratio on the same machine in the
  same minutes, against which the variants' ratios read.

Both sessions run interleaved in one process (ours, ort, ours, ort ...); each figure is
the median of ``--runs`` timed runs after ``--warmup``. onnxruntime's spinning is off.
Outputs are compared first (max abs difference printed). Wall-clock figures on a
shared machine are noisy: read the ratios of one run together.

    python bench/bench_quant.py
    python bench/bench_quant.py --models mlp --variants dyn,nbits --batches 1,8 --runs 20
    python bench/bench_quant.py --decode          # the 4-bit Llama decode step only

``--decode``: the tiny Llama of tests/genai/models/llama_genai (GroupQueryAttention,
fused norms) quantized to 4 bits by onnxruntime's MatMulNBitsQuantizer (block 32, zero
points; needs onnx_ir), one decode step (one token over a past of ``--past`` tokens),
float32 and 4-bit rows side by side.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.models import MODELS, inputs  # noqa: E402

VARIANTS = ("f32", "dyn", "qdq", "nbits", "fp16")


def nbits_model(m: onnx.ModelProto, block: int = 32) -> onnx.ModelProto:
    """MatMul nodes with a constant 2-D float32 weight -> 4-bit MatMulNBits."""
    from onnx import helper, numpy_helper
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits

    m = onnx.ModelProto.FromString(m.SerializeToString())
    inits = {t.name: t for t in m.graph.initializer}
    nodes = []
    for node in m.graph.node:
        w = inits.get(node.input[1]) if node.op_type == "MatMul" else None
        W = numpy_helper.to_array(w) if w is not None else None
        if W is None or W.ndim != 2 or W.dtype != np.float32:
            nodes.append(node)
            continue
        K, N = W.shape
        kb = -(-K // block)
        B = np.zeros((N, kb, block // 2), np.uint8)
        zp = np.zeros((N, -(-kb // 2)), np.uint8)
        sc = np.zeros((N, kb), np.float32)
        quantize_matmul_4bits(B, np.ascontiguousarray(W), sc, zp, block, N, K, False)
        base = node.input[1]
        m.graph.initializer.extend([numpy_helper.from_array(B, base + "_Q4"),
                                    numpy_helper.from_array(sc, base + "_scales"),
                                    numpy_helper.from_array(zp, base + "_zp")])
        nodes.append(helper.make_node("MatMulNBits", [node.input[0], base + "_Q4",
                                                      base + "_scales", base + "_zp"],
                                      list(node.output), domain="com.microsoft", K=K, N=N,
                                      bits=4, block_size=block))
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    if not any(o.domain == "com.microsoft" for o in m.opset_import):
        m.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return m


def variant(name: str, kind: str, m: onnx.ModelProto, tmp: Path) -> onnx.ModelProto:
    src, dst = tmp / f"{name}.onnx", tmp / f"{name}_{kind}.onnx"
    onnx.save(m, src)
    if kind == "f32":
        return m
    if kind == "dyn":
        from onnxruntime.quantization import QuantType, quantize_dynamic

        quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8)
    elif kind == "qdq":
        from onnxruntime.quantization import (
            CalibrationDataReader,
            QuantFormat,
            QuantType,
            quantize_static,
        )

        class Feeds(CalibrationDataReader):
            def __init__(self):
                self.it = iter([inputs(name, 1, seed=s) for s in range(4)])

            def get_next(self):
                return next(self.it, None)

        quantize_static(str(src), str(dst), Feeds(), quant_format=QuantFormat.QDQ,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    elif kind == "nbits":
        return nbits_model(m)
    elif kind == "fp16":
        from onnxruntime.transformers.float16 import convert_float_to_float16

        return convert_float_to_float16(m, keep_io_types=True)
    return onnx.load(dst)


def llama_decode(args, so) -> list[tuple[str, float]]:
    """The decode-step rows: (kind, ours / ort) for the float32 and the 4-bit Llama."""
    import onnxruntime as ort
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    import hetero_exec

    path = ROOT / "tests" / "genai" / "models" / "llama_genai" / "model.onnx"
    f32 = onnx.load(path)
    q = MatMulNBitsQuantizer(onnx.load(path), block_size=32, is_symmetric=False)
    q.process()
    rng = np.random.default_rng(0)
    P = args.past
    feed = {"input_ids": np.array([[7]], np.int64),
            "attention_mask": np.ones((1, P + 1), np.int64)}
    for i in range(2):
        for kv in ("key", "value"):
            feed[f"past_key_values.{i}.{kv}"] = rng.standard_normal((1, 2, P, 16)).astype(
                np.float32)
    rows = []
    for kind, m in (("f32", f32), ("nbits", q.model.model)):
        data = m.SerializeToString()
        ours = hetero_exec.InferenceSession(data, providers=["cpu"])
        theirs = ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])
        n_mm = sum(n.op_type == "MatMulNBits" for n in m.graph.node)
        rows.append((f"llama-{kind}({n_mm} nbits)", kind, ours, theirs))
    out = []
    for label, kind, ours, theirs in rows:
        a, b = ours.run(None, feed)[0], theirs.run(None, feed)[0]
        diff = float(np.abs(np.asarray(a, np.float64) - b).max())
        mo, mt = _interleaved(ours, theirs, feed, args)
        out.append((kind, mo / mt))
        print(f"{label:18} past {P:4d} {mo * 1e3:9.3f} {mt * 1e3:9.3f} {mo / mt:6.2f} "
              f"{diff:10.2e} {_best[-1]:6.2f}", flush=True)
    return out


def _interleaved(ours, theirs, feed, args) -> tuple[float, float]:
    """Median seconds of ours and onnxruntime's runs, interleaved (the ratio of the
    fastest runs is printed too, the steadier figure on a loaded machine)."""
    t_ours, t_ort = [], []
    for _ in range(args.warmup):
        ours.run(None, feed)
        theirs.run(None, feed)
    for _ in range(args.runs):
        t_ours.append(_once(lambda: ours.run(None, feed)))
        t_ort.append(_once(lambda: theirs.run(None, feed)))
    _best.append(min(t_ours) / min(t_ort))
    return statistics.median(t_ours), statistics.median(t_ort)


_best: list[float] = []  # ours / ort of the fastest runs, one per row


def _once(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mlp,bert")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0,
                    help="threads for both sides (0: each side's default); 1 reads the "
                         "kernels alone on a machine too loaded for a split to pay")
    ap.add_argument("--decode", action="store_true",
                    help="the 4-bit Llama decode step only (tests/genai's tiny Llama)")
    ap.add_argument("--past", type=int, default=63, help="--decode: tokens already in the cache")
    args = ap.parse_args()
    if args.threads:
        import os

        os.environ["HETERO_EXEC_INTRA_OP_THREADS"] = str(args.threads)
    import onnxruntime as ort

    import hetero_exec

    so = ort.SessionOptions()
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.log_severity_level = 3
    if args.threads:
        so.intra_op_num_threads = args.threads
    if args.decode:
        print(f"{'model':18} {'':9} {'ours ms':>9} {'ort ms':>9} {'ratio':>6} {'max|diff|':>10} {'best':>6}")
        llama_decode(args, so)
        return
    ratios = []
    print(f"{'model':10} {'variant':7} {'batch':>5} {'ours ms':>9} {'ort ms':>9} "
          f"{'ratio':>6} {'max|diff|':>10} {'best':>6}")
    with tempfile.TemporaryDirectory() as tmpdir:
        for name in args.models.split(","):
            base = MODELS[name]()
            for kind in args.variants.split(","):
                m = variant(name, kind, base, Path(tmpdir))
                data = m.SerializeToString()
                ours = hetero_exec.InferenceSession(data, providers=["cpu"])
                theirs = ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])
                for batch in [int(b) for b in args.batches.split(",")]:
                    feed = inputs(name, batch)
                    a, b = ours.run(None, feed)[0], theirs.run(None, feed)[0]
                    diff = float(np.abs(np.asarray(a, np.float64) - b).max())
                    mo, mt = _interleaved(ours, theirs, feed, args)
                    ratios.append((kind, mo / mt))
                    print(f"{name:10} {kind:7} {batch:5d} {mo * 1e3:9.3f} {mt * 1e3:9.3f} "
                          f"{mo / mt:6.2f} {diff:10.2e} {_best[-1]:6.2f}", flush=True)
    for group, rs in (("variants", [r for k, r in ratios if k != "f32"]),
                      ("f32 anchor", [r for k, r in ratios if k == "f32"])):
        if rs:
            geo = math.exp(sum(math.log(r) for r in rs) / len(rs))
            print(f"# {group}: geomean ours/ort {geo:.2f}x over {len(rs)} rows, "
                  f"worst {max(rs):.2f}x")


if __name__ == "__main__":
    main()
