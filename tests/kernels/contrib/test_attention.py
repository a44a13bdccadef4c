"""GroupQueryAttention and RotaryEmbedding (com.microsoft) against onnxruntime, on cpu
and strict sim-gpu."""

from __future__ import annotations

import numpy as np
import pytest

from tests.kernels.contrib._ort import compare, one_node

RNG = np.random.default_rng(11)


def _r(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


def _caches(max_pos, rd):
    inv = 1.0 / (10000 ** (np.arange(0, rd, 2) / rd))
    ang = np.arange(max_pos)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def _gqa(B, S, N, Nkv, H, seqlens, total, past_cap=0, packed=False, rotary=False,
         interleaved=0, rd=None, extra=None, dtype=np.float32, **attrs):
    """(model, feeds) of one GroupQueryAttention node; rows of a first prompt past a
    row's length are padding, which onnxruntime leaves undefined."""
    if packed:
        q, k, v = _r(B, S, (N + 2 * Nkv) * H, dtype=dtype), None, None
    else:
        q, k, v = (_r(B, S, n * H, dtype=dtype) for n in (N, Nkv, Nkv))
    pk = _r(B, Nkv, past_cap, H, dtype=dtype) if past_cap else None
    pv = _r(B, Nkv, past_cap, H, dtype=dtype) if past_cap else None
    cos = sin = None
    if rotary:
        cos, sin = (c.astype(dtype) for c in _caches(64, rd or H))
    inputs = [q, k, v, pk, pv, np.array(seqlens, np.int32), np.array(total, np.int32), cos, sin]
    for i, x in (extra or {}).items():  # later optional inputs by position
        inputs += [None] * (i + 1 - len(inputs))
        inputs[i] = x
    if rotary:
        attrs.update(do_rotary=1, rotary_interleaved=interleaved)
    return one_node("GroupQueryAttention", inputs, n_outputs=3, num_heads=N, kv_num_heads=Nkv,
                    out_types=[dtype] * 3, **attrs)


def _valid_rows(seqlens, S, total):
    """Cut the outputs to what onnxruntime defines: a first prompt's padding rows are not
    (nor, with packed QKV, their cache positions)."""
    lens = np.asarray(seqlens) + 1

    def rows(i, a):
        if S != total:
            return a
        if i == 0:
            return np.concatenate([a[b, :lens[b]] for b in range(a.shape[0])])
        return np.concatenate([a[b, :, :lens[b]].reshape(-1) for b in range(a.shape[0])])

    return rows


@pytest.mark.parametrize("rotary", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_gqa_prompt(rotary, packed):
    seqlens, S = [4, 2, 0], 5  # right padding: rows of length 5, 3 and 1
    # (onnxruntime's rotary wants a head size that is a multiple of 16)
    compare(*_gqa(3, S, 4, 2, 16 if rotary else 8, seqlens, S, packed=packed, rotary=rotary), rtol=1e-4,
            atol=1e-5, rows=_valid_rows(seqlens, S, S))


@pytest.mark.parametrize("rotary", [False, True])
def test_gqa_decode_shared_buffer(rotary):
    """Decode one token per row with different lengths into a past of capacity 9 > total."""
    seqlens, total = [3, 6], 7
    compare(*_gqa(2, 1, 6, 2, 16, seqlens, total, past_cap=9, rotary=rotary), rtol=1e-4,
            atol=1e-5)


def test_gqa_decode_past_exact_capacity_mha():
    """kv_num_heads == num_heads, a past exactly the length before this token."""
    compare(*_gqa(1, 1, 3, 3, 8, [5], 6, past_cap=5), rtol=1e-4, atol=1e-5)


def test_gqa_subsequent_prompt():
    """A second chunk of 3 tokens after 4 cached ones (batch 1)."""
    compare(*_gqa(1, 3, 4, 1, 16, [6], 7, past_cap=8, rotary=True, interleaved=1), rtol=1e-4,
            atol=1e-5)


@pytest.mark.parametrize("interleaved", [0, 1])
def test_gqa_partial_rotary_interleaved(interleaved):
    seqlens, S = [5], 6
    compare(*_gqa(1, S, 2, 1, 32, seqlens, S, rotary=True, interleaved=interleaved, rd=16),
            rtol=1e-4, atol=1e-5)


def test_gqa_local_window_softcap_scale():
    compare(*_gqa(2, 1, 4, 2, 8, [9, 4], 10, past_cap=12, local_window_size=3, softcap=2.0,
                  scale=0.3), rtol=1e-4, atol=1e-5)
    seqlens, S = [6, 3], 7
    compare(*_gqa(2, S, 4, 2, 8, seqlens, S, local_window_size=2), rtol=1e-4, atol=1e-5,
            rows=_valid_rows(seqlens, S, S))


def test_gqa_smooth_softmax_and_head_sink():
    seqlens, S = [4], 5
    compare(*_gqa(1, S, 4, 2, 8, seqlens, S, smooth_softmax=1), rtol=1e-4, atol=1e-5)
    sink = _r(4)
    compare(*_gqa(2, 1, 4, 2, 8, [3, 5], 6, past_cap=6, extra={11: sink}), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("past_cap", [0, 8])
def test_gqa_float16(past_cap):
    """float16 in and out, float32 arithmetic inside (as onnxruntime's cpu kernel)."""
    if past_cap:
        compare(*_gqa(2, 1, 4, 2, 16, [3, 5], 6, past_cap=past_cap, rotary=True,
                      dtype=np.float16), rtol=2e-3, atol=2e-3)
    else:
        compare(*_gqa(1, 5, 4, 2, 16, [4], 5, rotary=True, dtype=np.float16), rtol=2e-3,
                atol=2e-3)


def test_gqa_attention_bias():
    seqlens, S = [4, 4], 5
    bias = _r(2, 1, S, S)
    compare(*_gqa(2, S, 4, 2, 8, seqlens, S, extra={10: bias}), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("layout", ["3d", "4d"])
@pytest.mark.parametrize("interleaved", [0, 1])
def test_rotary_embedding(layout, interleaved):
    B, S, N, H = 2, 5, 3, 16
    cos, sin = _caches(32, H)
    x = _r(B, S, N * H) if layout == "3d" else _r(B, N, S, H)
    pos = RNG.integers(0, 32, (B, S)).astype(np.int64)
    compare(*one_node("RotaryEmbedding", [x, pos, cos, sin], interleaved=interleaved,
                      **({"num_heads": N} if layout == "3d" else {})), rtol=1e-5, atol=1e-5)


def test_rotary_embedding_offset_and_partial():
    B, S, N, H, rd = 1, 4, 2, 16, 8
    cos, sin = _caches(32, rd)
    compare(*one_node("RotaryEmbedding", [_r(B, S, N * H), np.array([3], np.int64), cos, sin],
                      num_heads=N, rotary_embedding_dim=rd), rtol=1e-5, atol=1e-5)
