"""The real-architecture benchmark models (bench/arch_models.py): each builds, passes the
full checker, is deterministic, and hetero_exec's cpu provider matches onnxruntime on it.

Small feeds (batch 1, batch 2 for two of them, short llama sequences) keep the file to a
few seconds; speed is bench/bench_cpu.py's business, never a test's.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from bench.arch_models import ARCH_MODELS, arch_inputs

RTOL, ATOL = 1e-3, 1e-4


@pytest.fixture(scope="module")
def built():
    return {}


def _model(built, name):
    if name not in built:
        built[name] = ARCH_MODELS[name]()
    return built[name]


def test_every_architecture_has_both_spellings():
    archs = {n.rsplit("_", 1)[0] for n in ARCH_MODELS}
    assert archs == {"mobilenetv2", "convnext", "vit", "llama", "swin", "whisper"}
    assert all(f"{a}_{s}" in ARCH_MODELS for a in archs for s in ("ts", "dynamo"))


@pytest.mark.parametrize("name", list(ARCH_MODELS))
def test_builds_and_checks(built, name):
    model = _model(built, name)
    onnx.checker.check_model(model, full_check=True)
    opset = {o.domain: o.version for o in model.opset_import}[""]
    assert opset == (18 if name.endswith("_dynamo") else 14)
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "N"


def test_spellings_differ_where_the_exporters_do(built):
    def ops(name):
        return {n.op_type for n in _model(built, name).graph.node}

    assert "LayerNormalization" in ops("vit_dynamo") and "LayerNormalization" not in ops("vit_ts")
    assert "Erf" in ops("convnext_ts") and "Erf" in ops("convnext_dynamo")
    assert "BatchNormalization" in ops("mobilenetv2_dynamo")
    assert "BatchNormalization" not in ops("mobilenetv2_ts")  # folded, as eval export does
    llama = ops("llama_ts")
    assert {"Reciprocal", "Sqrt", "Neg", "Sigmoid", "Expand", "Cos", "Sin"} <= llama
    groups = {a.i for n in _model(built, "mobilenetv2_ts").graph.node if n.op_type == "Conv"
              for a in n.attribute if a.name == "group"}
    assert max(groups) > 1  # depthwise convolutions


def test_inputs_are_deterministic():
    a, b = arch_inputs("llama_ts", 2, seed=3), arch_inputs("llama_ts", 2, seed=3)
    np.testing.assert_array_equal(a["input_ids"], b["input_ids"])
    with pytest.raises(KeyError, match="unknown model"):
        arch_inputs("resnet", 1)


def _cases():
    for name in ARCH_MODELS:
        batch = 2 if name in ("mobilenetv2_dynamo", "llama_ts") else 1
        yield pytest.param(name, batch, marks=pytest.mark.timeout(30), id=f"{name}-b{batch}")


@pytest.mark.parametrize("name, batch", list(_cases()))
def test_matches_onnxruntime(built, name, batch):
    ort = pytest.importorskip("onnxruntime")
    from hetero_exec.session import InferenceSession

    data = _model(built, name).SerializeToString()
    feed = arch_inputs(name, batch, seq=16)
    expected = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, feed)
    got = InferenceSession(data, providers=["cpu"]).run(None, feed)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.shape == e.shape and g.dtype == e.dtype
        np.testing.assert_allclose(g, e, rtol=RTOL, atol=ATOL)
