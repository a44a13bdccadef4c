"""Sampling at computed points: GridSample (a grid of normalized coordinates per output
pixel), AffineGrid (the grid an affine transform makes) and RoiAlign (bilinear samples
in the bins of each region of interest). Resize, whose plan is separable per axis, is
resize.py.
"""

from __future__ import annotations

import math

import numpy as np

from hetero_exec.kernels._common import host_ints
from hetero_exec.kernels.registry import kernel
from hetero_exec.kernels.resize import _compute_dtype, _norm_mode

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
