"""Normalisations: BatchNormalization, LayerNormalization, InstanceNormalization,
GroupNormalization, LRN, MeanVarianceNormalization, RMSNormalization, LpNormalization.

Statistics are computed in float32 (or the op's stash_type) for half inputs; outputs
keep the input dtype.
"""

from __future__ import annotations

import numpy as np

from hetero_exec.kernels._common import norm_axis, np_dtype
from hetero_exec.kernels._nn_common import acc_dtype
from hetero_exec.kernels.fused import FUSED_DOMAIN
from hetero_exec.kernels.native import library, row_kernels
from hetero_exec.kernels.registry import kernel


def _stat_shape(stat, x):
    """Broadcast shape of a per-channel (C,) statistic against x (N, C, ...); the old
    spatial=0 form with (C, D1, ...) statistics broadcasts as (1, C, D1, ...)."""
    if stat.ndim == 1:
        return stat.reshape((-1,) + (1,) * (x.ndim - 2))
    return stat.reshape((1,) + stat.shape)


def _mean_var(xp, x, axes):
    mean = xp.mean(x, axis=axes, keepdims=True)
    d = x - mean
    var = xp.mean(d * d, axis=axes, keepdims=True)
    return mean, var, d


# --------------------------------------------------------------------------- BatchNormalization


@kernel("BatchNormalization", since=(1, 6, 7, 9, 14, 15))
def BatchNormalization(xp, X, scale, B, input_mean, input_var, epsilon=1e-5, momentum=0.9,
                       training_mode=0, spatial=1, is_test=0, consumed_inputs=None, *,
                       num_outputs=1, opset=15):
    dt = X.dtype
    cdt = acc_dtype(xp, dt)
    # training statistics: opset >= 14 by attribute; older opsets when the extra
    # (mean, var, saved_mean, saved_var) outputs are requested
    training = bool(training_mode) if opset >= 14 else (num_outputs > 1 and not is_test)
    if not training:
        # fold into one per-channel affine map y = x * a + b
        a = scale.astype(cdt, copy=False) / xp.sqrt(input_var.astype(cdt, copy=False) + epsilon)
        b = B.astype(cdt, copy=False) - input_mean.astype(cdt, copy=False) * a
        a, b = _stat_shape(a, X), _stat_shape(b, X)
        if cdt == dt:
            Y = X * a
            Y += b
        else:
            Y = (X.astype(cdt) * a + b).astype(dt)
        return (Y,)
    axes = (0,) + tuple(range(2, X.ndim))
    Xc = X.astype(cdt, copy=False)
    mean = xp.mean(Xc, axis=axes)
    d = Xc - _stat_shape(mean, Xc)
    var = xp.mean(d * d, axis=axes)
    inv = 1.0 / xp.sqrt(var + epsilon)
    Y = d * _stat_shape(inv * scale.astype(cdt, copy=False), Xc)
    Y += _stat_shape(B.astype(cdt, copy=False), Xc)
    m_dt = input_mean.dtype
    run_mean = input_mean.astype(cdt, copy=False) * momentum + mean * (1 - momentum)
    run_var = input_var.astype(cdt, copy=False) * momentum + var * (1 - momentum)
    outs = (Y.astype(dt, copy=False), run_mean.astype(m_dt, copy=False),
            run_var.astype(input_var.dtype, copy=False))
    if opset < 14:
        outs = outs + (mean.astype(m_dt, copy=False), var.astype(m_dt, copy=False))
    return outs[:max(num_outputs, 1)]


# --------------------------------------------------------------------------- Layer / RMS


#: bytes of rows normalised per block on numpy, so the several passes over a block
#: (mean, centre, variance, scale, shift) hit cache rather than memory
_ROW_BLOCK = 1 << 20


def _stash_dtype(xp, stash_type, dt):
    sdt = np_dtype(stash_type) if stash_type else acc_dtype(xp, dt)
    if sdt.kind != "f" or (sdt == np.float16 and xp is np):
        sdt = np.dtype(np.float32)
    return sdt


def _row_blocks(xp, rows, cols, itemsize):
    if xp is not np:
        return [(0, rows)]
    blk = max(1, _ROW_BLOCK // max(cols * itemsize, 1))
    return [(r, min(rows, r + blk)) for r in range(0, rows, blk)]


def _trailing(xp, v, shape, cols, sdt):
    """A scale/bias broadcastable to the normalised trailing shape, as (1, cols)."""
    v = v.astype(sdt, copy=False)
    if tuple(v.shape) != tuple(shape):
        v = xp.broadcast_to(v, shape)
    return v.reshape(1, cols)


def _row_dot(xp, a):
    """Per-row sums of squares of a 2-D array, as (rows, 1), through batched BLAS dots."""
    return xp.matmul(a[:, None, :], a[:, :, None]).reshape(-1, 1)


def _normalized_rows(xp, X, axis, stash_type, scale):
    """X as a (rows, cols) matrix normalised per row over axes ``axis..``: the matrix, the
    stash dtype, the scale broadcast to a row (None without a scale), and rows/cols."""
    sdt = _stash_dtype(xp, stash_type, X.dtype)
    tail = X.shape[axis:]
    rows = int(np.prod(X.shape[:axis], dtype=np.int64))
    cols = int(np.prod(tail, dtype=np.int64))
    sc = None if scale is None else _trailing(xp, scale, tail, cols, sdt)
    return X.reshape(rows, cols), sdt, sc, rows, cols


def _compiled(xp, X2, sdt, rows: int, cols: int) -> bool:
    """Whether the C row kernels (native/norm.c) take this norm: a numpy float32 input
    normalised in float32, and something to normalise (float64 and the rest: numpy)."""
    return X2.dtype == sdt and rows > 0 and cols > 0 and library.takes(xp, X2)


def _vector_or_none(v, cols: int):
    return None if v is None else np.ascontiguousarray(v, dtype=np.float32).reshape(cols)


def _native_layer_norm(X2, sc, bi, epsilon: float):
    cols = X2.shape[1]
    return row_kernels.row_norm(X2, _vector_or_none(sc, cols), _vector_or_none(bi, cols),
                                float(epsilon))


def _native_rms_norm(X2, sc, epsilon: float):
    return row_kernels.row_norm(X2, _vector_or_none(sc, X2.shape[1]), None, float(epsilon),
                                rms=True)[0]


@kernel("LayerNormalization", since=17)
def LayerNormalization(xp, X, Scale, B=None, axis=-1, epsilon=1e-5, stash_type=1, *,
                       num_outputs=1):
    axis = norm_axis(axis, X.ndim)
    if num_outputs <= 1 and axis == X.ndim - 1:
        Y = _permuted_layer_norm(xp, X, Scale, B, epsilon)
        if Y is not None:
            return (Y,)
    X2, sdt, sc, rows, cols = _normalized_rows(xp, X, axis, stash_type, Scale)
    bi = None if B is None else _trailing(xp, B, X.shape[axis:], cols, sdt)
    dt = X.dtype
    if _compiled(xp, X2, sdt, rows, cols):
        Y, mean, inv = _native_layer_norm(X2, sc, bi, epsilon)
        outs = (Y.reshape(X.shape),)
        if num_outputs > 1:
            stat_shape = X.shape[:axis] + (1,) * (X.ndim - axis)
            outs += (mean.reshape(stat_shape), inv.reshape(stat_shape))
        return outs[:max(num_outputs, 1)]
    Y = xp.empty((rows, cols), dtype=sdt)
    mean = xp.empty((rows, 1), dtype=sdt)
    inv = xp.empty((rows, 1), dtype=sdt)
    ones = xp.full((cols, 1), 1.0 / cols, dtype=sdt)
    for r0, r1 in _row_blocks(xp, rows, cols, sdt.itemsize):
        xb = X2[r0:r1].astype(sdt, copy=False)
        m = xb @ ones  # row means through BLAS: much faster than a last-axis reduction
        d = Y[r0:r1]
        xp.subtract(xb, m, out=d)
        var = _row_dot(xp, d) / cols
        iv = 1.0 / xp.sqrt(var + epsilon)
        d *= iv
        if sc is not None:
            d *= sc
        if bi is not None:
            d += bi
        mean[r0:r1] = m
        inv[r0:r1] = iv
    outs = (Y.reshape(X.shape).astype(dt, copy=False),)
    if num_outputs > 1:
        stat_shape = X.shape[:axis] + (1,) * (X.ndim - axis)
        outs += (mean.reshape(stat_shape), inv.reshape(stat_shape))
    return outs[:max(num_outputs, 1)]


@kernel("RMSNormalization", since=23)
def RMSNormalization(xp, X, scale, axis=-1, epsilon=1e-5, stash_type=1):
    axis = norm_axis(axis, X.ndim)
    X2, sdt, sc, rows, cols = _normalized_rows(xp, X, axis, stash_type, scale)
    dt = X.dtype
    if _compiled(xp, X2, sdt, rows, cols):
        return (_native_rms_norm(X2, sc, epsilon).reshape(X.shape),)
    Y = xp.empty((rows, cols), dtype=sdt)
    for r0, r1 in _row_blocks(xp, rows, cols, sdt.itemsize):
        xb = X2[r0:r1].astype(sdt, copy=False)
        ms = _row_dot(xp, xb) / cols
        d = Y[r0:r1]
        xp.multiply(xb, 1.0 / xp.sqrt(ms + epsilon), out=d)
        if sc is not None:
            d *= sc
    return (Y.reshape(X.shape).astype(dt, copy=False),)


@kernel("FusedLayerNorm", since=1, domain=FUSED_DOMAIN)
def FusedLayerNorm(xp, X, scale=None, bias=None, axis=-1, epsilon=1e-5, axes=None):
    """LayerNormalization (scale and bias optional) in the input's precision: the node
    chain exporters write for it (ReduceMean, Sub, Pow, ReduceMean, Add, Sqrt, Div, ...).
    ``axes``: normalise over these instead of ``axis..`` (scale and bias broadcast as in
    the chain's Mul and Add)."""
    if axes is None:
        return LayerNormalization(xp, X, scale, bias, axis=axis, epsilon=epsilon, stash_type=0)
    ax = tuple(axes)
    if ax == (1,) and X.ndim >= 3 and library.takes(xp, X):
        g, b = _channel_vector(scale, X), _channel_vector(bias, X)
        if (scale is None or g is not None) and (bias is None or b is not None):
            # a channels-first LayerNorm (ConvNeXt's): native/norm.c, over the channels
            X3 = np.ascontiguousarray(X).reshape(X.shape[0], X.shape[1], -1)
            return (row_kernels.layer_norm_channels(X3, g, b, float(epsilon)).reshape(X.shape),)
    d = X - xp.mean(X, axis=ax, keepdims=True)
    var = xp.mean(d * d, axis=ax, keepdims=True)
    d *= 1.0 / xp.sqrt(var + epsilon)
    if scale is not None:
        d *= scale
    if bias is not None:
        d += bias
    return (d,)


def _permuted_layer_norm(xp, X, scale, bias, epsilon):
    """LayerNorm over the last axis of a float32 view (n, *S, C) whose channels are axis 1
    of a C-contiguous array (n, C, *S): ConvNeXt's LayerNorm of its depthwise conv's
    output permuted to channels-last. The rows would be copied out of the strided view
    first (2.5 ns a value); native/norm.c reads the NCHW array instead and writes the
    normalised rows in (n, *S, C) order. None when X is not such a view."""
    if (X.ndim < 3 or X.dtype != np.float32 or X.flags.c_contiguous or X.size == 0
            or not library.takes(xp, X)):
        return None
    base = np.moveaxis(X, -1, 1)
    C = X.shape[-1]
    if not base.flags.c_contiguous:
        return None
    vectors = []
    for v in (scale, bias):
        if v is not None and (v.dtype != np.float32 or v.size != C):
            return None
        vectors.append(None if v is None else v.reshape(C))
    Y = row_kernels.layer_norm_channels(base.reshape(X.shape[0], C, -1), *vectors,
                                        float(epsilon), channels_last=True)
    return Y.reshape(X.shape)


def _channel_vector(v, X):
    """``v`` as C float32 values when it broadcasts against X (n, C, ...) along axis 1
    only (a (C, 1, 1) or (1, C, 1, 1) scale), else None."""
    if v is None or v.dtype != np.float32 or v.size != X.shape[1] or v.ndim > X.ndim:
        return None
    aligned = (1,) * (X.ndim - v.ndim) + tuple(v.shape)
    if aligned[1] != X.shape[1] or any(d != 1 for i, d in enumerate(aligned) if i != 1):
        return None
    return np.ascontiguousarray(v).reshape(X.shape[1])


@kernel("FusedRMSNorm", since=1, domain=FUSED_DOMAIN)
def FusedRMSNorm(xp, X, scale=None, axis=-1, epsilon=1e-5):
    """x / sqrt(mean(x^2) + epsilon) [* scale] in the input's precision: RMSNorm as the
    exporters write it (Pow, ReduceMean, Add, Sqrt, Div or Reciprocal and Mul)."""
    return RMSNormalization(xp, X, scale, axis=axis, epsilon=epsilon, stash_type=0)


# --------------------------------------------------------------------------- Instance / Group


@kernel("InstanceNormalization", since=(1, 6, 22))
def InstanceNormalization(xp, input, scale, B, epsilon=1e-5, consumed_inputs=None):
    dt = input.dtype
    cdt = acc_dtype(xp, dt)
    Xc = input.astype(cdt, copy=False)
    axes = tuple(range(2, input.ndim))
    mean, var, d = _mean_var(xp, Xc, axes)
    Y = d * (_stat_shape(scale.astype(cdt, copy=False), Xc) / xp.sqrt(var + epsilon))
    Y += _stat_shape(B.astype(cdt, copy=False), Xc)
    return (Y.astype(dt, copy=False),)


@kernel("GroupNormalization", since=(18, 21))
def GroupNormalization(xp, X, scale, bias, epsilon=1e-5, num_groups=None, stash_type=1):
    dt = X.dtype
    sdt = _stash_dtype(xp, stash_type, dt)
    N, C = X.shape[:2]
    G = int(num_groups)
    Xg = X.astype(sdt, copy=False).reshape((N, G, -1))
    mean, var, d = _mean_var(xp, Xg, (2,))
    Y = (d / xp.sqrt(var + epsilon)).reshape(X.shape)
    sc = scale.astype(sdt, copy=False)
    bi = bias.astype(sdt, copy=False)
    if sc.shape[0] != C:
        # opset-18 form: one scale/bias per group, repeated over the group's channels
        sc = xp.repeat(sc, C // G)
        bi = xp.repeat(bi, C // G)
    Y = Y * _stat_shape(sc, Y) + _stat_shape(bi, Y)
    return (Y.astype(dt, copy=False),)


# --------------------------------------------------------------------------- LRN / MVN / Lp


@kernel("LRN", since=(1, 13))
def LRN(xp, X, alpha=1e-4, beta=0.75, bias=1.0, size=None):
    dt = X.dtype
    cdt = acc_dtype(xp, dt)
    Xc = X.astype(cdt, copy=False)
    sq = Xc * Xc
    C = X.shape[1]
    lo = (size - 1) // 2
    pad = xp.zeros((X.shape[0], C + size - 1) + X.shape[2:], dtype=cdt)
    pad[:, lo:lo + C] = sq
    ss = pad[:, 0:C].copy()
    for j in range(1, size):
        ss += pad[:, j:j + C]
    Y = Xc / (bias + (alpha / size) * ss) ** beta
    return (Y.astype(dt, copy=False),)


@kernel("MeanVarianceNormalization", since=(9, 13))
def MeanVarianceNormalization(xp, X, axes=(0, 2, 3)):
    dt = X.dtype
    cdt = acc_dtype(xp, dt)
    Xc = X.astype(cdt, copy=False)
    ax = tuple(norm_axis(a, X.ndim) for a in axes)
    mean, var, d = _mean_var(xp, Xc, ax)
    Y = d / (xp.sqrt(var) + 1e-9)
    return (Y.astype(dt, copy=False),)


@kernel("LpNormalization", since=(1, 22))
def LpNormalization(xp, input, axis=-1, p=2):
    dt = input.dtype
    cdt = acc_dtype(xp, dt)
    Xc = input.astype(cdt, copy=False)
    if p == 1:
        norm = xp.sum(xp.abs(Xc), axis=axis, keepdims=True)
    elif p == 2:
        norm = xp.sqrt(xp.sum(Xc * Xc, axis=axis, keepdims=True))
    else:
        norm = xp.sum(xp.abs(Xc) ** p, axis=axis, keepdims=True) ** (1.0 / p)
    safe = xp.where(norm == 0, 1, norm)
    Y = xp.where(norm == 0, 0, Xc / safe)
    return (Y.astype(dt, copy=False),)
