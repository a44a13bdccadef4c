"""Conv's array-module algorithms: the definitions, on numpy or CuPy, that the C
paths (_conv_native.py) are tested against. _conv_path.py chooses among them.

* `pointwise` (1x1 kernel, no padding): a plain GEMM per image over the channels, no
  im2col; a stride is one strided copy first;
* `depthwise_band` (one input channel per group, numpy): "column band" GEMMs. For each
  tile of T output columns, the K kernel rows of input it reads are copied side by side
  (K*U values, U = (T-1)*stride + (K-1)*dilation + 1), and one GEMM per channel against a
  (K*U, T) band matrix made from that channel's weights (and bias) computes the tile.
  Numpy's element-wise passes (one multiply and one add per kernel tap) run at a few
  GB/s here; the BLAS does the taps in registers, at the price of U/K times the
  arithmetic (bench/bench_conv.py measures the forms);
* `depthwise_taps` (other array modules, 3-D, channel multipliers): the sum over kernel
  taps of per-channel scaled strided slices, accumulated in place;
* `im2col` (everything else, groups included): the padded input viewed through
  ``as_strided`` as (N, C, *K, *O) windows and copied once into a reusable per-thread
  column buffer, then one batched GEMM over the group axis. Columns are laid out
  (N, C*K, O) so that ``W (M, C*K) @ cols`` writes NCHW directly; for small output
  planes (C*K, N*O) instead, for one wide GEMM;
* `shift` (the im2col nodes with stride and dilation 1, no groups, 2-D, on numpy,
  when the output plane has at least `SHIFT_MIN_PIXELS` pixels): the padded image is
  flattened, so each kernel tap's columns are one contiguous run of OH * Wp values
  (the rows of the padded width Wp; the KW - 1 extra columns per row are computed and
  cropped), copied as C long rows instead of C * OH short ones; one GEMM per image by
  the weights reordered tap-major (cached per node). ResNet's 56x56 and 28x28 3x3
  layers: 24.6 -> 17.5 ms and 14.0 -> 12.4 ms at batch 8 (bench/README.md);
* `epilogue`: the residual and the activation in place after any of them.
"""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING

import numpy as np

from hetero_exec.kernels import _threads
from hetero_exec.kernels._nn_common import (
    SCRATCH_KEEP,
    is_numpy,
    offset_slices,
    pad_spatial_scratch,
    scratch,
    window_view,
)
from hetero_exec.kernels._threads import matmul

if TYPE_CHECKING:
    from hetero_exec.kernels._conv_path import ConvPath


#: output plane size (columns per image) below which images share one wide GEMM
#: (small late-stage planes) rather than one GEMM per image
_GEMM_COLS = 1024


#: widest output tile of the depthwise column-band path (bench/bench_conv.py)
_BAND_TILE = 16


#: least output pixels per image for the ``shift`` path (below, im2col's copies are as
#: cheap and the cropped columns cost more)
SHIFT_MIN_PIXELS = 784


def pointwise(xp, X, W, B, strides, group, out_sp):
    """1x1 conv, no padding: Y (N, M, L) = W (g, Mg, Cg) @ X (N, g, Cg, L) (+ B)."""
    N, C = X.shape[:2]
    M = W.shape[0]
    L = math.prod(out_sp)
    if any(s != 1 for s in strides):  # the strided pixels, gathered in one copy
        Xs = X[(slice(None), slice(None)) + tuple(slice(None, None, s) for s in strides)]
        X = scratch(xp, Xs.shape, X.dtype, slot=1)
        X[...] = Xs
    Wr = W.reshape(group, M // group, C // group)
    # one GEMM per image even for small planes: transposing the batch into one wide GEMM
    # and back costs more than the thin GEMMs save (bench/README.md, "bench_conv.py")
    out = xp.empty((N, M, L), dtype=X.dtype)
    if group == 1:
        matmul(xp, Wr[0], X.reshape(N, C, L), out=out)
    else:
        matmul(xp, Wr, X.reshape(N, group, C // group, L),
               out=out.reshape(N, group, M // group, L))
    if B is not None:
        out += B.reshape(M, 1)
    return out.reshape((N, M) + tuple(out_sp))


def depthwise_taps(xp, X, W, B, strides, dilations, pb, pe, out_sp, group):
    """Grouped conv with one input channel per group (channel multiplier M/group): the
    sum over kernel taps of per-channel scaled strided slices, accumulated in place in
    the output with one reused product buffer (no GEMM, no array per tap)."""
    Xp = pad_spatial_scratch(xp, X, pb, pe)
    N = X.shape[0]
    M = W.shape[0]
    mult = M // group
    K = W.shape[2:]
    nd = len(K)
    Wr = W.reshape((group, mult) + (1,) * nd + (-1,))  # (g, mult, 1.., prodK)
    Y = xp.empty((N, group, mult) + tuple(out_sp), dtype=X.dtype)
    tmp = xp.empty_like(Y)
    for t, koff in enumerate(itertools.product(*[range(k) for k in K])):
        xs = Xp[(slice(None), slice(None)) + offset_slices(koff, out_sp, strides, dilations)]
        xp.multiply(xs[:, :, None], Wr[..., t], out=Y if t == 0 else tmp)
        if t:
            Y += tmp
    Y = Y.reshape((N, M) + tuple(out_sp))
    if B is not None:
        Y += B.reshape((-1,) + (1,) * nd)
    return Y


def band_tile(ow: int) -> int:
    """Output columns per tile: OW itself when narrow, else its largest divisor in
    [8, _BAND_TILE] (no partial tile), else _BAND_TILE (the last tile partly padding)."""
    if ow <= _BAND_TILE:
        return ow
    for t in range(_BAND_TILE, 7, -1):
        if ow % t == 0:
            return t
    return _BAND_TILE


def _band(xp, W, B, T: int, U: int, stride: int, dilation: int):
    """(C, KH*U [+1], T) per-channel band matrices: row i*U + t*stride + j*dilation of
    column t holds W[c, 0, i, j], so that a row of columns (K rows of U inputs) times the
    band is a tile of T outputs; the last row holds the bias (the columns end with a 1)."""
    C, _, KH, KW = W.shape
    KU = KH * U
    band = xp.zeros((C, KU + (B is not None), T), dtype=W.dtype)
    t_idx = xp.repeat(xp.arange(T), KW)
    j_idx = xp.tile(xp.arange(KW), T)
    u_idx = t_idx * stride + j_idx * dilation
    body = band[:, :KU].reshape(C, KH, U, T)
    body[:, :, u_idx, t_idx] = W[:, 0][:, :, j_idx]
    if B is not None:
        band[:, KU, :] = B.reshape(C, 1)
    return band


def depthwise_band(xp, X, W, B, strides, dilations, pb, pe, out_sp, path: ConvPath,
                   key_w, key_b):
    """Depthwise conv (channel multiplier 1, 1-D or 2-D) as column-band GEMMs."""
    if X.ndim == 3:  # 1-D: one row of height 1
        Y = depthwise_band(xp, X[:, :, None], W[:, :, None], B, [1] + list(strides),
                            [1] + list(dilations), [0] + list(pb), [0] + list(pe),
                            [1] + list(out_sp), path, key_w, key_b)
        return Y.reshape(Y.shape[:2] + (Y.shape[3],))
    N, C, H, Wd = X.shape
    KH, KW = W.shape[2:]
    (sh, sw), (dh, dw) = strides, dilations
    OH, OW = out_sp
    T = band_tile(OW)
    nT = -(-OW // T)
    U = (T - 1) * sw + (KW - 1) * dw + 1
    KU = KH * U
    # the last tile may read past the right pad: zero columns up to what it reads
    wp = max(Wd + pb[1] + pe[1], (nT * T - 1) * sw + (KW - 1) * dw + 1)
    Xp = pad_spatial_scratch(xp, X, pb, [pe[0], wp - Wd - pb[1]])
    band = path.band(xp, key_w, key_b, (T, U, sw, dw, X.dtype.str),
                     lambda: _band(xp, W, B, T, U, sw, dw))
    st = Xp.strides
    view = xp.lib.stride_tricks.as_strided(
        Xp, (C, N, OH, nT, KH, U), (st[1], st[0], sh * st[2], T * sw * st[3], dh * st[2], st[3]))
    R = N * OH * nT
    rows = band.shape[1]
    cols = scratch(xp, (C, R, rows), X.dtype)
    out = xp.empty((N, C, OH, OW), dtype=X.dtype)
    direct = N == 1 and nT * T == OW  # the GEMM writes the (1, C, OH, OW) output itself
    Y = out.reshape(C, R, T) if direct else scratch(xp, (C, R, T), X.dtype, slot=2)

    def channels(c0: int, c1: int) -> None:  # a block of channels: copy, GEMM, transpose
        cols[c0:c1, :, :KU].reshape(c1 - c0, N, OH, nT, KH, U)[...] = view[c0:c1]
        if B is not None:
            cols[c0:c1, :, KU] = 1
        xp.matmul(cols[c0:c1], band[c0:c1], out=Y[c0:c1])
        if not direct:
            out[:, c0:c1] = Y[c0:c1].reshape(c1 - c0, N, OH, nT * T)[..., :OW].transpose(1, 0, 2, 3)

    _threads.parallel_for(xp, C, channels, 2.0 * C * R * rows * T, least=8)
    return out


def _chunk(xp, N, per_image_bytes):
    """Images per im2col block: the whole batch when its columns fit the reusable
    scratch buffer (numpy) or always (cupy's pool caches device memory itself)."""
    if not is_numpy(xp):
        return N
    return max(1, min(N, SCRATCH_KEEP // max(per_image_bytes, 1)))


def im2col(xp, X, W, B, strides, dilations, pb, pe, group, out_sp):
    """The general case: im2col into a per-thread reusable buffer, then one (batched over
    groups) GEMM per block of images, the bias added on each block while it is in cache.

    Inside a run the images are split over our threads (kernels/_threads.py), each part
    copying its own columns into its own thread's buffer; a part is one block unless its
    columns outgrow that buffer."""
    N, C = X.shape[:2]
    M = W.shape[0]
    K = tuple(W.shape[2:])
    nd = len(K)
    Cg = C // group
    Mg = M // group
    kprod = math.prod(K)
    L = math.prod(out_sp)
    Xp = pad_spatial_scratch(xp, X, pb, pe)  # no copy when unpadded (1x1 convs)
    view = window_view(xp, Xp, out_sp, K, strides, dilations, kernel_first=True)  # (N, C, *K, *O)
    CK = Cg * kprod
    Wr = W.reshape(group, Mg, CK)
    out = xp.empty((N, M, L), dtype=X.dtype)
    nb = _chunk(xp, N, C * kprod * L * X.dtype.itemsize)
    wide = L < _GEMM_COLS and N > 1
    perm = (1,) + tuple(range(2, 2 + nd)) + (0,) + tuple(range(2 + nd, 2 + 2 * nd))

    def images(i0: int, i1: int) -> None:  # a block of images, in chunks that fit scratch
        for n0 in range(i0, i1, nb):
            n1 = min(i1, n0 + nb)
            if wide:
                _im2col_wide(xp, view[n0:n1].transpose(perm), Wr, B, out[n0:n1], group, CK)
            else:
                _im2col_per_image(xp, view[n0:n1], Wr, B, out[n0:n1], group, CK)

    _threads.parallel_for(xp, N, images, 2.0 * N * M * L * CK)
    return out.reshape((N, M) + tuple(out_sp))


def _im2col_per_image(xp, v, Wr, B, out, group, CK):
    """Columns (n, C*K, L) per image: the batched matmul writes NCHW directly."""
    n, L = v.shape[0], out.shape[-1]
    if v.flags.c_contiguous:  # unpadded 1x1: the images are the column matrices
        cols = v.reshape(n, group, CK, L)
    else:
        cols = scratch(xp, v.shape, v.dtype)
        cols[...] = v
        cols = cols.reshape(n, group, CK, L)
    if group == 1:
        matmul(xp, Wr[0], cols[:, 0], out=out)
    else:
        matmul(xp, Wr, cols, out=out.reshape(n, group, Wr.shape[1], L))
    if B is not None:
        out += B.reshape(-1, 1)


def _im2col_wide(xp, v, Wr, B, out, group, CK):
    """Small planes: columns (C*K, n*L) for one wide GEMM, transposed back to NCHW.
    ``v`` is the window view already permuted to (C, *K, n, *O)."""
    n, M, L = out.shape
    cols = scratch(xp, v.shape, v.dtype)
    cols[...] = v
    cols = cols.reshape(group, CK, n * L)
    Y = matmul(xp, Wr[0], cols[0]) if group == 1 else matmul(xp, Wr, cols)
    Y = Y.reshape(M, n, L).transpose(1, 0, 2)
    if B is not None:
        xp.add(Y, B.reshape(M, 1), out=out)
    else:
        out[...] = Y


def shift_fits(xp, X, W, strides, dilations, group, out_sp) -> bool:
    """Whether the ``shift`` path computes this conv (see the module docstring)."""
    return (is_numpy(xp) and group == 1 and X.ndim == 4 and all(s == 1 for s in strides)
            and all(d == 1 for d in dilations) and math.prod(out_sp) >= SHIFT_MIN_PIXELS)


def shift(xp, X, W, B, pb, pe, out_sp, path: ConvPath | None, key_w, key_b):
    """Stride-1 2-D conv by the shift form: per image, the padded plane flattened into a
    scratch row per channel, each tap's run of it copied into the columns, one GEMM, the
    crop (and bias) into the NCHW output."""
    N, C, H, Wd = X.shape
    M, _, KH, KW = W.shape
    OH, OW = out_sp
    Hp, Wp = H + pb[0] + pe[0], Wd + pb[1] + pe[1]
    L = OH * Wp  # the output on rows of the padded width, KW - 1 columns cropped per row
    taps = KH * KW

    def reorder():  # (M, C, KH, KW) -> (M, KH*KW*C): tap-major, as the columns are
        return np.ascontiguousarray(W.transpose(0, 2, 3, 1).reshape(M, taps * C))

    Wt = reorder() if path is None else path.band(
        xp, W if key_w is None else key_w, B if key_b is None else key_b, ("shift", W.shape),
        reorder)
    out = xp.empty((N, M, OH, OW), dtype=X.dtype)
    bias = None if B is None else B.reshape(M, 1, 1)

    def images(i0: int, i1: int) -> None:
        # a tap's run reads up to KW - 1 values past the padded plane: a zeroed tail
        flat = scratch(xp, (C, Hp * Wp + KW - 1), X.dtype, slot=1)
        flat[:] = 0  # the border and the tail (the inside is overwritten per image)
        plane = flat[:, :Hp * Wp].reshape(C, Hp, Wp)
        inside = plane[:, pb[0]:pb[0] + H, pb[1]:pb[1] + Wd]
        cols = scratch(xp, (taps * C, L), X.dtype, slot=0)
        Y = scratch(xp, (M, L), X.dtype, slot=2)
        for n in range(i0, i1):
            inside[...] = X[n]
            for t, (ky, kx) in enumerate(itertools.product(range(KH), range(KW))):
                off = ky * Wp + kx
                cols[t * C:(t + 1) * C] = flat[:, off:off + L]
            matmul(xp, Wt, cols, out=Y)
            crop = Y.reshape(M, OH, Wp)[:, :, :OW]
            if bias is not None:
                np.add(crop, bias, out=out[n])
            else:
                out[n] = crop

    _threads.parallel_for(xp, N, images, 2.0 * N * M * math.prod(out_sp) * taps * C)
    return out


def epilogue(xp, Y, Z, activation):
    """In place on a fresh conv output: add the residual Z, apply the activation ("Relu",
    or a callable ``activation(xp, Y)`` that works in place on Y)."""
    if Z is not None:
        Y += Z
    if activation == "Relu":
        xp.maximum(Y, 0, out=Y)
    elif callable(activation):
        activation(xp, Y)
    elif activation:
        raise ValueError(f"FusedConv: unsupported activation {activation!r}")
