"""Tensors made from attributes, shapes or scalars: Range, ConstantOfShape, Constant
(sparse values too), EyeLike, OneHot.
"""

from __future__ import annotations

import math

import numpy as np

from hetero_exec.kernels._common import norm_axis, np_dtype
from hetero_exec.kernels._tensor_common import ints, scalar
from hetero_exec.kernels.registry import kernel

_I64 = np.int64



@kernel("Range", since=(11, 27), host_inputs=(0, 1, 2))
def Range(xp, start, limit, delta, stash_type=1):
    dtype = start.dtype
    s, l, d = scalar(start), scalar(limit), scalar(delta)
    if dtype.kind in "iu":
        s, l, d = int(s), int(l), int(d)
        n = max(-((s - l) // d), 0)
        return (xp.arange(s, s + n * d, d, dtype=dtype)[:n],)
    n = max(int(math.ceil((l - s) / d)), 0)
    compute = np.float64 if (dtype == np.float64 or stash_type == 11) else np.float32
    out = xp.arange(n, dtype=compute) * compute(d) + compute(s)
    return (out.astype(dtype, copy=False),)


@kernel("ConstantOfShape", since=9, host_inputs=(0,))
def ConstantOfShape(xp, input, value=None):
    shape = ints(input)
    if value is None:
        return (xp.zeros(shape, dtype=np.float32),)
    return (xp.full(shape, value.reshape(-1)[0], dtype=value.dtype),)


def _sparse_to_dense(sp) -> np.ndarray:
    if isinstance(sp, np.ndarray):
        return sp
    if hasattr(sp, "toarray"):  # scipy-like
        return np.asarray(sp.toarray())
    from onnx import numpy_helper

    values = numpy_helper.to_array(sp.values)
    indices = numpy_helper.to_array(sp.indices).astype(_I64)
    dims = tuple(sp.dims)
    dense = np.zeros(dims, dtype=values.dtype)
    if indices.ndim == 2:  # [NNZ, rank] coordinates
        dense[tuple(indices.T)] = values
    else:  # linearised
        dense.reshape(-1)[indices] = values
    return dense


@kernel("Constant", since=(1, 9, 11, 12))
def Constant(xp, value=None, sparse_value=None, value_float=None, value_floats=None,
             value_int=None, value_ints=None, value_string=None, value_strings=None):
    if value is not None:
        arr = np.asarray(value)
    elif sparse_value is not None:
        arr = _sparse_to_dense(sparse_value)
    elif value_float is not None:
        arr = np.array(value_float, dtype=np.float32)
    elif value_floats is not None:
        arr = np.array(value_floats, dtype=np.float32)
    elif value_int is not None:
        arr = np.array(value_int, dtype=_I64)
    elif value_ints is not None:
        arr = np.array(value_ints, dtype=_I64)
    elif value_string is not None:
        return (np.array(value_string, dtype=object),)
    elif value_strings is not None:
        return (np.array(value_strings, dtype=object),)
    else:
        raise ValueError("Constant: no value attribute")
    if arr.dtype.kind in "OSU":  # strings stay on the host
        return (arr.astype(object),)
    return (xp.asarray(arr),)


@kernel("EyeLike", since=(9, 22))
def EyeLike(xp, input, dtype=None, k=0):
    out_dtype = np_dtype(dtype) if dtype is not None else input.dtype
    n, m = input.shape
    return (xp.eye(n, m, k=k, dtype=out_dtype),)


@kernel("OneHot", since=(9, 11), host_inputs=(1,))
def OneHot(xp, indices, depth, values, axis=-1):
    depth = int(scalar(depth))
    rank = indices.ndim + 1
    axis = norm_axis(axis, rank)
    idx = indices
    if idx.dtype.kind == "f":
        idx = idx.astype(_I64)
    idx = xp.where(idx < 0, idx + depth, idx)
    shape = [1] * rank
    shape[axis] = depth
    hot = xp.expand_dims(idx, axis) == xp.arange(depth).reshape(shape)
    return (xp.where(hot, values[1], values[0]),)
