"""Models made by onnxruntime's own tooling: the transformer optimizer
(onnxruntime.transformers.optimizer.optimize_model) and a session's
``optimized_model_filepath`` at the extended level. Their com.microsoft ops run on cpu and
on strict sim-gpu (the GPU required), matching onnxruntime on the original model."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper as h
from onnx import numpy_helper as nh

import hetero_exec

RNG = np.random.default_rng(23)
H, F = 32, 64


def _init(name, *shape):
    return nh.from_array((RNG.standard_normal(shape) * 0.1).astype(np.float32), name)


def _const(name, v):
    return nh.from_array(np.array(v, np.float32), name)


def _gelu_erf(x, y):
    return [h.make_node("Div", [x, "sqrt2"], [f"{y}_d"]), h.make_node("Erf", [f"{y}_d"], [f"{y}_e"]),
            h.make_node("Add", [f"{y}_e", "one"], [f"{y}_e1"]),
            h.make_node("Mul", [x, f"{y}_e1"], [f"{y}_g"]),
            h.make_node("Mul", [f"{y}_g", "half"], [y])]


def _gelu_tanh(x, y):
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))): GPT-2's gelu_new."""
    return [h.make_node("Pow", [x, "three"], [f"{y}_p"]),
            h.make_node("Mul", [f"{y}_p", "k"], [f"{y}_pk"]),
            h.make_node("Add", [x, f"{y}_pk"], [f"{y}_s"]),
            h.make_node("Mul", [f"{y}_s", "c"], [f"{y}_sc"]),
            h.make_node("Tanh", [f"{y}_sc"], [f"{y}_t"]),
            h.make_node("Add", [f"{y}_t", "one"], [f"{y}_t1"]),
            h.make_node("Mul", [x, "half"], [f"{y}_xh"]),
            h.make_node("Mul", [f"{y}_xh", f"{y}_t1"], [y])]


def _block(gelu) -> onnx.ModelProto:
    """A transformer block's residual, LayerNorms and MLP, batch and sequence symbolic."""
    nodes = [h.make_node("Add", ["x", "skip"], ["s"]),
             h.make_node("LayerNormalization", ["s", "g1", "b1"], ["n1"], epsilon=1e-5),
             h.make_node("MatMul", ["n1", "W1"], ["m1"]), h.make_node("Add", ["m1", "c1"], ["a1"]),
             *gelu("a1", "act"),
             h.make_node("MatMul", ["act", "W2"], ["m2"]), h.make_node("Add", ["m2", "c2"], ["a2"]),
             h.make_node("Add", ["a2", "n1"], ["r"]),
             h.make_node("LayerNormalization", ["r", "g2", "b2"], ["y"], epsilon=1e-5)]
    inits = [_init("g1", H), _init("b1", H), _init("W1", H, F), _init("c1", F), _init("W2", F, H),
             _init("c2", H), _init("g2", H), _init("b2", H), _const("sqrt2", 1.4142135),
             _const("one", 1.0), _const("half", 0.5), _const("three", 3.0),
             _const("k", 0.044715), _const("c", 0.7978845608)]
    g = h.make_graph(nodes, "block", [h.make_tensor_value_info("x", TP.FLOAT, ["B", "S", H]),
                                      h.make_tensor_value_info("skip", TP.FLOAT, ["B", "S", H])],
                     [h.make_tensor_value_info("y", TP.FLOAT, ["B", "S", H])], initializer=inits)
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])


def _convnet() -> onnx.ModelProto:
    """Conv-Relu, a residual Conv-Add-Relu, a Gemm-Relu head and a scaled, transposed
    MatMul: onnxruntime's extended level makes FusedConv, FusedGemm and FusedMatMul."""
    nodes = [h.make_node("Conv", ["x", "w1", "cb1"], ["c1"], pads=[1, 1, 1, 1]),
             h.make_node("Relu", ["c1"], ["r1"]),
             h.make_node("Conv", ["r1", "w2", "cb2"], ["c2"], pads=[1, 1, 1, 1]),
             h.make_node("Add", ["c2", "r1"], ["s2"]), h.make_node("Relu", ["s2"], ["r2"]),
             h.make_node("GlobalAveragePool", ["r2"], ["p"]), h.make_node("Flatten", ["p"], ["f"]),
             h.make_node("Gemm", ["f", "gw", "gb"], ["gm"], transB=1),
             h.make_node("Relu", ["gm"], ["y"]),
             h.make_node("Transpose", ["q"], ["qt"], perm=[0, 2, 1]),
             h.make_node("MatMul", ["qt", "kq"], ["qk"]),
             h.make_node("Mul", ["qk", "scale"], ["z"])]
    inits = [_init("w1", 6, 3, 3, 3), _init("cb1", 6), _init("w2", 6, 6, 3, 3), _init("cb2", 6),
             _init("gw", 5, 6), _init("gb", 5), _init("kq", 2, 7, 9), _const("scale", 0.125)]
    g = h.make_graph(nodes, "net", [h.make_tensor_value_info("x", TP.FLOAT, ["N", 3, 9, 11]),
                                    h.make_tensor_value_info("q", TP.FLOAT, [2, 7, 4])],
                     [h.make_tensor_value_info("y", TP.FLOAT, ["N", 5]),
                      h.make_tensor_value_info("z", TP.FLOAT, [2, 4, 9])], initializer=inits)
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])


def _ort_run(model: bytes, feeds):
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"]).run(None, feeds)


def _ort_optimized(model: onnx.ModelProto, tmp_path) -> onnx.ModelProto:
    src, dst = tmp_path / "src.onnx", tmp_path / "opt.onnx"
    onnx.save(model, src)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = str(dst)
    ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"])
    return onnx.load(dst)


def _transformers_optimized(model: onnx.ModelProto, tmp_path, model_type) -> onnx.ModelProto:
    from onnxruntime.transformers.optimizer import optimize_model

    src = tmp_path / "src.onnx"
    onnx.save(model, src)
    return optimize_model(str(src), model_type=model_type, num_heads=2, hidden_size=H,
                          opt_level=0).model


def _check(original: onnx.ModelProto, made: onnx.ModelProto, feeds, expect_ops):
    ops = {f"{n.domain}::{n.op_type}" for n in made.graph.node if n.domain == "com.microsoft"}
    assert expect_ops <= ops, ops  # the tool did make the contrib ops this test is about
    want = _ort_run(original.SerializeToString(), feeds)
    for provider, opts in (("cpu", {}), ("sim-gpu", {"require_gpu": True})):
        sess = hetero_exec.InferenceSession(made.SerializeToString(), providers=[provider], **opts)
        got = sess.run(None, feeds)
        for w, g in zip(want, got):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4, err_msg=provider)


def _block_feeds():
    return {"x": RNG.standard_normal((2, 5, H)).astype(np.float32),
            "skip": RNG.standard_normal((2, 5, H)).astype(np.float32)}


@pytest.mark.parametrize("tool", ["transformers", "ort"])
def test_bert_block(tool, tmp_path):
    m = _block(_gelu_erf)
    made = (_transformers_optimized(m, tmp_path, "bert") if tool == "transformers"
            else _ort_optimized(m, tmp_path))
    _check(m, made, _block_feeds(),
           {"com.microsoft::SkipLayerNormalization", "com.microsoft::BiasGelu"})


def test_gpt2_block_fast_gelu(tmp_path):
    m = _block(_gelu_tanh)
    made = _transformers_optimized(m, tmp_path, "gpt2")
    _check(m, made, _block_feeds(), {"com.microsoft::FastGelu"})


def test_convnet_extended_level(tmp_path):
    m = _convnet()
    made = _ort_optimized(m, tmp_path)
    feeds = {"x": RNG.standard_normal((2, 3, 9, 11)).astype(np.float32),
             "q": RNG.standard_normal((2, 7, 4)).astype(np.float32)}
    _check(m, made, feeds, {"com.microsoft::FusedConv", "com.microsoft::FusedMatMul",
                            "com.microsoft::FusedGemm"})
