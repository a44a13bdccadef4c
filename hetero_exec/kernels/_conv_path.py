"""Conv's path: chosen per node at compile time (the ``specialize`` hook of the kernel
table, conv.py) from its attributes and weight shape (`choose_path`), and run by
`conv_core`, which tries the C form of a path (_conv_native.py) and falls back to its
array-module algorithm (_conv_numpy.py).

The paths (the algorithms are described in _conv_numpy.py and _conv_native.py):

* ``pointwise`` (1x1 kernel, no padding); float32 on the C library: the packed product;
* ``depthwise`` (one input channel per group, numpy): column-band GEMMs;
* ``depthwise_native`` (the same nodes when the C library is available): in float32
  native/depthwise.c; other dtypes, and planes too large for its int32 offsets, take
  ``depthwise``;
* ``depthwise_taps`` (other array modules, 3-D, channel multipliers): per-tap slices;
* ``im2col`` (everything else, groups included); ``shift`` (im2col nodes with stride and
  dilation 1, no groups, 2-D, large planes); float32 ungrouped ones on the C library:
  the packed conv, each tap read in place from the padded input.

Where the C library computes the product but its store cannot apply the activation, or
numpy computed it, the bias, residual and activation run in one C pass
(native/act.c) when the library is available.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import numpy as np

from hetero_exec.kernels import _conv_native as conv_native
from hetero_exec.kernels import _conv_numpy as conv_numpy
from hetero_exec.kernels._nn_common import (
    acc_dtype,
    conv_geometry,
    is_numpy,
    spatial_attrs,
)
from hetero_exec.kernels.native import library
from hetero_exec.kernels.native.activation import NO_ACTIVATION, activation_args

PATHS = ("pointwise", "depthwise", "depthwise_native", "depthwise_taps", "im2col", "shift")


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


def pads_zero(auto_pad: str, pads) -> bool:
    """No padding at all: VALID, no pads, or SAME (which pads nothing for a 1x1 kernel)."""
    return auto_pad != "NOTSET" or not pads or not any(pads)


def path_for(xp, w_shape: Sequence[int], group: int, pads_zero: bool) -> ConvPath:
    """A node's path on ``xp``, the compiled kernels included where they may run."""
    numpy_arrays = is_numpy(xp)
    return ConvPath(choose_path(numpy_arrays, w_shape, group, pads_zero,
                                numpy_arrays and library.available()))


def conv_core(xp, X, W, B, strides, dilations, pb, pe, group, out_sp, Z=None, activation="",
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
        Y = conv_native.depthwise_packed(X, W, B, Z, activation, act, strides, dilations, pb,
                                         out_sp)
        if Y is not None:
            return Y
    if kind == "depthwise_native":
        kind = "depthwise"  # a dtype (or a plane) native/depthwise.c does not take
    if kind in ("im2col", "shift"):  # the shift form where the geometry suits it
        fits = conv_numpy.shift_fits(xp, X, W, strides, dilations, group, out_sp)
        kind = "shift" if fits else "im2col"
    if kind == "pointwise" and compiled:
        Y = conv_native.pointwise_packed(X, W, B, Z, activation, act, strides, group, out_sp, path,
                                         W if key_w is None else key_w)
        if Y is not None:
            return Y
    if kind in ("im2col", "shift") and compiled:
        Y = conv_native.conv_packed(X, W, B, Z, activation, act, strides, dilations, pb, pe,
                                    group, out_sp, path, W if key_w is None else key_w)
        if Y is not None:
            return Y
    def products(bias):
        if kind == "pointwise":
            return conv_numpy.pointwise(xp, X, W, bias, strides, group, out_sp)
        if kind == "shift":
            return conv_numpy.shift(xp, X, W, bias, pb, pe, out_sp, path, key_w, key_b)
        return conv_numpy.im2col(xp, X, W, bias, strides, dilations, pb, pe, group, out_sp)

    if kind in ("pointwise", "im2col", "shift") and compiled and (B is not None or Z is not None):
        # the bias, residual (and activation, when compiled) in one pass after the products
        Y = products(None)
        conv_native.channels_epilogue(Y, B, Z, NO_ACTIVATION if act is None else act)
        if act is None:
            conv_numpy.epilogue(xp, Y, None, activation)
        return Y
    if kind == "depthwise":
        Y = conv_numpy.depthwise_band(xp, X, W, B, strides, dilations, pb, pe, out_sp, path,
                                      W if key_w is None else key_w, B if key_b is None else key_b)
    elif kind == "depthwise_taps":
        Y = conv_numpy.depthwise_taps(xp, X, W, B, strides, dilations, pb, pe, out_sp, group)
    else:
        Y = products(B)
    conv_numpy.epilogue(xp, Y, Z, activation)
    return Y


def conv_full(xp, X, W, B, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None,
              pads=None, strides=None, Z=None, activation="", path: ConvPath | None = None):
    nd = X.ndim - 2
    strides, dilations = spatial_attrs(nd, strides, dilations)
    K = list(kernel_shape) if kernel_shape else list(W.shape[2:])
    out_sp, pb, pe = conv_geometry(X.shape[2:], K, strides, dilations, pads, auto_pad)
    out_dtype = X.dtype
    if path is None:
        path = path_for(xp, W.shape, group, not any(pb) and not any(pe))
    cdt = acc_dtype(xp, out_dtype)
    if cdt == np.float16 and path.kind == "depthwise_taps":
        # element-wise sums over the taps: no BLAS accumulates them wider, so float32
        cdt = np.dtype(np.float32)
    Xc = X.astype(cdt, copy=False)
    Wc = W.astype(cdt, copy=False)
    Bc = None if B is None else B.astype(cdt, copy=False)
    Zc = None if Z is None else Z.astype(cdt, copy=False)
    Y = conv_core(xp, Xc, Wc, Bc, strides, dilations, pb, pe, group, out_sp, Zc, activation,
                  path, W, B)
    return Y.astype(out_dtype, copy=False)
