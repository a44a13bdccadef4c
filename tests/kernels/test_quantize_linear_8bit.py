"""QuantizeLinear's one-pass path (float32, one scale and zero point, 8-bit out: a QDQ
model's activations) against onnxruntime, ties and saturation included."""

from __future__ import annotations

import numpy as np
import onnxruntime
import pytest
from onnx import TensorProto
from onnx import helper as h

from hetero_exec import InferenceSession


def _model(elem: int, with_zp: bool):
    ins = ["x", "s"] + (["z"] if with_zp else [])
    node = h.make_node("QuantizeLinear", ins, ["y"])
    inits = [h.make_tensor("s", TensorProto.FLOAT, [], [0.5])]
    if with_zp:
        inits.append(h.make_tensor("z", elem, [], [3 if elem == TensorProto.INT8 else 130]))
    g = h.make_graph([node], "q", [h.make_tensor_value_info("x", TensorProto.FLOAT, [None, 7])],
                     [h.make_tensor_value_info("y", elem if with_zp else TensorProto.UINT8,
                                               [None, 7])], inits)
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 13)])
    m.ir_version = 8
    return m.SerializeToString()


@pytest.mark.parametrize("elem,with_zp", [(TensorProto.UINT8, True), (TensorProto.INT8, True),
                                          (TensorProto.UINT8, False)])
def test_quantize_linear_8bit_matches_onnxruntime(elem, with_zp):
    data = _model(elem, with_zp)
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(0, 40, (9, 7)),  # saturates both ways
                        (np.arange(-30, 33) * 0.25).reshape(9, 7)]).astype(np.float32)  # ties
    x = x[::2]  # not contiguous in the session's feed either way
    got = InferenceSession(data, providers=["cpu"]).run(None, {"x": x})[0]
    want = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"]).run(
        None, {"x": np.ascontiguousarray(x)})[0]
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("n", [5, 16, 67, 4099])
@pytest.mark.parametrize("kind", ["normal", "ties", "positive", "nan"])
def test_dynamic_quantize_linear_matches_onnxruntime(n, kind):
    # the C pass (qgemm.c he_dynamic_quantize) a vector at a time with a scalar tail:
    # lengths around the vector widths, values on the rounding ties (x / scale = k + 0.5),
    # ranges that do not cross zero, and a NaN (skipped by the range, as onnxruntime's)
    rng = np.random.default_rng(n)
    x = rng.normal(0, 3, n).astype(np.float32)
    if kind == "ties":
        x = ((np.arange(n) % 64) - 31.5).astype(np.float32) * (63.0 / 255.0)
    elif kind == "positive":
        x = np.abs(x) + 1.0
    elif kind == "nan" and n > 5:
        x[n // 2] = np.nan
    node = h.make_node("DynamicQuantizeLinear", ["x"], ["y", "s", "z"])
    g = h.make_graph([node], "dq", [h.make_tensor_value_info("x", TensorProto.FLOAT, [n])],
                     [h.make_tensor_value_info("y", TensorProto.UINT8, [n]),
                      h.make_tensor_value_info("s", TensorProto.FLOAT, []),
                      h.make_tensor_value_info("z", TensorProto.UINT8, [])])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 13)])
    m.ir_version = 8
    data = m.SerializeToString()
    got = InferenceSession(data, providers=["cpu"]).run(None, {"x": x})
    want = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"]).run(
        None, {"x": x})
    keep = ~np.isnan(x)
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[2], want[2])
    np.testing.assert_array_equal(got[0][keep], want[0][keep])
