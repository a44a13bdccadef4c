"""Contrib layer norms against onnxruntime, on cpu and strict sim-gpu."""

from __future__ import annotations

import numpy as np
import pytest

from tests.kernels.contrib._ort import compare, one_node

RNG = np.random.default_rng(7)


def _r(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


def test_simplified_layer_norm():
    domain = ""  # where onnxruntime registers it
    X, scale = _r(3, 5, 37), _r(37)
    compare(*one_node("SimplifiedLayerNormalization", [X, scale], domain=domain, epsilon=1e-6))
    # both outputs, over the last two axes
    scale2 = _r(5, 37)
    compare(*one_node("SimplifiedLayerNormalization", [X, scale2], n_outputs=2, domain=domain,
                      axis=1, epsilon=1e-5), rtol=1e-4)


def test_simplified_layer_norm_ms_domain_runs():
    """com.microsoft's spelling (onnxruntime has none in 1.32): the default domain's result."""
    import hetero_exec
    from tests.kernels.contrib._ort import run_ort, with_output_shapes

    X, scale = _r(2, 3, 19), _r(19)
    want = run_ort(*one_node("SimplifiedLayerNormalization", [X, scale], domain=""))
    model, feeds = one_node("SimplifiedLayerNormalization", [X, scale], domain="com.microsoft")
    model = with_output_shapes(model, want)
    for provider, opts in (("cpu", {}), ("sim-gpu", {"require_gpu": True})):
        got = hetero_exec.InferenceSession(model, providers=[provider], **opts).run(None, feeds)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("skip_shape", [(2, 7, 45), (1, 7, 45), (7, 45)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_skip_layer_norm(skip_shape, with_bias):
    X, skip, gamma, beta = _r(2, 7, 45), _r(*skip_shape), _r(45), _r(45)
    bias = _r(45) if with_bias else None
    model, feeds = one_node("SkipLayerNormalization", [X, skip, gamma, beta, bias],
                            output_names=["y0", "", "", "y3"], epsilon=1e-5)
    compare(model, feeds, rtol=1e-4, atol=1e-5)
    compare(*one_node("SkipLayerNormalization", [X, skip, gamma, None, bias]), rtol=1e-4,
            atol=1e-5)


@pytest.mark.parametrize("with_bias", [False, True])
def test_skip_simplified_layer_norm(with_bias):
    X, skip, gamma = _r(3, 5, 33), _r(3, 5, 33), _r(33)
    bias = _r(33) if with_bias else None
    model, feeds = one_node("SkipSimplifiedLayerNormalization", [X, skip, gamma, bias],
                            output_names=["y0", "", "", "y3"], epsilon=1e-6)
    compare(model, feeds, rtol=1e-4, atol=1e-5)


def test_skip_layer_norm_float16():
    X, skip = _r(2, 3, 24, dtype=np.float16), _r(2, 3, 24, dtype=np.float16)
    gamma, beta = _r(24, dtype=np.float16), _r(24, dtype=np.float16)
    compare(*one_node("SkipLayerNormalization", [X, skip, gamma, beta]), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("with_segment", [False, True])
@pytest.mark.parametrize("with_mask", [False, True])
def test_embed_layer_norm(with_segment, with_mask):
    B, S, V, P, H = 2, 5, 11, 9, 24
    ids = RNG.integers(0, V, (B, S)).astype(np.int32)
    seg = RNG.integers(0, 2, (B, S)).astype(np.int32) if with_segment else None
    seg_emb = _r(2, H) if with_segment else None
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], np.int32) if with_mask else None
    inputs = [ids, seg, _r(V, H), _r(P, H), seg_emb, _r(H), _r(H), mask]
    compare(*one_node("EmbedLayerNormalization", inputs, n_outputs=3, initializers=(2, 3, 4, 5, 6),
                      out_types=[np.float32, np.int32, np.float32], epsilon=1e-5), rtol=1e-4, atol=1e-5)
