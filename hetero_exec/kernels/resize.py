"""Resampling kernels: Resize and Upsample (GridSample, AffineGrid and RoiAlign, which
sample at computed points rather than on a separable plan: grid_sample.py).

Resize is separable: each resized axis gets a small host-side plan (source indices and
weights per output position, shape (out, taps)) and the device work is one gather plus
a weighted sum per tap along that axis.
"""

from __future__ import annotations

import math

import numpy as np

from hetero_exec.kernels._common import host_ints, norm_axes
from hetero_exec.kernels._tensor_common import host_floats, to_host
from hetero_exec.kernels.registry import kernel

# --------------------------------------------------------------------------- Resize planning


def _source_coords(ctm: str, out_len: int, in_len: int, scale: float,
                   roi) -> tuple[np.ndarray, np.ndarray | None]:
    """Source coordinate of every output index along one axis (float64), plus the
    extrapolation mask for tf_crop_and_resize."""
    y = np.arange(out_len, dtype=np.float64)
    out_w = scale * in_len
    extrap = None
    if ctm == "half_pixel":
        x = (y + 0.5) / scale - 0.5
    elif ctm == "asymmetric":
        x = y / scale
    elif ctm == "align_corners":
        x = np.zeros(out_len) if out_w == 1 else y * (in_len - 1) / (out_w - 1)
    elif ctm == "pytorch_half_pixel":
        x = np.full(out_len, -0.5) if out_w == 1 else (y + 0.5) / scale - 0.5
    elif ctm == "half_pixel_symmetric":
        adjustment = out_len / out_w
        offset = in_len / 2 * (1 - adjustment)
        x = offset + (y + 0.5) / scale - 0.5
    elif ctm == "tf_half_pixel_for_nn":
        x = (y + 0.5) / scale
    elif ctm == "tf_crop_and_resize":
        r0, r1 = roi
        if out_w == 1:
            x = np.full(out_len, (r1 - r0) * (in_len - 1) / 2)
        else:
            x = y * (r1 - r0) * (in_len - 1) / (out_w - 1)
        x = x + r0 * (in_len - 1)
        extrap = (x < 0) | (x > in_len - 1)
    else:
        raise ValueError(f"Resize: unknown coordinate_transformation_mode {ctm!r}")
    return x, extrap


def _nearest_index(x: np.ndarray, mode: str, scale: float) -> np.ndarray:
    if mode == "round_prefer_floor":
        i = np.ceil(x - 0.5)
    elif mode == "round_prefer_ceil":
        i = np.floor(x + 0.5)
    elif mode == "floor":
        i = np.floor(x)
    elif mode == "ceil":
        i = np.ceil(x)
    elif mode == "simple":  # Resize-10 / Upsample: ceil when downsampling, else truncate
        i = np.ceil(x) if scale < 1 else np.floor(x)
    else:
        raise ValueError(f"Resize: unknown nearest_mode {mode!r}")
    return i.astype(np.int64)


def _cubic_weight(x: np.ndarray, a: float) -> np.ndarray:
    x = np.abs(x)
    x2 = x * x
    x3 = x2 * x
    near = (a + 2) * x3 - (a + 3) * x2 + 1
    far = a * x3 - 5 * a * x2 + 8 * a * x - 4 * a
    return np.where(x <= 1, near, np.where(x < 2, far, 0.0))


def _tap_coeffs(mode: str, ratio: np.ndarray, scale: float, a: float,
                antialias: bool) -> np.ndarray:
    """(out, taps) weights for ``ratio`` in (0, 1] (the onnx reference's convention)."""
    r = ratio[:, None]
    if mode == "linear":
        if not antialias:
            return np.concatenate([1 - r, r], axis=1)
        s = min(scale, 1.0)
        start = int(np.floor(-1 / s) + 1)
        taps = np.arange(start, start + 2 - 2 * start)
        c = np.clip(1 - np.abs((taps[None, :] - r) * s), 0, 1)
        return c / c.sum(axis=1, keepdims=True)
    # cubic
    if not antialias:
        return np.concatenate([
            ((a * (r + 1) - 5 * a) * (r + 1) + 8 * a) * (r + 1) - 4 * a,
            ((a + 2) * r - (a + 3)) * r * r + 1,
            ((a + 2) * (1 - r) - (a + 3)) * (1 - r) * (1 - r) + 1,
            ((a * (2 - r) - 5 * a) * (2 - r) + 8 * a) * (2 - r) - 4 * a,
        ], axis=1)
    s = min(scale, 1.0)
    i_start = int(np.floor(-2 / s) + 1)
    taps = np.arange(i_start, 2 - i_start)
    c = _cubic_weight(s * (taps[None, :] - r), a)
    return c / c.sum(axis=1, keepdims=True)


def _axis_plan(mode, ctm, nearest_mode, a, exclude_outside, antialias, in_len, out_len, scale, roi):
    """Source indices (out, taps) clamped into the input, their weights (None for nearest:
    one tap) and the tf_crop_and_resize extrapolation mask (or None)."""
    x, extrap = _source_coords(ctm, out_len, in_len, scale, roi)
    if mode == "nearest":
        idx = _nearest_index(x, nearest_mode, scale)[:, None]
        coeffs = None
        if exclude_outside:  # an outside pick gets weight 0 (the reference's reading)
            coeffs = ((idx >= 0) & (idx < in_len)).astype(np.float64)
        return np.clip(idx, 0, in_len - 1), coeffs, extrap
    x0 = np.floor(x)
    ratio = np.where(x == x0, 1.0, x - x0)  # prefer the left pixel at integer positions
    coeffs = _tap_coeffs(mode, ratio, scale, a, antialias)
    # taps are always an even count centred on x: start one left of floor(x) + 1 - n/2,
    # or at x - n/2 when x is an integer (ratio 1 puts the weight on the right-middle tap)
    n = coeffs.shape[1]
    start = x0.astype(np.int64) - n // 2 + (x != x0)
    idx = start[:, None] + np.arange(n)[None, :]
    if exclude_outside:
        coeffs = np.where((idx < 0) | (idx >= in_len), 0.0, coeffs)
        s = coeffs.sum(axis=1, keepdims=True)
        coeffs = coeffs / np.where(s == 0, 1.0, s)
    return np.clip(idx, 0, in_len - 1), coeffs, extrap


def _compute_dtype(dtype) -> np.dtype:
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


def _apply_axis(xp, data, axis, idx, coeffs, extrap, extrapolation_value, cdt):
    bshape = [1] * data.ndim
    bshape[axis] = idx.shape[0]
    if coeffs is None:
        out = xp.take(data, xp.asarray(idx[:, 0]), axis=axis)
    else:
        if data.dtype != cdt:
            data = data.astype(cdt)
        out = None
        for j in range(idx.shape[1]):
            w = xp.asarray(coeffs[:, j].astype(cdt).reshape(bshape))
            t = xp.take(data, xp.asarray(idx[:, j]), axis=axis)
            t *= w
            if out is None:
                out = t
            else:
                out += t
    if extrap is not None and extrap.any():
        fill = xp.asarray(np.asarray(extrapolation_value).astype(out.dtype))
        out = xp.where(xp.asarray(extrap.reshape(bshape)), fill, out)
    return out


def _cast_back(xp, y, dtype):
    if y.dtype == dtype:
        return y
    if np.dtype(dtype).kind in "iu":
        info = np.iinfo(dtype)
        return xp.clip(xp.rint(y), info.min, info.max).astype(dtype)
    return y.astype(dtype)


def _resize(xp, X, *, full_scales, out_shape, roi, mode, ctm, nearest_mode, a, exclude_outside,
            antialias, extrapolation_value):
    rank = X.ndim
    cdt = _compute_dtype(X.dtype)
    y = X
    # Axes are separable and commute: shrink first, then grow the innermost axis (the
    # costly element-wise gather) while the array is smallest, then the outer ones.
    def cost_order(ax):
        ratio = out_shape[ax] / X.shape[ax] if X.shape[ax] else 1.0
        return (0, ratio, 0) if ratio < 1 else (1, 0, -ax)

    for ax in sorted(range(rank), key=cost_order):
        in_len = X.shape[ax]
        out_len = int(out_shape[ax])
        scale = float(full_scales[ax])
        axis_roi = None if roi is None else (roi[ax], roi[ax + rank])
        if math.isclose(scale, 1.0) and out_len == in_len and (
                ctm != "tf_crop_and_resize" or axis_roi is None
                or (math.isclose(axis_roi[0], 0.0) and math.isclose(axis_roi[1], 1.0))):
            continue
        if out_len == 0:
            shape = list(y.shape)
            shape[ax] = 0
            y = xp.empty(shape, dtype=cdt if mode != "nearest" else X.dtype)
            continue
        idx, coeffs, extrap = _axis_plan(mode, ctm, nearest_mode, a, exclude_outside, antialias,
                                         in_len, out_len, scale, axis_roi)
        y = _apply_axis(xp, y, ax, idx, coeffs, extrap, extrapolation_value, cdt)
    return _cast_back(xp, y, X.dtype)


def _norm_mode(mode: str) -> str:
    return {"bilinear": "linear", "trilinear": "linear", "bicubic": "cubic"}.get(mode, mode)


@kernel("Resize", since=(11, 13, 18, 19), host_inputs=(1, 2, 3))
def Resize(xp, X, roi=None, scales=None, sizes=None, mode="nearest",
           coordinate_transformation_mode="half_pixel", nearest_mode="round_prefer_floor",
           cubic_coeff_a=-0.75, exclude_outside=0, extrapolation_value=0.0, antialias=0,
           axes=None, keep_aspect_ratio_policy="stretch"):
    rank = X.ndim
    shape = X.shape
    mode = _norm_mode(mode)
    sc = host_floats(scales)
    sz = host_ints(sizes)
    # roi stays in its own dtype: the reference's coordinate arithmetic (float32 roi
    # differences) decides where exact-.5 nearest picks fall
    rf = list(to_host(roi).reshape(-1)) if roi is not None else []
    ax = list(norm_axes(axes, rank)) if axes is not None else list(range(rank))
    if rf and axes is not None:
        full = [0.0] * rank + [1.0] * rank
        for i, d in enumerate(ax):
            full[d] = rf[i]
            full[rank + d] = rf[len(ax) + i]
        rf = full
    if sz:
        full_sizes = list(shape)
        for i, d in enumerate(ax):
            full_sizes[d] = sz[i]
        full_scales = [full_sizes[i] / shape[i] if shape[i] else 1.0 for i in range(rank)]
        if keep_aspect_ratio_policy != "stretch":
            pick = min if keep_aspect_ratio_policy == "not_larger" else max
            s = pick(full_scales[d] for d in ax)
            full_scales = [s if i in ax else 1.0 for i in range(rank)]
            full_sizes = [int(s * shape[i] + 0.5) if i in ax else shape[i] for i in range(rank)]
        out_shape = full_sizes
    elif sc:
        full_scales = [1.0] * rank
        for i, d in enumerate(ax):
            full_scales[d] = sc[i]
        out_shape = [int(s * d) for s, d in zip(full_scales, shape)]
    else:
        raise ValueError("Resize: one of scales and sizes is required")
    return (_resize(xp, X, full_scales=full_scales, out_shape=out_shape, roi=rf or None, mode=mode,
                    ctm=coordinate_transformation_mode, nearest_mode=nearest_mode, a=cubic_coeff_a,
                    exclude_outside=exclude_outside, antialias=bool(antialias),
                    extrapolation_value=extrapolation_value),)


def _resize_v10(xp, X, scales, mode):
    mode = _norm_mode(mode)
    out_shape = [int(s * d) for s, d in zip(scales, X.shape)]
    return _resize(xp, X, full_scales=scales, out_shape=out_shape, roi=None, mode=mode,
                   ctm="asymmetric", nearest_mode="simple", a=-0.75, exclude_outside=0,
                   antialias=False, extrapolation_value=0.0)


@kernel("Resize", since=10, host_inputs=(1,))
def Resize_10(xp, X, scales, mode="nearest"):
    return (_resize_v10(xp, X, host_floats(scales), mode),)


@kernel("Upsample", since=(1, 7, 9), host_inputs=(1,))
def Upsample(xp, X, scales=None, mode="nearest", height_scale=None, width_scale=None):
    if scales is None:  # Upsample-1: NCHW with height/width scales
        sc = [1.0] * (X.ndim - 2) + [float(height_scale), float(width_scale)]
    else:
        sc = host_floats(scales)
    if mode == "nearest" and all(float(s).is_integer() for s in sc):  # plain repetition
        y = X
        for axis, s in enumerate(sc):
            if s != 1:
                y = xp.repeat(y, int(s), axis=axis)
        return (y,)
    return (_resize_v10(xp, X, sc, mode),)
