"""Helpers private to the tensor / gather / resize / detection kernel families."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from hetero_exec.kernels._common import host_ints, host_scalar


def to_host(v: Any) -> np.ndarray:
    """A (small) value as a numpy array, whether it lives in numpy or cupy."""
    if hasattr(v, "get") and not isinstance(v, (np.ndarray, dict)):  # cupy array
        v = v.get()
    return np.asarray(v)


def ints(v: Any) -> list[int]:
    """``host_ints`` with a fast path for numpy integer arrays and lists (shape ops call
    this on every run, so it is kept to a ``tolist``)."""
    if type(v) is np.ndarray and v.dtype.kind in "iu":
        return v.reshape(-1).tolist()
    if type(v) is list:
        return [int(i) for i in v]
    return host_ints(v)


def scalar(v: Any) -> Any:
    """The first element of a host value as a Python scalar."""
    if type(v) is np.ndarray:
        return v.reshape(-1)[0].item()
    return host_scalar(v)


def host_floats(v: Any) -> list[float]:
    """A host value (scales, roi...) as a Python float list; [] for None or empty."""
    if v is None:
        return []
    return [float(f) for f in to_host(v).reshape(-1)]


def flat_index(xp, indices, data_shape, axis: int):
    """Flat offsets into a C-ordered ``data_shape`` of ``data[i0, .., indices[i], .., in]``
    for every position of ``indices`` (which may be smaller than data off ``axis``);
    ``indices`` must already be non-negative."""
    rank = indices.ndim
    strides = [math.prod(data_shape[d + 1:]) for d in range(rank)]
    base = None
    for d, n in enumerate(indices.shape):
        if d == axis or n == 1:
            continue
        shape = [1] * rank
        shape[d] = n
        term = xp.arange(0, n * strides[d], strides[d], dtype=np.int64).reshape(shape)
        base = term if base is None else base + term
    lin = indices.astype(np.int64, copy=False)
    if strides[axis] != 1:
        lin = lin * strides[axis]
    return lin if base is None else lin + base


def normalize_indices(xp, indices, dim):
    """Negative indices counted from the end (``dim`` may be a broadcastable array)."""
    if indices.dtype.kind == "u":
        return indices
    return xp.where(indices < 0, indices + dim, indices)


_UFUNCS = {"add": "add", "mul": "multiply", "max": "maximum", "min": "minimum"}


def scatter_reduce(xp, out, idx, updates, reduction: str) -> None:
    """``out[idx] = reduction(out[idx], updates)`` in place, duplicates in ``idx``
    (a 1-D array of row indices into ``out``) all applied.

    Uses ``ufunc.at`` where the array module has it for the ufunc (numpy; cupy for some),
    else applies the updates in rounds in which every row index is unique.
    """
    if reduction in (None, "none"):
        out[idx] = updates
        return
    name = _UFUNCS.get(reduction)
    if name is None:
        raise ValueError(f"unsupported scatter reduction {reduction!r}")
    ufunc = getattr(xp, name)
    if xp is np:
        ufunc.at(out, idx, updates)
        return
    try:
        ufunc.at(out, idx, updates)
        return
    except (AttributeError, NotImplementedError, TypeError):
        pass
    n = idx.shape[0]
    if n == 0:
        return
    order = xp.argsort(idx)
    s = idx[order]
    u = updates[order]
    is_start = xp.concatenate([xp.ones((1,), dtype=bool), s[1:] != s[:-1]])
    group = xp.cumsum(is_start) - 1
    first = xp.nonzero(is_start)[0]
    rank = xp.arange(n) - first[group]
    for r in range(int(rank.max()) + 1):
        m = rank == r
        rows = s[m]
        out[rows] = ufunc(out[rows], u[m])
