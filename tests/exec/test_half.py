"""float16 models (onnxruntime's convert_float_to_float16) run as onnxruntime's cpu runs
them: float32 arithmetic inside accumulating nodes, float16 storage (exec/half.py).
Checked against onnxruntime on the float16 model and on the float32 model."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import helper
from onnxruntime.transformers.float16 import convert_float_to_float16

import hetero_exec
from hetero_exec.exec import half
from tests._models import init, model, vi


def _mlp(D=96) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h0"]),
             helper.make_node("Add", ["h0", "b1"], ["h"]),
             helper.make_node("LayerNormalization", ["h", "g", "b"], ["ln"], axis=-1),
             helper.make_node("Tanh", ["ln"], ["t"]),
             helper.make_node("Gemm", ["t", "W2"], ["o"], transB=1),
             helper.make_node("ReduceMean", ["o"], ["y"], axes=[-1], keepdims=1)]
    return model(nodes, [vi("x", 1, ["N", D])], [vi("y", 1, ["N", 1])],
                 [init("W1", (rng.standard_normal((D, D)) * 0.2).astype(np.float32)),
                  init("b1", rng.standard_normal(D).astype(np.float32) * 3),
                  init("g", rng.random(D).astype(np.float32) + 0.5),
                  init("b", rng.standard_normal(D).astype(np.float32)),
                  init("W2", rng.standard_normal((D, D)).astype(np.float32))], opset=17)


def _convnet() -> onnx.ModelProto:
    rng = np.random.default_rng(1)
    C = 8
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "s", "bb", "mu", "var"], ["bn"]),
             helper.make_node("Relu", ["bn"], ["r"]),
             helper.make_node("AveragePool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("GlobalAveragePool", ["p"], ["y"])]
    return model(nodes, [vi("x", 1, [2, 3, 12, 10])], [vi("y", 1, [2, C, 1, 1])],
                 [init("W", rng.standard_normal((C, 3, 3, 3)).astype(np.float32)),
                  init("s", rng.random(C).astype(np.float32) + 0.5),
                  init("bb", rng.standard_normal(C).astype(np.float32)),
                  init("mu", rng.standard_normal(C).astype(np.float32)),
                  init("var", rng.random(C).astype(np.float32) + 0.5)], opset=17)


def _ort(m, feed):
    sess = onnxruntime.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feed)[0]


@pytest.mark.parametrize("build,shape", [(_mlp, (64, 96)), (_convnet, (2, 3, 12, 10))])
def test_float16_model_within_onnxruntime_tolerance(build, shape):
    m32 = build()
    m16 = convert_float_to_float16(m32, keep_io_types=False)
    x = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    want32 = _ort(m32, {"x": x})
    ort16 = _ort(m16, {"x": x.astype(np.float16)}).astype(np.float32)
    got = hetero_exec.InferenceSession(m16.SerializeToString(), providers=["cpu"]).run(
        None, {"x": x.astype(np.float16)})[0]
    assert got.dtype == np.float16
    got = got.astype(np.float32)
    scale = float(np.abs(want32).max())
    ort_err = float(np.abs(ort16 - want32).max())
    # as close to the float32 model as onnxruntime (float16 storage: a few ulps of slack)
    assert float(np.abs(got - want32).max()) <= 2 * ort_err + 2e-3 * scale
    np.testing.assert_allclose(got, ort16, rtol=4e-3, atol=4e-3 * scale)


def test_float16_layer_norm_computes_in_float32():
    """A large mean: float16 arithmetic loses the deviations, float32 keeps them."""
    D = 512
    rng = np.random.default_rng(3)
    node = helper.make_node("LayerNormalization", ["x", "g", "b"], ["y"], axis=-1)
    m = model([node], [vi("x", 10, [4, D])], [vi("y", 10, [4, D])],
              [init("g", np.ones(D, np.float16)), init("b", np.zeros(D, np.float16))], opset=17)
    x = (300 + rng.standard_normal((4, D))).astype(np.float16)
    want = _ort(m, {"x": x}).astype(np.float32)
    sess = hetero_exec.InferenceSession(m.SerializeToString(), providers=["cpu"])
    got = sess.run(None, {"x": x})[0]
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float32), want, atol=4e-3, rtol=4e-3)
    step = next(n for n in sess.placement.segments[0].nodes if n.op_type != "Cast")
    assert step.op_type in half.FLOAT32_OPS


def test_float16_plan_wraps_float_nodes():
    """MatMul / LayerNormalization / Add on float16 get the float32 wrapper (with the
    weight upcast at compile time)."""
    from hetero_exec.exec.plan import Compiler
    from hetero_exec.ir.load import load

    m16 = convert_float_to_float16(_mlp(), keep_io_types=False)
    _, g = load(m16)
    plan = Compiler().compile_graph(g)
    names = {s.node.op_type: s.fn.__name__ for s in plan.steps}
    assert names["MatMul"].endswith("_float32")
    assert names["LayerNormalization"].endswith("_float32")
    assert names["Add"].endswith("_float32")
    x = np.random.default_rng(4).standard_normal((3, 96)).astype(np.float16)
    step = next(s for s in plan.steps if s.node.op_type == "MatMul")
    W = plan.template[step.inputs[1]]
    assert W.dtype == np.float16
    (y,) = step.fn(np, x, W)
    assert y.dtype == np.float16
    want = (x.astype(np.float32) @ W.astype(np.float32)).astype(np.float16)
    np.testing.assert_array_equal(y, want)


@pytest.mark.parametrize("n", [2048, 4099, 1 << 16])
def test_native_half_conversion_matches_astype(n):
    from hetero_exec.kernels.native import library, row_kernels

    if not library.available():
        pytest.skip(library.unavailable_reason())
    rng = np.random.default_rng(n)
    h = (rng.standard_normal(n) * 3000).astype(np.float16)
    h[:6] = [np.inf, -np.inf, 6e-8, -0.0, 65504, 1e-5]  # infinities, subnormals, extremes
    f = row_kernels.convert_half(h, np.float32)
    np.testing.assert_array_equal(f.view(np.uint32), h.astype(np.float32).view(np.uint32))
    x = (rng.standard_normal(n) * 30000).astype(np.float32)
    x[:5] = [np.inf, 1e-9, 65520.0, -70000.0, 2.0 ** -24 * 1.5]  # ties, overflow, subnormal
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    got = row_kernels.convert_half(x, np.float16)
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    assert np.isnan(row_kernels.convert_half(np.full(n, np.nan, np.float32), np.float16)).all()
