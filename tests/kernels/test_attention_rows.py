"""FusedAttention's compiled rows (native/attention.c) against the definition in float64:
softmax(scale * Q @ K^T + mask) @ V, for the masks decoders make (causal with float32's
minimum or -inf, left padding, a decode step's unfilled cache positions), grouped kv
heads, K given either way, broadcast masks and strided views; and rows with no visible
key, as numpy computes them."""

from __future__ import annotations

import numpy as np
import pytest

from hetero_exec.kernels.fused_attention import FusedAttention
from hetero_exec.kernels.native import library, row_kernels

pytestmark = pytest.mark.skipif(not library.available(), reason="no C library")

MIN = np.finfo(np.float32).min


def reference(Q, K, V, mask, scale, k_transposed, kv_groups, nan_to_zero=0):
    Q, K, V = (x.astype(np.float64) for x in (Q, K, V))
    KT = K if k_transposed else np.swapaxes(K, -1, -2)
    g = Q.shape[1] // KT.shape[1] if kv_groups > 1 else 1
    KT, V = np.repeat(KT, g, axis=1), np.repeat(V, g, axis=1)
    s = Q @ KT * scale
    if mask is not None:
        s = s + mask.astype(np.float64)
    with np.errstate(invalid="ignore"):
        e = np.exp(s - s.max(axis=-1, keepdims=True))
        p = e / e.sum(axis=-1, keepdims=True)
    if nan_to_zero:
        p = np.where(np.isnan(p), 0.0, p)
    return p @ V


def causal(L, S, fill=MIN):
    """Row i sees keys up to S - L + i (a prompt after S - L cached positions)."""
    m = np.zeros((L, S), np.float32)
    m[np.triu_indices(L, k=S - L + 1, m=S)] = fill
    return m


def run(monkeypatch, Q, K, V, mask, scale=0.25, k_transposed=1, kv_groups=1, nan_to_zero=0):
    ran: list[int] = []
    native = row_kernels.attention_rows
    monkeypatch.setattr(row_kernels, "attention_rows",
                        lambda *a: ran.append(1) or native(*a))
    (y,) = FusedAttention(np, Q, K, V, mask, scale=scale, k_transposed=k_transposed,
                          kv_groups=kv_groups, nan_to_zero=nan_to_zero)
    assert ran, "the compiled rows did not run"
    return y


def operands(rng, B, Hq, Hkv, L, S, D, k_transposed):
    Q = rng.standard_normal((B, Hq, L, D)).astype(np.float32)
    K = rng.standard_normal((B, Hkv, D, S) if k_transposed else (B, Hkv, S, D)).astype(np.float32)
    V = rng.standard_normal((B, Hkv, S, D)).astype(np.float32)
    return Q, K, V


@pytest.mark.parametrize("k_transposed", [1, 0])
@pytest.mark.parametrize("fill", [MIN, -np.inf])
@pytest.mark.parametrize("L,S,D", [(37, 37, 16), (5, 40, 13), (1, 70, 64), (2, 2100, 8), (3, 21, 80),
                                   (1, 97, 16), (1, 600, 32), (6, 300, 128)])
def test_causal_prompt_and_decode(monkeypatch, k_transposed, fill, L, S, D):
    rng = np.random.default_rng(L * S + D)
    Q, K, V = operands(rng, 2, 4, 4, L, S, D, k_transposed)
    mask = np.broadcast_to(causal(L, S, fill), (2, 1, L, S)).copy()
    mask[1, :, :, :3] = fill  # the second row left-padded by 3
    if L == 1:
        mask[:, :, :, 50:] = fill  # a decode step: cache positions not filled yet
    want = reference(Q, K, V, mask, 0.25, k_transposed, 1)
    got = run(monkeypatch, Q, K, V, mask, k_transposed=k_transposed)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("mask_shape", [(9, 30), (1, 1, 1, 30), (2, 1, 9, 30), None])
def test_grouped_heads_and_broadcast_masks(monkeypatch, mask_shape):
    rng = np.random.default_rng(3)
    Q, K, V = operands(rng, 2, 6, 2, 9, 30, 16, 1)
    mask = None
    if mask_shape is not None:
        mask = np.where(rng.random(mask_shape) < 0.3, MIN, 0.0).astype(np.float32)
        mask[..., 0] = 0.0  # a visible key in every row
    want = reference(Q, K, V, mask, 0.125, 1, 3)
    got = run(monkeypatch, Q, K, V, mask, scale=0.125, kv_groups=3)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)


def test_strided_views(monkeypatch):
    """Q and V as a model's transposes make them ((B, L, H, D) read as (B, H, L, D))."""
    rng = np.random.default_rng(4)
    Q = rng.standard_normal((2, 11, 4, 16)).astype(np.float32).transpose(0, 2, 1, 3)
    K = rng.standard_normal((2, 4, 16, 11)).astype(np.float32)
    V = rng.standard_normal((2, 11, 4, 16)).astype(np.float32).transpose(0, 2, 1, 3)
    mask = causal(11, 11)
    got = run(monkeypatch, Q, K, V, mask)
    np.testing.assert_allclose(got, reference(Q, K, V, mask, 0.25, 1, 1), rtol=1e-5, atol=2e-6)


def test_rows_with_no_visible_key_as_numpy(monkeypatch):
    """Every key hidden: float32's minimum leaves the scores equal (a uniform row, the
    values' mean); -inf gives a NaN row, zeros with nan_to_zero (torch's SDPA guard)."""
    rng = np.random.default_rng(5)
    Q, K, V = operands(rng, 1, 2, 2, 3, 8, 16, 1)
    for fill, nan_to_zero in ((MIN, 0), (-np.inf, 0), (-np.inf, 1)):
        mask = causal(3, 8)
        mask[1] = fill
        got = run(monkeypatch, Q, K, V, mask, nan_to_zero=nan_to_zero)
        want = reference(Q, K, V, mask, 0.25, 1, 1, nan_to_zero)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)
        if fill == MIN:
            np.testing.assert_allclose(got[0, :, 1], V[0].mean(axis=1), rtol=1e-5, atol=2e-6)
        elif nan_to_zero:
            assert (got[0, :, 1] == 0).all()
        else:
            assert np.isnan(got[0, :, 1]).all() and not np.isnan(got[0, :, [0, 2]]).any()


@pytest.mark.parametrize("fill", [MIN, -np.inf, -5.0])
def test_a_where_condition(monkeypatch, fill):
    """GPT-2's causal Where(cond, scores, fill) before the padding mask: a fill that hides
    (<= -1e30) skips the keys, another is a score like any other."""
    rng = np.random.default_rng(7)
    Q, K, V = operands(rng, 2, 3, 3, 6, 20, 16, 1)
    cond = (causal(6, 20, -1.0) == 0)[None, None]
    mask = np.zeros((2, 1, 1, 20), np.float32)
    mask[1, ..., :4] = MIN
    fill = np.array(fill, np.float32)
    ran: list[int] = []
    native = row_kernels.attention_rows
    monkeypatch.setattr(row_kernels, "attention_rows", lambda *a: ran.append(1) or native(*a))
    (got,) = FusedAttention(np, Q, K, V, mask, cond, fill, scale=0.5)
    assert ran
    s = np.where(cond, (Q.astype(np.float64) @ K.astype(np.float64)) * 0.5, float(fill)) + mask
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    want = (p / p.sum(axis=-1, keepdims=True)) @ V.astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)


def test_other_operands_take_numpy():
    """float64, a 3-d Q, or a condition that is not bool: the numpy path, which the
    definition is."""
    rng = np.random.default_rng(6)
    Q, K, V = operands(rng, 1, 2, 2, 4, 4, 8, 1)
    assert row_kernels.attention_rows(Q.astype(np.float64), K, V, None, 1.0, 1, 1, 0) is None
    assert row_kernels.attention_rows(Q[0], K[0], V[0], None, 1.0, 1, 1, 0) is None
    cond = np.tril(np.ones((4, 4), np.int64))
    assert row_kernels.attention_rows(Q, K, V, None, 1.0, 1, 1, 0, cond, np.float32(0)) is None
