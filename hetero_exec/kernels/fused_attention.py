"""The fusion passes' attention chains (placement/fusions/), in the "hetero_exec"
domain: FusedAttention (scores, scale, mask, softmax and the product by V, in blocks of
query rows whose scores stay in cache) and FusedRotary (a rotary embedding's
multiply-adds in place). The ONNX attention ops they come from are attention.py.
"""

from __future__ import annotations

import math

import numpy as np

from hetero_exec.kernels.attention import _grouped_matmul, _mm
from hetero_exec.kernels.fused import FUSED_DOMAIN
from hetero_exec.kernels.native import row_kernels
from hetero_exec.kernels.reduce import exp_scores_inplace
from hetero_exec.kernels.registry import kernel

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
