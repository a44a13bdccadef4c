"""onnxruntime's Attention (BERT/GPT-2's, with its QKV projection) and MultiHeadAttention
(com.microsoft), as its CPU kernels compute them: masked positions get
``mask_filter_value`` (-10000 by default) added to their scores rather than -inf, so a
row whose keys the mask all removes averages them as onnxruntime's does; causally later
keys are removed outright.

Mask forms taken: key lengths (B,), end and start positions (2B,), a raw 0/1 mask
(B, T) or (B, S, T); and a float ``attention_bias`` (B or 1, N or 1, S, T).
"""

from __future__ import annotations

import math

import numpy as np

from hetero_exec.kernels.attention import _grouped_matmul
from hetero_exec.kernels.contrib import schemas
from hetero_exec.kernels.contrib.attention import _blas_context
from hetero_exec.kernels.contrib.schemas import MS_DOMAIN, define
from hetero_exec.kernels.fused import product
from hetero_exec.kernels.registry import kernel

_T3 = ("tensor(float)", "tensor(float16)", "tensor(bfloat16)")


def _infer_attention(ctx) -> None:
    x, w = schemas.input_dims(ctx, 0), schemas.input_dims(ctx, 1)
    sizes = schemas.attr_ints(ctx, "qkv_hidden_sizes")
    dims = None
    if x is not None and len(x) == 3:
        v = sizes[2] if sizes else (w[1] // 3 if w is not None and isinstance(w[1], int) else None)
        dims = [x[0], x[1], v]
    schemas.set_output(ctx, 0, schemas.elem_type(ctx, 0), dims)
    schemas.set_output(ctx, 1, schemas.elem_type(ctx, 0), None)


def _infer_mha(ctx) -> None:
    q, v = schemas.input_dims(ctx, 0), schemas.input_dims(ctx, 2)
    dims = None
    if q is not None and len(q) == 3 and v is not None and len(v) == 3:
        dims = [q[0], q[1], v[2]]
    elif q is not None and len(q) == 3 and schemas.input_type(ctx, 1) is not None \
            and schemas.input_type(ctx, 2) is not None and v is not None and len(v) == 4:
        h = v[3] if isinstance(v[3], int) else None
        dims = [q[0], q[1], None if h is None or not isinstance(v[1], int) else v[1] * h]
    schemas.set_output(ctx, 0, schemas.elem_type(ctx, 0), dims)
    for o in (1, 2):
        schemas.set_output(ctx, o, schemas.elem_type(ctx, 0), None)


define("Attention",
       ["input:T", "weights:T", "bias:T?", "mask_index:M?", "past:T?", "attention_bias:T?",
        "past_sequence_length:M?"], ["output:T", "present:T?"],
       {"T": _T3, "M": ("tensor(int32)",)},
       {"num_heads": "i!", "qkv_hidden_sizes": "ints", "unidirectional": "i", "scale": "f",
        "mask_filter_value": "f", "do_rotary": "i", "past_present_share_buffer": "i",
        "rotary_embedding_dim": "i"}, _infer_attention)
define("MultiHeadAttention",
       ["query:T", "key:T?", "value:T?", "bias:T?", "key_padding_mask:M?", "attention_bias:T?",
        "past_key:T?", "past_value:T?", "past_sequence_length:M?", "cache_indirection:M?"],
       ["output:T", "present_key:T?", "present_value:T?", "qk:QK?"],
       {"T": _T3, "QK": _T3, "M": ("tensor(int32)",)},
       {"num_heads": "i!", "unidirectional": "i", "scale": "f", "mask_filter_value": "f"},
       _infer_mha)


def _heads(x, heads):
    """(B, S, heads*H) -> (B, heads, S, H)."""
    b, s, d = x.shape
    return x.reshape(b, s, heads, d // heads).transpose(0, 2, 1, 3)


def _mask_bias(xp, mask, batch, seq, total, past, filt, causal, dtype):
    """The additive (B or 1, 1, S, T) bias of a mask index and causality, or None."""
    bias = None
    j = xp.arange(total, dtype=np.int64).reshape(1, -1)
    if mask is not None:
        m = mask.astype(np.int64)
        if m.ndim == 1 and m.shape[0] == batch:  # key lengths
            keep = j < m.reshape(-1, 1)
            keep = keep.reshape(batch, 1, 1, total)
        elif m.ndim == 1 and m.shape[0] == 2 * batch:  # end then start positions
            end, start = m[:batch].reshape(-1, 1), m[batch:].reshape(-1, 1)
            keep = ((j < end) & (j >= start)).reshape(batch, 1, 1, total)
        elif m.ndim == 2:
            keep = (m > 0).reshape(m.shape[0], 1, 1, m.shape[1])
        elif m.ndim == 3:
            keep = (m > 0).reshape(m.shape[0], 1, m.shape[1], m.shape[2])
        else:
            raise ValueError(f"attention mask of shape {tuple(m.shape)} is not supported")
        bias = xp.where(keep, 0, filt).astype(dtype)
    if causal:  # later keys are out whatever the mask says: a row the mask empties
        # attends its causal keys, as onnxruntime's does
        i = xp.arange(seq, dtype=np.int64).reshape(-1, 1)
        later = xp.where(j > i + past, -np.inf, 0).astype(dtype).reshape(1, 1, seq, total)
        bias = later if bias is None else bias + later
    return bias


def _attend(xp, q, k, v, scale, bias, attention_bias):
    """softmax(scale * q @ k^T + bias) @ v over (B, N, S, H) arrays, in float32."""
    cdt = np.float64 if q.dtype == np.float64 else np.float32
    s = _grouped_matmul(xp, q.astype(cdt, copy=False),
                        xp.swapaxes(k.astype(cdt, copy=False), -1, -2), k.shape[1])
    s *= cdt(scale)
    if bias is not None:
        s = s + bias
    if attention_bias is not None:
        s = s + attention_bias.astype(cdt, copy=False)
    s -= xp.max(s, axis=-1, keepdims=True)
    s = xp.exp(s)
    s /= xp.sum(s, axis=-1, keepdims=True)
    out = _grouped_matmul(xp, s, v.astype(cdt, copy=False), v.shape[1])
    b, n, seq, h = out.shape
    return out.transpose(0, 2, 1, 3).reshape(b, seq, n * h).astype(q.dtype, copy=False)


def _attention_refuse(attrs, given, num_outputs) -> str | None:
    if attrs.get("do_rotary"):
        return "do_rotary=1 is not supported"
    if attrs.get("past_present_share_buffer"):
        return "past_present_share_buffer=1 is not supported"
    return None


def _mha_refuse(attrs, given, num_outputs) -> str | None:
    if 9 in given:
        return "cache_indirection (beam search) is not supported"
    if num_outputs > 3:
        return "the qk output is not supported"
    return None


@kernel("Attention", since=1, domain=MS_DOMAIN, refuse=_attention_refuse)
def Attention(xp, input, weights, bias=None, mask_index=None, past=None, attention_bias=None,
              past_sequence_length=None, num_heads=0, qkv_hidden_sizes=None, unidirectional=0,
              scale=0.0, mask_filter_value=-10000.0, do_rotary=0, past_present_share_buffer=0,
              rotary_embedding_dim=0, *, num_outputs=1):
    if do_rotary:
        raise ValueError("Attention: do_rotary=1 is not supported")
    if past_present_share_buffer:
        raise ValueError("Attention: past_present_share_buffer=1 is not supported")
    batch, seq, _ = input.shape
    qkv = xp.asarray(product(xp, input, weights))
    if bias is not None:
        qkv = qkv + bias
    if qkv_hidden_sizes:
        hq, hk, hv = (int(x) for x in qkv_hidden_sizes)
    else:
        hq = hk = hv = weights.shape[1] // 3
    q = _heads(qkv[..., :hq], num_heads)
    k = _heads(qkv[..., hq:hq + hk], num_heads)
    v = _heads(qkv[..., hq + hk:hq + hk + hv], num_heads)
    past_len = 0
    if past is not None:
        past_len = past.shape[3]
        k = xp.concatenate((past[0].astype(k.dtype, copy=False), k), axis=2)
        v = xp.concatenate((past[1].astype(v.dtype, copy=False), v), axis=2)
    total = k.shape[2]
    alpha = scale if scale else 1.0 / math.sqrt(hq // num_heads)
    cdt = np.float64 if input.dtype == np.float64 else np.float32
    mb = _mask_bias(xp, mask_index, batch, seq, total, past_len, mask_filter_value,
                    unidirectional, cdt)
    with _blas_context(xp):
        out = _attend(xp, q, k, v, alpha, mb, attention_bias)
    if num_outputs > 1:
        return (out, xp.stack((k, v)))
    return (out,)


@kernel("MultiHeadAttention", since=1, domain=MS_DOMAIN, refuse=_mha_refuse)
def MultiHeadAttention(xp, query, key=None, value=None, bias=None, key_padding_mask=None,
                       attention_bias=None, past_key=None, past_value=None,
                       past_sequence_length=None, cache_indirection=None, num_heads=0,
                       unidirectional=0, scale=0.0, mask_filter_value=-10000.0, *,
                       num_outputs=1):
    if cache_indirection is not None:
        raise ValueError("MultiHeadAttention: cache_indirection (beam search) is not supported")
    if num_outputs > 3:
        raise ValueError("MultiHeadAttention: the qk output is not supported")
    n = int(num_heads)
    batch, seq = query.shape[0], query.shape[1]
    if key is None and query.ndim == 5:  # packed QKV (B, S, N, 3, H)
        q, k, v = (query[:, :, :, i].transpose(0, 2, 1, 3) for i in range(3))
        if bias is not None:
            raise ValueError("MultiHeadAttention: bias with packed QKV is not supported")
    else:
        d = query.shape[2]
        qx = query if bias is None else query + bias[:d]
        q = _heads(qx, n)
        if key.ndim == 5:  # packed KV (B, L, N, 2, H)
            k, v = (key[:, :, :, i].transpose(0, 2, 1, 3) for i in range(2))
        elif key.ndim == 4:  # (B, N, L, H): a cross-attention cache, used as is
            k, v = key, value
        else:
            kx = key if bias is None else key + bias[d:2 * d]
            vx = value if bias is None else value + bias[2 * d:]
            k, v = _heads(kx, n), _heads(vx, n)
    past_len = 0
    if past_key is not None and key is not None and key.ndim != 4:
        past_len = past_key.shape[2]
        k = xp.concatenate((past_key, k), axis=2)
        v = xp.concatenate((past_value, v), axis=2)
    total = k.shape[2]
    alpha = scale if scale else 1.0 / math.sqrt(q.shape[-1])
    cdt = np.float64 if query.dtype == np.float64 else np.float32
    mb = _mask_bias(xp, key_padding_mask, batch, seq, total, past_len, mask_filter_value,
                    unidirectional, cdt)
    with _blas_context(xp):
        out = _attend(xp, q, k, v, alpha, mb, attention_bias)
    return (out, k, v)[:max(num_outputs, 1)]
