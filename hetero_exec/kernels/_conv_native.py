"""Conv by the C library (kernels/native), float32: the products on a weight packed
once (pointwise, ungrouped convs read tap by tap, patch embeddings) and the depthwise
conv (native/depthwise.c), bias, residual and Relu/Clip added as each tile is stored;
`channels_epilogue` (native/act.c) for what the store cannot apply. Each returns None
where a call does not suit it, and _conv_path.py falls back to _conv_numpy.py's
algorithm, the definition these are tested against.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from hetero_exec.kernels import _conv_numpy as conv_numpy
from hetero_exec.kernels._nn_common import (
    scratch,
)
from hetero_exec.kernels.native import packed_gemm, plane_kernels, row_kernels
from hetero_exec.kernels.native.activation import NO_ACTIVATION, ActivationArgs, activation_args

if TYPE_CHECKING:
    from hetero_exec.kernels._conv_path import ConvPath


def channels_epilogue(Y, B, Z, act: ActivationArgs) -> None:
    """act(Y + B[channel] + Z) in place on a fresh float32 (N, M, *S) product, by the C
    epilogue (native/act.c), its rows split over the library's workers."""
    row_kernels.channels(Y, B, Z, *act)


def depthwise_packed(X, W, B, Z, activation, act, strides, dilations, pb, out_sp):
    """Depthwise conv (multiplier 1, 1-D or 2-D) in float32 by native/depthwise.c, bias,
    residual and Relu/Clip added as each run is stored; None when this call does not suit
    it (another dtype, no AVX-512, a plane too large for its int32 offsets)."""
    if X.dtype != np.float32 or W.dtype != np.float32 or not packed_gemm.available():
        return None
    if X.ndim == 3:  # 1-D: one row of height 1
        Y = depthwise_packed(X[:, :, None], W[:, :, None], B,
                             None if Z is None else Z[:, :, None], activation, act,
                              (1, strides[0]), (1, dilations[0]), (0, pb[0]), (1, out_sp[0]))
        return None if Y is None else Y[:, :, 0]
    if not plane_kernels.depthwise_fits(X.shape, W.shape, tuple(strides), tuple(dilations),
                                        tuple(out_sp)):
        return None
    C = X.shape[1]
    return stored(lambda code, lo, hi: plane_kernels.depthwise_2d(
        X, W.reshape((C,) + W.shape[2:]), tuple(strides), tuple(dilations), (pb[0], pb[1]),
        tuple(out_sp), bias=B, z=Z, act=code, lo=lo, hi=hi), activation, act)


def pointwise_packed(X, W, B, Z, activation, act, strides, group, out_sp, path: ConvPath,
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
    Y = stored(lambda code, lo, hi: packed.matmul(Xs, bias=B, z=Z, act=code, lo=lo, hi=hi),
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


def stored(run: Callable[[int, float, float], Any], activation, act):
    """``run(code, lo, hi)``, a packed product given the activation its store applies
    (none, Relu, Clip); an activation the store lacks gets its own pass after it."""
    store = activation_args(activation, store_only=True)
    Y = run(*(store if store is not None else NO_ACTIVATION))
    if store is None:
        if act is not None:
            channels_epilogue(Y, None, None, act)
        else:
            conv_numpy.epilogue(np, Y, None, activation)
    return Y


def conv_packed(X, W, B, Z, activation, act, strides, dilations, pb, pe, group, out_sp,
                path: ConvPath, key_w):
    """An ungrouped float32 2-D conv on its weight packed once, each tap read in place from
    the padded input (packed_gemm.PackedLeft.conv: no im2col, no per-tap GEMM), bias,
    residual and Relu/Clip added as the tiles are stored; None when this call does not
    suit it."""
    if (X.ndim not in (3, 4) or group != 1 or X.dtype != np.float32 or W.dtype != np.float32
            or not packed_gemm.available()):
        return None
    if X.ndim == 3:  # 1-D (an audio front end): a 2-D conv of one row
        Y = conv_packed(X[:, :, None], W[:, :, None], B, None if Z is None else Z[:, :, None],
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
        Y = stored(lambda code, lo, hi: packed.matmul(
            patches(X, KH, KW, OH, OW), bias=B, z=None if Z is None else Z.reshape(N, M, -1),
            act=code, lo=lo, hi=hi), activation, act)
        return Y.reshape(N, M, OH, OW)
    pads = (pb[0], pb[1], pe[0], pe[1])
    return stored(lambda code, lo, hi: packed.conv(X, (KH, KW), tuple(dilations), tuple(strides),
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
