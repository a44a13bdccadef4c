"""The benchmark models: they build, pass the checker, and hetero_exec matches onnxruntime.

This is the "real models match onnxruntime" test: a ResNet, a BERT and a GPT-2 shaped
the way torch exports them, at batch 1 (short sequences for the text models, so the
whole file stays well under a minute on two cores).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from bench.models import MODELS, inputs, tiny_ops

RTOL, ATOL = 1e-3, 1e-4


@pytest.fixture(scope="module")
def models():
    """Each model built once for the module (ResNet-18's weights take a second)."""
    return {name: build() for name, build in MODELS.items()}


@pytest.mark.parametrize("name", list(MODELS))
def test_builds_and_checks(models, name):
    model = models[name]
    onnx.checker.check_model(model, full_check=True)
    batch = model.graph.input[0].type.tensor_type.shape.dim[0]
    assert batch.dim_param == "N"


def test_tiny_ops_checks():
    model = tiny_ops(10)
    onnx.checker.check_model(model, full_check=True)
    assert [n.op_type for n in model.graph.node[:3]] == ["Add", "Mul", "Relu"]


def test_inputs_are_deterministic():
    a, b = inputs("bert", 3, seed=1, seq=8), inputs("bert", 3, seed=1, seq=8)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    assert a["attention_mask"][0].all() and not a["attention_mask"][2].all()


def _match_onnxruntime(model, feed):
    ort = pytest.importorskip("onnxruntime")
    from hetero_exec.session import InferenceSession

    data = model.SerializeToString()
    expected = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, feed)
    got = InferenceSession(data, providers=["cpu"]).run(None, feed)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.shape == e.shape and g.dtype == e.dtype
        np.testing.assert_allclose(g, e, rtol=RTOL, atol=ATOL)


# timeouts bound each model, so a slow kernel fails here rather than stalling the suite
@pytest.mark.parametrize("name, batch, seq", [
    pytest.param("mlp", 2, None, marks=pytest.mark.timeout(10)),
    pytest.param("resnet18", 1, None, marks=pytest.mark.timeout(30)),
    pytest.param("bert", 2, 16, marks=pytest.mark.timeout(15)),
    pytest.param("gpt2", 1, 32, marks=pytest.mark.timeout(15)),
])
def test_matches_onnxruntime(models, name, batch, seq):
    feed = inputs(name, batch, seq=seq) if seq else inputs(name, batch)
    _match_onnxruntime(models[name], feed)


@pytest.mark.timeout(10)
def test_tiny_ops_matches_onnxruntime():
    _match_onnxruntime(tiny_ops(30), {"x": np.linspace(-2, 2, 16, dtype=np.float32)[None]})
