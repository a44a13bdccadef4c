"""Convolutions: Conv, FusedConv, ConvTranspose, ConvInteger, QLinearConv, DeformConv,
Col2Im, CausalConvWithState, registered in the kernel table.

Conv and FusedConv choose their path per node at compile time (`_specialize`, from
_conv_path.py's `choose_path`); the paths' algorithms are _conv_numpy.py's (numpy and
other array modules: the definitions) and _conv_native.py's (the C library).
"""

from __future__ import annotations

import itertools
import math
from typing import Sequence

import numpy as np

from hetero_exec.kernels import _int_gemm
from hetero_exec.kernels._common import host_ints
from hetero_exec.kernels._conv_path import (
    conv_core,
    conv_full,
    pads_zero,
    path_for,
)
from hetero_exec.kernels._nn_common import (
    acc_dtype,
    conv_geometry,
    spatial_attrs,
)
from hetero_exec.kernels.fused import FUSED_DOMAIN, epilogue_activation
from hetero_exec.kernels.registry import KnownInput, kernel


def _specialize(op: str):
    """The compile-time hook of Conv / FusedConv: the node's path from its attributes and
    weight shape, held (with its weight-derived caches) by the function returned."""

    def hook(xp, kwargs: dict, inputs: Sequence[KnownInput]):
        w = inputs[1] if len(inputs) > 1 else KnownInput()
        if w.shape is None or not all(isinstance(d, int) for d in w.shape):
            return None  # the weight's shape decides the path: choose at run time
        path = path_for(xp, w.shape, kwargs.get("group", 1),
                        pads_zero(kwargs.get("auto_pad", "NOTSET"), kwargs.get("pads")))
        from hetero_exec.kernels._conv_bound import BoundCalls

        if op == "Conv":
            bound = BoundCalls(path, "")

            def conv(xp, X, W, B=None, **attrs):
                if xp is np:
                    call = bound.get(X, W, B, None, attrs)
                    if call is not None:
                        return (call(X, None),)
                return (conv_full(xp, X, W, B, path=path, **attrs),)
        else:
            act = epilogue_activation(kwargs.get("activation", ""), kwargs.get("activation_params"))
            bound = BoundCalls(path, act)

            def conv(xp, X, W, B=None, Z=None, activation="", activation_params=None, **attrs):
                if xp is np:
                    call = bound.get(X, W, B, Z, attrs)
                    if call is not None:
                        return (call(X, Z),)
                return (conv_full(xp, X, W, B, Z=Z, path=path, activation=act, **attrs),)
        conv.__name__ = f"{op}_{path.kind}"
        conv.path = path
        return conv

    return hook


@kernel("Conv", since=(1, 11, 22), specialize=_specialize("Conv"))
def Conv(xp, X, W, B=None, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None,
         pads=None, strides=None):
    return (conv_full(xp, X, W, B, auto_pad, dilations, group, kernel_shape, pads, strides),)


@kernel("FusedConv", since=1, domain=FUSED_DOMAIN, specialize=_specialize("FusedConv"))
def FusedConv(xp, X, W, B=None, Z=None, activation="", activation_params=None, auto_pad="NOTSET",
              dilations=None, group=1, kernel_shape=None, pads=None, strides=None):
    """Internal op of the fusion passes (placement/fusions/):
    ``activation(Conv(X, W, B) + Z)``, Z (optional) of the output's shape, the activation
    (kernels.fused.ACTIVATIONS, with its ``activation_params``) applied in place on the
    conv output."""
    return (conv_full(xp, X, W, B, auto_pad, dilations, group, kernel_shape, pads, strides,
                      Z, epilogue_activation(activation, activation_params)),)


def _int_conv(xp, x, w, x_zero_point, w_zero_point, auto_pad, dilations, group, kernel_shape,
              pads, strides):
    """(x - xzp) conv (w - wzp) exactly, as int32: float32 convolutions whose reductions
    stay under 2**24 (kernels/_int_gemm.py), over chunks of input channels when one
    output's reduction is longer; float64 only for a grouped conv that long."""
    X = _int_gemm.centered(xp, x, None if x_zero_point is None else x_zero_point.reshape(()),
                           -1)
    Wf = w.astype(np.float32)
    if w_zero_point is not None:
        wz = w_zero_point.astype(np.float32)
        if wz.ndim == 1 and wz.shape[0] == w.shape[0] and wz.shape[0] != 1:
            wz = wz.reshape((-1,) + (1,) * (w.ndim - 1))
        else:
            wz = wz.reshape(())
        Wf = Wf - wz
    nd = X.ndim - 2
    strides, dilations = spatial_attrs(nd, strides, dilations)
    K = list(kernel_shape) if kernel_shape else list(w.shape[2:])
    out_sp, pb, pe = conv_geometry(X.shape[2:], K, strides, dilations, pads, auto_pad)
    taps = math.prod(K)
    chunk = _int_gemm.chunk_for(_int_gemm.span(x.dtype), _int_gemm.span(w.dtype))
    if w.shape[1] * taps <= chunk:
        return conv_core(xp, X, Wf, None, strides, dilations, pb, pe, group,
                         out_sp).astype(np.int32)
    channels = chunk // taps
    if group != 1 or channels < 1:
        Y = conv_core(xp, X.astype(np.float64), Wf.astype(np.float64), None, strides,
                      dilations, pb, pe, group, out_sp)
        return xp.rint(Y).astype(np.int32)
    acc = None
    for c0 in range(0, w.shape[1], channels):
        part = conv_core(xp, xp.ascontiguousarray(X[:, c0:c0 + channels]),
                         xp.ascontiguousarray(Wf[:, c0:c0 + channels]), None, strides,
                         dilations, pb, pe, 1, out_sp).astype(np.int32)
        if acc is None:
            acc = part
        else:
            acc += part
    return acc


@kernel("ConvInteger", since=10)
def ConvInteger(xp, x, w, x_zero_point=None, w_zero_point=None, auto_pad="NOTSET", dilations=None,
                group=1, kernel_shape=None, pads=None, strides=None):
    return (_int_conv(xp, x, w, x_zero_point, w_zero_point, auto_pad, dilations, group,
                      kernel_shape, pads, strides),)


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


@kernel("CausalConvWithState", since=27)
def CausalConvWithState(xp, input, weight, bias=None, past_state=None, activation="none"):
    if activation not in ("none", "silu", "swish"):
        raise ValueError(f"CausalConvWithState: unsupported activation {activation!r}")
    Nb, C, L = input.shape
    k = weight.shape[2]
    dt = input.dtype
    # the taps are element-wise sums, which no BLAS accumulates wider: float32 on every xp
    cdt = np.dtype(np.float32) if dt == np.float16 else acc_dtype(xp, dt)
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
