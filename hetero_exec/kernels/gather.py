"""Gather / scatter kernels: Gather, GatherElements, GatherND, Scatter, ScatterElements,
ScatterND, TensorScatter."""

from __future__ import annotations

import math

import numpy as np

from hetero_exec.kernels._common import norm_axis
from hetero_exec.kernels._tensor_common import flat_index, normalize_indices, scatter_reduce
from hetero_exec.kernels.registry import kernel


@kernel("Gather", since=(1, 11, 13))
def Gather(xp, data, indices, axis=0):
    axis = norm_axis(axis, data.ndim)
    if indices.ndim == 0 and type(indices) is np.ndarray and type(data) is np.ndarray:
        # the Shape -> Gather(scalar) pattern: basic indexing, a view (the Ellipsis keeps
        # a 0-d result an array)
        return (data[(slice(None),) * axis + (int(indices), Ellipsis)],)
    # take() accepts negative indices in [-n, n) on numpy and cupy alike
    return (xp.take(data, indices, axis=axis),)


@kernel("GatherElements", since=(11, 13))
def GatherElements(xp, data, indices, axis=0):
    axis = norm_axis(axis, data.ndim)
    idx = normalize_indices(xp, indices, data.shape[axis])
    return (xp.take(data.reshape(-1), flat_index(xp, idx, data.shape, axis)),)


def _nd_rows(xp, data, indices, batch_dims: int):
    """Row indices of ``indices`` (..., k) into ``data`` viewed as (B * prod(dims[b:b+k]), rest)."""
    b = batch_dims
    k = indices.shape[-1]
    dims = data.shape[b:b + k]
    bsize = math.prod(data.shape[:b])
    idx = indices.reshape(bsize, -1, k)
    lin = None
    for j, d in enumerate(dims):
        ij = normalize_indices(xp, idx[..., j], d)
        lin = ij if lin is None else lin * d + ij
    if lin is None:  # k == 0: whole slices
        lin = xp.zeros(idx.shape[:2], dtype=np.int64)
    inner = math.prod(dims)
    if bsize > 1:
        lin = lin + (xp.arange(bsize) * inner).reshape(bsize, 1)
    return lin.reshape(-1), data.reshape((bsize * inner,) + data.shape[b + k:])


@kernel("GatherND", since=(11, 12))
def GatherND(xp, data, indices, batch_dims=0):
    rows, table = _nd_rows(xp, data, indices, batch_dims)
    out_shape = indices.shape[:-1] + data.shape[batch_dims + indices.shape[-1]:]
    return (xp.take(table, rows, axis=0).reshape(out_shape),)


def _scatter_elements(xp, data, indices, updates, axis, reduction):
    axis = norm_axis(axis, data.ndim)
    out = data.copy()
    idx = normalize_indices(xp, indices, data.shape[axis])
    lin = flat_index(xp, idx, data.shape, axis)
    lin = xp.broadcast_to(lin, indices.shape).reshape(-1)
    scatter_reduce(xp, out.reshape(-1), lin, updates.reshape(-1), reduction)  # a view of the copy
    return out


@kernel("Scatter", since=(9, 11))
def Scatter(xp, data, indices, updates, axis=0):
    return (_scatter_elements(xp, data, indices, updates, axis, None),)


@kernel("ScatterElements", since=(11, 13, 16, 18))
def ScatterElements(xp, data, indices, updates, axis=0, reduction="none"):
    return (_scatter_elements(xp, data, indices, updates, axis, reduction),)


@kernel("ScatterND", since=(11, 13, 16, 18))
def ScatterND(xp, data, indices, updates, reduction="none"):
    out = data.copy()
    rows, table = _nd_rows(xp, out, indices, 0)
    upd = updates.reshape((rows.shape[0],) + table.shape[1:])
    scatter_reduce(xp, table, rows, upd, reduction)  # table is a view of the fresh copy
    return (out,)


@kernel("TensorScatter", since=24)
def TensorScatter(xp, past_cache, update, write_indices=None, mode="linear", axis=-2):
    rank = past_cache.ndim
    axis = norm_axis(axis, rank)
    batch = past_cache.shape[0]
    max_len = past_cache.shape[axis]
    seq = update.shape[axis]
    if write_indices is None:
        write_indices = xp.zeros((batch,), dtype=np.int64)
    pos = write_indices.astype(np.int64).reshape(-1, 1) + xp.arange(seq).reshape(1, -1)  # (B, S)
    if mode == "circular":
        pos = pos % max_len
    out = past_cache.copy()
    ix = []
    lead = axis + 1  # advanced indices over dims 0..axis, slices after
    for d in range(axis):
        shape = [1] * lead
        shape[d] = update.shape[d]
        ix.append(xp.arange(update.shape[d]).reshape(shape))
    shape = [1] * lead
    shape[0] = batch
    shape[axis] = seq
    if axis == 0:
        raise ValueError("TensorScatter: axis must not be the batch axis")
    ix.append(pos.reshape(shape))
    out[tuple(ix)] = update
    return (out,)
