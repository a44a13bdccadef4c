"""placement/fusions/integer.py: a quantize_dynamic model's MatMulInteger -> Cast ->
Mul(scale) [-> Add(bias)] becomes one MatMulIntegerToFloat, stored as float32 from the
integer GEMM's tile (one program record), against onnxruntime on the same model."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import hetero_exec
from hetero_exec.ir.load import load
from hetero_exec.placement.fusions.integer import fuse_integer_scale
from tests._models import init, model, u8s8_anchor, vi
from tests.exec.program.test_lowerings import python_steps
from tests.kernels.contrib.test_quant_integer import _mlp


def _ort(m: onnx.ModelProto, feed: dict) -> list:
    import onnxruntime

    exact = u8s8_anchor(m, feed)
    if exact is not None:
        return exact
    so = onnxruntime.SessionOptions()
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return onnxruntime.InferenceSession(m.SerializeToString(), so,
                                        providers=["CPUExecutionProvider"]).run(None, feed)


@pytest.mark.parametrize("weight_type", ["QInt8", "QUInt8"])
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("rows", [1, 19])
def test_quantize_dynamic_products_are_fused(tmp_path, weight_type, per_channel, rows):
    from onnxruntime.quantization import QuantType, quantize_dynamic

    src, dst = tmp_path / "f.onnx", tmp_path / "q.onnx"
    onnx.save(_mlp(), src)
    quantize_dynamic(str(src), str(dst), weight_type=getattr(QuantType, weight_type),
                     per_channel=per_channel)
    m = onnx.load(dst)
    sess = hetero_exec.InferenceSession(m.SerializeToString(), providers=["cpu"])
    ops = [n.op_type for n in sess.placement.graph.nodes]
    assert "MatMulInteger" not in ops and ops.count("MatMulIntegerToFloat") == sum(
        n.op_type == "MatMulInteger" for n in m.graph.node)
    x = np.random.default_rng(rows).standard_normal((rows, 72)).astype(np.float32)
    want = _ort(m, {"x": x})[0]
    for _ in range(3):  # plain, binding, the program
        np.testing.assert_allclose(sess.run(None, {"x": x})[0], want, rtol=1e-5, atol=1e-4)
    assert python_steps(sess) == []


def _chain(scale_shape: tuple, bias: bool, extra_reader: bool = False) -> onnx.ModelProto:
    rng = np.random.default_rng(5)
    K, N = 37, 21
    nodes = [helper.make_node("MatMulInteger", ["A", "W", "azp", "wzp"], ["acc"]),
             helper.make_node("Cast", ["acc"], ["accf"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["accf", "s"], ["y0"])]
    out = "y0"
    if bias:
        nodes.append(helper.make_node("Add", ["y0", "b"], ["y"]))
        out = "y"
    outputs = [vi(out, TensorProto.FLOAT, [3, N])]
    if extra_reader:  # the cast's value read elsewhere too: no fusion
        nodes.append(helper.make_node("Neg", ["accf"], ["n"]))
        outputs.append(vi("n", TensorProto.FLOAT, [3, N]))
    return model(nodes, [vi("A", TensorProto.UINT8, [3, K]),
                         vi("s", TensorProto.FLOAT, list(scale_shape))], outputs,
                 [init("W", rng.integers(-128, 128, (K, N)).astype(np.int8)),
                  init("azp", np.array(7, np.uint8)), init("wzp", np.array(-3, np.int8)),
                  init("b", rng.standard_normal(N).astype(np.float32))], opset=17)


@pytest.mark.parametrize("scale_shape,bias", [((), True), ((21,), False), ((21,), True)])
def test_a_fed_scale_and_a_bias_go_into_the_product(scale_shape, bias):
    m = _chain(scale_shape, bias)
    _, g = load(m)
    assert fuse_integer_scale(g) is not None
    assert [n.op_type for n in g.nodes] == ["MatMulIntegerToFloat"]
    rng = np.random.default_rng(6)
    feed = {"A": rng.integers(0, 256, (3, 37)).astype(np.uint8),
            "s": np.asarray(rng.random(scale_shape) * 0.01 + 0.001, np.float32)}
    sess = hetero_exec.InferenceSession(m.SerializeToString(), providers=["cpu"])
    want = _ort(m, feed)[0]
    for _ in range(3):
        np.testing.assert_allclose(sess.run(None, feed)[0], want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("scale_shape,extra", [((3, 21), False), ((1,), False), ((), True)])
def test_chains_it_cannot_take_stay_as_written(scale_shape, extra):
    # a scale per row, a (1,) scale (MatMulIntegerToFloat takes () or (N,)), a value read
    # by another node
    _, g = load(_chain(scale_shape, False, extra))
    assert fuse_integer_scale(g) is None
