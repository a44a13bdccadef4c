"""Attention-family ops: Attention (opset 23/24/25), RotaryEmbedding, SwiGLU,
LinearAttention, ai.onnx.preview::FlexAttention, and the fusion passes' FusedAttention
and FusedRotary.

Grouped-query attention never materialises repeated K/V: query heads are viewed as
(kv_heads, group) and matmul broadcasts K/V over the group axis. Element-wise steps run
in the input precision, as the spec's function bodies do; 16-bit float matmuls accumulate in
float32 and round once (what numpy returns for them, only through BLAS).
"""

from __future__ import annotations

import math

import numpy as np

from hetero_exec.kernels._common import np_dtype
from hetero_exec.kernels.fused import FUSED_DOMAIN, product
from hetero_exec.kernels.native import row_kernels
from hetero_exec.kernels.reduce import exp_scores_inplace
from hetero_exec.kernels.registry import kernel

_BLAS = (np.dtype(np.float32), np.dtype(np.float64))


def _mm(xp, a, b, out=None):
    """matmul (large products split over our threads, kernels/_threads.py); 16-bit floats
    accumulate in float32 and round once to the input type."""
    if a.dtype in _BLAS and b.dtype in _BLAS:
        return product(xp, a, b, out=out)
    return xp.matmul(a.astype(np.float32), b.astype(np.float32)).astype(a.dtype)


def _split_heads(xp, x, heads):
    """(B, S, heads*D) -> (B, heads, S, D)."""
    b, s, hd = x.shape
    if hd % heads:
        raise ValueError(f"hidden size {hd} is not divisible by {heads} heads")
    return xp.transpose(x.reshape(b, s, heads, hd // heads), (0, 2, 1, 3))


def _grouped_matmul(xp, a, b, kv_heads):
    """a: (B, Hq, L, X); b: (B, Hkv, X, Y) with Hq = g*Hkv, query head h using kv head h//g."""
    bsz, hq = a.shape[0], a.shape[1]
    if hq == kv_heads:
        return _mm(xp, a, b)
    if kv_heads <= 0 or hq % kv_heads:
        raise ValueError(f"{hq} query heads are not a multiple of {kv_heads} key/value heads")
    # the g query heads of a kv head as one taller matrix: one product per kv head, with
    # no operand broadcast along a middle axis (which a BLAS batch cannot stride over)
    rows = a.shape[2]
    out = _mm(xp, a.reshape(bsz, kv_heads, (hq // kv_heads) * rows, a.shape[3]), b)
    return out.reshape(bsz, hq, rows, out.shape[-1])


def _softmax_guarded(xp, x, inplace=False):
    """Softmax over the last axis where an all -inf row gives zeros, not NaN."""
    m = xp.max(x, axis=-1, keepdims=True)
    m = xp.where(m == -math.inf, 0, m)
    e = xp.subtract(x, m, out=x if inplace else None)
    exp_scores_inplace(xp, e)
    s = xp.sum(e, axis=-1, keepdims=True)
    e /= xp.where(s == 0, 1, s)
    return e


@kernel("Attention", since=(23, 24, 25))
def Attention(
    xp,
    Q,
    K,
    V,
    attn_mask=None,
    past_key=None,
    past_value=None,
    nonpad_kv_seqlen=None,
    *,
    is_causal=0,
    kv_num_heads=None,
    q_num_heads=None,
    qk_matmul_output_mode=0,
    scale=None,
    softcap=0.0,
    softmax_precision=None,
    left_window_size=-1,
    right_window_size=-1,
    num_outputs=1,
):
    out_dtype = Q.dtype
    rank3 = Q.ndim == 3
    if rank3:
        if q_num_heads is None or kv_num_heads is None:
            raise ValueError("3D Attention inputs need the q_num_heads and kv_num_heads attributes")
        batch, q_len = Q.shape[0], Q.shape[1]
        Q = _split_heads(xp, Q, q_num_heads)
        K = _split_heads(xp, K, kv_num_heads)
        V = _split_heads(xp, V, kv_num_heads)
    batch, hq, q_len, head = Q.shape
    if scale is None:
        scale = 1.0 / math.sqrt(head)
    # Q and K are each scaled by sqrt(scale), in the input precision, as the spec prescribes
    sq = np.dtype(out_dtype).type(math.sqrt(scale))  # a numpy scalar: mixes with cupy arrays too
    if past_key is not None:
        K = xp.concatenate((past_key, K), axis=2)
    if past_value is not None:
        V = xp.concatenate((past_value, V), axis=2)
    present_key, present_value = K, V
    kv_heads, kv_len = K.shape[1], K.shape[2]

    qk = _grouped_matmul(xp, Q * sq, xp.swapaxes(K * sq, -1, -2), kv_heads)  # (B, Hq, L, S)
    qk_raw = qk
    if softcap and softcap > 0:
        qk = xp.tanh(qk / softcap) * softcap

    # additive bias: float mask plus -inf where causal/window/padding/bool mask forbid
    bias = None
    allowed = None
    if attn_mask is not None:
        pad = kv_len - attn_mask.shape[-1]
        if pad > 0:
            fill = False if attn_mask.dtype == np.bool_ else -np.inf
            widths = [(0, 0)] * (attn_mask.ndim - 1) + [(0, pad)]
            attn_mask = xp.pad(attn_mask, widths, mode="constant", constant_values=fill)
        if attn_mask.dtype == np.bool_:
            allowed = attn_mask
        else:
            bias = attn_mask.astype(out_dtype, copy=False)
    windowed = left_window_size >= 0 or right_window_size >= 0
    if is_causal or windowed:
        if past_key is not None:
            offset = past_key.shape[2]
        elif nonpad_kv_seqlen is not None:
            offset = (nonpad_kv_seqlen.astype(np.int64) - q_len).reshape(-1, 1, 1, 1)
        else:
            offset = 0
        i = xp.arange(q_len, dtype=np.int64).reshape(-1, 1)
        j = xp.arange(kv_len, dtype=np.int64).reshape(1, -1)
        diff = (i + offset) - j  # query absolute position minus key position
        conds = []
        if is_causal:
            conds.append(diff >= 0)
        if left_window_size >= 0:
            conds.append(diff <= left_window_size)
        if right_window_size >= 0:
            conds.append(-diff <= right_window_size)
        for c in conds:
            allowed = c if allowed is None else allowed & c
    if nonpad_kv_seqlen is not None:
        pad_ok = (
            xp.arange(kv_len, dtype=np.int64).reshape(1, -1)
            < nonpad_kv_seqlen.astype(np.int64).reshape(-1, 1)
        ).reshape(batch, 1, 1, kv_len)
        allowed = pad_ok if allowed is None else allowed & pad_ok
    if allowed is not None:
        neg = xp.where(allowed, 0, -np.inf).astype(out_dtype)
        bias = neg if bias is None else bias + neg

    scores = qk if bias is None else qk + bias
    qk_out = None
    if num_outputs >= 4:
        qk_out = {0: qk_raw, 1: qk, 2: scores}.get(qk_matmul_output_mode)
    if softmax_precision is not None:
        scores = scores.astype(np_dtype(softmax_precision), copy=False)
    # softmax may overwrite scores unless they are the exposed qk_matmul_output
    probs = _softmax_guarded(xp, scores, inplace=scores is not qk_out)
    if bias is not None:
        # a row no key may attend gives zeros (decided on the bias, not on possibly-NaN logits)
        all_masked = xp.max(bias, axis=-1, keepdims=True) == -math.inf
        if bool(all_masked.any()):
            probs = xp.where(all_masked, 0, probs)
    if qk_matmul_output_mode == 3 and num_outputs >= 4:
        qk_out = probs
    probs = probs.astype(out_dtype, copy=False)
    Y = _grouped_matmul(xp, probs, V, kv_heads).astype(V.dtype, copy=False)
    if rank3:
        Y = xp.transpose(Y, (0, 2, 1, 3)).reshape(batch, q_len, -1)
    outs = (Y, present_key, present_value)
    if num_outputs >= 4:
        if qk_out is None:
            qk_out = probs
        if qk_out.shape != (batch, hq, q_len, kv_len):
            qk_out = xp.broadcast_to(qk_out, (batch, hq, q_len, kv_len))
        outs = outs + (xp.ascontiguousarray(qk_out.astype(out_dtype)),)
    return outs


@kernel("RotaryEmbedding", since=23)
def RotaryEmbedding(
    xp,
    X,
    cos_cache,
    sin_cache,
    position_ids=None,
    *,
    interleaved=0,
    num_heads=0,
    rotary_embedding_dim=0,
):
    shape = X.shape
    if X.ndim == 3:  # (B, S, H*D) -> (B, S, H, D)
        if not num_heads:
            raise ValueError("RotaryEmbedding on a 3D input needs the num_heads attribute")
        x = X.reshape(shape[0], shape[1], num_heads, shape[2] // num_heads)
        head_axis = 2
    elif X.ndim == 4:  # (B, H, S, D)
        x = X
        head_axis = 1
    else:
        raise ValueError(f"RotaryEmbedding input must be 3D or 4D, got {X.ndim}D")
    head = x.shape[-1]
    rd = rotary_embedding_dim or head
    if position_ids is not None:
        cos = xp.take(cos_cache, position_ids.astype(np.int64), axis=0)
        sin = xp.take(sin_cache, position_ids.astype(np.int64), axis=0)
    else:
        cos, sin = cos_cache, sin_cache
    if cos.shape[-1] != rd // 2:
        raise ValueError(f"cos/sin cache last dimension {cos.shape[-1]} != rotary dim/2 {rd // 2}")
    cos = xp.expand_dims(cos, head_axis)  # broadcast over heads
    sin = xp.expand_dims(sin, head_axis)
    x_rot = x[..., :rd]
    if interleaved:
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
    else:
        x1, x2 = x_rot[..., : rd // 2], x_rot[..., rd // 2 :]
    real = cos * x1 - sin * x2
    imag = sin * x1 + cos * x2
    if interleaved:
        rot = xp.stack((real, imag), axis=-1).reshape(x_rot.shape)
    else:
        rot = xp.concatenate((real, imag), axis=-1)
    out = rot if rd == head else xp.concatenate((rot, x[..., rd:]), axis=-1)
    return (out.astype(X.dtype, copy=False).reshape(shape),)


@kernel("SwiGLU", since=28)
def SwiGLU(xp, A, B, *, alpha=1.0):
    if A.shape != B.shape:
        raise ValueError(f"SwiGLU needs equal shapes, got {A.shape} and {B.shape}")
    sig = (1 / (1 + xp.exp(-alpha * A))).astype(A.dtype, copy=False)
    return ((A * sig * B).astype(A.dtype, copy=False),)


@kernel("LinearAttention", since=27)
def LinearAttention(
    xp,
    query,
    key,
    value,
    past_state=None,
    decay=None,
    beta=None,
    *,
    chunk_size=64,
    kv_num_heads=None,
    q_num_heads=None,
    scale=0.0,
    update_rule="gated_delta",
):
    if update_rule not in ("linear", "gated", "delta", "gated_delta"):
        raise ValueError(f"unsupported update_rule {update_rule!r}")
    if not q_num_heads or not kv_num_heads or q_num_heads % kv_num_heads:
        raise ValueError("q_num_heads must be a positive multiple of kv_num_heads")
    gating = update_rule in ("gated", "gated_delta")
    delta = update_rule in ("delta", "gated_delta")
    if gating != (decay is not None):
        raise ValueError(f"update_rule {update_rule!r} {'requires' if gating else 'forbids'} decay")
    if delta != (beta is not None):
        raise ValueError(f"update_rule {update_rule!r} {'requires' if delta else 'forbids'} beta")
    f32 = np.float32
    b, t, _ = query.shape
    hq, hk = q_num_heads, kv_num_heads
    dk = query.shape[-1] // hq
    dv = value.shape[-1] // hk
    g = hq // hk
    # (B, T, H, D) in float32, read one time step at a time
    q4 = query.reshape(b, t, hk, g, dk).astype(f32)
    k4 = key.reshape(b, t, hk, dk).astype(f32)
    v4 = value.reshape(b, t, hk, dv).astype(f32)
    if gating:
        if decay.shape[-1] == hk:
            dec = xp.exp(decay.astype(f32)).reshape(b, t, hk, 1, 1)
        elif decay.shape[-1] == hk * dk:
            dec = xp.exp(decay.astype(f32)).reshape(b, t, hk, dk, 1)
        else:
            raise ValueError(f"decay last dimension {decay.shape[-1]} must be {hk} or {hk * dk}")
    if delta:
        bl = beta.shape[-1]
        if bl not in (hk, 1):
            raise ValueError(f"beta last dimension {bl} must be {hk} or 1")
        bet = beta.astype(f32).reshape(b, t, bl, 1)
    if past_state is not None:
        state_dtype = past_state.dtype
        state = past_state.astype(f32)  # (B, Hkv, dk, dv)
    else:
        state_dtype = query.dtype
        state = xp.zeros((b, hk, dk, dv), dtype=f32)
    sc = float(scale) if scale else 1.0 / math.sqrt(dk)
    outs = []
    for i in range(t):
        k_t, v_t = k4[:, i], v4[:, i]
        if gating:
            state = state * dec[:, i]
        if delta:
            retrieved = xp.matmul(k_t[:, :, None, :], state)[:, :, 0]  # (B, Hkv, dv)
            v_t = bet[:, i] * (v_t - retrieved)
        state = state + k_t[..., :, None] * v_t[..., None, :]
        # (B, Hkv, g, dk) @ (B, Hkv, dk, dv) -> (B, Hkv, g, dv)
        outs.append(xp.matmul(q4[:, i], state))
    out = xp.stack(outs, axis=1) * f32(sc)  # (B, T, Hkv, g, dv)
    out = out.reshape(b, t, hq * dv).astype(query.dtype)
    return (out, state.astype(state_dtype))


def _run_mod(mod, scope, x):
    if mod is None:
        return x
    if hasattr(mod, "run"):
        res = mod.run(scope, [x])
    else:
        res = mod(x)
    if isinstance(res, (list, tuple)):
        if len(res) != 1:
            raise ValueError("a FlexAttention modifier graph must produce exactly one output")
        res = res[0]
    return res


@kernel("FlexAttention", since=1, domain="ai.onnx.preview")
def FlexAttention(
    xp, Q, K, V, *, prob_mod=None, scale=None, score_mod=None, softmax_precision=None, scope=None
):
    if Q.ndim != 4 or K.ndim != 4 or V.ndim != 4:
        raise ValueError("FlexAttention needs rank-4 Q, K, V")
    head = Q.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(head)
    if softmax_precision is not None:
        cdt = np_dtype(softmax_precision)
    elif Q.dtype.itemsize < 4:
        cdt = np.dtype(np.float32)
    else:
        cdt = Q.dtype
    sq = np.dtype(Q.dtype).type(np.sqrt(np.float32(scale)))
    kv_heads = K.shape[1]
    scores = _grouped_matmul(xp, Q * sq, xp.swapaxes(K * sq, -1, -2), kv_heads)
    scores = scores.astype(cdt, copy=False)
    if score_mod is not None:
        scores = xp.asarray(_run_mod(score_mod, scope, scores)).astype(cdt, copy=False)
    m = xp.max(scores, axis=-1, keepdims=True)
    e = xp.exp(scores - m)
    probs = e / xp.sum(e, axis=-1, keepdims=True)
    if prob_mod is not None:
        probs = xp.asarray(_run_mod(prob_mod, scope, probs)).astype(cdt, copy=False)
    out = _grouped_matmul(xp, probs, V.astype(cdt, copy=False), kv_heads)
    return (out.astype(V.dtype),)


# --------------------------------------------------------------------------- fused chains

#: bytes of attention scores per block on numpy: the in-place scale, mask and softmax
#: passes over a block then run in cache
_SCORE_BLOCK = 1 << 21


def _softmax_last_inplace(xp, s):
    """Softmax over the last axis, written into ``s``: the Softmax kernel's arithmetic
    (compiled for float32 on the host, native/softmax.c)."""
    if xp is np and row_kernels.softmax_fits(s):
        return row_kernels.softmax_rows(s)
    s -= xp.max(s, axis=-1, keepdims=True)
    exp_scores_inplace(xp, s)
    s /= xp.sum(s, axis=-1, keepdims=True)
    return s


def _blocked(x, n0, n1, n):
    """Rows n0:n1 of axis 0 of ``x`` when it spans that axis (size n), else x itself."""
    if x is None or x.ndim < 3 or x.shape[0] != n:
        return x
    return x[n0:n1]


def _add_mask(s, mask, groups):
    """s + mask, in place when the mask broadcasts into s (``groups``: added in the view
    of s with its leading axis split as (-1, groups))."""
    view = s.reshape((-1, groups) + s.shape[1:]) if groups else s
    if np.broadcast_shapes(view.shape, mask.shape) == view.shape:
        view += mask
        return s
    return (view + mask).reshape(s.shape)


def _attention_block(xp, Q, K, V, mask, condition, fill, scale, k_transposed, kv_groups,
                     mask_groups=0, out=None, nan_to_zero=0):
    KT = K if k_transposed else xp.swapaxes(K, -1, -2)
    if kv_groups > 1:
        s = _grouped_matmul(xp, Q, KT, KT.shape[1])
    else:
        s = _mm(xp, Q, KT)
    if scale != 1.0:
        s *= s.dtype.type(scale)
    if condition is not None:
        if np.broadcast_shapes(s.shape, condition.shape) == s.shape:
            xp.copyto(s, fill.astype(s.dtype, copy=False), where=xp.logical_not(condition))
        else:
            s = xp.where(condition, s, fill.astype(s.dtype, copy=False))
    if mask is not None:
        s = _add_mask(s, mask, mask_groups)
    _softmax_last_inplace(xp, s)
    if nan_to_zero:  # a row with no key to attend: zeros (torch's exported SDPA guard)
        xp.copyto(s, s.dtype.type(0), where=xp.isnan(s))
    if kv_groups > 1:
        return _grouped_matmul(xp, s, V, V.shape[1])
    return _mm(xp, s, V, out=out)


@kernel("FusedAttention", since=1, domain=FUSED_DOMAIN)
def FusedAttention(xp, Q, K, V, mask=None, condition=None, fill=None, scale=1.0, k_transposed=1,
                   kv_groups=1, mask_groups=0, nan_to_zero=0):
    """``Softmax(scale * Q @ K^T [where condition else fill] [+ mask]) @ V`` in one pass
    over the scores, in place: the MatMul-[Mul]-[Where]-[Add]-Softmax-MatMul chain.
    ``k_transposed``: K is given as K^T (..., D, S); ``kv_groups`` > 1: K and V hold
    Hq / kv_groups heads, each shared by a group of query heads (repeat_kv not run);
    ``mask_groups`` > 0: the mask is added to the scores viewed (-1, mask_groups, ...);
    ``nan_to_zero``: NaN probabilities (a row that attends no key) become zeros."""
    if xp is np and not mask_groups:
        y = row_kernels.attention_rows(Q, K, V, mask, scale, k_transposed, kv_groups, nan_to_zero,
                                       condition, fill)
        if y is not None:
            return (y,)
    n = Q.shape[0] if Q.ndim >= 3 else 0
    per_row = Q.dtype.itemsize * math.prod(Q.shape[1:-1]) * (K.shape[-1] if k_transposed else K.shape[-2])
    step = max(1, _SCORE_BLOCK // max(per_row, 1))
    if mask_groups:
        step = max(mask_groups, step - step % mask_groups)
    sliced = (K, V, condition) if mask_groups else (K, V, mask, condition)
    if xp is not np or n <= 1 or n <= step or kv_groups > 1 \
            or any(x is not None and x.ndim >= 3 and x.shape[0] not in (1, n) for x in sliced):
        return (_attention_block(xp, Q, K, V, mask, condition, fill, scale, k_transposed, kv_groups,
                                 mask_groups, nan_to_zero=nan_to_zero),)
    out = None
    for n0 in range(0, n, step):
        n1 = min(n, n0 + step)
        m = mask if mask_groups else _blocked(mask, n0, n1, n)
        blk = _attention_block(xp, Q[n0:n1], _blocked(K, n0, n1, n), _blocked(V, n0, n1, n),
                               m, _blocked(condition, n0, n1, n), fill,
                               scale, k_transposed, kv_groups, mask_groups,
                               nan_to_zero=nan_to_zero)
        if out is None:
            out = xp.empty((n,) + blk.shape[1:], dtype=blk.dtype)
        out[n0:n1] = blk
    return (out,)


@kernel("FusedRotary", since=1, domain=FUSED_DOMAIN)
def FusedRotary(xp, X, cos, sin, split=0):
    """``X * cos + rotate_half(X) * sin``, rotate_half(X) = Concat(-X[..., split:],
    X[..., :split]) on the last axis (Llama's rotary embedding as exported): the rotated
    copy is built once, in place (no negated half, no concatenation of new arrays)."""
    h = int(split)
    w = X.shape[-1] - h
    rh = xp.empty_like(X)
    xp.negative(X[..., h:], out=rh[..., :w])
    rh[..., w:] = X[..., :h]
    rh = _inplace(xp.multiply, rh, sin)
    return (_inplace(xp.add, xp.multiply(X, cos), rh),)


def _inplace(op, a, b):
    """op(a, b), written into ``a`` (a fresh array) when b broadcasts into it."""
    if np.broadcast_shapes(a.shape, b.shape) == a.shape:
        return op(a, b, out=a)
    return op(a, b)
