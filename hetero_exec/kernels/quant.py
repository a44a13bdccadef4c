"""Linear (de)quantisation: QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear.

Per-tensor, per-axis and blocked (``block_size``) granularities; integer targets
(u)int2/4/8/16 and the ml_dtypes float8/float4 types (those only exist on numpy, so
nodes with such tensors are for the cpu provider).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from hetero_exec.kernels._common import norm_axis, np_dtype
from hetero_exec.kernels.registry import kernel

_BYTES = (np.dtype(np.uint8), np.dtype(np.int8))
_INT_RANGES = {
    np.dtype(np.uint8): (0, 255),
    np.dtype(np.int8): (-128, 127),
    np.dtype(np.uint16): (0, 65535),
    np.dtype(np.int16): (-32768, 32767),
    np.dtype(ml_dtypes.uint4): (0, 15),
    np.dtype(ml_dtypes.int4): (-8, 7),
    np.dtype(ml_dtypes.uint2): (0, 3),
    np.dtype(ml_dtypes.int2): (-2, 1),
}

_FLOAT8 = {
    np.dtype(ml_dtypes.float8_e4m3fn),
    np.dtype(ml_dtypes.float8_e4m3fnuz),
    np.dtype(ml_dtypes.float8_e5m2),
    np.dtype(ml_dtypes.float8_e5m2fnuz),
}

_FLOAT_SMALL = {  # no inf/nan encodings: the cast itself saturates
    np.dtype(ml_dtypes.float4_e2m1fn),
    np.dtype(ml_dtypes.float6_e2m3fn),
    np.dtype(ml_dtypes.float6_e3m2fn),
}


def _param(xp, v, shape, axis, block_size):
    """Scale / zero point made broadcastable to x: scalar, per-axis (1-D along axis) or
    blocked (repeated block_size times along axis, trimmed to x's extent)."""
    if v.ndim == 0:
        return v
    if v.size == 1:
        return v.reshape(())
    rank = len(shape)
    axis = norm_axis(axis, rank)
    if axis >= rank:
        axis = rank - 1
    if not block_size:
        dims = [1] * rank
        dims[axis] = v.size
        return v.reshape(dims)
    v = xp.repeat(v, int(block_size), axis=axis)
    if v.shape[axis] != shape[axis]:
        sl = [slice(None)] * rank
        sl[axis] = slice(0, shape[axis])
        v = v[tuple(sl)]
    return v


@kernel("QuantizeLinear", since=(10, 13, 19, 21, 23, 24, 25, 28))
def QuantizeLinear(xp, x, y_scale, y_zero_point=None, axis=1, block_size=0, output_dtype=0,
                   precision=0, saturate=1):
    q = _quantize_scalar_8bit(xp, x, y_scale, y_zero_point, output_dtype, precision)
    if q is not None:
        return (q,)
    if y_zero_point is not None:
        out_dt = np.dtype(y_zero_point.dtype)
    elif output_dtype:
        out_dt = np_dtype(output_dtype)
    else:
        out_dt = np.dtype(np.uint8)
    scale = _param(xp, y_scale, x.shape, axis, block_size)
    if precision:
        pdt = np_dtype(precision)
        v = x.astype(pdt, copy=False) / scale.astype(pdt, copy=False)
    else:
        v = x / scale
    if v.dtype.kind != "f" or v.dtype.itemsize < 4:
        v = v.astype(np.float32)
    zp = None
    if y_zero_point is not None:
        zp = _param(xp, y_zero_point, x.shape, axis, block_size)

    if out_dt in _INT_RANGES:
        lo, hi = _INT_RANGES[out_dt]
        q = xp.rint(v)
        if zp is not None:
            q = q + zp.astype(np.int32).astype(q.dtype)
        q = xp.clip(q, lo, hi)
        if out_dt.kind not in "iu":  # ml_dtypes (u)int2/4 cast from a machine int
            return (xp.asarray(q.astype(np.int32).astype(out_dt)),)
        return (xp.asarray(q.astype(out_dt)),)
    if out_dt in _FLOAT8:
        if saturate:
            m = float(ml_dtypes.finfo(out_dt).max)
            v = xp.clip(v, -m, m)
        return (xp.asarray(v.astype(out_dt)),)
    if out_dt in _FLOAT_SMALL:
        if zp is not None:
            v = v + zp.astype(np.float32)
        return (xp.asarray(v.astype(out_dt)),)
    raise ValueError(f"QuantizeLinear: unsupported output type {out_dt}")


def _quantize_scalar_8bit(xp, x, y_scale, y_zero_point, output_dtype, precision):
    """A QDQ model's activation quantization (float32 x, one scale and zero point, 8-bit
    out) in one buffer, without broadcasting the parameters: the same arithmetic as the
    general path (x / scale, half to even, + zero point, clip), a third of its passes'
    allocations. None when it is not that case. (A scalar C loop of the same
    arithmetic was slower than these vectorized passes: rintf and the clamps are libm calls
    there.)"""
    if xp is not np or x.dtype != np.float32 or precision or y_scale.size != 1 \
            or y_scale.dtype != np.float32:
        return None
    out_dt = np.dtype(y_zero_point.dtype) if y_zero_point is not None else (
        np_dtype(output_dtype) if output_dtype else np.dtype(np.uint8))
    if out_dt not in _BYTES or (y_zero_point is not None and y_zero_point.size != 1):
        return None
    zp = 0 if y_zero_point is None else int(y_zero_point.reshape(-1)[0])
    lo, hi = _INT_RANGES[out_dt]
    v = np.divide(x, y_scale.reshape(()))
    np.rint(v, out=v)
    v += np.float32(zp)
    np.clip(v, lo, hi, out=v)
    return v.astype(out_dt)


@kernel("DequantizeLinear", since=(10, 13, 19, 21, 23, 24, 25, 28))
def DequantizeLinear(xp, x, x_scale, x_zero_point=None, axis=1, block_size=0, output_dtype=0):
    xdt = np.dtype(x.dtype)
    dx = x.astype(np.float32)
    # float8/float4 have no meaningful zero point (it must be 0)
    if x_zero_point is not None and xdt not in _FLOAT8 and xdt not in _FLOAT_SMALL:
        dx = dx - _param(xp, x_zero_point, x.shape, axis, block_size).astype(np.float32)
    scale = _param(xp, x_scale, x.shape, axis, block_size)
    y = dx * scale
    out_dt = np_dtype(output_dtype) if output_dtype else np.dtype(x_scale.dtype)
    return (xp.asarray(y.astype(out_dt, copy=False)),)


@kernel("DynamicQuantizeLinear", since=11)
def DynamicQuantizeLinear(xp, x):
    if xp is np and x.dtype == np.float32 and x.size:
        from hetero_exec.kernels.native import library

        if library.available():  # one pass for the range, one to quantize (qgemm.c)
            xc = np.ascontiguousarray(x)
            y = np.empty(x.shape, np.uint8)
            scale, zp = np.empty((), np.float32), np.empty((), np.uint8)
            library.lib().he_dynamic_quantize(library.address(xc), xc.size, library.address(y),
                                              scale.ctypes.data, zp.ctypes.data)
            return (y, scale, zp)
    xf = x.astype(np.float32, copy=False)
    zero = np.float32(0)
    if x.size:
        maxx = xp.maximum(zero, xp.max(xf))
        minx = xp.minimum(zero, xp.min(xf))
    else:
        maxx = minx = xp.asarray(zero)
    rng = xp.where(maxx == minx, np.float32(1.0), maxx - minx)
    scale = (rng / np.float32(255)).astype(np.float32)
    zp = xp.rint(xp.clip(-minx / scale, 0, 255))
    y = xp.asarray(xp.clip(xp.rint(xf / scale) + zp, 0, 255).astype(np.uint8))
    return (y, xp.asarray(scale.astype(x.dtype)), xp.asarray(zp.astype(np.uint8)))

