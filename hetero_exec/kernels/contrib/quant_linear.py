"""com.microsoft ops on 8-bit linearly quantized tensors (QLinearAdd, QLinearMul,
QLinearSigmoid, QLinearLeakyRelu, QLinearConcat, QLinearAveragePool,
QLinearGlobalAveragePool) and GatherBlockQuantized.

Each dequantizes in float32, applies the float op and requantizes (round half to even,
saturate), as onnxruntime does. The unary ops go through a 256-entry table built for the
node's scales on each run (onnxruntime builds the same table), so the float function is
evaluated 256 times whatever the tensor's size.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hetero_exec.kernels.contrib.quant_matmul import MS_DOMAIN, unpack_codes
from hetero_exec.kernels.registry import kernel


def _scalar(v: Any, dtype=np.float32) -> Any:
    return v.reshape(()).astype(dtype)


def dequantize(xp, x: Any, scale: Any, zero_point: Any) -> Any:
    xf = x.astype(np.float32)
    if zero_point is not None:
        xf = xf - _scalar(zero_point)
    return xf * _scalar(scale)


def quantize(xp, v: Any, scale: Any, zero_point: Any, dtype: Any) -> Any:
    """``saturate(rint(v / scale + zero_point))`` in ``dtype`` (uint8 or int8)."""
    return _requantize(xp, v / _scalar(scale), zero_point, dtype)


def _centered(x: Any, zero_point: Any) -> Any:
    xf = x.astype(np.float32)
    return xf if zero_point is None else xf - _scalar(zero_point)


def _requantize(xp, v: Any, zero_point: Any, dtype: Any) -> Any:
    """``saturate(rint(v + zero_point))``: v already divided by the output scale (the zero
    point added before rounding, as onnxruntime's vector kernels do)."""
    q = xp.rint(v if zero_point is None else v + _scalar(zero_point))
    info = np.iinfo(np.dtype(dtype))
    return xp.clip(q, info.min, info.max).astype(dtype)


def _out_dtype(zero_point: Any, x: Any) -> np.dtype:
    return np.dtype(zero_point.dtype if zero_point is not None else x.dtype)


@kernel("QLinearAdd", since=1, domain=MS_DOMAIN)
def QLinearAdd(xp, A, A_scale, A_zero_point, B, B_scale, B_zero_point=None, C_scale=None,
               C_zero_point=None):
    cs = _scalar(C_scale)
    v = (_centered(A, A_zero_point) * (_scalar(A_scale) / cs)
         + _centered(B, B_zero_point) * (_scalar(B_scale) / cs))
    return (_requantize(xp, v, C_zero_point, _out_dtype(C_zero_point, A)),)


@kernel("QLinearMul", since=1, domain=MS_DOMAIN)
def QLinearMul(xp, A, A_scale, A_zero_point, B, B_scale, B_zero_point=None, C_scale=None,
               C_zero_point=None):
    # the integer product (exact in float32) times one multiplier, as onnxruntime rounds
    prod = _centered(A, A_zero_point) * _centered(B, B_zero_point)
    mult = _scalar(A_scale) * _scalar(B_scale) / _scalar(C_scale)
    return (_requantize(xp, prod * mult, C_zero_point, _out_dtype(C_zero_point, A)),)


def _table_op(xp, X, X_scale, X_zero_point, Y_scale, Y_zero_point, fn) -> Any:
    """fn on every value X's dtype has, requantized: then one lookup per element."""
    dt = np.dtype(X.dtype)
    info = np.iinfo(dt)
    codes = xp.arange(int(info.min), int(info.max) + 1, dtype=np.int32).astype(dt)
    table = quantize(xp, fn(xp, dequantize(xp, codes, X_scale, X_zero_point)), Y_scale,
                     Y_zero_point, _out_dtype(Y_zero_point, X))
    index = X.astype(np.int32) - int(info.min)
    return xp.take(table, index)


def _sigmoid(xp, v):
    return np.float32(1) / (np.float32(1) + xp.exp(-v))


@kernel("QLinearSigmoid", since=1, domain=MS_DOMAIN)
def QLinearSigmoid(xp, X, X_scale, X_zero_point=None, Y_scale=None, Y_zero_point=None):
    return (_table_op(xp, X, X_scale, X_zero_point, Y_scale, Y_zero_point, _sigmoid),)


@kernel("QLinearLeakyRelu", since=1, domain=MS_DOMAIN)
def QLinearLeakyRelu(xp, X, X_scale, X_zero_point=None, Y_scale=None, Y_zero_point=None,
                     alpha=0.01):
    a = np.float32(alpha)
    return (_table_op(xp, X, X_scale, X_zero_point, Y_scale, Y_zero_point,
                      lambda xp, v: xp.where(v >= 0, v, v * a)),)


@kernel("QLinearConcat", since=1, domain=MS_DOMAIN)
def QLinearConcat(xp, Y_scale, Y_zero_point, *inputs, axis=0):
    """inputs: (X, X_scale, X_zero_point) triples."""
    if len(inputs) % 3 or not inputs:
        raise ValueError(f"QLinearConcat: inputs after Y_scale and Y_zero_point must be "
                         f"(tensor, scale, zero point) triples, got {len(inputs)} inputs")
    out_dt = _out_dtype(Y_zero_point, inputs[0])
    parts = [quantize(xp, dequantize(xp, inputs[i], inputs[i + 1], inputs[i + 2]), Y_scale,
                      Y_zero_point, out_dt) for i in range(0, len(inputs), 3)]
    return (xp.concatenate(parts, axis=axis),)


def _nhwc_to_nchw(xp, X):
    return xp.moveaxis(X, -1, 1)


def _average_pool(xp, X, **attrs):
    from hetero_exec.kernels.pool import AveragePool

    return AveragePool(xp, X, **attrs)[0]


@kernel("QLinearAveragePool", since=1, domain=MS_DOMAIN)
def QLinearAveragePool(xp, X, x_scale, x_zero_point=None, y_scale=None, y_zero_point=None,
                       auto_pad="NOTSET", ceil_mode=0, channels_last=0, count_include_pad=0,
                       kernel_shape=None, pads=None, strides=None):
    # onnxruntime averages dequantized values in NCHW, and centred codes (scaled after)
    # in NHWC: the same orders, so the same roundings
    Xf = _centered(X, x_zero_point)
    scale = _scalar(x_scale)
    if not channels_last:
        Xf, scale = Xf * scale, np.float32(1)
    if channels_last:
        Xf = xp.ascontiguousarray(_nhwc_to_nchw(xp, Xf))
    Yf = _average_pool(xp, Xf, auto_pad=auto_pad, ceil_mode=ceil_mode,
                       count_include_pad=count_include_pad, kernel_shape=kernel_shape,
                       pads=pads, strides=strides)
    if channels_last:
        Yf = xp.moveaxis(Yf, 1, -1)
    return (quantize(xp, Yf * scale, y_scale, y_zero_point, _out_dtype(y_zero_point, X)),)


@kernel("QLinearGlobalAveragePool", since=1, domain=MS_DOMAIN)
def QLinearGlobalAveragePool(xp, X, x_scale, x_zero_point=None, y_scale=None,
                             y_zero_point=None, channels_last=0):
    axes = tuple(range(1, X.ndim - 1)) if channels_last else tuple(range(2, X.ndim))
    Yf = xp.mean(_centered(X, x_zero_point), axis=axes, keepdims=True, dtype=np.float32)
    return (quantize(xp, Yf * _scalar(x_scale), y_scale, y_zero_point,
                     _out_dtype(y_zero_point, X)),)


# ------------------------------------------------------------------ GatherBlockQuantized


@kernel("GatherBlockQuantized", since=1, domain=MS_DOMAIN)
def GatherBlockQuantized(xp, data, indices, scales, zero_points=None, gather_axis=0,
                         quantize_axis=1, block_size=128, bits=4):
    """Rows of a blockwise-quantized table (an embedding), dequantized to scales' dtype.

    data is int4 / uint4 (one code an element) or uint8 holding ``8 // bits`` codes a
    byte along the quantize axis, the last one (MatMulNBits' layout; then a missing zero
    point is ``2 ** (bits - 1)`` and zero points are packed the same way)."""
    rank = data.ndim
    g = gather_axis % rank
    qa = quantize_axis % rank
    packed = np.dtype(data.dtype) == np.uint8
    if packed:
        if qa != rank - 1:
            raise ValueError("GatherBlockQuantized: uint8 data is quantized along its last "
                             f"axis, got quantize_axis={quantize_axis}")
        if bits not in (4, 8):
            raise ValueError(f"GatherBlockQuantized: bits must be 4 or 8, got {bits}")
    if g == qa:
        raise ValueError("GatherBlockQuantized: gather_axis and quantize_axis must differ")
    idx = indices.astype(np.int64)
    n = data.shape[g]
    if idx.size and (int(idx.min()) < -n or int(idx.max()) >= n):
        raise ValueError(f"GatherBlockQuantized: indices out of range for axis {g} of {n}")
    idx = xp.where(idx < 0, idx + n, idx)
    codes = xp.take(data, idx, axis=g)
    sc = xp.take(scales, idx, axis=g)
    zp = None if zero_points is None else xp.take(zero_points, idx, axis=g)
    out_q = qa + idx.ndim - 1 if qa > g else qa  # the quantize axis in the gathered shape
    if packed:
        codes = unpack_codes(xp, codes, bits)
        if zp is not None:
            zp = unpack_codes(xp, zp, bits)
    codes = codes.astype(np.float32)
    length = codes.shape[out_q]
    blocks = sc.shape[out_q]
    if zp is None:
        zpf = np.float32(1 << (bits - 1)) if packed else np.float32(0)
    else:
        zpf = _expand(xp, zp.astype(np.float32), out_q, blocks, block_size, length)
    scf = _expand(xp, sc.astype(np.float32), out_q, blocks, block_size, length)
    if packed and codes.shape[out_q] > length:
        codes = xp.take(codes, xp.arange(length), axis=out_q)
    return (((codes - zpf) * scf).astype(scales.dtype),)


def _expand(xp, v, axis: int, blocks: int, block_size: int, length: int) -> Any:
    """Per-block values repeated over their block along ``axis``, trimmed to ``length``."""
    if v.shape[axis] != blocks:  # packed zero points: more codes than blocks
        v = xp.take(v, xp.arange(blocks), axis=axis)
    v = xp.repeat(v, block_size, axis=axis)
    if v.shape[axis] != length:
        v = xp.take(v, xp.arange(length), axis=axis)
    return v
