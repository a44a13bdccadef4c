"""The C library's kernels over image planes, float32 (native/depthwise.c,
depthwise_cl.c, conv.c's patches): `depthwise_2d` (the depthwise Conv, by planes or along
the channels), `max_pool_2d` (by depthwise.c's runs) and `conv_patches` (a conv's patches
pixel-major, for packed_gemm.PackedRight), with the rules for when each takes a conv.
"""

from __future__ import annotations

import numpy as np

from hetero_exec.kernels.native import library
from hetero_exec.kernels.native.library import address
from hetero_exec.kernels.native.library import contiguous_f32 as _contiguous_f32
from hetero_exec.kernels.native.library import lib as _lib
from hetero_exec.kernels.native.library import parts as _parts
from hetero_exec.kernels.native.library import pointer as _ptr
from hetero_exec.kernels.native.packed_gemm import ACT_NONE


def max_pool_2d(X: np.ndarray, kernel: tuple[int, int], strides: tuple[int, int],
                dilations: tuple[int, int], pads: tuple[int, int, int, int],
                out_sp: tuple[int, int]) -> np.ndarray:
    """MaxPool of X (n, C, H, W) float32 without indices: each plane padded with -inf (and
    phased by the column stride) into a worker's own buffer, which stays in cache, then
    the maximum over the taps 16 output pixels at a time by the depthwise conv's runs
    (native/depthwise.c; NaN propagates, as numpy's maximum does). ``pads`` (top, left,
    bottom, right): the bottom and right ones follow from ``out_sp``. (Padding the whole
    input first, as before, wrote and read it once more: ResNet-18's MaxPool at batch 8
    took 4x onnxruntime's time.)"""
    n, C, H, Wd = X.shape
    KH, KW = kernel
    OH, OW = out_sp
    X = np.ascontiguousarray(X, dtype=np.float32)
    Y = np.empty((n, C, OH, OW), np.float32)
    if _lib().he_maxpool_plane_mt(address(X), address(Y), n * C, H, Wd, OH, OW, KH, KW,
                                  strides[0], strides[1], dilations[0], dilations[1], pads[0],
                                  pads[1], _parts(n * C, 2.0 * Y.size * KH * KW)):
        raise MemoryError("max_pool_2d: no memory for a padded plane or the run tables")
    return Y


#: a depthwise output pixel's tap in `_parts`' FLOPs: with its loads and the plane's
#: padding, small planes run at a few GFLOP/s against a GEMM's 100, so that counting 2
#: left MobileNetV2's 8x8 and 4x4 layers at batch 8 on one thread (32: 0.87-0.97x the
#: model's time in two A/B runs; ConvNeXt 0.95-1.02x)
DEPTHWISE_COST = 32.0


#: the same at one image while gemm.c's workers sleep (`he_pool_hot`): waking them cost
#: more than a small plane's work (1.14-1.36x; ConvNeXt at batch 1, whose products are
#: OpenBLAS's, 1.17-1.19x at 32). MobileNetV2 at batch 1, whose pointwise products keep
#: the workers spinning, runs 0.91-0.92x with them split
DEPTHWISE_COST_COLD = 2.0


def depthwise_2d(X: np.ndarray, W: np.ndarray, strides: tuple[int, int],
                 dilations: tuple[int, int], pads: tuple[int, int], out_sp: tuple[int, int],
                 bias: np.ndarray | None = None, z: np.ndarray | None = None,
                 act: int = ACT_NONE, lo: float = 0.0, hi: float = 0.0) -> np.ndarray:
    """act(depthwise(X, W) + bias + z) for X (n, C, H, W) float32 and W (C, KH, KW) (one
    input channel a group, multiplier 1), ``pads`` the top and left ones (the bottom and
    right follow from ``out_sp``); returns (n, C, OH, OW). Each plane is padded into a
    small buffer of the C worker's own (native/depthwise.c)."""
    return depthwise_call(X.shape, W, strides, dilations, pads, out_sp, bias, act, lo, hi)(X, z)


def depthwise_call(x_shape: tuple[int, ...], W: np.ndarray, strides: tuple[int, int],
                   dilations: tuple[int, int], pads: tuple[int, int], out_sp: tuple[int, int],
                   bias: np.ndarray | None = None, act: int = ACT_NONE, lo: float = 0.0,
                   hi: float = 0.0):
    """`depthwise_2d` bound to inputs of ``x_shape``: ``call(X, z=None) -> Y``, the
    kernel's arguments worked out once (a Conv node's call at one input shape)."""
    n, C, H, Wd = x_shape
    KH, KW = W.shape[-2:]
    OH, OW = out_sp
    W = np.ascontiguousarray(W, dtype=np.float32).reshape(C, KH, KW)
    bias = _contiguous_f32(bias)
    shape = (n, C, OH, OW)
    cost = DEPTHWISE_COST * n * C * OH * OW * KH * KW
    cold = DEPTHWISE_COST_COLD * n * C * OH * OW * KH * KW
    lib = _lib()
    hot = lib.he_pool_hot
    head = (address(W), _ptr(bias))
    # small planes along the channels (depthwise_cl.c), a vector of channels an item; else
    # by planes
    along = depthwise_along_channels(OH * OW, KH * KW)
    fn = lib.he_depthwise_cl_mt if along else lib.he_depthwise_mt
    vw = library.constant("VW")  # channels a vector (depthwise_cl.c): 16 on AVX-512
    items = n * -(-C // vw) if along else n * C
    mid = (n if along else n * C, C, H, Wd, OH, OW, KH, KW, strides[0], strides[1],
           dilations[0], dilations[1], pads[0], pads[1], act, lo, hi)

    def call(X: np.ndarray, z: np.ndarray | None = None) -> np.ndarray:
        X = np.ascontiguousarray(X, dtype=np.float32)
        Y = np.empty(shape, np.float32)
        if z is not None:  # (held here while the kernel reads it)
            z = np.ascontiguousarray(z, np.float32).reshape(shape)
        parts = _parts(items, cost if n > 1 or hot() else cold)
        if fn(address(X), *head, _ptr(z), address(Y), *mid, parts):
            raise MemoryError("depthwise_2d: no memory for a padded plane or the run tables")
        return Y

    call.keep = (W, bias)  # (the call holds their pointers only)
    return call


def depthwise_along_channels(out_pixels: int, taps: int) -> bool:
    """Whether a depthwise conv runs along the channels (depthwise_cl.c) rather than by
    planes: output planes of at most 64 pixels, or 256 for 5x5 kernels and larger. On
    MobileNetV2's and ConvNeXt's layers it took 0.29-0.87x the plane kernel's time there
    (4x4 and 8x8 planes, strided ones, 7x7 on 16x16), and 0.74-1.3x for 3x3 on 16x16 and
    1.8-2.2x on ConvNeXt's 32x32 planes (bench/bench_conv.py)."""
    return out_pixels <= 64 or (out_pixels <= 256 and taps >= 25)


def depthwise_fits(x_shape: tuple[int, ...], w_shape: tuple[int, ...], strides: tuple[int, int],
                   dilations: tuple[int, int], out_sp: tuple[int, int]) -> bool:
    """Whether `depthwise_2d` computes this depthwise conv: its padded plane's offsets
    and an output plane within int32."""
    if len(x_shape) != 4 or len(w_shape) != 4 or len(out_sp) != 2:
        return False
    H, Wd = x_shape[2:]
    KH, KW = w_shape[2:]
    OH, OW = out_sp
    rows = max((OH - 1) * strides[0] + (KH - 1) * dilations[0] + 1, H) + KH * dilations[0]
    cols = max((OW - 1) * strides[1] + (KW - 1) * dilations[1] + 1, Wd) + 2 * strides[1] + 16
    return rows * cols < 2**31 - 1024 and OH * OW < 2**31


def conv_patches(X: np.ndarray, kernel: tuple[int, int], dilations: tuple[int, int],
                 strides: tuple[int, int], pads: tuple[int, int], out_sp: tuple[int, int],
                 parts: int | None = None) -> np.ndarray:
    """X (n, C, H, W), C-contiguous float32, as its conv's patches, one output pixel's a
    row: (n * OH * OW, C * KH * KW), zero where ``pads`` (top, left) reach beyond X. A
    scratch buffer (kernels._nn_common.scratch, slot 1): never return it."""
    from hetero_exec.kernels._nn_common import scratch

    n, C, H, Wd = X.shape
    KH, KW = kernel
    OH, OW = out_sp
    P = scratch(np, (n * OH * OW, C * KH * KW), np.float32, slot=1)
    rows = n * OH
    _lib().he_patches_mt(address(X), address(P), n, C, H, Wd, KH, KW, strides[0], strides[1],
                         dilations[0], dilations[1], pads[0], pads[1], OH, OW,
                         _parts(rows, PATCH_COST * P.size) if parts is None else parts)
    return P


#: an element of `conv_patches` in `_parts`' FLOPs (a scattered copy: ~0.9 ns a value
#: on one core, where `_parts`' 4 MFLOP are ~30 us)
PATCH_COST = 64.0
