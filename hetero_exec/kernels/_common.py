"""Helpers shared by kernel families: reading host values, axis normalisation, dtype
conversion. (Element-wise ops register through `kernels.elementwise`'s own `_unary` and `_binary`.)"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import onnx.helper


def host_ints(v: Any) -> list[int]:
    """A host value (shape, axes, pads...) as a Python int list; accepts numpy, cupy, lists."""
    if v is None:
        return []
    if hasattr(v, "get") and not isinstance(v, (np.ndarray, dict)):  # cupy array
        v = v.get()
    return [int(i) for i in np.asarray(v).reshape(-1)]


def host_scalar(v: Any) -> Any:
    """The first element as a Python scalar. A device array gives up that one element
    only (``.item()``: a sync, as CuPy's ``int(x)``), never its whole buffer."""
    if hasattr(v, "get") and not isinstance(v, (np.ndarray, dict)):
        return v.reshape(-1)[0].item()
    return np.asarray(v).reshape(-1)[0].item()


def norm_axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def norm_axes(axes: Sequence[int], rank: int) -> tuple[int, ...]:
    return tuple(a + rank if a < 0 else a for a in axes)


def np_dtype(onnx_type: int) -> np.dtype:
    """The numpy dtype for an ONNX TensorProto element type (ml_dtypes for bfloat16, float8...)."""
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(onnx_type))


def onnx_type(dtype: Any) -> int:
    return onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
