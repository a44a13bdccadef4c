"""Convolutions: Conv, ConvTranspose, ConvInteger, QLinearConv, DeformConv, Col2Im,
CausalConvWithState.

Conv runs one of four paths, chosen per node at compile time (the ``specialize`` hook
of the kernel table) from its attributes and weight shape, see `choose_path`:

* ``pointwise`` (1x1 kernel, no padding): a plain GEMM per image over the channels, no
  im2col; a stride is one strided copy first;
* ``depthwise`` (one input channel per group, numpy): "column band" GEMMs. For each
  tile of T output columns, the K kernel rows of input it reads are copied side by side
  (K*U values, U = (T-1)*stride + (K-1)*dilation + 1), and one GEMM per channel against a
  (K*U, T) band matrix made from that channel's weights (and bias) computes the tile.
  Numpy's element-wise passes (one multiply and one add per kernel tap) run at a few
  GB/s here; the BLAS does the taps in registers, at the price of U/K times the
  arithmetic (bench/bench_conv.py measures the forms);
* ``depthwise_native`` (the same nodes, float32, when the C library is available):
  kernels/native/depthwise.c, each plane padded into a small buffer, runs of output
  pixels summed a vector at once (a tap is a load and an FMA), bias, residual and
  Relu/Clip as a run is stored; output planes of at most 64 pixels (256 from 5x5
  kernels) along the channels instead (depthwise_cl.c). Other dtypes, and planes too
  large for its int32 offsets, take the ``depthwise`` path. The pointwise and im2col
  paths then add the bias and residual and apply the activation in one C pass too
  (native/act.c, `row_kernels.channels`);
* ``depthwise_taps`` (other array modules, 3-D, channel multipliers): the sum over kernel
  taps of per-channel scaled strided slices, accumulated in place;
* ``im2col`` (everything else, groups included): the padded input viewed through
  ``as_strided`` as (N, C, *K, *O) windows and copied once into a reusable per-thread
  column buffer, then one batched GEMM over the group axis. Columns are laid out
  (N, C*K, O) so that ``W (M, C*K) @ cols`` writes NCHW directly; for small output
  planes (C*K, N*O) instead, for one wide GEMM;
* ``shift`` (the im2col nodes with stride and dilation 1, no groups, 2-D, on numpy,
  when the output plane has at least `_SHIFT_MIN_PIXELS` pixels): the padded image is
  flattened, so each kernel tap's columns are one contiguous run of OH * Wp values
  (the rows of the padded width Wp; the KW - 1 extra columns per row are computed and
  cropped), copied as C long rows instead of C * OH short ones; one GEMM per image by
  the weights reordered tap-major (cached per node). ResNet's 56x56 and 28x28 3x3
  layers: 24.6 -> 17.5 ms and 14.0 -> 12.4 ms at batch 8 (bench/README.md).
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Callable, Sequence

import numpy as np

from hetero_exec.kernels import _int_gemm, _threads
from hetero_exec.kernels._common import host_ints
from hetero_exec.kernels._nn_common import (
    SCRATCH_KEEP,
    acc_dtype,
    conv_geometry,
    is_numpy,
    offset_slices,
    pad_spatial_scratch,
    scratch,
    spatial_attrs,
    window_view,
)
from hetero_exec.kernels._threads import matmul
from hetero_exec.kernels.fused import FUSED_DOMAIN, epilogue_activation
from hetero_exec.kernels.native import library, packed_gemm, plane_kernels, row_kernels
from hetero_exec.kernels.native.activation import NO_ACTIVATION, ActivationArgs, activation_args
from hetero_exec.kernels.registry import KnownInput, kernel

#: output plane size (columns per image) below which images share one wide GEMM
#: (small late-stage planes) rather than one GEMM per image
_GEMM_COLS = 1024
#: widest output tile of the depthwise column-band path (bench/bench_conv.py)
_BAND_TILE = 16

#: least output pixels per image for the ``shift`` path (below, im2col's copies are as
#: cheap and the cropped columns cost more)
_SHIFT_MIN_PIXELS = 784

PATHS = ("pointwise", "depthwise", "depthwise_native", "depthwise_taps", "im2col", "shift")


# --------------------------------------------------------------------------- path choice


def choose_path(numpy_arrays: bool, w_shape: Sequence[int], group: int, pads_zero: bool,
                compiled: bool = False) -> str:
    """The Conv path for weights of ``w_shape`` (M, C/group, *K): see the module docstring.
    ``compiled``: the compiled kernels (kernels/native) may be used.

    >>> w = (32, 1, 3, 3)
    >>> choose_path(True, w, 32, False), choose_path(True, w, 32, False, compiled=True)
    ('depthwise', 'depthwise_native')
    >>> choose_path(False, (32, 1, 3, 3), 32, False), choose_path(True, (64, 32, 1, 1), 1, True)
    ('depthwise_taps', 'pointwise')
    >>> choose_path(True, (64, 8, 3, 3), 4, False)
    'im2col'
    """
    M, Cg = w_shape[0], w_shape[1]
    K = tuple(w_shape[2:])
    if group > 1 and Cg == 1:
        if numpy_arrays and M == group and len(K) in (1, 2):
            return "depthwise_native" if compiled else "depthwise"
        return "depthwise_taps"
    if all(k == 1 for k in K) and pads_zero:
        return "pointwise"
    return "im2col"


class ConvPath:
    """One node's Conv path, and what it derives from that node's (constant) weights.

    The band matrices of the depthwise path are built once per weight array, bias and
    geometry and kept here; the cache holds the arrays it was built from and compares
    them by identity, so a weight that changes between runs (a graph input) rebuilds."""

    def __init__(self, kind: str):
        if kind not in PATHS:
            raise ValueError(f"unknown Conv path {kind!r}; known: {PATHS}")
        self.kind = kind
        self._band: tuple | None = None  # (W, B, key, band)

    def band(self, xp, W, B, key: tuple, build: Callable[[], Any]):
        cached = self._band
        if cached is not None and cached[0] is W and cached[1] is B and cached[2] == key:
            return cached[3]
        band = build()
        self._band = (W, B, key, band)  # one assignment: concurrent callers see old or new
        return band

    def __repr__(self) -> str:
        return f"ConvPath({self.kind!r})"


def _pads_zero(auto_pad: str, pads) -> bool:
    """No padding at all: VALID, no pads, or SAME (which pads nothing for a 1x1 kernel)."""
    return auto_pad != "NOTSET" or not pads or not any(pads)


def _path_for(xp, w_shape: Sequence[int], group: int, pads_zero: bool) -> ConvPath:
    """A node's path on ``xp``, the compiled kernels included where they may run."""
    numpy_arrays = is_numpy(xp)
    return ConvPath(choose_path(numpy_arrays, w_shape, group, pads_zero,
                                numpy_arrays and library.available()))


# --------------------------------------------------------------------------- pointwise


def _pointwise(xp, X, W, B, strides, group, out_sp):
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


# --------------------------------------------------------------------------- depthwise


def _depthwise_taps(xp, X, W, B, strides, dilations, pb, pe, out_sp, group):
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


def _band_tile(ow: int) -> int:
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


def _depthwise_band(xp, X, W, B, strides, dilations, pb, pe, out_sp, path: ConvPath,
                    key_w, key_b):
    """Depthwise conv (channel multiplier 1, 1-D or 2-D) as column-band GEMMs."""
    if X.ndim == 3:  # 1-D: one row of height 1
        Y = _depthwise_band(xp, X[:, :, None], W[:, :, None], B, [1] + list(strides),
                            [1] + list(dilations), [0] + list(pb), [0] + list(pe),
                            [1] + list(out_sp), path, key_w, key_b)
        return Y.reshape(Y.shape[:2] + (Y.shape[3],))
    N, C, H, Wd = X.shape
    KH, KW = W.shape[2:]
    (sh, sw), (dh, dw) = strides, dilations
    OH, OW = out_sp
    T = _band_tile(OW)
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


def _native_epilogue(Y, B, Z, act: ActivationArgs) -> None:
    """act(Y + B[channel] + Z) in place on a fresh float32 (N, M, *S) product, by the C
    epilogue (native/act.c), its rows split over the library's workers."""
    row_kernels.channels(Y, B, Z, *act)


def _depthwise_packed(X, W, B, Z, activation, act, strides, dilations, pb, out_sp):
    """Depthwise conv (multiplier 1, 1-D or 2-D) in float32 by native/depthwise.c, bias,
    residual and Relu/Clip added as each run is stored; None when this call does not suit
    it (another dtype, no AVX-512, a plane too large for its int32 offsets)."""
    if X.dtype != np.float32 or W.dtype != np.float32 or not packed_gemm.available():
        return None
    if X.ndim == 3:  # 1-D: one row of height 1
        Y = _depthwise_packed(X[:, :, None], W[:, :, None], B,
                              None if Z is None else Z[:, :, None], activation, act,
                              (1, strides[0]), (1, dilations[0]), (0, pb[0]), (1, out_sp[0]))
        return None if Y is None else Y[:, :, 0]
    if not plane_kernels.depthwise_fits(X.shape, W.shape, tuple(strides), tuple(dilations),
                                      tuple(out_sp)):
        return None
    C = X.shape[1]
    return _stored(lambda code, lo, hi: plane_kernels.depthwise_2d(
        X, W.reshape((C,) + W.shape[2:]), tuple(strides), tuple(dilations), (pb[0], pb[1]),
        tuple(out_sp), bias=B, z=Z, act=code, lo=lo, hi=hi), activation, act)


# --------------------------------------------------------------------------- im2col


def _chunk(xp, N, per_image_bytes):
    """Images per im2col block: the whole batch when its columns fit the reusable
    scratch buffer (numpy) or always (cupy's pool caches device memory itself)."""
    if not is_numpy(xp):
        return N
    return max(1, min(N, SCRATCH_KEEP // max(per_image_bytes, 1)))


def _im2col(xp, X, W, B, strides, dilations, pb, pe, group, out_sp):
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


# --------------------------------------------------------------------------- shift


def _shift_fits(xp, X, W, strides, dilations, group, out_sp) -> bool:
    """Whether the ``shift`` path computes this conv (see the module docstring)."""
    return (is_numpy(xp) and group == 1 and X.ndim == 4 and all(s == 1 for s in strides)
            and all(d == 1 for d in dilations) and math.prod(out_sp) >= _SHIFT_MIN_PIXELS)


def _shift(xp, X, W, B, pb, pe, out_sp, path: ConvPath | None, key_w, key_b):
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
        xp, W if key_w is None else key_w, B if key_b is None else key_b, ("shift", W.shape), reorder)
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


def _pointwise_packed(X, W, B, Z, activation, act, strides, group, out_sp, path: ConvPath,
                      key_w):
    """The ungrouped float32 1x1 conv on its weight packed once (kept by the node's path),
    bias, residual and Relu/Clip added as the tiles are stored (a strided one on its
    pixels gathered first: ResNet's downsampling shortcuts); None when this call does not
    suit it."""
    if (group != 1 or X.dtype != np.float32 or W.dtype != np.float32
            or not packed_gemm.available()):
        return None
    N, C = X.shape[:2]
    M = W.shape[0]
    if C == 0:
        return None
    packed = path.band(np, key_w, None, ("packed_left", M, C),
                       lambda: packed_gemm.PackedLeft(W.reshape(M, C)))
    Xs = strided_pixels(X, strides, out_sp)
    Y = _stored(lambda code, lo, hi: packed.matmul(Xs, bias=B, z=Z, act=code, lo=lo, hi=hi),
                activation, act)
    return Y.reshape((N, M) + tuple(out_sp))


def strided_pixels(X, strides, out_sp):
    """X (N, C, *S) as (N, C, L) on the pixels a 1x1 conv of these strides reads: a view
    at strides 1, else those pixels gathered into a scratch buffer (slot 1: never return
    it)."""
    N, C = X.shape[:2]
    if all(s == 1 for s in strides):
        return X.reshape(N, C, -1)
    picked = X[(slice(None), slice(None)) + tuple(slice(None, s * o, s)
                                                  for s, o in zip(strides, out_sp))]
    out = scratch(np, picked.shape, np.float32, slot=1)
    np.copyto(out, picked)
    return out.reshape(N, C, -1)


def _stored(run: Callable[[int, float, float], Any], activation, act):
    """``run(code, lo, hi)``, a packed product given the activation its store applies
    (none, Relu, Clip); an activation the store lacks gets its own pass after it."""
    store = activation_args(activation, store_only=True)
    Y = run(*(store if store is not None else NO_ACTIVATION))
    if store is None:
        if act is not None:
            _native_epilogue(Y, None, None, act)
        else:
            _epilogue(np, Y, None, activation)
    return Y


def _conv_packed(X, W, B, Z, activation, act, strides, dilations, pb, pe, group, out_sp,
                 path: ConvPath, key_w):
    """An ungrouped float32 2-D conv on its weight packed once, each tap read in place from
    the padded input (packed_gemm.PackedLeft.conv: no im2col, no per-tap GEMM), bias,
    residual and Relu/Clip added as the tiles are stored; None when this call does not
    suit it."""
    if (X.ndim not in (3, 4) or group != 1 or X.dtype != np.float32 or W.dtype != np.float32
            or not packed_gemm.available()):
        return None
    if X.ndim == 3:  # 1-D (an audio front end): a 2-D conv of one row
        Y = _conv_packed(X[:, :, None], W[:, :, None], B, None if Z is None else Z[:, :, None],
                         activation, act, (1, strides[0]), (1, dilations[0]), (0, pb[0]),
                         (0, pe[0]), group, (1, out_sp[0]), path, key_w)
        return None if Y is None else Y[:, :, 0]
    N, C, H, Wd = X.shape
    M, _, KH, KW = W.shape
    padded = (C, H + pb[0] + pe[0], Wd + pb[1] + pe[1])
    tiled = patchify_fits(W.shape, strides, dilations, pb, pe)
    if not tiled and not packed_gemm.conv_fits(C * KH * KW, padded, tuple(out_sp),
                                               tuple(strides)):
        return None
    packed = path.band(np, key_w, None, ("packed_left", W.shape),
                       lambda: packed_gemm.PackedLeft(W.reshape(M, C * KH * KW)))
    if tiled:
        OH, OW = out_sp
        Y = _stored(lambda code, lo, hi: packed.matmul(
            patches(X, KH, KW, OH, OW), bias=B, z=None if Z is None else Z.reshape(N, M, -1),
            act=code, lo=lo, hi=hi), activation, act)
        return Y.reshape(N, M, OH, OW)
    pads = (pb[0], pb[1], pe[0], pe[1])
    return _stored(lambda code, lo, hi: packed.conv(X, (KH, KW), tuple(dilations), tuple(strides),
                                                    pads, tuple(out_sp), bias=B, z=Z, act=code,
                                                    lo=lo, hi=hi), activation, act)


def patchify_fits(w_shape, strides, dilations, pb, pe) -> bool:
    """A conv whose kernel tiles its input (kernel = strides, no dilation, no padding: a
    ViT/Swin patch embedding, ConvNeXt's stem and downsampling): one copy of the input
    into patches (`patches`), then a plain product by the packed weight."""
    return (len(w_shape) == 4 and tuple(w_shape[2:]) == tuple(strides) and not any(pb)
            and not any(pe) and all(d == 1 for d in dilations) and max(strides) > 1)


def patches(X, KH: int, KW: int, OH: int, OW: int):
    """X (N, C, H, W) cut into its (KH, KW) tiles as a (N, C*KH*KW, OH*OW) scratch
    buffer (slot 1; rows in the weight's (C, KH, KW) order): never return it."""
    N, C = X.shape[:2]
    tiles = X[:, :, :OH * KH, :OW * KW].reshape(N, C, OH, KH, OW, KW)
    out = scratch(np, (N, C, KH, KW, OH, OW), np.float32, slot=1)
    np.copyto(out, tiles.transpose(0, 1, 3, 5, 2, 4))
    return out.reshape(N, C * KH * KW, OH * OW)


# --------------------------------------------------------------------------- core


def _epilogue(xp, Y, Z, activation):
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


def _conv_core(xp, X, W, B, strides, dilations, pb, pe, group, out_sp, Z=None, activation="",
               path: ConvPath | None = None, key_w=None, key_b=None):
    """Conv of X (N, C, *S) with W (M, C/group, *K), plus B (M,) if given, computed
    in (and returned as) the dtype of X and W, by ``path`` (chosen here when None). ``Z``
    (the output's shape) is added and ``activation`` applied in place. ``key_w``/``key_b``
    are the arrays the caller was given (before any cast): the path's caches key on them."""
    N = X.shape[0]
    M = W.shape[0]
    out_shape = (N, M) + tuple(out_sp)
    if N == 0 or M == 0 or math.prod(out_sp) == 0:
        return xp.zeros(out_shape, dtype=X.dtype)  # empty: no bias, Z or activation to apply
    if path is None:
        path = ConvPath(choose_path(is_numpy(xp), W.shape, group, not any(pb) and not any(pe)))
    kind = path.kind
    if kind == "pointwise" and (any(pb) or any(pe)):
        kind = "im2col"  # a pointwise node whose auto_pad pads after all
    if kind == "depthwise_native" and not is_numpy(xp):
        kind = "depthwise_taps"  # compiled for host memory only
    # (a residual that only broadcasts to the output takes numpy's add)
    compiled = library.takes(xp, X, W) and (Z is None or tuple(Z.shape) == out_shape)
    act = activation_args(activation) if compiled else None  # None: numpy applies it
    if kind == "depthwise_native" and compiled:
        Y = _depthwise_packed(X, W, B, Z, activation, act, strides, dilations, pb, out_sp)
        if Y is not None:
            return Y
    if kind == "depthwise_native":
        kind = "depthwise"  # a dtype (or a plane) native/depthwise.c does not take
    if kind in ("im2col", "shift"):  # the shift form where the geometry suits it
        kind = "shift" if _shift_fits(xp, X, W, strides, dilations, group, out_sp) else "im2col"
    if kind == "pointwise" and compiled:
        Y = _pointwise_packed(X, W, B, Z, activation, act, strides, group, out_sp, path,
                              W if key_w is None else key_w)
        if Y is not None:
            return Y
    if kind in ("im2col", "shift") and compiled:
        Y = _conv_packed(X, W, B, Z, activation, act, strides, dilations, pb, pe, group, out_sp,
                         path, W if key_w is None else key_w)
        if Y is not None:
            return Y
    if kind in ("pointwise", "im2col", "shift") and compiled and (B is not None or Z is not None):
        # the bias, residual (and activation, when compiled) in one pass after the products
        if kind == "pointwise":
            Y = _pointwise(xp, X, W, None, strides, group, out_sp)
        elif kind == "shift":
            Y = _shift(xp, X, W, None, pb, pe, out_sp, path, key_w, key_b)
        else:
            Y = _im2col(xp, X, W, None, strides, dilations, pb, pe, group, out_sp)
        _native_epilogue(Y, B, Z, NO_ACTIVATION if act is None else act)
        if act is None:
            _epilogue(xp, Y, None, activation)
        return Y
    if kind == "depthwise":
        Y = _depthwise_band(xp, X, W, B, strides, dilations, pb, pe, out_sp, path,
                            W if key_w is None else key_w, B if key_b is None else key_b)
    elif kind == "depthwise_taps":
        Y = _depthwise_taps(xp, X, W, B, strides, dilations, pb, pe, out_sp, group)
    elif kind == "pointwise":
        Y = _pointwise(xp, X, W, B, strides, group, out_sp)
    elif kind == "shift":
        Y = _shift(xp, X, W, B, pb, pe, out_sp, path, key_w, key_b)
    else:
        Y = _im2col(xp, X, W, B, strides, dilations, pb, pe, group, out_sp)
    _epilogue(xp, Y, Z, activation)
    return Y


def _conv_full(xp, X, W, B, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None,
               pads=None, strides=None, Z=None, activation="", path: ConvPath | None = None):
    nd = X.ndim - 2
    strides, dilations = spatial_attrs(nd, strides, dilations)
    K = list(kernel_shape) if kernel_shape else list(W.shape[2:])
    out_sp, pb, pe = conv_geometry(X.shape[2:], K, strides, dilations, pads, auto_pad)
    out_dtype = X.dtype
    if path is None:
        path = _path_for(xp, W.shape, group, not any(pb) and not any(pe))
    cdt = acc_dtype(xp, out_dtype)
    if cdt == np.float16 and path.kind == "depthwise_taps":
        # element-wise sums over the taps: no BLAS accumulates them wider, so float32
        cdt = np.dtype(np.float32)
    Xc = X.astype(cdt, copy=False)
    Wc = W.astype(cdt, copy=False)
    Bc = None if B is None else B.astype(cdt, copy=False)
    Zc = None if Z is None else Z.astype(cdt, copy=False)
    Y = _conv_core(xp, Xc, Wc, Bc, strides, dilations, pb, pe, group, out_sp, Zc, activation,
                   path, W, B)
    return Y.astype(out_dtype, copy=False)


# --------------------------------------------------------------------------- Conv


def _specialize(op: str):
    """The compile-time hook of Conv / FusedConv: the node's path from its attributes and
    weight shape, held (with its weight-derived caches) by the function returned."""

    def hook(xp, kwargs: dict, inputs: Sequence[KnownInput]):
        w = inputs[1] if len(inputs) > 1 else KnownInput()
        if w.shape is None or not all(isinstance(d, int) for d in w.shape):
            return None  # the weight's shape decides the path: choose at run time
        path = _path_for(xp, w.shape, kwargs.get("group", 1),
                         _pads_zero(kwargs.get("auto_pad", "NOTSET"), kwargs.get("pads")))
        from hetero_exec.kernels._conv_bound import BoundCalls

        if op == "Conv":
            bound = BoundCalls(path, "")

            def conv(xp, X, W, B=None, **attrs):
                if xp is np:
                    call = bound.get(X, W, B, None, attrs)
                    if call is not None:
                        return (call(X, None),)
                return (_conv_full(xp, X, W, B, path=path, **attrs),)
        else:
            act = epilogue_activation(kwargs.get("activation", ""), kwargs.get("activation_params"))
            bound = BoundCalls(path, act)

            def conv(xp, X, W, B=None, Z=None, activation="", activation_params=None, **attrs):
                if xp is np:
                    call = bound.get(X, W, B, Z, attrs)
                    if call is not None:
                        return (call(X, Z),)
                return (_conv_full(xp, X, W, B, Z=Z, path=path, activation=act, **attrs),)
        conv.__name__ = f"{op}_{path.kind}"
        conv.path = path
        return conv

    return hook


@kernel("Conv", since=(1, 11, 22), specialize=_specialize("Conv"))
def Conv(xp, X, W, B=None, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None,
         pads=None, strides=None):
    return (_conv_full(xp, X, W, B, auto_pad, dilations, group, kernel_shape, pads, strides),)


@kernel("FusedConv", since=1, domain=FUSED_DOMAIN, specialize=_specialize("FusedConv"))
def FusedConv(xp, X, W, B=None, Z=None, activation="", activation_params=None, auto_pad="NOTSET",
              dilations=None, group=1, kernel_shape=None, pads=None, strides=None):
    """Internal op of the fusion passes (placement/fusions/):
    ``activation(Conv(X, W, B) + Z)``, Z (optional) of the output's shape, the activation
    (kernels.fused.ACTIVATIONS, with its ``activation_params``) applied in place on the
    conv output."""
    return (_conv_full(xp, X, W, B, auto_pad, dilations, group, kernel_shape, pads, strides,
                       Z, epilogue_activation(activation, activation_params)),)


# --------------------------------------------------------------------------- integer / quantised


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
        return _conv_core(xp, X, Wf, None, strides, dilations, pb, pe, group,
                          out_sp).astype(np.int32)
    channels = chunk // taps
    if group != 1 or channels < 1:
        Y = _conv_core(xp, X.astype(np.float64), Wf.astype(np.float64), None, strides,
                       dilations, pb, pe, group, out_sp)
        return xp.rint(Y).astype(np.int32)
    acc = None
    for c0 in range(0, w.shape[1], channels):
        part = _conv_core(xp, xp.ascontiguousarray(X[:, c0:c0 + channels]),
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
