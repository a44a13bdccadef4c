"""Contrib activations and bias sums against onnxruntime, on cpu and strict sim-gpu."""

from __future__ import annotations

import numpy as np
import pytest

from tests.kernels.contrib._ort import compare, one_node

RNG = np.random.default_rng(5)


def _r(*shape, dtype=np.float32):
    return (2 * RNG.standard_normal(shape)).astype(dtype)


def test_gelu():  # (onnxruntime's cpu Gelu is float32 only)
    compare(*one_node("Gelu", [_r(3, 7, 13)]), rtol=1e-5, atol=1e-6)


def test_fast_gelu():
    compare(*one_node("FastGelu", [_r(2, 5, 19)]), rtol=1e-4, atol=1e-5)
    compare(*one_node("FastGelu", [_r(2, 5, 19), _r(19)]), rtol=1e-4, atol=1e-5)


def test_bias_gelu():
    compare(*one_node("BiasGelu", [_r(3, 4, 21), _r(21)], initializers=(1,)), rtol=1e-5,
            atol=1e-6)


@pytest.mark.parametrize("alpha", [1.702, 0.5])
def test_quick_gelu(alpha):
    compare(*one_node("QuickGelu", [_r(4, 33)], alpha=alpha), rtol=1e-5, atol=1e-6)


def test_quick_gelu_float16():
    compare(*one_node("QuickGelu", [_r(4, 33, dtype=np.float16)]), rtol=2e-3, atol=2e-3)


def test_bias_add():
    """onnxruntime has BiasAdd on CUDA only: its cpu runs the two Adds it stands for."""
    import onnx
    from onnx import helper

    from tests.kernels.contrib._ort import PROVIDERS, run_ort, run_ours, with_output_shapes

    X, bias, skip = _r(2, 3, 320), _r(320), _r(2, 3, 320)
    model, feeds = one_node("BiasAdd", [X, bias, skip])
    plain = onnx.load_from_string(model)
    del plain.graph.node[:]
    plain.graph.node.extend([helper.make_node("Add", ["x0", "x1"], ["t"]),
                             helper.make_node("Add", ["t", "x2"], ["y0"])])
    want = run_ort(plain.SerializeToString(), feeds)
    model = with_output_shapes(model, want)
    for provider, options in PROVIDERS:
        got = run_ours(model, feeds, provider, **options)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-6)
