"""Convolutions: Conv, ConvTranspose, ConvInteger, QLinearConv, DeformConv, Col2Im,
CausalConvWithState.

Conv is im2col + GEMM. The padded input is viewed through ``as_strided`` as
(N, C, *K, *O) windows and copied once into a reusable column buffer laid out
(N, C*K, O), so that ``W (M, C*K) @ cols`` writes the NCHW output directly with no
transpose after the GEMM; for small output planes the columns are laid out
(C*K, N*O) instead, for one wide GEMM. A stride-1 1x1 convolution needs no copy at
all; depthwise convolutions accumulate over kernel taps instead of a GEMM.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from hetero_exec.kernels._common import host_ints
from hetero_exec.kernels._nn_common import (
    SCRATCH_KEEP,
    acc_dtype,
    conv_geometry,
    is_numpy,
    offset_slices,
    pad_spatial,
    pad_spatial_scratch,
    scratch,
    spatial_attrs,
    window_view,
)
from hetero_exec.kernels.fused import FUSED_DOMAIN, activate
from hetero_exec.kernels.registry import kernel

#: output plane size (columns per image) below which images share one wide GEMM
#: (small late-stage planes) rather than one GEMM per image
_GEMM_COLS = 1024


# --------------------------------------------------------------------------- core


def _depthwise(xp, Xp, W, out_sp, strides, dilations, group):
    """Grouped conv with one input channel per group: sum over kernel taps of
    per-channel scaled strided slices (no im2col, no GEMM)."""
    N = Xp.shape[0]
    M = W.shape[0]
    mult = M // group
    K = W.shape[2:]
    nd = len(K)
    Wr = W.reshape((group, mult) + (1,) * nd + (-1,))  # (g, mult, 1.., prodK)
    Y = None
    for t, koff in enumerate(itertools.product(*[range(k) for k in K])):
        sl = (slice(None), slice(None)) + offset_slices(koff, out_sp, strides, dilations)
        xs = Xp[sl]
        if mult == 1:
            term = xs * Wr[:, 0, ..., t]
        else:
            term = xs[:, :, None] * Wr[..., t]
        if Y is None:
            Y = term
        else:
            Y += term
    return Y.reshape((N, M) + tuple(out_sp))


def _chunk(xp, N, per_image_bytes):
    """Images per im2col block: the whole batch when its columns fit the reusable
    scratch buffer (numpy) or always (cupy's pool caches device memory itself)."""
    if not is_numpy(xp):
        return N
    return max(1, min(N, SCRATCH_KEEP // max(per_image_bytes, 1)))


def _epilogue(xp, Y, Z, activation):
    """In place on a fresh conv output block: add the residual Z, apply the activation
    (a name of kernels.fused.ACTIVATIONS, or (name, params))."""
    if Z is not None:
        Y += Z
    if activation:
        name, params = (activation, None) if isinstance(activation, str) else activation
        activate(xp, Y, name, params, "FusedConv")


def _conv_core(xp, X, W, B, strides, dilations, pb, pe, group, out_sp, Z=None, activation=""):
    """Conv of X (N, C, *S) with W (M, C/group, *K), plus B (M,) if given, computed
    in (and returned as) the dtype of X and W. ``Z`` (the output's shape) is added and
    ``activation`` applied in place, block by block while the output is in cache.

    Each block of images is one copy into the column buffer, one (batched) matmul and
    the in-place epilogue (bias, Z, activation) on that block's output: few switches
    between single-threaded numpy work and the multi-threaded BLAS, whose spinning
    workers otherwise compete with the copies on a loaded machine (the whole batch is
    one block unless its columns outgrow the scratch buffer)."""
    N, C = X.shape[:2]
    M = W.shape[0]
    K = tuple(W.shape[2:])
    nd = len(K)
    Cg = C // group
    Mg = M // group
    kprod = math.prod(K)
    L = math.prod(out_sp)
    out_shape = (N, M) + tuple(out_sp)

    if N == 0 or M == 0 or L == 0:
        return xp.zeros(out_shape, dtype=X.dtype)  # empty: no bias, Z or activation to apply

    if Cg == 1 and group > 1:  # depthwise (channel multiplier Mg)
        Y = _depthwise(xp, pad_spatial(xp, X, pb, pe, 0), W, out_sp, strides, dilations, group)
        if B is not None:
            Y += B.reshape((-1,) + (1,) * nd)
        _epilogue(xp, Y, Z, activation)
        return Y
    Zr = None if Z is None else Z.reshape(N, M, L)

    Xp = pad_spatial_scratch(xp, X, pb, pe)  # no copy when unpadded (1x1 convs)
    view = window_view(xp, Xp, out_sp, K, strides, dilations, kernel_first=True)  # (N, C, *K, *O)
    CK = Cg * kprod
    Wr = W.reshape(group, Mg, CK)
    out = xp.empty((N, M, L), dtype=X.dtype)
    nb = _chunk(xp, N, C * kprod * L * X.dtype.itemsize)
    if L >= _GEMM_COLS or N == 1:
        # columns (n, C*K, L) per image: the batched matmul writes NCHW directly
        for n0 in range(0, N, nb):
            n1 = min(N, n0 + nb)
            v = view[n0:n1]
            if v.flags.c_contiguous:  # stride-1 1x1: the images are the column matrices
                cols = v.reshape(n1 - n0, group, CK, L)
            else:
                cols = scratch(xp, v.shape, X.dtype)
                cols[...] = v
                cols = cols.reshape(n1 - n0, group, CK, L)
            if group == 1:
                xp.matmul(Wr[0], cols[:, 0], out=out[n0:n1])
            else:
                xp.matmul(Wr, cols, out=out[n0:n1].reshape(n1 - n0, group, Mg, L))
            blk = out[n0:n1]
            if B is not None:
                blk += B.reshape(M, 1)
            _epilogue(xp, blk, None if Zr is None else Zr[n0:n1], activation)
    else:
        # small planes: columns (C*K, n*L) for one wide GEMM, transposed back to NCHW
        perm = (1,) + tuple(range(2, 2 + nd)) + (0,) + tuple(range(2 + nd, 2 + 2 * nd))
        Bc = None if B is None else B.reshape(M, 1)
        for n0 in range(0, N, nb):
            n1 = min(N, n0 + nb)
            v = view[n0:n1].transpose(perm)  # (C, *K, n, *O)
            cols = scratch(xp, v.shape, X.dtype)
            cols[...] = v
            cols = cols.reshape(group, CK, (n1 - n0) * L)
            if group == 1:
                Y = xp.matmul(Wr[0], cols[0])
            else:
                Y = xp.matmul(Wr, cols)
            Y = Y.reshape(M, n1 - n0, L).transpose(1, 0, 2)
            if Bc is not None:
                xp.add(Y, Bc, out=out[n0:n1])
            else:
                out[n0:n1] = Y
            _epilogue(xp, out[n0:n1], None if Zr is None else Zr[n0:n1], activation)
    return out.reshape(out_shape)


def _conv_full(xp, X, W, B, auto_pad, dilations, group, kernel_shape, pads, strides, Z=None,
               activation=""):
    nd = X.ndim - 2
    strides, dilations = spatial_attrs(nd, strides, dilations)
    K = list(kernel_shape) if kernel_shape else list(W.shape[2:])
    out_sp, pb, pe = conv_geometry(X.shape[2:], K, strides, dilations, pads, auto_pad)
    out_dtype = X.dtype
    cdt = acc_dtype(xp, out_dtype)
    Xc = X.astype(cdt, copy=False)
    Wc = W.astype(cdt, copy=False)
    Bc = None if B is None else B.astype(cdt, copy=False)
    Zc = None if Z is None else Z.astype(cdt, copy=False)
    Y = _conv_core(xp, Xc, Wc, Bc, strides, dilations, pb, pe, group, out_sp, Zc, activation)
    return Y.astype(out_dtype, copy=False)


# --------------------------------------------------------------------------- Conv


@kernel("Conv", since=(1, 11, 22))
def Conv(xp, X, W, B=None, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None,
         pads=None, strides=None):
    return (_conv_full(xp, X, W, B, auto_pad, dilations, group, kernel_shape, pads, strides),)


@kernel("FusedConv", since=1, domain=FUSED_DOMAIN)
def FusedConv(xp, X, W, B=None, Z=None, activation="", activation_params=None, auto_pad="NOTSET",
              dilations=None, group=1, kernel_shape=None, pads=None, strides=None):
    """Internal op of the fusion passes (placement/fusions/):
    ``activation(Conv(X, W, B) + Z)``, Z (optional) of the output's shape, the activation
    (kernels.fused.ACTIVATIONS) applied in place on each block of the GEMM output."""
    act = (activation, activation_params) if activation else ""
    return (_conv_full(xp, X, W, B, auto_pad, dilations, group, kernel_shape, pads, strides,
                       Z, act),)


# --------------------------------------------------------------------------- integer / quantised


def _int_conv(xp, x, w, x_zero_point, w_zero_point, auto_pad, dilations, group, kernel_shape,
              pads, strides):
    """(x - xzp) conv (w - wzp) exactly, as float64 (exact for 8/16-bit operands)."""
    X = x.astype(np.float64)
    if x_zero_point is not None:
        X = X - x_zero_point.astype(np.float64).reshape(())
    Wf = w.astype(np.float64)
    if w_zero_point is not None:
        wz = w_zero_point.astype(np.float64)
        if wz.ndim == 1 and wz.shape[0] == w.shape[0] and wz.shape[0] != 1:
            wz = wz.reshape((-1,) + (1,) * (w.ndim - 1))
        else:
            wz = wz.reshape(())
        Wf = Wf - wz
    nd = X.ndim - 2
    strides, dilations = spatial_attrs(nd, strides, dilations)
    K = list(kernel_shape) if kernel_shape else list(w.shape[2:])
    out_sp, pb, pe = conv_geometry(X.shape[2:], K, strides, dilations, pads, auto_pad)
    return _conv_core(xp, X, Wf, None, strides, dilations, pb, pe, group, out_sp)


@kernel("ConvInteger", since=10)
def ConvInteger(xp, x, w, x_zero_point=None, w_zero_point=None, auto_pad="NOTSET", dilations=None,
                group=1, kernel_shape=None, pads=None, strides=None):
    Y = _int_conv(xp, x, w, x_zero_point, w_zero_point, auto_pad, dilations, group, kernel_shape,
                  pads, strides)
    return (xp.rint(Y).astype(np.int32),)


@kernel("QLinearConv", since=10)
def QLinearConv(xp, x, x_scale, x_zero_point, w, w_scale, w_zero_point, y_scale, y_zero_point,
                B=None, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None, pads=None,
                strides=None):
    acc = _int_conv(xp, x, w, x_zero_point, w_zero_point, auto_pad, dilations, group,
                    kernel_shape, pads, strides)
    nd = x.ndim - 2
    if B is not None:
        acc = acc + B.astype(np.float64).reshape((-1,) + (1,) * nd)
    ws = w_scale.reshape((-1,) + (1,) * nd) if w_scale.size > 1 else w_scale.reshape(())
    # the requantisation multiplier in the scales' own dtype (as the reference does)
    mult = x_scale.reshape(()) * ws / y_scale.reshape(())
    R = acc * mult.astype(np.float64)
    out_dt = np.dtype(y_zero_point.dtype if y_zero_point is not None else x.dtype)
    if y_zero_point is not None:
        R = R + y_zero_point.astype(np.float64).reshape(())
    info = np.iinfo(out_dt)
    return (xp.clip(xp.rint(R), info.min, info.max).astype(out_dt),)


# --------------------------------------------------------------------------- ConvTranspose


def _col2im(xp, cols, in_sp, strides, dilations, full_sp, offset):
    """Scatter-add cols (N, M, *K, *I) into a zero buffer (N, M, *full_sp): tap k of
    input position i lands at offset + i*stride + k*dilation. One strided add per tap."""
    N, M = cols.shape[:2]
    nd = len(in_sp)
    K = cols.shape[2: 2 + nd]
    buf = xp.zeros((N, M) + tuple(full_sp), dtype=cols.dtype)
    for koff in itertools.product(*[range(k) for k in K]):
        sl = []
        for i in range(nd):
            start = offset[i] + koff[i] * dilations[i]
            sl.append(slice(start, start + (in_sp[i] - 1) * strides[i] + 1, strides[i]))
        lead = (slice(None), slice(None))
        buf[lead + tuple(sl)] += cols[lead + tuple(koff)]
    return buf


@kernel("ConvTranspose", since=(1, 11, 22))
def ConvTranspose(xp, X, W, B=None, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None,
                  output_padding=None, output_shape=None, pads=None, strides=None):
    N, C = X.shape[:2]
    in_sp = list(X.shape[2:])
    nd = len(in_sp)
    strides, dilations = spatial_attrs(nd, strides, dilations)
    K = list(W.shape[2:])
    out_pad = list(output_padding) if output_padding else [0] * nd
    eff = [(k - 1) * d + 1 for k, d in zip(K, dilations)]
    full = [s * (i - 1) + e + op for s, i, e, op in zip(strides, in_sp, eff, out_pad)]
    if output_shape:
        out_sp = list(output_shape)[-nd:]
    elif auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        out_sp = [i * s for i, s in zip(in_sp, strides)]
    else:
        out_sp = None
    if out_sp is not None:
        total = [f - o for f, o in zip(full, out_sp)]
        if auto_pad == "SAME_UPPER":
            pb = [t // 2 for t in total]
        else:
            pb = [t - t // 2 for t in total]
    else:
        p = list(pads) if pads else [0] * (2 * nd)
        pb, pe = p[:nd], p[nd:]
        out_sp = [f - b - e for f, b, e in zip(full, pb, pe)]

    out_dtype = X.dtype
    cdt = acc_dtype(xp, out_dtype)
    Xc = X if X.dtype == cdt else X.astype(cdt)
    Wc = W if W.dtype == cdt else W.astype(cdt)
    Cg = C // group
    Mg = W.shape[1]
    M = Mg * group
    kprod = math.prod(K)
    iprod = math.prod(in_sp)
    Xr = Xc.reshape(N, group, Cg, iprod)
    WrT = Wc.reshape(group, Cg, Mg * kprod).transpose(0, 2, 1)
    cols = xp.matmul(WrT, Xr)  # (N, g, Mg*K, I)
    cols = cols.reshape((N, M) + tuple(K) + tuple(in_sp))
    # buffer index range covers both the scattered taps [0, full) and the output window
    lo = [min(0, b) for b in pb]
    hi = [max(f, b + o) for f, b, o in zip(full, pb, out_sp)]
    size = [h - l for h, l in zip(hi, lo)]
    buf = _col2im(xp, cols, in_sp, strides, dilations, size, [-l for l in lo])
    crop = tuple(slice(b - l, b - l + o) for b, l, o in zip(pb, lo, out_sp))
    Y = buf[(slice(None), slice(None)) + crop]
    if B is not None:
        Y = Y + B.astype(cdt).reshape((-1,) + (1,) * nd)
    else:
        Y = xp.ascontiguousarray(Y)
    return (Y.astype(out_dtype, copy=False),)


# --------------------------------------------------------------------------- Col2Im


@kernel("Col2Im", since=18, host_inputs=(1, 2))
def Col2Im(xp, input, image_shape, block_shape, dilations=None, pads=None, strides=None):
    img = host_ints(image_shape)
    K = host_ints(block_shape)
    nd = len(img)
    strides, dilations = spatial_attrs(nd, strides, dilations)
    p = list(pads) if pads else [0] * (2 * nd)
    pb, pe = p[:nd], p[nd:]
    N = input.shape[0]
    kprod = math.prod(K)
    C = input.shape[1] // kprod
    eff = [(k - 1) * d + 1 for k, d in zip(K, dilations)]
    blocks = [(i + b + e - f) // s + 1 for i, b, e, f, s in zip(img, pb, pe, eff, strides)]
    cols = input.reshape((N, C) + tuple(K) + tuple(blocks))
    full = [i + b + e for i, b, e in zip(img, pb, pe)]
    full = [max(f, (bl - 1) * s + ef) for f, bl, s, ef in zip(full, blocks, strides, eff)]
    buf = _col2im(xp, cols, blocks, strides, dilations, full, [0] * nd)
    Y = buf[(slice(None), slice(None)) + tuple(slice(b, b + i) for b, i in zip(pb, img))]
    return (xp.ascontiguousarray(Y),)


# --------------------------------------------------------------------------- DeformConv


@kernel("DeformConv", since=(19, 22))
def DeformConv(xp, X, W, offset, B=None, mask=None, dilations=None, group=1, kernel_shape=None,
               offset_group=1, pads=None, strides=None):
    if X.ndim != 4:
        raise NotImplementedError(f"DeformConv supports 2D inputs only, got shape {X.shape}")
    N, C, H, Wd = X.shape
    M = W.shape[0]
    kh, kw = (list(kernel_shape) if kernel_shape else list(W.shape[2:]))
    strides, dilations = spatial_attrs(2, strides, dilations)
    p = list(pads) if pads else [0, 0, 0, 0]
    OH, OW = offset.shape[2:]
    og = offset_group or 1
    group = group or 1
    cdt = acc_dtype(xp, X.dtype)
    Xc = X.astype(cdt, copy=False)
    off = offset.astype(cdt, copy=False).reshape(N, og, kh, kw, 2, OH, OW)
    base_h = (xp.arange(OH, dtype=cdt) * strides[0] - p[0]).reshape(1, 1, 1, 1, OH, 1) + \
        (xp.arange(kh, dtype=cdt) * dilations[0]).reshape(1, 1, kh, 1, 1, 1)
    base_w = (xp.arange(OW, dtype=cdt) * strides[1] - p[1]).reshape(1, 1, 1, 1, 1, OW) + \
        (xp.arange(kw, dtype=cdt) * dilations[1]).reshape(1, 1, 1, kw, 1, 1)
    ph = base_h + off[:, :, :, :, 0]  # (N, og, kh, kw, OH, OW)
    pw = base_w + off[:, :, :, :, 1]
    h0 = xp.floor(ph)
    w0 = xp.floor(pw)
    lh = ph - h0
    lw = pw - w0
    h0 = h0.astype(np.int64)
    w0 = w0.astype(np.int64)
    P = kh * kw * OH * OW
    Xg = Xc.reshape(N, og, C // og, H * Wd)
    cols = None
    for dh_, dw_ in ((0, 0), (0, 1), (1, 0), (1, 1)):
        hh = h0 + dh_
        ww = w0 + dw_
        wt = (lh if dh_ else 1 - lh) * (lw if dw_ else 1 - lw)
        valid = (hh >= 0) & (hh < H) & (ww >= 0) & (ww < Wd)
        idx = xp.clip(hh, 0, H - 1) * Wd + xp.clip(ww, 0, Wd - 1)
        wt = xp.where(valid, wt, 0).astype(cdt, copy=False)
        idx = xp.broadcast_to(idx.reshape(N, og, 1, P), (N, og, C // og, P))
        vals = xp.take_along_axis(Xg, idx, axis=-1)  # (N, og, C/og, P)
        term = vals * wt.reshape(N, og, 1, P)
        cols = term if cols is None else cols + term
    if mask is not None:
        cols = cols * mask.astype(cdt, copy=False).reshape(N, og, 1, P)
    Cg = C // group
    Mg = M // group
    cols = cols.reshape(N, group, Cg * kh * kw, OH * OW)
    Wr = W.astype(cdt, copy=False).reshape(group, Mg, Cg * kh * kw)
    Y = xp.matmul(Wr, cols).reshape(N, M, OH, OW)
    if B is not None:
        Y = Y + B.astype(cdt, copy=False).reshape(-1, 1, 1)
    return (Y.astype(X.dtype, copy=False),)


# --------------------------------------------------------------------------- CausalConvWithState


@kernel("CausalConvWithState", since=27)
def CausalConvWithState(xp, input, weight, bias=None, past_state=None, activation="none"):
    if activation not in ("none", "silu", "swish"):
        raise ValueError(f"CausalConvWithState: unsupported activation {activation!r}")
    Nb, C, L = input.shape
    k = weight.shape[2]
    dt = input.dtype
    cdt = acc_dtype(xp, dt)
    if past_state is None:
        pad = xp.zeros((Nb, C, k - 1), dtype=dt)
    else:
        pad = past_state.astype(dt, copy=False)
    padded = xp.concatenate([pad, input], axis=2)
    pc = padded.astype(cdt, copy=False)
    wc = weight.astype(cdt, copy=False).reshape(C, k)
    out = None
    for j in range(k):
        term = pc[:, :, j:j + L] * wc[:, j].reshape(1, C, 1)
        out = term if out is None else out + term
    if bias is not None:
        out = out + bias.astype(cdt, copy=False).reshape(1, C, 1)
    if activation in ("silu", "swish"):
        o32 = out.astype(np.float32) if out.dtype != np.float64 else out
        out = o32 / (1 + xp.exp(-o32))
    present = xp.ascontiguousarray(padded[:, :, padded.shape[2] - (k - 1):])
    return (out.astype(dt, copy=False), present)
