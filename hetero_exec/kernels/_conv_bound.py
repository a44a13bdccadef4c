"""A Conv node's call bound to one input shape.

The general route (_conv_path.conv_full) works out the node's geometry, its path and the
compiled kernel's arguments on every call: 40-50 us of Python a node, where most of
MobileNetV2's convolutions at batch 1 are 5-100 us of work. Where a call takes one of
the compiled kernels (kernels/native: the depthwise, pointwise and packed convolutions,
and a kernel that tiles its input as one product), the node binds it at the first call
of each input shape (`bind`), and later calls at that shape, with the same weight and
bias arrays, only allocate the output (and gather the pixels a strided 1x1 conv reads)
and call the kernel. Every other call (another dtype or device, a grouped conv, a
geometry the kernels do not take, inputs the general route must reject) keeps the
general route.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from hetero_exec.kernels import _conv_native as conv_native
from hetero_exec.kernels import _conv_numpy as conv_numpy
from hetero_exec.kernels._nn_common import conv_geometry, spatial_attrs
from hetero_exec.kernels.native import library, packed_gemm, plane_kernels
from hetero_exec.kernels.native.activation import NO_ACTIVATION, activation_args

#: the input shapes a node keeps bound calls for; a model fed more shapes rebinds
LIMIT = 8

BoundCall = Callable[[np.ndarray, "np.ndarray | None"], np.ndarray]


class BoundCalls:
    """One Conv node's bound calls, by the input's shape and dtype and the residual's.

    A call is kept with the weight and bias arrays it was bound to and used only for
    those same objects (a weight fed as a graph input rebinds), as ConvPath's caches do.
    The table is replaced, never changed in place, so concurrent runs read a whole one."""

    __slots__ = ("path", "activation", "_calls")

    def __init__(self, path, activation):
        self.path = path
        self.activation = activation
        self._calls: dict[tuple, tuple[Any, Any, BoundCall | None]] = {}

    def get(self, X: np.ndarray, W: np.ndarray, B: np.ndarray | None, Z: np.ndarray | None,
            attrs: dict[str, Any]) -> BoundCall | None:
        """The bound call for these inputs (binding it at a new shape), or None when the
        general route runs them."""
        key = (X.shape, X.dtype, None if Z is None else (Z.shape, Z.dtype))
        hit = self._calls.get(key)
        if hit is not None and hit[0] is W and hit[1] is B:
            return hit[2]
        call = bind(X, W, B, Z, self.path, self.activation, attrs)
        calls = {} if len(self._calls) >= LIMIT else dict(self._calls)
        calls[key] = (W, B, call)
        self._calls = calls
        return call


def bind(X: np.ndarray, W: np.ndarray, B: np.ndarray | None, Z: np.ndarray | None, path,
         activation, attrs: dict[str, Any]) -> BoundCall | None:
    """``call(X, Z) -> Y`` for inputs shaped and typed as these, by the compiled kernel
    the general route would take for them; None where it would take another."""
    f32 = np.float32
    if (X.ndim != 4 or W.ndim != 4 or X.dtype != f32 or W.dtype != f32
            or not library.takes(np, X)):
        return None
    N, C, H, Wd = X.shape
    M = W.shape[0]
    group = attrs.get("group", 1)
    KH, KW = W.shape[2:]
    if (C != W.shape[1] * group or list(attrs.get("kernel_shape") or (KH, KW)) != [KH, KW]
            or (B is not None and (B.dtype != f32 or B.shape != (M,)))):
        return None  # the general route names what is wrong
    strides, dilations = spatial_attrs(2, attrs.get("strides"), attrs.get("dilations"))
    out_sp, pb, pe = conv_geometry((H, Wd), [KH, KW], strides, dilations, attrs.get("pads"),
                                   attrs.get("auto_pad", "NOTSET"))
    out_shape = (N, M, *out_sp)
    if N == 0 or M == 0 or math.prod(out_sp) == 0:
        return None
    if Z is not None and (tuple(Z.shape) != out_shape or Z.dtype != f32):
        return None
    store, after = _store(activation)
    code, lo, hi = store
    kind = path.kind
    strides, dilations, out_sp = tuple(strides), tuple(dilations), tuple(out_sp)
    if kind == "depthwise_native":
        if M != C or not plane_kernels.depthwise_fits(X.shape, W.shape, strides, dilations,
                                                    out_sp):
            return None
        call = plane_kernels.depthwise_call(X.shape, W.reshape(C, KH, KW), strides, dilations,
                                          (pb[0], pb[1]), out_sp, B, code, lo, hi)
    elif kind == "pointwise":
        L = math.prod(out_sp)
        if any(pb) or any(pe) or group != 1 or C == 0:
            return None
        packed = path.band(np, W, None, ("packed_left", M, C),
                           lambda: packed_gemm.PackedLeft(W.reshape(M, C)))
        product = packed.matmul_call(N, L, L, C * L, B, code, lo, hi)

        def call(X: np.ndarray, Z: np.ndarray | None) -> np.ndarray:
            return product(conv_native.strided_pixels(X, strides, out_sp), Z).reshape(out_shape)
    elif kind in ("im2col", "shift"):
        padded = (C, H + pb[0] + pe[0], Wd + pb[1] + pe[1])
        tiled = conv_native.patchify_fits(W.shape, strides, dilations, pb, pe)
        if group != 1:
            return None
        if not (tiled or packed_gemm.conv_fits(C * KH * KW, padded, out_sp, strides)):
            if not packed_gemm.patches_fit(N * math.prod(out_sp), M):
                return None
            call = _pixel_patches(path, W, B, (KH, KW), dilations, strides, (pb[0], pb[1]),
                                  out_sp, out_shape, store)
            return _contiguous(call if after is None else _then(call, after))
        packed = path.band(np, W, None, ("packed_left", W.shape),
                           lambda: packed_gemm.PackedLeft(W.reshape(M, C * KH * KW)))
        if tiled:
            call = _patchified(packed, N, KH, KW, out_sp, out_shape, B, store)
        else:
            call = packed.conv_call(X.shape, (KH, KW), dilations, strides,
                                    (pb[0], pb[1], pe[0], pe[1]), out_sp, B, code, lo, hi)
    else:
        return None
    return _contiguous(call if after is None else _then(call, after))


def _patchified(packed, N: int, KH: int, KW: int, out_sp, out_shape, B, store) -> BoundCall:
    """A conv whose kernel tiles its input: its patches copied out, then one product."""
    OH, OW = out_sp
    L = OH * OW
    product = packed.matmul_call(N, L, L, packed.K * L, B, *store)

    def call(X: np.ndarray, Z: np.ndarray | None) -> np.ndarray:
        return product(conv_native.patches(X, KH, KW, OH, OW), Z).reshape(out_shape)

    return call


def _pixel_patches(path, W: np.ndarray, B, kernel, dilations, strides, pads, out_sp,
                   out_shape, store) -> BoundCall:
    """A conv as each output pixel's patch (a row) times the weight packed transposed
    (plane_kernels.conv_patches, PackedRight), then the (pixels, M) result turned into
    NCHW: for ungrouped convs whose planes are too narrow for the packed conv's lanes
    (ResNet-18's 7 x 7 ones), where im2col and OpenBLAS ran at 110-130 GFLOP/s against
    onnxruntime's 250. The bias and the store's activation go in the product; with a
    residual, the activation waits for it."""
    N, M = out_shape[:2]
    L = out_shape[2] * out_shape[3]
    packed = path.band(np, W, None, ("packed_right", W.shape), lambda: packed_gemm.PackedRight(
        np.ascontiguousarray(W.reshape(M, -1).T)))
    code, lo, hi = store

    def call(X: np.ndarray, Z: np.ndarray | None) -> np.ndarray:
        P = plane_kernels.conv_patches(X, kernel, dilations, strides, pads, out_sp)
        if Z is None:
            Yt = packed.matmul(P, bias=B, act=code, lo=lo, hi=hi).reshape(N, L, M)
            return np.ascontiguousarray(Yt.transpose(0, 2, 1)).reshape(out_shape)
        Yt = packed.matmul(P, bias=B).reshape(N, L, M)
        Y = np.add(Yt.transpose(0, 2, 1), Z.reshape(N, M, L))
        if code == packed_gemm.ACT_RELU:
            np.maximum(Y, 0, out=Y)
        elif code == packed_gemm.ACT_CLIP:
            np.minimum(np.maximum(Y, np.float32(lo), out=Y), np.float32(hi), out=Y)
        return Y.reshape(out_shape)

    call.keep = packed  # type: ignore[attr-defined]
    return call


def _store(activation) -> tuple[tuple[int, float, float], Callable[[np.ndarray], None] | None]:
    """The activation as the kernels' store applies it (none, Relu, Clip), and the pass
    after the kernel for one it lacks (conv_native.stored's rule)."""
    store = activation_args(activation, store_only=True)
    if store is not None:
        return store, None
    act = activation_args(activation)
    if act is not None:
        return NO_ACTIVATION, lambda Y: conv_native.channels_epilogue(Y, None, None, act)
    return NO_ACTIVATION, lambda Y: conv_numpy.epilogue(np, Y, None, activation)


def _then(call: BoundCall, after: Callable[[np.ndarray], None]) -> BoundCall:
    def run(X: np.ndarray, Z: np.ndarray | None) -> np.ndarray:
        Y = call(X, Z)
        after(Y)
        return Y

    return run


def _contiguous(call: BoundCall) -> BoundCall:
    """The kernels read X as a dense (N, C, H, W) block: a strided view is copied first."""

    def run(X: np.ndarray, Z: np.ndarray | None) -> np.ndarray:
        if not X.flags.c_contiguous:
            X = np.ascontiguousarray(X)
        return call(X, Z)

    return run
