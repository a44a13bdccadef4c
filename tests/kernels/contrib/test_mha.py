"""Attention and MultiHeadAttention (com.microsoft) against onnxruntime, on cpu and strict
sim-gpu."""

from __future__ import annotations

import numpy as np
import pytest

from tests.kernels.contrib._ort import compare, one_node

RNG = np.random.default_rng(17)


def _r(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


B, S, N, H = 2, 5, 3, 8
D = N * H


@pytest.mark.parametrize("mask", ["none", "lengths", "raw", "raw3d", "startend"])
@pytest.mark.parametrize("unidirectional", [0, 1])
def test_attention(mask, unidirectional):
    x, w, b = _r(B, S, 20), _r(20, 3 * D), _r(3 * D)
    m = {"none": None,
         "lengths": np.array([5, 3], np.int32),
         "raw": np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], np.int32),
         "raw3d": (RNG.random((B, S, S)) > 0.3).astype(np.int32),
         "startend": np.array([5, 4, 0, 1], np.int32)}[mask]
    compare(*one_node("Attention", [x, w, b, m], initializers=(1, 2), num_heads=N,
                      unidirectional=unidirectional), rtol=1e-4, atol=1e-5)


def test_attention_past_present_and_bias():
    P = 4
    x, w, b = _r(B, 1, 20), _r(20, 3 * D), _r(3 * D)
    past = _r(2, B, N, P, H)
    mask = np.ones((B, P + 1), np.int32)
    mask[0, :2] = 0  # left padding in the cache of row 0
    compare(*one_node("Attention", [x, w, b, mask, past], n_outputs=2, initializers=(1, 2),
                      num_heads=N, unidirectional=1), rtol=1e-4, atol=1e-5)
    ab = _r(1, N, S, S)
    compare(*one_node("Attention", [_r(B, S, 20), w, b, None, None, ab], initializers=(1, 2),
                      num_heads=N, scale=0.2), rtol=1e-4, atol=1e-5)


def test_attention_qkv_hidden_sizes():
    x, w, b = _r(B, S, 16), _r(16, 4 * D), _r(4 * D)
    compare(*one_node("Attention", [x, w, b], initializers=(1, 2), num_heads=N,
                      qkv_hidden_sizes=[D, D, 2 * D]), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("mask", ["none", "lengths", "raw"])
def test_mha_separate(with_bias, mask):
    L = 7
    q, k, v = _r(B, S, D), _r(B, L, D), _r(B, L, D)
    bias = _r(3 * D) if with_bias else None
    m = {"none": None, "lengths": np.array([7, 4], np.int32),
         "raw": (RNG.random((B, L)) > 0.3).astype(np.int32)}[mask]
    compare(*one_node("MultiHeadAttention", [q, k, v, bias, m], num_heads=N), rtol=1e-4,
            atol=1e-5)


def test_mha_self_attention_with_past_causal_and_bias():
    P = 3
    q, k, v = _r(B, S, D), _r(B, S, D), _r(B, S, D)
    pk, pv = _r(B, N, P, H), _r(B, N, P, H)
    ab = _r(B, 1, S, P + S)
    inputs = [q, k, v, None, None, ab, pk, pv]
    compare(*one_node("MultiHeadAttention", inputs, n_outputs=3, num_heads=N, unidirectional=1),
            rtol=1e-4, atol=1e-5)


def test_mha_bnsh_key_value():
    """Cross attention on a (B, N, L, H) key/value cache (onnxruntime's cpu has no packed
    QKV or KV forms to compare with)."""
    L = 6
    compare(*one_node("MultiHeadAttention", [_r(B, S, D), _r(B, N, L, H), _r(B, N, L, H)],
                      num_heads=N), rtol=1e-4, atol=1e-5)
