"""The com.microsoft.nchwc domain: onnxruntime's blocked-channel layout ops, as its
``optimized_model_filepath`` writes them at ORT_ENABLE_ALL (Conv, MaxPool, AveragePool,
GlobalAveragePool, ReorderInput, ReorderOutput, Upsample).

onnxruntime keeps these tensors as ``[N, C_padded, H, W]`` with channel blocks
interleaved in memory; that memory order is its own business and never leaves its
session. Here an NCHWc tensor is a plain NCHW array whose channels are padded with
zeros to a multiple of the block: ReorderInput pads, ReorderOutput trims, and the ops
between run the ordinary kernels. Only the convolution weights, which the optimizer
rewrote into blocked order in the saved model, are read back into OIHW (once, at
compile time when constant). The block is the one onnxruntime's MLAS picks on this
machine (16 with AVX-512F, else 8); as onnxruntime warns when it saves such a model,
the file is for the machine that wrote it.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import numpy as np

from hetero_exec.kernels.registry import KnownInput, kernel

NCHWC_DOMAIN = "com.microsoft.nchwc"


@functools.lru_cache(maxsize=1)
def block_size() -> int:
    """MLAS's NCHWc block on this cpu (16 floats with AVX-512F, else 8)."""
    from hetero_exec.kernels.native.library import cpu_runs

    return 16 if cpu_runs()["avx512"] else 8


def _round_up(c: int, b: int) -> int:
    return -(-c // b) * b


def unblock_filter(xp, W: Any, group: int, x_channels: int, blk: int) -> Any:
    """OIHW from the optimizer's blocked filter: ``OIHWBiBo`` for a conv on an NCHWc
    input, ``OIHWBo`` for one on plain NCHW (few input channels) or a depthwise one."""
    O, I = W.shape[0], W.shape[1]
    sp = tuple(W.shape[2:])
    if O % blk:
        raise ValueError(f"nchwc Conv: filter has {O} output channels, not a multiple of "
                         f"the block {blk}")
    if group == 1 and I % blk == 0 and x_channels == I:  # OIHWBiBo
        S = W.reshape((O // blk, I // blk) + sp + (blk, blk))
        nd = len(sp)
        order = (0, 3 + nd, 1, 2 + nd) + tuple(range(2, 2 + nd))
        return xp.ascontiguousarray(S.transpose(order)).reshape((O, I) + sp)
    S = W.reshape((O // blk, I) + sp + (blk,))  # OIHWBo
    order = (0, S.ndim - 1) + tuple(range(1, S.ndim - 1))
    return xp.ascontiguousarray(S.transpose(order)).reshape((O, I) + sp)


def _conv(xp, X, W, B, Sum, activation, activation_params, attrs):
    from hetero_exec.kernels.conv import FusedConv

    leaky = activation == "LeakyRelu"
    Y = FusedConv(xp, X, W, B, Sum, "" if leaky else activation, activation_params,
                  **attrs)[0]
    if leaky:
        alpha = np.float32(activation_params[0] if activation_params else 0.01)
        Y = xp.where(Y >= 0, Y, Y * alpha)
    return Y


def _conv_hook(xp, kwargs: dict, inputs: Sequence[KnownInput]):
    """A constant filter read back into OIHW once."""
    if len(inputs) < 2 or inputs[1].value is None or inputs[1].overridable:
        return None
    x_shape = inputs[0].shape
    if x_shape is None or len(x_shape) < 2 or not isinstance(x_shape[1], int):
        return None
    group = int(kwargs.get("group", 1))
    W = xp.asarray(unblock_filter(np, inputs[1].value, group, x_shape[1], block_size()))

    def Conv_nchwc_unblocked(xp, X, Wb, B=None, Sum=None, activation="",
                             activation_params=None, **attrs):
        if X.shape[1] != x_shape[1]:
            return Conv(xp, X, Wb, B, Sum, activation, activation_params, **attrs)
        return (_conv(xp, X, W, B, Sum, activation, activation_params, attrs),)

    return Conv_nchwc_unblocked


@kernel("Conv", since=1, domain=NCHWC_DOMAIN, specialize=_conv_hook)
def Conv(xp, X, W, B=None, Sum=None, activation="", activation_params=None, auto_pad="NOTSET",
         dilations=None, group=1, kernel_shape=None, pads=None, strides=None):
    """Conv on a (padded) NCHWc input or, for few input channels, a plain NCHW one; the
    output is NCHWc; ``Sum`` (a residual) is added before ``activation``."""
    Wu = unblock_filter(xp, W, group, X.shape[1], block_size())
    attrs = dict(auto_pad=auto_pad, dilations=dilations, group=group,
                 kernel_shape=kernel_shape, pads=pads, strides=strides)
    return (_conv(xp, X, Wu, B, Sum, activation, activation_params, attrs),)


@kernel("MaxPool", since=1, domain=NCHWC_DOMAIN)
def MaxPool(xp, X, auto_pad="NOTSET", ceil_mode=0, dilations=None, kernel_shape=None,
            pads=None, storage_order=0, strides=None):
    from hetero_exec.kernels.pool import MaxPool as plain

    return (plain(xp, X, auto_pad=auto_pad, ceil_mode=ceil_mode, dilations=dilations,
                  kernel_shape=kernel_shape, pads=pads, storage_order=storage_order,
                  strides=strides)[0],)


@kernel("AveragePool", since=1, domain=NCHWC_DOMAIN)
def AveragePool(xp, X, auto_pad="NOTSET", ceil_mode=0, count_include_pad=0, dilations=None,
                kernel_shape=None, pads=None, strides=None):
    from hetero_exec.kernels.pool import AveragePool as plain

    return (plain(xp, X, auto_pad=auto_pad, ceil_mode=ceil_mode,
                  count_include_pad=count_include_pad, dilations=dilations,
                  kernel_shape=kernel_shape, pads=pads, strides=strides)[0],)


@kernel("GlobalAveragePool", since=1, domain=NCHWC_DOMAIN)
def GlobalAveragePool(xp, X):
    return (xp.mean(X, axis=tuple(range(2, X.ndim)), keepdims=True, dtype=X.dtype),)


@kernel("GlobalMaxPool", since=1, domain=NCHWC_DOMAIN)
def GlobalMaxPool(xp, X):
    return (xp.max(X, axis=tuple(range(2, X.ndim)), keepdims=True),)


@kernel("ReorderInput", since=1, domain=NCHWC_DOMAIN)
def ReorderInput(xp, X, channels_last=0):
    """NCHW (or NHWC) -> NCHWc: channels padded with zeros to the block."""
    if channels_last:
        X = xp.moveaxis(X, -1, 1)
    C = X.shape[1]
    Cp = _round_up(C, block_size())
    if Cp == C:
        return (xp.ascontiguousarray(X),)
    Y = xp.zeros((X.shape[0], Cp) + tuple(X.shape[2:]), dtype=X.dtype)
    Y[:, :C] = X
    return (Y,)


@kernel("ReorderOutput", since=1, domain=NCHWC_DOMAIN)
def ReorderOutput(xp, X, channels=0, channels_last=0):
    """NCHWc -> NCHW (or NHWC) with ``channels`` channels."""
    Y = X[:, :channels] if channels else X
    if channels_last:
        Y = xp.moveaxis(Y, 1, -1)
    return (xp.ascontiguousarray(Y),)


@kernel("Upsample", since=1, domain=NCHWC_DOMAIN)
def Upsample(xp, X, scales=None, mode="nearest", coordinate_transformation_mode="asymmetric"):
    """Integer spatial ``scales``; nearest or linear (onnx Resize's rules)."""
    from hetero_exec.kernels.resize import Resize

    sc = [int(s) for s in (scales or [])]
    if len(sc) == X.ndim - 2:
        sc = [1, 1] + sc
    if mode == "nearest" and coordinate_transformation_mode == "asymmetric":
        Y = X
        for axis, s in enumerate(sc):
            if s != 1:
                Y = xp.repeat(Y, s, axis=axis)
        return (Y,)
    sizes = np.array([d * s for d, s in zip(X.shape, sc)], np.int64)
    return Resize(xp, X, None, None, sizes, mode=mode,
                  coordinate_transformation_mode=coordinate_transformation_mode,
                  nearest_mode="floor")
