"""Exact 8-bit integer products against onnxruntime: MatMulInteger and ConvInteger with
reductions long enough that an unchunked float32 product would round, onnxruntime's
quantize_dynamic models (as written, and as its optimizer fuses them into
DynamicQuantizeMatMul), MatMulIntegerToFloat and QGemm on odd shapes; cpu and strict
sim-gpu."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper
from onnxruntime.quantization import QuantType, quantize_dynamic

from tests._models import init, model, ort_u8s8_saturates, vi
from tests.kernels.contrib._quant_helpers import MS, compare

U8, I8 = TensorProto.UINT8, TensorProto.INT8
_NP = {U8: np.uint8, I8: np.int8}


def _ints(rng, dtype, shape, extreme=False):
    info = np.iinfo(dtype)
    if extreme:  # the far ends of the range: the largest partial sums
        return rng.choice([info.min, info.max], size=shape).astype(dtype)
    return rng.integers(info.min, int(info.max) + 1, size=shape).astype(dtype)


@pytest.mark.parametrize("a_t,b_t", [(U8, I8), (U8, U8), (I8, I8)])
@pytest.mark.parametrize("constant_b", [True, False])
def test_matmul_integer_long_reduction_is_exact(a_t, b_t, constant_b):
    rng = np.random.default_rng(0)
    M, K, N = 7, 1500, 9  # 1500 * 255 * 255 is far past float32's exact 2**24
    A = _ints(rng, _NP[a_t], (M, K), extreme=True)
    B = _ints(rng, _NP[b_t], (K, N), extreme=True)
    azp, bzp = np.array(_NP[a_t](3)), np.array(_NP[b_t](-2 if b_t == I8 else 250))
    node = helper.make_node("MatMulInteger", ["A", "B", "azp", "bzp"], ["Y"])
    inputs = [vi("A", a_t, [M, K])] + ([] if constant_b else [vi("B", b_t, [K, N])])
    inits = [init("azp", azp), init("bzp", bzp)] + ([init("B", B)] if constant_b else [])
    m = model([node], inputs, [vi("Y", TensorProto.INT32, [M, N])], inits)
    feed = {"A": A} if constant_b else {"A": A, "B": B}
    compare(m, feed, device_ops=["MatMulInteger"], rtol=0, atol=0)


@pytest.mark.parametrize("group,C", [(1, 300), (1, 7), (3, 9)])
def test_conv_integer_exact(group, C):
    rng = np.random.default_rng(1)
    X = _ints(rng, np.uint8, (2, C, 9, 8), extreme=True)
    W = _ints(rng, np.uint8, (6, C // group, 3, 3), extreme=True)
    node = helper.make_node("ConvInteger", ["X", "W", "xzp", "wzp"], ["Y"], group=group,
                            pads=[1, 0, 1, 2], strides=[2, 1])
    m = model([node], [vi("X", U8, list(X.shape))], [vi("Y", TensorProto.INT32, ["n", "m", "h", "w"])],
              [init("W", W), init("xzp", np.array(np.uint8(7))),
               init("wzp", np.array(np.uint8(200)))])
    compare(m, {"X": X}, device_ops=["ConvInteger"], rtol=0, atol=0)


def _mlp() -> onnx.ModelProto:
    rng = np.random.default_rng(2)
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h0"]),
             helper.make_node("Add", ["h0", "b1"], ["h"]),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "W2"], ["y"])]
    return model(nodes, [vi("x", 1, ["N", 72])], [vi("y", 1, ["N", 30])],
                 [init("W1", rng.standard_normal((72, 56)).astype(np.float32)),
                  init("b1", rng.standard_normal(56).astype(np.float32)),
                  init("W2", rng.standard_normal((56, 30)).astype(np.float32))])


@pytest.mark.parametrize("weight_type", [QuantType.QInt8, QuantType.QUInt8])
@pytest.mark.parametrize("per_channel", [False, True])
def test_quantize_dynamic_models(tmp_path, weight_type, per_channel):
    src, dst, fused = tmp_path / "f.onnx", tmp_path / "q.onnx", tmp_path / "qo.onnx"
    onnx.save(_mlp(), src)
    # 7-bit int8 weights where onnxruntime's u8 x s8 sums saturate: it stays exact there
    reduced = weight_type == QuantType.QInt8 and ort_u8s8_saturates()
    quantize_dynamic(str(src), str(dst), weight_type=weight_type, per_channel=per_channel,
                     reduce_range=reduced)
    so = onnxruntime.SessionOptions()
    so.optimized_model_filepath = str(fused)
    so.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    onnxruntime.InferenceSession(str(dst), so, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(3).standard_normal((5, 72)).astype(np.float32)
    q = onnx.load(dst)
    assert "MatMulInteger" in {n.op_type for n in q.graph.node}
    compare(q, {"x": x}, device_ops=["MatMulInteger"], rtol=1e-5, atol=1e-4,
            weights_7bit=reduced)
    qo = onnx.load(fused)
    assert "DynamicQuantizeMatMul" in {n.op_type for n in qo.graph.node}
    compare(qo, {"x": x}, device_ops=["DynamicQuantizeMatMul"], rtol=1e-5, atol=1e-4,
            weights_7bit=reduced)


@pytest.mark.parametrize("a_t,b_t", [(U8, I8), (I8, I8), (U8, U8)])
@pytest.mark.parametrize("per_column", [False, True])
def test_matmul_integer_to_float(a_t, b_t, per_column):
    rng = np.random.default_rng(4)
    K, N = 37, 11
    A = _ints(rng, _NP[a_t], (2, 5, K))
    B = _ints(rng, _NP[b_t], (K, N))
    bs = (rng.random(N if per_column else 1) * 0.1 + 0.01).astype(np.float32)
    bz = _ints(rng, _NP[b_t], (N,) if per_column else ())
    reduced = (a_t, b_t) == (U8, I8) and ort_u8s8_saturates()
    if reduced:  # 7-bit weights: onnxruntime's u8 x s8 sums cannot saturate
        B, bz = B // 2, bz // 2
    node = helper.make_node("MatMulIntegerToFloat",
                            ["A", "B", "a_scale", "b_scale", "azp", "bzp", "bias"], ["Y"],
                            domain=MS)
    m = model([node], [vi("A", a_t, [2, 5, K])], [vi("Y", 1, [2, 5, N])],
              [init("B", B), init("a_scale", np.array(0.05, np.float32)),
               init("b_scale", bs if per_column else bs.reshape(())),
               init("azp", np.array(_NP[a_t](5))), init("bzp", bz),
               init("bias", rng.standard_normal(N).astype(np.float32))],
              extra_opsets={MS: 1})
    compare(m, {"A": A}, device_ops=["MatMulIntegerToFloat"], rtol=1e-5, atol=1e-5,
            weights_7bit=reduced)


@pytest.mark.parametrize("trans", [(0, 0), (1, 0), (0, 1), (1, 1)])
@pytest.mark.parametrize("requantize", [False, True])
def test_qgemm(trans, requantize):
    rng = np.random.default_rng(5)
    M, K, N = 6, 29, 13
    tA, tB = trans
    A = _ints(rng, np.uint8, (K, M) if tA else (M, K))
    B = _ints(rng, np.int8, (N, K) if tB else (K, N))
    reduced = ort_u8s8_saturates()
    if reduced:  # 7-bit weights: onnxruntime's u8 x s8 sums cannot saturate
        B = B // 2
    names = ["A", "a_scale", "azp", "B", "b_scale", "bzp", "C"]
    inits = [init("B", B), init("a_scale", np.array(0.02, np.float32)),
             init("azp", np.array(np.uint8(128))),
             init("b_scale", (rng.random(N) * 0.05 + 0.01).astype(np.float32)),
             init("bzp", np.zeros(N, np.int8)),
             init("C", rng.integers(-500, 500, N).astype(np.int32))]
    out_t = 1
    if requantize:
        names += ["y_scale", "yzp"]
        inits += [init("y_scale", np.array(0.3, np.float32)), init("yzp", np.array(np.uint8(100)))]
        out_t = U8
    node = helper.make_node("QGemm", names, ["Y"], domain=MS, alpha=0.75, transA=tA, transB=tB)
    m = model([node], [vi("A", U8, list(A.shape))], [vi("Y", out_t, [M, N])], inits,
              extra_opsets={MS: 1})
    compare(m, {"A": A}, device_ops=["QGemm"], rtol=1e-5, atol=1 if requantize else 1e-4,
            weights_7bit=reduced)
