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
    args = ap.parse_args()
    import onnxruntime as ort

    import hetero_exec

    so = ort.SessionOptions()
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.log_severity_level = 3
    ratios = []
    print(f"{'model':10} {'variant':7} {'batch':>5} {'ours ms':>9} {'ort ms':>9} "
          f"{'ratio':>6} {'max|diff|':>10}")
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
                    t_ours, t_ort = [], []
                    for _ in range(args.warmup):
                        ours.run(None, feed)
                        theirs.run(None, feed)
                    for _ in range(args.runs):  # interleaved
                        t_ours.append(_once(lambda: ours.run(None, feed)))
                        t_ort.append(_once(lambda: theirs.run(None, feed)))
                    mo, mt = statistics.median(t_ours), statistics.median(t_ort)
                    ratios.append((kind, mo / mt))
                    print(f"{name:10} {kind:7} {batch:5d} {mo * 1e3:9.3f} {mt * 1e3:9.3f} "
                          f"{mo / mt:6.2f} {diff:10.2e}", flush=True)
    for group, rs in (("variants", [r for k, r in ratios if k != "f32"]),
                      ("f32 anchor", [r for k, r in ratios if k == "f32"])):
        if rs:
            geo = math.exp(sum(math.log(r) for r in rs) / len(rs))
            print(f"# {group}: geomean ours/ort {geo:.2f}x over {len(rs)} rows, "
                  f"worst {max(rs):.2f}x")


if __name__ == "__main__":
    main()
