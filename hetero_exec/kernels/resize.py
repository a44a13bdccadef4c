"""Resampling kernels: Resize, Upsample, GridSample, AffineGrid, RoiAlign.

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


# --------------------------------------------------------------------------- GridSample


def _gs_denormalize(n, length: int, align_corners: bool):
    if align_corners:
        return (n + 1) / 2 * (length - 1)
    return ((n + 1) * length - 1) / 2


def _gs_reflect(xp, x, lo: float, hi: float):
    rng = hi - lo
    if rng <= 0:
        return xp.full_like(x, lo)
    below = x < lo
    above = x > hi
    d = xp.where(below, lo - x, x - hi)
    n = xp.trunc(d / rng)
    r = d - n * rng
    even = (n % 2) == 0
    from_below = xp.where(even, lo + r, hi - r)
    from_above = xp.where(even, hi - r, lo + r)
    return xp.where(below, from_below, xp.where(above, from_above, x))


def _gs_cubic_coeffs(xp, t):
    a = -0.75
    t1 = t + 1
    u = 1 - t
    u1 = 2 - t
    return [
        ((a * t1 - 5 * a) * t1 + 8 * a) * t1 - 4 * a,
        ((a + 2) * t - (a + 3)) * t * t + 1,
        ((a + 2) * u - (a + 3)) * u * u + 1,
        ((a * u1 - 5 * a) * u1 + 8 * a) * u1 - 4 * a,
    ]


@kernel("GridSample", since=(16, 20))
def GridSample(xp, X, grid, align_corners=0, mode="linear", padding_mode="zeros"):
    mode = _norm_mode(mode)
    n_batch, channels = X.shape[:2]
    dims = X.shape[2:]
    nd = len(dims)
    out_spatial = grid.shape[1:-1]
    npts = math.prod(out_spatial)
    cdt = _compute_dtype(X.dtype)
    g = grid.reshape(n_batch, npts, nd).astype(cdt, copy=False)
    ac = bool(align_corners)

    # per spatial dim (X order): candidate indices, weights, in-range masks; each (N, P)
    taps_per_dim = []
    for d in range(nd):
        length = dims[d]
        x = _gs_denormalize(g[:, :, nd - 1 - d], length, ac)
        lo, hi = (0.0, length - 1.0) if ac else (-0.5, length - 0.5)
        if mode == "nearest":
            x = xp.rint(x)
        if padding_mode == "border":
            x = xp.where((x < lo) | (x > hi), xp.clip(x, 0, length - 1), x)
        elif padding_mode == "reflection":
            x = _gs_reflect(xp, x, lo, hi)
        if mode == "nearest":
            idxs = [x.astype(np.int64)]
            weights = [None]
        else:
            x0 = xp.floor(x)
            t = x - x0
            x0 = x0.astype(np.int64)
            if mode == "linear":
                idxs = [x0, x0 + 1]
                weights = [1 - t, t]
            else:
                idxs = [x0 - 1, x0, x0 + 1, x0 + 2]
                weights = _gs_cubic_coeffs(xp, t)
        taps = []
        for i, w in zip(idxs, weights):
            if padding_mode == "zeros":
                valid = (i >= 0) & (i < length)
                i = xp.clip(i, 0, length - 1)
            else:
                if padding_mode == "reflection":
                    i = _gs_reflect(xp, i.astype(cdt), lo, hi).astype(np.int64)
                i = xp.clip(i, 0, length - 1)
                valid = None
            taps.append((i, w, valid))
        taps_per_dim.append(taps)

    # channel-last rows, so every tap is one row gather of C values per sample point
    n_in = math.prod(dims)
    rows_src = xp.ascontiguousarray(X.reshape(n_batch, channels, n_in).transpose(0, 2, 1))
    rows_src = rows_src.reshape(n_batch * n_in, channels)
    base = (xp.arange(n_batch) * n_in).reshape(-1, 1) if n_batch > 1 else None
    strides = [math.prod(dims[d + 1:]) for d in range(nd)]
    out = None
    combos = [[]]
    for taps in taps_per_dim:
        combos = [c + [t] for c in combos for t in taps]
    for combo in combos:
        lin = None
        w = None
        valid = None
        for d, (i, wd, vd) in enumerate(combo):
            term = i * strides[d] if strides[d] != 1 else i
            lin = term if lin is None else lin + term
            if wd is not None:
                w = wd if w is None else w * wd
            if vd is not None:
                valid = vd if valid is None else valid & vd
        if valid is not None:
            w = valid.astype(cdt) if w is None else xp.where(valid, w, 0)
        if base is not None:
            lin = lin + base
        vals = xp.take(rows_src, lin.reshape(-1), axis=0)  # (N * P, C)
        if w is not None:
            vals = vals.astype(cdt, copy=False)
            vals *= w.reshape(-1, 1)
        if out is None:
            out = vals
        else:
            out += vals
    out = out.reshape(n_batch, npts, channels).transpose(0, 2, 1)
    return (out.astype(X.dtype, copy=False).reshape((n_batch, channels) + tuple(out_spatial)),)


# --------------------------------------------------------------------------- AffineGrid


@kernel("AffineGrid", since=20, host_inputs=(1,))
def AffineGrid(xp, theta, size, align_corners=0):
    spatial = host_ints(size)[2:]
    n_batch = theta.shape[0]
    nd = len(spatial)
    axes_1d = []
    for length in spatial:
        if align_corners:
            a = np.linspace(-1.0, 1.0, length) if length > 1 else np.array([-1.0])
        else:
            a = (np.arange(length) * 2 + 1) / length - 1
        axes_1d.append(a)
    mesh = np.meshgrid(*axes_1d, indexing="ij")  # X-order (D, H, W)
    coords = [m.reshape(-1) for m in reversed(mesh)]  # x (W), y (H), [z (D)]
    base = np.stack(coords + [np.ones_like(coords[0])], axis=1)  # (P, nd + 1)
    base = xp.asarray(base.astype(theta.dtype))
    grid = xp.matmul(base, xp.swapaxes(theta, 1, 2))  # (N, P, nd)
    return (grid.reshape((n_batch, *spatial, nd)),)


# --------------------------------------------------------------------------- RoiAlign


def _roi_axis(xp, start, bin_size, grid, gmax: int, pooled: int, length: int, cdt):
    """Per roi, bin and sample along one spatial axis: (low, high) indices and weights
    (R, pooled, gmax); weights are zero for samples off the map or past the roi's grid."""
    p = xp.arange(pooled, dtype=cdt).reshape(1, -1, 1)
    i = xp.arange(gmax, dtype=cdt).reshape(1, 1, -1)
    g = xp.maximum(grid, 1).astype(cdt).reshape(-1, 1, 1)
    bs = bin_size.reshape(-1, 1, 1)
    c = start.reshape(-1, 1, 1) + p * bs + (i + 0.5) * bs / g
    inside = (c >= -1.0) & (c <= length) & (i < grid.reshape(-1, 1, 1))
    c = xp.maximum(c, 0)
    low = xp.floor(c).astype(np.int64)
    at_end = low >= length - 1
    low = xp.where(at_end, length - 1, low)
    high = xp.where(at_end, length - 1, low + 1)
    c = xp.where(at_end, low.astype(cdt), c)
    lfrac = c - low
    hfrac = 1 - lfrac
    zero = xp.zeros((), dtype=cdt)
    return low, high, xp.where(inside, hfrac, zero), xp.where(inside, lfrac, zero)

_ROI_CHUNK_ELEMS = 1 << 24


def _roi_avg(xp, data, b, y_plan, x_plan, grid_h, grid_w, count):
    yl, yh, wyl, wyh = y_plan
    xl, xh, wxl, wxh = x_plan
    n, ph, _ = yl.shape
    _, pw, gw = xl.shape
    channels = data.shape[1]
    # rows first: (R, PH, C, W) = sum over samples and corners of wy * X[b, :, y, :]
    bb = b.reshape(-1, 1, 1)
    rows = data[bb, :, yl, :] * wyl[..., None, None]
    rows += data[bb, :, yh, :] * wyh[..., None, None]
    rows = rows.sum(axis=2)
    # then columns, gathered along W per roi: (R, PH, C, PW, GW)
    shp = (n, ph, channels, pw * gw)
    lo = xp.take_along_axis(rows, xp.broadcast_to(xl.reshape(n, 1, 1, pw * gw), shp), axis=3)
    hi = xp.take_along_axis(rows, xp.broadcast_to(xh.reshape(n, 1, 1, pw * gw), shp), axis=3)
    lo = lo.reshape(n, ph, channels, pw, gw) * wxl.reshape(n, 1, 1, pw, gw)
    hi = hi.reshape(n, ph, channels, pw, gw) * wxh.reshape(n, 1, 1, pw, gw)
    out = (lo + hi).sum(axis=4) / count.reshape(-1, 1, 1, 1)
    return out.transpose(0, 2, 1, 3)  # (R, C, PH, PW)


def _roi_max(xp, data, b, y_plan, x_plan, grid_h, grid_w):
    """Max over samples of the largest weighted corner (onnxruntime's definition)."""
    yl, yh, wyl, wyh = y_plan
    xl, xh, wxl, wxh = x_plan
    n, ph, gh = yl.shape
    _, pw, gw = xl.shape
    bb = b.reshape(-1, 1, 1, 1, 1)
    ys = (yl.reshape(n, ph, 1, gh, 1), yh.reshape(n, ph, 1, gh, 1))
    xs = (xl.reshape(n, 1, pw, 1, gw), xh.reshape(n, 1, pw, 1, gw))
    wys = (wyl.reshape(n, ph, 1, gh, 1), wyh.reshape(n, ph, 1, gh, 1))
    wxs = (wxl.reshape(n, 1, pw, 1, gw), wxh.reshape(n, 1, pw, 1, gw))
    best = None
    for yi, wy in zip(ys, wys):
        for xi, wx in zip(xs, wxs):
            v = data[bb, :, yi, xi] * (wy * wx)[..., None]  # (R, PH, PW, GH, GW, C)
            best = v if best is None else xp.maximum(best, v)
    in_grid = ((xp.arange(gh).reshape(1, 1, 1, -1, 1) < grid_h.reshape(-1, 1, 1, 1, 1))
               & (xp.arange(gw).reshape(1, 1, 1, 1, -1) < grid_w.reshape(-1, 1, 1, 1, 1)))
    best = xp.where(in_grid[..., None], best, -xp.inf)
    out = best.max(axis=(3, 4))
    out = xp.where(xp.isinf(out) & (out < 0), 0, out)  # a roi without samples gives 0
    return out.transpose(0, 3, 1, 2)


@kernel("RoiAlign", since=(10, 16))
def RoiAlign(xp, X, rois, batch_indices, coordinate_transformation_mode=None, mode="avg",
             output_height=1, output_width=1, sampling_ratio=0, spatial_scale=1.0, *, opset=None):
    if coordinate_transformation_mode is None:
        # RoiAlign-10 had no half-pixel offset
        coordinate_transformation_mode = ("half_pixel" if (opset or 16) >= 16
                                          else "output_half_pixel")
    half_pixel = coordinate_transformation_mode == "half_pixel"
    _, channels, height, width = X.shape
    n_rois = rois.shape[0]
    ph, pw = output_height, output_width
    cdt = _compute_dtype(X.dtype)
    if n_rois == 0:
        return (xp.zeros((0, channels, ph, pw), dtype=X.dtype),)
    r = rois.astype(cdt) * cdt.type(spatial_scale) - cdt.type(0.5 if half_pixel else 0.0)
    start_w, start_h, end_w, end_h = r[:, 0], r[:, 1], r[:, 2], r[:, 3]
    roi_w = end_w - start_w
    roi_h = end_h - start_h
    if not half_pixel:
        roi_w = xp.maximum(roi_w, 1.0)
        roi_h = xp.maximum(roi_h, 1.0)
    bin_h = roi_h / ph
    bin_w = roi_w / pw
    if sampling_ratio > 0:
        grid_h = xp.full((n_rois,), sampling_ratio, dtype=np.int64)
        grid_w = grid_h
        gh_max = gw_max = int(sampling_ratio)
    else:
        grid_h = xp.ceil(roi_h / ph).astype(np.int64)
        grid_w = xp.ceil(roi_w / pw).astype(np.int64)
        gh_max = max(int(grid_h.max()), 1)  # data-dependent loop bound (one sync)
        gw_max = max(int(grid_w.max()), 1)
    count = xp.maximum(grid_h * grid_w, 1).astype(cdt)

    # (R, PH, GH) and (R, PW, GW) sample plans
    y_plan = _roi_axis(xp, start_h, bin_h, grid_h, gh_max, ph, height, cdt)
    x_plan = _roi_axis(xp, start_w, bin_w, grid_w, gw_max, pw, width, cdt)
    b = batch_indices.astype(np.int64)
    data = X.astype(cdt, copy=False)
    # bound the gathered intermediates (rois x bins x samples x channels x width) by chunking rois
    per_roi = ph * gh_max * channels * (width if mode == "avg" else pw * gw_max * 4)
    step = max(1, _ROI_CHUNK_ELEMS // max(per_roi, 1))
    outs = []
    for lo in range(0, n_rois, step):
        sl = slice(lo, min(lo + step, n_rois))
        args = (xp, data, b[sl], [a[sl] for a in y_plan], [a[sl] for a in x_plan],
                grid_h[sl], grid_w[sl])
        outs.append(_roi_avg(*args, count[sl]) if mode == "avg" else _roi_max(*args))
    out = outs[0] if len(outs) == 1 else xp.concatenate(outs, axis=0)
    return (out.astype(X.dtype, copy=False),)
