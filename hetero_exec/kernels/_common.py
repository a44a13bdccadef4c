"""Helpers shared by kernel families: registering element-wise ops in one line,
axis normalisation, reading host values, dtype conversion."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import numpy as np
import onnx.helper

from hetero_exec.kernels.registry import kernel


def unary(op_type: str, fn: Callable[[Any, Any], Any], since: int | Iterable[int] = 1, **kw) -> None:
    """Register an element-wise op ``y = fn(xp, x)`` that keeps x's dtype."""

    def k(xp, x):
        return (fn(xp, x),)

    k.__name__ = k.__qualname__ = op_type
    kernel(op_type, since, **kw)(k)


def binary(op_type: str, fn: Callable[[Any, Any, Any], Any], since: int | Iterable[int] = 1, **kw) -> None:
    """Register a broadcasting binary op ``z = fn(xp, a, b)``."""

    def k(xp, a, b):
        return (fn(xp, a, b),)

    k.__name__ = k.__qualname__ = op_type
    kernel(op_type, since, **kw)(k)


def variadic(op_type: str, fn: Callable[[Any, Any, Any], Any], since: int | Iterable[int] = 1, **kw) -> None:
    """Register an op folding ``fn`` over any number of broadcast inputs (Sum, Max...)."""

    def k(xp, *xs):
        out = xs[0]
        for x in xs[1:]:
            out = fn(xp, out, x)
        return (xp.asarray(out),)

    k.__name__ = k.__qualname__ = op_type
    kernel(op_type, since, **kw)(k)


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
