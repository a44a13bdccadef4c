"""Pooling: MaxPool, AveragePool, LpPool, Global{Average,Max,Lp}Pool, MaxUnpool, MaxRoiPool.

Max and sum windows are box reductions, done one spatial axis at a time (separable):
per axis and kernel tap one strided-slice op over the whole output, taps that fall in
the padding clipped away instead of padding a copy of the input. No Python loop over
pixels and no (outputs x taps) temporary. MaxPool's Indices output takes the per-tap
path over a padded input, tracking the winning tap.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from hetero_exec.kernels._common import host_ints
from hetero_exec.kernels._nn_common import (
    acc_dtype,
    is_numpy,
    offset_slices,
    pad_spatial,
    spatial_attrs,
)
from hetero_exec.kernels.native import packed_gemm, plane_kernels
from hetero_exec.kernels.registry import kernel


def _pool_geometry(in_sp, kernel, strides, dilations, pads, auto_pad, ceil_mode):
    """Output shape, begin pads, explicit end pads, and the extra end padding that
    ceil_mode windows hanging past the padded input need."""
    nd = len(in_sp)
    eff = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        out = [-(-i // s) for i, s in zip(in_sp, strides)]
        need = [max(0, (o - 1) * s + e - i) for o, s, e, i in zip(out, strides, eff, in_sp)]
        pb = [n // 2 if auto_pad == "SAME_UPPER" else n - n // 2 for n in need]
        pe = [n - b for n, b in zip(need, pb)]
    else:
        if auto_pad == "VALID" or not pads:
            pb, pe = [0] * nd, [0] * nd
        else:
            pads = list(pads)
            pb, pe = pads[:nd], pads[nd:]
        out = []
        for i, b, e, ef, s in zip(in_sp, pb, pe, eff, strides):
            span = i + b + e - ef
            if ceil_mode:
                o = -(-span // s) + 1
                if (o - 1) * s >= i + b:  # last window would start in the end padding
                    o -= 1
            else:
                o = span // s + 1
            out.append(max(o, 0))
    extra = [max(0, (o - 1) * s + ef - (i + b + e))
             for o, s, ef, i, b, e in zip(out, strides, eff, in_sp, pb, pe)]
    return out, pb, pe, extra


def _taps(kernel):
    return itertools.product(*[range(k) for k in kernel])


def _window_counts(xp, in_sp, out_sp, kernel, strides, dilations, pb, pe, include_pad, dtype):
    """Per-output number of window taps that fall inside the input (or inside the
    explicitly padded input when include_pad): separable, so an outer product of 1-D
    host arrays."""
    cnt = None
    for i, o, k, s, d, b, e in zip(in_sp, out_sp, kernel, strides, dilations, pb, pe):
        pos = np.arange(o)[:, None] * s - b + np.arange(k)[None, :] * d
        lo, hi = (-b, i + e) if include_pad else (0, i)
        c = ((pos >= lo) & (pos < hi)).sum(axis=1).astype(np.float64)
        cnt = c if cnt is None else np.multiply.outer(cnt, c)
    cnt = np.maximum(cnt, 1)
    return xp.asarray(cnt.astype(dtype))


def _pool_prepare(X, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode):
    nd = X.ndim - 2
    kernel = list(kernel_shape)
    strides, dilations = spatial_attrs(nd, strides, dilations)
    out, pb, pe, extra = _pool_geometry(list(X.shape[2:]), kernel, strides, dilations, pads,
                                        auto_pad, ceil_mode)
    return nd, kernel, strides, dilations, out, pb, pe, extra


def _min_value(dtype):
    dtype = np.dtype(dtype)
    if dtype.kind in "iu":
        return np.iinfo(dtype).min
    if dtype.kind == "b":
        return False
    return -np.inf


#: bytes of input processed per block by the pools on numpy: small enough that a
#: block's intermediates stay in cache between the per-axis passes
_POOL_BLOCK = 2 << 20


def _box_reduce(xp, A, out_sp, kernel, strides, dilations, pb, is_max):
    """_box_reduce_all over cache-sized blocks of the leading (N*C) rows."""
    nd = len(kernel)
    lead_shape = A.shape[: A.ndim - nd]
    rows = int(np.prod(lead_shape)) if lead_shape else 1
    plane = int(np.prod(A.shape[A.ndim - nd:])) * A.dtype.itemsize
    blk = max(1, _POOL_BLOCK // max(plane, 1))
    if not is_numpy(xp) or rows <= blk or not A.flags.c_contiguous:
        return _box_reduce_all(xp, A, out_sp, kernel, strides, dilations, pb, is_max)
    A2 = A.reshape((rows,) + A.shape[A.ndim - nd:])
    out = np.empty((rows,) + tuple(out_sp), dtype=A.dtype)
    for r0 in range(0, rows, blk):
        out[r0:r0 + blk] = _box_reduce_all(xp, A2[r0:r0 + blk], out_sp, kernel, strides,
                                           dilations, pb, is_max)
    return out.reshape(lead_shape + tuple(out_sp))


def _box_reduce_all(xp, A, out_sp, kernel, strides, dilations, pb, is_max):
    """Max or sum of A over pooling windows, one spatial axis at a time (a box reduce
    is separable): per axis and kernel tap one strided slice op over the part of the
    output whose tap falls inside the input. Taps in the padding are skipped rather
    than materialising a padded copy, so padding acts as -inf (max) or 0 (sum)."""
    nd = len(kernel)
    for ax in range(nd):
        axis = A.ndim - nd + ax
        n_in = A.shape[axis]
        O, k, s, d, b = out_sp[ax], kernel[ax], strides[ax], dilations[ax], pb[ax]
        if k == 1 and s == 1 and b == 0 and O == n_in:
            continue
        lead = (slice(None),) * axis
        taps = []
        for t in range(k):
            off = t * d - b
            lo = max(0, -(off // s))  # first o with o*s + off >= 0: ceil(-off / s)
            hi = min(O, (n_in - 1 - off) // s + 1) if n_in - 1 - off >= 0 else 0
            if hi > lo:
                taps.append((lo, hi, slice(lo * s + off, (hi - 1) * s + off + 1, s)))
        shape = A.shape[:axis] + (O,) + A.shape[axis + 1:]
        full = [tp for tp in taps if tp[0] == 0 and tp[1] == O]
        if full:
            first = full[0]
            R = A[lead + (first[2],)].copy()
            taps = [tp for tp in taps if tp is not first]
        elif is_max:
            R = xp.full(shape, _min_value(A.dtype), dtype=A.dtype)
        else:
            R = xp.zeros(shape, dtype=A.dtype)
        for lo, hi, src in taps:
            dst = lead + (slice(lo, hi),)
            if is_max:
                xp.maximum(R[dst], A[lead + (src,)], out=R[dst])
            else:
                R[dst] += A[lead + (src,)]
        A = R
    return A


# --------------------------------------------------------------------------- MaxPool


def _max_pool(xp, X, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode, storage_order,
              want_indices):
    nd, kernel, strides, dilations, out, pb, pe, extra = _pool_prepare(
        X, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)
    if (not want_indices and nd == 2 and xp is np and X.dtype == np.float32 and X.size
            and all(out) and packed_gemm.available()):  # compiled (native/conv.c)
        ends = [e + x for e, x in zip(pe, extra)]
        return plane_kernels.max_pool_2d(X, tuple(kernel), tuple(strides), tuple(dilations),
                                       (pb[0], pb[1], ends[0], ends[1]), tuple(out)), None
    if not want_indices:
        Y = _box_reduce(xp, X, out, kernel, strides, dilations, pb, True)
        return (Y if Y is not X else X.copy()), None
    Xp = pad_spatial(xp, X, pb, [e + x for e, x in zip(pe, extra)], _min_value(X.dtype))
    lead = (slice(None), slice(None))
    Y = None
    best = None
    for t, koff in enumerate(_taps(kernel)):
        v = Xp[lead + offset_slices(koff, out, strides, dilations)]
        if Y is None:
            Y = v.copy()
            if want_indices:
                best = xp.zeros(Y.shape, dtype=np.int64)
        elif want_indices:
            upd = v > Y
            Y = xp.where(upd, v, Y)
            best = xp.where(upd, t, best)
        else:
            xp.maximum(Y, v, out=Y)
    if Y is None:  # empty kernel: cannot happen for valid models
        raise ValueError("MaxPool: empty kernel_shape")
    if not want_indices:
        return Y, None
    # absolute input coordinates of the chosen tap, then the flat index into X
    N, C = X.shape[:2]
    in_sp = X.shape[2:]
    coords = []
    rem = best
    for i in reversed(range(nd)):
        k_i = rem % kernel[i]
        rem = rem // kernel[i]
        shape = [1] * (nd + 2)
        shape[2 + i] = out[i]
        o = xp.arange(out[i], dtype=np.int64).reshape(shape)
        coords.append(o * strides[i] - pb[i] + k_i * dilations[i])
    coords = coords[::-1]
    nc = (xp.arange(N, dtype=np.int64).reshape((N,) + (1,) * (nd + 1)) * C
          + xp.arange(C, dtype=np.int64).reshape((1, C) + (1,) * nd)) * math.prod(in_sp)
    idx = 0
    if storage_order == 1:  # column-major over the spatial axes
        for i in reversed(range(nd)):
            idx = idx * in_sp[i] + coords[i]
    else:
        for i in range(nd):
            idx = idx * in_sp[i] + coords[i]
    return Y, (nc + idx).astype(np.int64)


@kernel("MaxPool", since=(1, 8, 10, 11, 12, 22))
def MaxPool(xp, X, auto_pad="NOTSET", ceil_mode=0, dilations=None, kernel_shape=None, pads=None,
            storage_order=0, strides=None, *, num_outputs=1):
    Y, I = _max_pool(xp, X, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode,
                     storage_order, num_outputs > 1)
    return (Y,) if I is None else (Y, I)


# --------------------------------------------------------------------------- Average / Lp


def _sum_pool(xp, X, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode, fn=None):
    """Sum over each window of fn(X) (zero padding); returns the sum in the compute
    dtype and the geometry."""
    nd, kernel, strides, dilations, out, pb, pe, extra = _pool_prepare(
        X, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)
    cdt = acc_dtype(xp, X.dtype)
    Xc = X.astype(cdt, copy=False)
    if fn is not None:
        Xc = fn(Xc)
    S = _box_reduce(xp, Xc, out, kernel, strides, dilations, pb, False)
    if S is X:
        S = S.copy()
    return S, (kernel, strides, dilations, out, pb, pe)


@kernel("AveragePool", since=(1, 7, 10, 11, 19, 22))
def AveragePool(xp, X, auto_pad="NOTSET", ceil_mode=0, count_include_pad=0, dilations=None,
                kernel_shape=None, pads=None, strides=None):
    S, (kernel, strides, dilations, out, pb, pe) = _sum_pool(
        xp, X, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)
    cnt = _window_counts(xp, X.shape[2:], out, kernel, strides, dilations, pb, pe,
                         bool(count_include_pad), S.dtype)
    S /= cnt
    return (S.astype(X.dtype, copy=False),)


def _lp_fn(xp, p):
    if p == 2:
        return lambda v: v * v
    if p == 1:
        return xp.abs
    return lambda v: xp.abs(v) ** p


def _lp_root(xp, S, p):
    if p == 2:
        return xp.sqrt(S)
    if p == 1:
        return S
    return S ** (1.0 / p)


@kernel("LpPool", since=(1, 2, 11, 18, 22))
def LpPool(xp, X, auto_pad="NOTSET", ceil_mode=0, dilations=None, kernel_shape=None, p=2,
           pads=None, strides=None):
    p = float(p)
    S, _ = _sum_pool(xp, X, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode,
                     _lp_fn(xp, p))
    return (_lp_root(xp, S, p).astype(X.dtype, copy=False),)


# --------------------------------------------------------------------------- Global pools


@kernel("GlobalAveragePool", since=(1, 22))
def GlobalAveragePool(xp, X):
    axes = tuple(range(2, X.ndim))
    L = math.prod(X.shape[2:])
    if xp is np and X.dtype in (np.float32, np.float64) and X.size > 0:
        # each (image, channel) plane's mean as a product with a column of 1/L: numpy's
        # reduction over short contiguous planes ran at ~2 ns a value (MobileNetV2's
        # 4x4 planes at batch 8: 0.29 ms, the product 0.05 ms)
        ones = np.full((L, 1), 1.0 / L, X.dtype)
        Y = np.ascontiguousarray(X).reshape(-1, L) @ ones
        return (Y.reshape(X.shape[:2] + (1,) * len(axes)),)
    cdt = acc_dtype(xp, X.dtype)
    return (xp.mean(X, axis=axes, keepdims=True, dtype=cdt).astype(X.dtype, copy=False),)


@kernel("GlobalMaxPool", since=(1, 22))
def GlobalMaxPool(xp, X):
    axes = tuple(range(2, X.ndim))
    return (xp.max(X, axis=axes, keepdims=True),)


@kernel("GlobalLpPool", since=(1, 2, 22))
def GlobalLpPool(xp, X, p=2):
    p = float(p)
    axes = tuple(range(2, X.ndim))
    cdt = acc_dtype(xp, X.dtype)
    S = xp.sum(_lp_fn(xp, p)(X.astype(cdt, copy=False)), axis=axes, keepdims=True)
    return (_lp_root(xp, S, p).astype(X.dtype, copy=False),)


# --------------------------------------------------------------------------- MaxUnpool


@kernel("MaxUnpool", since=(9, 11, 22), host_inputs=(2,))
def MaxUnpool(xp, X, I, output_shape=None, kernel_shape=None, pads=None, strides=None):
    nd = X.ndim - 2
    kernel = list(kernel_shape)
    strides = list(strides) if strides else [1] * nd
    p = list(pads) if pads else [0] * (2 * nd)
    inferred = list(X.shape[:2]) + [
        (X.shape[2 + i] - 1) * strides[i] - (p[i] + p[nd + i]) + kernel[i] for i in range(nd)
    ]
    # indices address the inferred (unpadded pre-pool) shape, as the reference does;
    # an explicit output_shape then places that block at the origin
    flat = xp.zeros(math.prod(inferred), dtype=X.dtype)
    flat[I.reshape(-1).astype(np.int64)] = X.reshape(-1)
    Y = flat.reshape(inferred)
    if output_shape is not None:
        shape = host_ints(output_shape)
        if list(shape) != inferred:
            res = xp.zeros(shape, dtype=X.dtype)
            sl = tuple(slice(0, min(a, b)) for a, b in zip(inferred, shape))
            res[sl] = Y[sl]
            Y = res
    return (Y,)


# --------------------------------------------------------------------------- MaxRoiPool


@kernel("MaxRoiPool", since=(1, 22))
def MaxRoiPool(xp, X, rois, pooled_shape=None, spatial_scale=1.0):
    """Caffe-style RoI max pooling (as onnxruntime): each RoI box, scaled and rounded to
    the feature grid, is split into pooled_shape bins; empty bins give 0.

    Separable: a masked max over W per bin column, then over H per bin row."""
    N, C, H, W = X.shape
    PH, PW = pooled_shape
    cdt = acc_dtype(xp, X.dtype)
    r = rois.astype(np.float64)
    batch = r[:, 0].astype(np.int64)
    x1 = xp.rint(r[:, 1] * spatial_scale)
    y1 = xp.rint(r[:, 2] * spatial_scale)
    x2 = xp.rint(r[:, 3] * spatial_scale)
    y2 = xp.rint(r[:, 4] * spatial_scale)
    rh = xp.maximum(y2 - y1 + 1, 1)
    rw = xp.maximum(x2 - x1 + 1, 1)
    bh = rh / PH
    bw = rw / PW

    def bins(start, size, n, limit):
        k = xp.arange(n, dtype=np.float64)
        lo = xp.clip(xp.floor(k[None, :] * size[:, None]) + start[:, None], 0, limit)
        hi = xp.clip(xp.ceil((k[None, :] + 1) * size[:, None]) + start[:, None], 0, limit)
        pos = xp.arange(limit, dtype=np.float64)
        # (R, n, limit): which feature rows/columns fall in each bin
        return (pos[None, None, :] >= lo[:, :, None]) & (pos[None, None, :] < hi[:, :, None])

    mh = bins(y1, bh, PH, H)
    mw = bins(x1, bw, PW, W)
    neg = -np.inf
    feat = X.astype(cdt, copy=False)[batch]  # (R, C, H, W)
    # max over W within each bin column: (R, C, H, PW)
    colmax = xp.max(xp.where(mw[:, None, None, :, :], feat[:, :, :, None, :], neg), axis=-1)
    # max over H within each bin row: (R, C, PH, PW)
    cols_t = colmax.transpose(0, 1, 3, 2)[:, :, None, :, :]  # (R, C, 1, PW, H)
    Y = xp.max(xp.where(mh[:, None, :, None, :], cols_t, neg), axis=-1)
    Y = xp.where(Y == neg, 0, Y)  # empty bins
    return (Y.astype(X.dtype, copy=False),)
