"""The com.microsoft.nchwc ops in models onnxruntime itself writes: small conv nets
saved through ``optimized_model_filepath`` at ORT_ENABLE_ALL (its NCHWc transformer
rewrites them, on this machine's block size), run here and compared with onnxruntime
on the saved model and on the original."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import helper

import hetero_exec
from tests._models import init, model, vi
from tests.kernels.contrib._quant_helpers import SIM, placed

NCHWC = "com.microsoft.nchwc"


def _optimized(m: onnx.ModelProto, path) -> onnx.ModelProto:
    so = onnxruntime.SessionOptions()
    so.optimized_model_filepath = str(path)
    so.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3  # its warning that the file is for this machine
    onnxruntime.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return onnx.load(path)


def _net(C: int, act: str, tail: str) -> tuple[onnx.ModelProto, tuple]:
    rng = np.random.default_rng(C)
    x_shape = (2, 3, 21, 18)
    acts = {"Relu": [helper.make_node("Relu", ["c1"], ["r1"])],
            "LeakyRelu": [helper.make_node("LeakyRelu", ["c1"], ["r1"], alpha=0.2)],
            "Clip": [helper.make_node("Clip", ["c1", "lo", "hi"], ["r1"])]}
    nodes = [helper.make_node("Conv", ["x", "W1", "B1"], ["c1"], pads=[1, 1, 1, 1])]
    nodes += acts[act]
    nodes += [helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[3, 3], strides=[2, 2],
                               ceil_mode=1),
              helper.make_node("Conv", ["p1", "W2", "B2"], ["c2"], pads=[1, 1, 1, 1]),
              helper.make_node("Add", ["c2", "p1"], ["a"]),
              helper.make_node("Relu", ["a"], ["ra"]),
              helper.make_node("Conv", ["ra", "W3"], ["c3"], pads=[1, 1, 1, 1], group=C,
                               strides=[2, 2]),
              helper.make_node("AveragePool", ["c3"], ["ap"], kernel_shape=[3, 3],
                               pads=[1, 1, 1, 1])]
    inits = [init("W1", rng.standard_normal((C, 3, 3, 3)).astype(np.float32)),
             init("B1", rng.standard_normal(C).astype(np.float32)),
             init("W2", (rng.standard_normal((C, C, 3, 3)) * 0.1).astype(np.float32)),
             init("B2", rng.standard_normal(C).astype(np.float32)),
             init("W3", rng.standard_normal((C, 1, 3, 3)).astype(np.float32)),
             init("lo", np.array(0.0, np.float32)), init("hi", np.array(3.0, np.float32))]
    if tail == "global":
        nodes += [helper.make_node("GlobalAveragePool", ["ap"], ["y"])]
        out = vi("y", 1, [2, C, 1, 1])
    else:  # a nearest 2x upsample of the NCHWc tensor, then one more conv
        inits.append(init("sc", np.array([1, 1, 2, 2], np.float32)))
        inits.append(init("W4", (rng.standard_normal((C, C, 1, 1)) * 0.1).astype(np.float32)))
        nodes += [helper.make_node("Resize", ["ap", "", "sc"], ["up"], mode="nearest",
                                   coordinate_transformation_mode="asymmetric",
                                   nearest_mode="floor"),
                  helper.make_node("Conv", ["up", "W4"], ["y"])]
        out = vi("y", 1, [2, C, "h", "w"])
    return model(nodes, [vi("x", 1, list(x_shape))], [out], inits, opset=17), x_shape


@pytest.mark.parametrize("C", [16, 12, 32])
@pytest.mark.parametrize("act", ["Relu", "LeakyRelu", "Clip"])
@pytest.mark.parametrize("tail", ["global", "upsample"])
def test_nchwc_models_from_onnxruntime(tmp_path, C, act, tail):
    m, x_shape = _net(C, act, tail)
    opt = _optimized(m, tmp_path / "opt.onnx")
    domains = {n.domain for n in opt.graph.node}
    if NCHWC not in domains:
        pytest.skip("onnxruntime wrote no NCHWc ops on this cpu")
    x = np.random.default_rng(1).standard_normal(x_shape).astype(np.float32)
    sess = onnxruntime.InferenceSession(opt.SerializeToString(),
                                        providers=["CPUExecutionProvider"])
    want = sess.run(None, {"x": x})[0]
    scale = float(np.abs(want).max())
    for providers in (["cpu"], [SIM, "cpu"]):
        ours = hetero_exec.InferenceSession(opt.SerializeToString(), providers=providers)
        got = ours.run(None, {"x": x})[0]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * scale)
        if providers[0] is SIM:
            assert placed(ours, "Conv") == {"sim-gpu"}
    orig = onnxruntime.InferenceSession(m.SerializeToString(),
                                        providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, orig, rtol=1e-4, atol=1e-5 * scale)
