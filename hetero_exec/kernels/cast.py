"""Cast, CastLike, BitCast.

Element types follow onnx.helper.tensor_dtype_to_np_dtype: ml_dtypes for bfloat16,
float8*, float4e2m1, (u)int4 and (u)int2; numpy object arrays of ``str`` for STRING.
The kernels are device-eligible; a provider refuses dtypes its array module lacks
(cupy has no ml_dtypes types and no strings), so those branches only ever see numpy.

Saturation (opset 19+, default on) applies to the four float8 types exactly as
onnx/reference/ops/op_cast.py does: clip to the type's finite range, then convert
(NaN stays NaN, +-inf becomes +-max). float8e8m0 follows onnx.numpy_helper.to_float8e8m0
(``round_mode`` up/down/nearest).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from hetero_exec.kernels._common import np_dtype
from hetero_exec.kernels.registry import kernel

_FLOAT8 = frozenset({TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E4M3FNUZ,
                     TensorProto.FLOAT8E5M2, TensorProto.FLOAT8E5M2FNUZ})
_E8M0 = getattr(TensorProto, "FLOAT8E8M0", None)


def _finfo(dtype):
    import ml_dtypes

    return ml_dtypes.finfo(dtype)


def _is_str(dtype) -> bool:
    return dtype.kind in "OUS"


def _to_string(xp, x):
    if _is_str(x.dtype):
        return x if x.dtype.kind == "O" else x.astype(object)
    if x.dtype.kind == "V":  # ml_dtypes: numpy cannot format them directly
        x = x.astype(np.float32)
    return x.astype(np.str_).astype(object)


def _from_string(xp, x, to: int, dtype):
    s = x.astype(np.str_)
    if dtype.kind == "b":
        # numpy treats any non-empty string as True; "0"/"false" should be False
        low = np.char.lower(np.char.strip(s))
        return ~np.isin(low, ["", "0", "0.0", "false"])
    if dtype.kind in "iuf":
        return s.astype(dtype)
    return _cast_numeric(xp, s.astype(np.float32), to, dtype, saturate=1, round_mode="up")


def _to_e8m0(xp, x, saturate, round_mode):
    """Port of onnx.numpy_helper.to_float8e8m0 (exponent of a float32, with rounding)."""
    import ml_dtypes

    bits = x.astype(np.float32).view(np.uint32)
    exponent = ((bits >> 23) & 0xFF).astype(np.uint16)
    special = exponent == 0xFF
    if round_mode == "nearest":
        g = (bits & 0x400000) > 0
        r = (bits & 0x200000) > 0
        s = (bits & 0x1FFFFF) > 0
        lsb = exponent > 0
        round_up = g & (r | s | lsb) & ~special
    elif round_mode == "up":
        round_up = ((bits & 0x7FFFFF) > 0) & ~special
    elif round_mode == "down":
        round_up = xp.zeros(bits.shape, dtype=bool)
    else:
        raise ValueError(f"Cast: unsupported round_mode {round_mode!r}")
    if saturate:
        round_up = round_up & (exponent != 0xFE)
    exponent = (exponent + round_up.astype(np.uint16)).astype(np.uint8)
    out = xp.where(special, np.uint8(0xFF), exponent).astype(np.uint8)
    return out.view(ml_dtypes.float8_e8m0fnu)


def _cast_numeric(xp, x, to: int, dtype, saturate, round_mode):
    if x.dtype == dtype:
        return x
    if to in _FLOAT8 and saturate:
        fi = _finfo(dtype)
        if x.dtype.kind in "iub":
            x = x.astype(np.float32)
        return xp.clip(x, float(fi.min), float(fi.max)).astype(dtype)
    if _E8M0 is not None and to == _E8M0:
        return _to_e8m0(xp, x, saturate, round_mode)
    return x.astype(dtype)


def cast(xp, x, to: int, saturate=1, round_mode="up"):
    """``x`` converted to ONNX element type ``to``."""
    if to == TensorProto.STRING:
        return _to_string(xp, x)
    dtype = np_dtype(to)
    if _is_str(x.dtype):
        return _from_string(xp, x, to, dtype)
    return _cast_numeric(xp, x, to, dtype, saturate, round_mode)


def _to_enum(to) -> int:
    if isinstance(to, str):  # Cast-1 spelled the type as a string ("FLOAT")
        return TensorProto.DataType.Value(to.upper())
    return int(to)


@kernel("Cast", (1, 19, 24))
def Cast(xp, input, to, saturate=1, round_mode="up"):  # noqa: A002
    to = _to_enum(to)
    if xp is np and to in _HALF_FLOAT and type(input) is np.ndarray:
        from hetero_exec.kernels.native.row_kernels import convert_half

        out = convert_half(input, _HALF_FLOAT[to])  # float16 <-> float32 (native/half.c)
        if out is not None:
            return (out,)
    return (xp.asarray(cast(xp, input, to, saturate, round_mode)),)


#: Cast targets native/half.c converts to (from the other of the two)
_HALF_FLOAT = {TensorProto.FLOAT: np.dtype(np.float32), TensorProto.FLOAT16: np.dtype(np.float16)}


@kernel("CastLike", (15, 19, 24))
def CastLike(xp, input, target_type, saturate=1, round_mode="up"):  # noqa: A002
    dt = target_type.dtype
    to = TensorProto.STRING if _is_str(dt) else _onnx_type(dt)
    return (xp.asarray(cast(xp, input, to, saturate, round_mode)),)


def _onnx_type(dtype) -> int:
    import onnx.helper

    return onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


@kernel("BitCast", 26)
def BitCast(xp, input, to):  # noqa: A002
    to = _to_enum(to)
    if to == TensorProto.STRING or _is_str(input.dtype):
        raise ValueError("BitCast: STRING is not supported")
    dtype = np_dtype(to)
    if dtype.itemsize != input.dtype.itemsize:
        raise ValueError(f"BitCast: {input.dtype} and {dtype} differ in size")
    return (input.view(dtype),)
