"""onnxruntime's attention ops: GroupQueryAttention and RotaryEmbedding (com.microsoft).
Attention and MultiHeadAttention live in mha.py.

GroupQueryAttention follows onnxruntime's CPU kernel: batch b's keys are its first
``seqlens_k[b] + 1`` cache positions; a first prompt (sequence length equal to
``total_sequence_length``) starts at position 0 of every row, right-padded; later calls
append their tokens at ``seqlens_k[b] + 1 - S``. present_key/present_value have the
past's capacity (at least total_sequence_length): a shared past/present buffer keeps its
shape, and the positions past a row's length are zero, as onnxruntime writes them when
the buffers are distinct. Query heads share kv heads in groups, never repeated
(attention.py's grouped products).
"""

from __future__ import annotations

import contextlib
import math

import numpy as np

from hetero_exec.kernels._threads import single_blas_thread
from hetero_exec.kernels.attention import RotaryEmbedding as _rotary
from hetero_exec.kernels.attention import _grouped_matmul
from hetero_exec.kernels.contrib import schemas
from hetero_exec.kernels.contrib.schemas import MS_DOMAIN, define
from hetero_exec.kernels.kv_cache import is_shared
from hetero_exec.kernels.native import row_kernels
from hetero_exec.kernels.registry import kernel

_T3 = ("tensor(float)", "tensor(float16)", "tensor(bfloat16)")


def _infer_gqa(ctx) -> None:
    q = schemas.input_dims(ctx, 0)
    heads = schemas.attr_int(ctx, "num_heads")
    kv_heads = schemas.attr_int(ctx, "kv_num_heads")
    elem = schemas.elem_type(ctx, 0)
    dims = None
    head = None
    if q is not None and len(q) == 3 and isinstance(q[2], int):
        packed = schemas.input_type(ctx, 1) is None
        head = q[2] // (heads + 2 * kv_heads) if packed else q[2] // heads
        dims = [q[0], q[1], heads * head]
    schemas.set_output(ctx, 0, elem, dims)
    past = schemas.input_dims(ctx, 3)
    cache = [None if q is None else q[0], kv_heads or None, None, head]
    if past is not None and len(past) == 4:
        cache = [past[0], past[1], None, past[3]]
    cache_elem = schemas.elem_type(ctx, 3) or elem
    schemas.set_output(ctx, 1, cache_elem, cache)
    schemas.set_output(ctx, 2, cache_elem, cache)


define("GroupQueryAttention",
       ["query:T", "key:T?", "value:T?", "past_key:T_CACHE?", "past_value:T_CACHE?",
        "seqlens_k:M", "total_sequence_length:M", "cos_cache:T?", "sin_cache:T?",
        "position_ids:tensor(int64)?", "attention_bias:T?", "head_sink:T?",
        "k_scale:T_KV_SCALE?", "v_scale:T_KV_SCALE?", "q_norm_weight:T?", "k_norm_weight:T?",
        "query_seqlens:M?"],
       ["output:T", "present_key:T_CACHE?", "present_value:T_CACHE?", "output_qk:T?"],
       {"T": _T3,
        "T_CACHE": _T3 + ("tensor(uint8)", "tensor(int8)", "tensor(float8e4m3fn)"),
        "T_KV_SCALE": ("tensor(float)",), "M": ("tensor(int32)",)},
       {"num_heads": "i!", "kv_num_heads": "i!", "scale": "f", "softcap": "f", "do_rotary": "i",
        "rotary_interleaved": "i", "local_window_size": "i", "smooth_softmax": "i",
        "qk_output": "i", "causal": "i", "sliding_window_cache": "i", "kv_cache_bit_width": "i",
        "k_quant_type": "s", "v_quant_type": "s", "q_norm_epsilon": "f", "k_norm_epsilon": "f",
        "qk_norm_epsilon": "f"},
       _infer_gqa)
define("RotaryEmbedding", ["input:T", "position_ids:M", "cos_cache:T", "sin_cache:T"],
       ["output:T"], {"T": _T3, "M": ("tensor(int64)",)},
       {"interleaved": "i", "num_heads": "i", "rotary_embedding_dim": "i",
        "is_packed_batching": "i", "scale": "f"}, schemas.same_as(0))


# --------------------------------------------------------------------------- RotaryEmbedding


@kernel("RotaryEmbedding", since=1, domain=MS_DOMAIN,
        refuse=lambda attrs, given, n: "is_packed_batching=1 is not supported"
        if attrs.get("is_packed_batching") else None)
def RotaryEmbedding(xp, input, position_ids, cos_cache, sin_cache, interleaved=0, num_heads=0,
                    rotary_embedding_dim=0, is_packed_batching=0, scale=1.0):
    """input (B, S, N*H) or (B, N, S, H); position_ids (B, S), or (1,): the first
    token's position, the others following it; cos/sin caches (max_position, rd / 2)."""
    if is_packed_batching:
        raise ValueError("RotaryEmbedding: is_packed_batching=1 is not supported")
    seq = input.shape[1] if input.ndim == 3 else input.shape[2]
    pos = position_ids
    if pos.size == 1 and (pos.ndim <= 1 or seq != 1 or input.shape[0] != 1):
        pos = xp.arange(seq, dtype=np.int64).reshape(1, seq) + pos.reshape(1, 1).astype(np.int64)
    rd = rotary_embedding_dim or 2 * cos_cache.shape[-1]
    heads = num_heads
    if input.ndim == 3 and not heads:
        heads = input.shape[2] // rd  # no partial rotation without num_heads: head size rd
    return _rotary(xp, input, cos_cache, sin_cache, pos, interleaved=interleaved,
                   num_heads=heads, rotary_embedding_dim=rd)


# --------------------------------------------------------------------------- GroupQueryAttention


def _heads_first(x, batch, seq, heads, head):
    """(B, S, heads*H) -> (B, heads, S, H) (a view)."""
    return x.reshape(batch, seq, heads, head).transpose(0, 2, 1, 3)


def _present(xp, past, new, past_len, capacity):
    """The cache after this call: past's first ``past_len[b]`` positions of row b, then
    ``new`` (B, S, Hkv, H) at past_len[b].., zeros elsewhere; (B, Hkv, capacity, H). A
    generator's shared buffer (kv_cache.share_buffer) is the present: only the new
    positions are written, in place."""
    batch, seq, kv_heads, head = new.shape
    if past is not None and past.shape[2] >= capacity and is_shared(past):
        present = past  # a generator's buffer (kv_cache.share_buffer): written in place
        rows = xp.arange(batch, dtype=np.int64).reshape(-1, 1)
        cols = past_len.reshape(-1, 1) + xp.arange(seq, dtype=np.int64).reshape(1, -1)
        present[rows, :, cols] = new
        return present
    if xp is np:  # lengths on the host: copy each row's slices, zero only its tail
        present = np.empty((batch, kv_heads, capacity, head), dtype=new.dtype)
        for b, p in enumerate(past_len.tolist()):
            if past is not None and p:
                present[b, :, :p] = past[b, :, :p]
            present[b, :, p:p + seq] = new[b].transpose(1, 0, 2)
            present[b, :, p + seq:] = 0
        return present
    present = xp.zeros((batch, kv_heads, capacity, head), dtype=new.dtype)
    if past is not None and past.shape[2]:
        keep = (xp.arange(past.shape[2], dtype=np.int64).reshape(1, 1, -1, 1)
                < past_len.reshape(-1, 1, 1, 1))
        present[:, :, :past.shape[2]] = xp.where(keep, past, 0).astype(new.dtype, copy=False)
    rows = xp.arange(batch, dtype=np.int64).reshape(-1, 1)
    cols = past_len.reshape(-1, 1) + xp.arange(seq, dtype=np.int64).reshape(1, -1)
    present[rows, :, cols] = new  # (B, S) indices: the (B, S, Hkv, H) block lands per row
    return present


#: GroupQueryAttention's optional inputs the kernel does not take, by position
_GQA_INPUTS_NOT_TAKEN = {12: "k_scale", 13: "v_scale", 14: "q_norm_weight", 15: "k_norm_weight",
                         16: "query_seqlens"}


def _gqa_refuse(attrs, given, num_outputs) -> str | None:
    for i, name in _GQA_INPUTS_NOT_TAKEN.items():
        if i in given:
            return f"the {name} input is not supported"
    for name in ("k_quant_type", "v_quant_type"):
        if attrs.get(name, "NONE") != "NONE":
            return f"quantized key/value caches ({name}={attrs[name]!r}) are not supported"
    if attrs.get("qk_output", 0) or num_outputs > 3:
        return "the output_qk output is not supported"
    if not attrs.get("causal", 1):
        return "causal=0 is not supported"
    return None


@kernel("GroupQueryAttention", since=1, domain=MS_DOMAIN, host_inputs=(6,), refuse=_gqa_refuse)
def GroupQueryAttention(xp, query, key=None, value=None, past_key=None, past_value=None,
                        seqlens_k=None, total_sequence_length=None, cos_cache=None,
                        sin_cache=None, position_ids=None, attention_bias=None, head_sink=None,
                        k_scale=None, v_scale=None, q_norm_weight=None, k_norm_weight=None,
                        query_seqlens=None, *, num_heads=0, kv_num_heads=0, scale=0.0,
                        softcap=0.0, do_rotary=0, rotary_interleaved=0, local_window_size=-1,
                        smooth_softmax=-1, qk_output=0, causal=1, sliding_window_cache=0,
                        kv_cache_bit_width=0, k_quant_type="NONE", v_quant_type="NONE",
                        q_norm_epsilon=1e-6, k_norm_epsilon=1e-6, qk_norm_epsilon=1e-6,
                        num_outputs=1):
    for name, v in (("k_scale", k_scale), ("v_scale", v_scale), ("q_norm_weight", q_norm_weight),
                    ("k_norm_weight", k_norm_weight), ("query_seqlens", query_seqlens)):
        if v is not None:
            raise ValueError(f"GroupQueryAttention: the {name} input is not supported")
    if k_quant_type not in ("NONE", b"NONE") or v_quant_type not in ("NONE", b"NONE"):
        raise ValueError("GroupQueryAttention: quantized key/value caches are not supported")
    if qk_output or num_outputs > 3:
        raise ValueError("GroupQueryAttention: the output_qk output is not supported")
    if not causal:
        raise ValueError("GroupQueryAttention: causal=0 is not supported")
    heads, kv_heads = int(num_heads), int(kv_num_heads)
    if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
        raise ValueError(f"GroupQueryAttention: num_heads {heads} is not a positive multiple "
                         f"of kv_num_heads {kv_heads}")
    batch, seq = query.shape[0], query.shape[1]
    if key is None:  # packed (B, S, (N + 2 Nkv) H)
        head = query.shape[2] // (heads + 2 * kv_heads)
        q = query[..., :heads * head]
        k = query[..., heads * head:(heads + kv_heads) * head]
        v = query[..., (heads + kv_heads) * head:]
    else:
        head = query.shape[2] // heads
        q, k, v = query, key, value
    total = int(np.asarray(total_sequence_length).reshape(-1)[0])
    first_prompt = seq == total
    lens = seqlens_k.astype(np.int64).reshape(-1) + 1  # each row's keys after this call
    past_len = xp.zeros_like(lens) if first_prompt else lens - seq
    capacity = max(total, past_key.shape[2] if past_key is not None else 0)

    q4 = _heads_first(q, batch, seq, heads, head)
    k4 = _heads_first(k, batch, seq, kv_heads, head)
    if do_rotary:
        if position_ids is not None:
            pos = position_ids.astype(np.int64)
        else:
            pos = past_len.reshape(-1, 1) + xp.arange(seq, dtype=np.int64).reshape(1, -1)
        # padding rows of a first prompt read position 1, as onnxruntime's do
        pos = xp.where(pos < lens.reshape(-1, 1), pos, 1) if first_prompt else pos
        rd = 2 * cos_cache.shape[-1]
        q4 = _rotary(xp, q4, cos_cache, sin_cache, pos, interleaved=rotary_interleaved,
                     rotary_embedding_dim=rd)[0]
        k4 = _rotary(xp, k4, cos_cache, sin_cache, pos, interleaved=rotary_interleaved,
                     rotary_embedding_dim=rd)[0]
    new_k = k4.transpose(0, 2, 1, 3)  # (B, S, Nkv, H)
    new_v = v.reshape(batch, seq, kv_heads, head)
    present_k = _present(xp, past_key, new_k, past_len, capacity)
    present_v = _present(xp, past_value, new_v, past_len, capacity)

    with _blas_context(xp):
        out = _attend(xp, q4, present_k, present_v, past_len, total, head, heads, kv_heads,
                      scale, softcap, attention_bias, local_window_size, head_sink,
                      smooth_softmax, query.dtype)
    return (out, present_k, present_v)[:max(num_outputs, 1)]


def _blas_context(xp):
    """One BLAS thread for the many small per-head products on the host: a threaded BLAS
    costs more in wake-ups than it gains there (bench/bench_contrib.py)."""
    return single_blas_thread() if xp is np else contextlib.nullcontext()


def _attend(xp, q4, present_k, present_v, past_len, total, head, heads, kv_heads, scale,
            softcap, attention_bias, local_window_size, head_sink, smooth_softmax, dtype):
    """Causal (windowed) attention of q4 (B, N, S, H) over each row's keys; (B, S, N*H)."""
    batch, seq = q4.shape[0], q4.shape[2]
    # scores over the first ``total`` positions only: no row reads past them
    cdt = np.float64 if dtype == np.float64 else np.float32
    K = present_k[:, :, :total].astype(cdt, copy=False)
    V = present_v[:, :, :total].astype(cdt, copy=False)
    alpha = scale if scale else 1.0 / math.sqrt(head)
    at = (past_len.reshape(-1, 1) + xp.arange(seq, dtype=np.int64).reshape(1, -1))[:, None, :, None]
    j = xp.arange(total, dtype=np.int64).reshape(1, 1, 1, -1)
    allowed = j <= at
    if local_window_size is not None and local_window_size > 0:
        allowed = allowed & (j > at - local_window_size)  # the last w keys
    if xp is np and cdt == np.float32 and not (softcap and softcap > 0) and head_sink is None \
            and smooth_softmax != 1:
        # each row's keys only, in C (the prompt's causal half, the decode step's filled)
        bias = None if attention_bias is None else attention_bias[..., :total]
        out = row_kernels.attention_rows(
            q4.astype(cdt, copy=False), K, V, bias, alpha, False,
            heads // kv_heads, False, allowed, np.float32(-np.inf))
        if out is not None:
            return out.transpose(0, 2, 1, 3).reshape(batch, seq, heads * head).astype(dtype)
    scores = _grouped_matmul(xp, q4.astype(cdt, copy=False), xp.swapaxes(K, -1, -2), kv_heads)
    scores *= cdt(alpha)
    if softcap and softcap > 0:
        scores = xp.tanh(scores / cdt(softcap)) * cdt(softcap)
    if attention_bias is not None:
        scores = scores + attention_bias[..., :total].astype(cdt, copy=False)
    xp.copyto(scores, cdt(-np.inf), where=xp.logical_not(allowed))
    probs = _softmax(xp, scores, head_sink, smooth_softmax, heads, cdt)
    out = _grouped_matmul(xp, probs, V, kv_heads)  # (B, N, S, H)
    return out.transpose(0, 2, 1, 3).reshape(batch, seq, heads * head).astype(dtype)


def _softmax(xp, scores, head_sink, smooth_softmax, heads, cdt):
    """Softmax over the last axis, in place; with a sink (``head_sink[h]``, or 0 under
    smooth_softmax) one more logit joins each row's denominator."""
    sink = None
    if head_sink is not None:
        sink = head_sink.astype(cdt).reshape(1, heads, 1, 1)
    elif smooth_softmax == 1:
        sink = xp.zeros((1, 1, 1, 1), dtype=cdt)
    m = xp.max(scores, axis=-1, keepdims=True)
    if sink is not None:
        m = xp.maximum(m, sink)
    e = xp.subtract(scores, m, out=scores)  # (scores is this call's own array)
    xp.exp(e, out=e)
    s = xp.sum(e, axis=-1, keepdims=True)
    if sink is not None:
        s = s + xp.exp(sink - m)
    e /= s
    return e
