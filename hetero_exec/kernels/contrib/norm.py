"""onnxruntime's layer norms: SimplifiedLayerNormalization (default domain and
com.microsoft), SkipSimplifiedLayerNormalization, SkipLayerNormalization,
EmbedLayerNormalization. The normalisation itself is norm.py's LayerNormalization /
RMSNormalization (compiled rows on the host); the skip and bias sums are added first.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from hetero_exec.kernels.contrib import schemas
from hetero_exec.kernels.contrib.schemas import FLOATS, MS_DOMAIN, define
from hetero_exec.kernels.norm import LayerNormalization, RMSNormalization
from hetero_exec.kernels.registry import kernel

_T3 = ("tensor(float)", "tensor(float16)", "tensor(bfloat16)")


def _stats_shape(ctx, i: int, axis: int = -1):
    dims = schemas.input_dims(ctx, i)
    if dims is None:
        return None
    axis = axis % len(dims) if dims else 0
    return dims[:axis] + [1] * (len(dims) - axis)


def _infer_simplified(ctx) -> None:
    axis = schemas.attr_int(ctx, "axis", -1)
    schemas.set_output(ctx, 0, schemas.elem_type(ctx, 1), schemas.input_dims(ctx, 0))
    stash = schemas.attr_int(ctx, "stash_type", 1)
    schemas.set_output(ctx, 1, stash, _stats_shape(ctx, 0, axis))


def _infer_skip(ctx) -> None:
    dims = schemas.input_dims(ctx, 0)
    schemas.set_output(ctx, 0, schemas.elem_type(ctx, 0), dims)
    schemas.set_output(ctx, 1, TensorProto.FLOAT, _stats_shape(ctx, 0))
    schemas.set_output(ctx, 2, TensorProto.FLOAT, _stats_shape(ctx, 0))
    schemas.set_output(ctx, 3, schemas.elem_type(ctx, 0), dims)


for _domain in ("", MS_DOMAIN):
    define("SimplifiedLayerNormalization", ["X:T", "scale:V"], ["Y:V", "inv_std_var:U?"],
           {"T": FLOATS, "U": ("tensor(float)", "tensor(double)"), "V": FLOATS},
           {"axis": "i", "epsilon": "f", "stash_type": "i"}, _infer_simplified, domain=_domain)
define("SkipLayerNormalization", ["input:T", "skip:T", "gamma:T", "beta:T?", "bias:T?"],
       ["output:T", "mean:U?", "inv_std_var:U?", "input_skip_bias_sum:T?"],
       {"T": _T3, "U": ("tensor(float)",)}, {"epsilon": "f"}, _infer_skip)
define("SkipSimplifiedLayerNormalization", ["input:T", "skip:T", "gamma:T", "bias:T?"],
       ["output:T", "mean:U?", "inv_std_var:U?", "input_skip_bias_sum:T?"],
       {"T": _T3, "U": ("tensor(float)",)}, {"epsilon": "f"}, _infer_skip)


def _infer_embed(ctx) -> None:
    ids = schemas.input_dims(ctx, 0)
    word = schemas.input_dims(ctx, 2)
    dims = None if ids is None or word is None else ids + word[-1:]
    schemas.set_output(ctx, 0, schemas.elem_type(ctx, 2), dims)
    schemas.set_output(ctx, 1, TensorProto.INT32, None if ids is None else ids[:1])
    schemas.set_output(ctx, 2, schemas.elem_type(ctx, 2), dims)


define("EmbedLayerNormalization",
       ["input_ids:T1", "segment_ids:T1?", "word_embedding:T", "position_embedding:T",
        "segment_embedding:T?", "gamma:T", "beta:T", "mask:T1?", "position_ids:T1?"],
       ["output:T", "mask_index:T1?", "embedding_sum:T?"],
       {"T1": ("tensor(int32)",), "T": ("tensor(float)", "tensor(float16)")},
       {"epsilon": "f", "mask_index_type": "i"}, _infer_embed)


# --------------------------------------------------------------------------- kernels


def _rms_with_inv(xp, X, scale, axis, epsilon, out_dtype):
    """RMS norm over ``axis..`` computed in float32 (float64 for double), with the
    per-row 1/sqrt(mean(x^2) + epsilon) as a second output."""
    cdt = np.float64 if X.dtype == np.float64 else np.float32
    axes = tuple(range(axis, X.ndim))
    xc = X.astype(cdt, copy=False)
    inv = 1.0 / xp.sqrt(xp.mean(xc * xc, axis=axes, keepdims=True) + cdt(epsilon))
    Y = (xc * inv) * scale.astype(cdt, copy=False)
    return Y.astype(out_dtype, copy=False), inv.astype(cdt, copy=False)


def _simplified(xp, X, scale, axis=-1, epsilon=1e-5, stash_type=1, *, num_outputs=1):
    """x / sqrt(mean(x^2 over axis..) + epsilon) * scale; Y has the scale's dtype."""
    axis = axis % X.ndim if X.ndim else 0
    if num_outputs <= 1 and X.dtype == scale.dtype:
        return RMSNormalization(xp, X, scale, axis=axis, epsilon=epsilon, stash_type=stash_type)
    Y, inv = _rms_with_inv(xp, X, scale, axis, epsilon, scale.dtype)
    return (Y, inv)[:max(num_outputs, 1)]


@kernel("SimplifiedLayerNormalization", since=1)
def SimplifiedLayerNormalization(xp, X, scale, axis=-1, epsilon=1e-5, stash_type=1, *,
                                 num_outputs=1):
    return _simplified(xp, X, scale, axis, epsilon, stash_type, num_outputs=num_outputs)


@kernel("SimplifiedLayerNormalization", since=1, domain=MS_DOMAIN)
def SimplifiedLayerNormalization_ms(xp, X, scale, axis=-1, epsilon=1e-5, stash_type=1, *,
                                    num_outputs=1):
    return _simplified(xp, X, scale, axis, epsilon, stash_type, num_outputs=num_outputs)


def _skip_sum(xp, input, skip, bias):
    """input + skip (+ bias): skip is (B, S, H), (1, S, H) or (S, H), bias (H,)."""
    s = input + skip
    if bias is not None:
        s += bias
    return s


def _row_stats(xp, s, simplified: bool, epsilon: float):
    """Per-row float32 mean (zeros for the simplified norm) and 1/std, shaped (..., 1)."""
    sc = s.astype(np.float32, copy=False)
    if simplified:
        mean = xp.zeros(s.shape[:-1] + (1,), np.float32)
        var = xp.mean(sc * sc, axis=-1, keepdims=True)
    else:
        mean = xp.mean(sc, axis=-1, keepdims=True)
        d = sc - mean
        var = xp.mean(d * d, axis=-1, keepdims=True)
    return mean, (1.0 / xp.sqrt(var + np.float32(epsilon))).astype(np.float32)


@kernel("SkipLayerNormalization", since=1, domain=MS_DOMAIN)
def SkipLayerNormalization(xp, input, skip, gamma, beta=None, bias=None, epsilon=1e-12, *,
                           num_outputs=1):
    s = _skip_sum(xp, input, skip, bias)
    Y = LayerNormalization(xp, s, gamma, beta, axis=-1, epsilon=epsilon, stash_type=1)[0]
    outs = (Y,)
    if num_outputs > 1:
        outs += _row_stats(xp, s, False, epsilon) + (s,)
    return outs[:max(num_outputs, 1)]


@kernel("SkipSimplifiedLayerNormalization", since=1, domain=MS_DOMAIN)
def SkipSimplifiedLayerNormalization(xp, input, skip, gamma, bias=None, epsilon=1e-12, *,
                                     num_outputs=1):
    s = _skip_sum(xp, input, skip, bias)
    Y = RMSNormalization(xp, s, gamma, axis=-1, epsilon=epsilon, stash_type=1)[0]
    outs = (Y,)
    if num_outputs > 1:
        outs += _row_stats(xp, s, True, epsilon) + (s,)
    return outs[:max(num_outputs, 1)]


@kernel("EmbedLayerNormalization", since=1, domain=MS_DOMAIN)
def EmbedLayerNormalization(xp, input_ids, segment_ids, word_embedding, position_embedding,
                            segment_embedding=None, gamma=None, beta=None, mask=None,
                            position_ids=None, epsilon=1e-12, mask_index_type=1, *,
                            num_outputs=1):
    """LayerNorm(word[ids] + position[pos] (+ segment[seg])); mask_index: the count of
    ones in each row of ``mask`` (zeros without one)."""
    batch, seq = input_ids.shape
    emb = xp.take(word_embedding, input_ids.astype(np.int64), axis=0)
    if position_ids is None:
        pos = xp.take(position_embedding, xp.arange(seq, dtype=np.int64), axis=0)[None]
    else:
        pos = xp.take(position_embedding, position_ids.astype(np.int64), axis=0)
    emb = emb + pos
    if segment_ids is not None and segment_embedding is not None:
        emb += xp.take(segment_embedding, segment_ids.astype(np.int64), axis=0)
    Y = LayerNormalization(xp, emb, gamma, beta, axis=-1, epsilon=epsilon, stash_type=1)[0]
    outs = (Y,)
    if num_outputs > 1:
        if mask is None:
            mask_index = xp.zeros((batch,), np.int32)
        else:
            mask_index = xp.sum(mask == 1, axis=1).astype(np.int32)
        outs += (mask_index, emb)
    return outs[:max(num_outputs, 1)]
