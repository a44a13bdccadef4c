"""Reductions and axis-wise ops: Reduce*, ArgMax/ArgMin, CumSum/CumProd,
Softmax/LogSoftmax/Hardmax, TopK, Det.

Reduce* take ``axes`` as an attribute in old opsets and as input 1 in new ones (same
parameter name, read on the host either way). An empty ``axes`` reduces everything
unless ``noop_with_empty_axes``, which reduces nothing (the op's element-wise part still
applies, as in the ONNX reference: ReduceSumSquare -> x*x). A reduction over an empty
set gives the op's identity (0, 1, -inf, dtype min, ...).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from hetero_exec.kernels._common import host_ints, norm_axis
from hetero_exec.kernels.native import row_kernels
from hetero_exec.kernels.registry import kernel


def _is_ml(dtype) -> bool:
    """bfloat16/float8 (ml_dtypes): numpy kind 'V'."""
    return dtype.kind == "V"


def _acc_dtype(dtype):
    """Accumulate half/bfloat16 in float32 (as onnxruntime does); others in their own type."""
    if dtype == np.float16 or _is_ml(dtype):
        return np.dtype(np.float32)
    return dtype


def _axes(data, axes, noop_with_empty_axes) -> tuple[int, ...] | None:
    """Normalised reduction axes: a tuple (possibly empty = reduce nothing) or None = all."""
    ax = host_ints(axes) if axes is not None else []
    if not ax:
        return () if noop_with_empty_axes else None
    r = data.ndim
    return tuple(sorted({a + r if a < 0 else a for a in ax}))


def _out_shape(shape, axes, keepdims):
    if keepdims:
        return tuple(1 if i in axes else s for i, s in enumerate(shape))
    return tuple(s for i, s in enumerate(shape) if i not in axes)


def _reduce(xp, data, axes, keepdims, noop_with_empty_axes, *, pre=None, red=None,
            post=None, empty=None, exact=False):
    """Run ``post(red(pre(data), axes, keepdims))``; ``empty`` for an empty reduced set.
    Half floats are computed in float32 unless ``exact`` (max/min need no widening)."""
    ax = _axes(data, axes, noop_with_empty_axes)
    keepdims = bool(keepdims)
    if ax == ():  # no reduction: only the element-wise parts
        y = pre(xp, data) if pre else data
        y = post(xp, y) if post else y
        return (xp.asarray(y).astype(data.dtype, copy=False),)
    if ax is None:
        ax = tuple(range(data.ndim))
    if any(data.shape[a] == 0 for a in ax):
        value = empty(data.dtype) if callable(empty) else empty
        return (xp.full(_out_shape(data.shape, ax, keepdims), value, dtype=data.dtype),)
    y = data
    if not exact and _acc_dtype(data.dtype) != data.dtype:
        y = y.astype(np.float32)  # x*x, exp... of float16 overflow long before float32's
    y = pre(xp, y) if pre else y
    y = red(xp, y, ax, keepdims)
    if post:
        y = post(xp, y)
    return (xp.asarray(y).astype(data.dtype, copy=False),)


def _sum(xp, x, ax, kd):
    return xp.sum(x, axis=ax, keepdims=kd, dtype=_acc_dtype(x.dtype))


def _max_empty(dtype):
    if dtype == np.bool_:
        return False
    if dtype.kind in "iu":
        return np.iinfo(dtype).min
    return -np.inf


def _min_empty(dtype):
    if dtype == np.bool_:
        return True
    if dtype.kind in "iu":
        return np.iinfo(dtype).max
    return np.inf


def _mean(xp, x, ax, kd):
    n = math.prod(x.shape[a] for a in ax)
    if x.dtype.kind in "iub":  # like numpy's mean(dtype=int): true division, then truncation
        return xp.sum(x, axis=ax, keepdims=kd, dtype=x.dtype) / n
    return xp.sum(x, axis=ax, keepdims=kd, dtype=_acc_dtype(x.dtype)) / n


def _logsumexp(xp, x, ax, kd):
    m = xp.max(x, axis=ax, keepdims=True)
    m = xp.where(xp.isfinite(m), m, 0)
    s = xp.log(xp.sum(xp.exp(x - m), axis=ax, keepdims=True))
    s = s + m
    if not kd:
        s = s.reshape(_out_shape(x.shape, ax, False))
    return s


def _square(xp, x):
    return x * x


def _reg_reduce(op_type: str, sinces, **parts: Any) -> None:
    def k(xp, data, axes=None, keepdims=1, noop_with_empty_axes=0):
        return _reduce(xp, data, axes, keepdims, noop_with_empty_axes, **parts)

    k.__name__ = k.__qualname__ = op_type
    fast = _FAST.get(op_type)
    kernel(op_type, sinces, host_inputs=(1,),
           specialize=None if fast is None else _specialize_reduce(k, fast))(k)


#: the reductions whose float32/float64 form is one ufunc reduction (Mean: a sum, then
#: the division), for `_specialize_reduce`
_FAST: dict[str, tuple[str, bool]] = {"ReduceSum": ("add", False), "ReduceMean": ("add", True),
                                      "ReduceMax": ("maximum", False),
                                      "ReduceMin": ("minimum", False)}


def _specialize_reduce(general: Callable, fast: tuple[str, bool]) -> Callable:
    """A reduction over constant axes of a float32/float64 input, as one ufunc reduce: the
    axes parsed and the dtypes chosen once (per input rank: an If's output may have none
    declared), not each call (two ReduceSum were 40% of a small Loop body's iteration,
    bench/README.md). A call that reduces an empty set, or whose axes its input's rank
    does not have, takes the general kernel."""
    ufunc_name, mean = fast

    def hook(xp, kwargs: dict, inputs):
        data = inputs[0]
        if xp is not np or data.dtype not in _FAST_DTYPES:
            return None
        if len(inputs) > 1:  # axes as an input: a constant one only
            if inputs[1].value is None or inputs[1].overridable:
                return None
            axes = inputs[1].value
        else:
            axes = kwargs.get("axes")
        listed = host_ints(axes) if axes is not None else []
        if not listed and kwargs.get("noop_with_empty_axes", 0):
            return None
        keep = bool(kwargs.get("keepdims", 1))
        ufunc = getattr(np, ufunc_name)
        by_rank: dict[int, tuple[int, ...] | None] = {}

        def axes_for(rank: int) -> tuple[int, ...] | None:
            if any(not -rank <= a < rank for a in listed):
                return None  # the general kernel names the bad axis
            return tuple(sorted({a % rank for a in listed})) if listed else tuple(range(rank))

        def reduce(xp, data, axes=None, keepdims=1, noop_with_empty_axes=0):
            if data.ndim not in by_rank:
                by_rank[data.ndim] = axes_for(data.ndim)
            ax = by_rank[data.ndim]
            if (ax is None or data.dtype not in _FAST_DTYPES
                    or (data.size == 0 and not all(data.shape[a] for a in ax))):
                return general(xp, data, axes, keepdims, noop_with_empty_axes)
            y = ufunc.reduce(data, axis=ax, keepdims=keep)
            if mean:
                y = y / math.prod(data.shape[a] for a in ax)
            return (xp.asarray(y, dtype=data.dtype),)

        reduce.__name__ = f"{general.__name__}_axes"
        return reduce

    return hook


_FAST_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


# sinces: the attribute-axes era and the input-axes era (13 for ReduceSum, 18 for the rest)
_reg_reduce("ReduceSum", (1, 13), red=_sum, empty=0)
_reg_reduce("ReduceMean", (1, 18), red=_mean, empty=lambda dt: 0 if dt.kind in "iub" else np.nan)
_reg_reduce("ReduceProd", (1, 18), empty=1,
            red=lambda xp, x, ax, kd: xp.prod(x, axis=ax, keepdims=kd, dtype=_acc_dtype(x.dtype)))
_reg_reduce("ReduceMax", (1, 18), empty=_max_empty, exact=True,
            red=lambda xp, x, ax, kd: xp.max(x, axis=ax, keepdims=kd))
_reg_reduce("ReduceMin", (1, 18), empty=_min_empty, exact=True,
            red=lambda xp, x, ax, kd: xp.min(x, axis=ax, keepdims=kd))
_reg_reduce("ReduceL1", (1, 18), pre=lambda xp, x: xp.abs(x), red=_sum, empty=0)
_reg_reduce("ReduceL2", (1, 18), pre=_square, red=_sum, post=lambda xp, y: xp.sqrt(y), empty=0)
_reg_reduce("ReduceSumSquare", (1, 18), pre=_square, red=_sum, empty=0)
_reg_reduce("ReduceLogSum", (1, 18), red=_sum, post=lambda xp, y: xp.log(y), empty=_max_empty)
_reg_reduce("ReduceLogSumExp", (1, 18), red=_logsumexp, empty=_max_empty)


# ---------------------------------------------------------------- ArgMax / ArgMin
def _arg(xp, fn: Callable, data, axis, keepdims, select_last_index):
    axis = norm_axis(axis, data.ndim)
    if select_last_index:
        n = data.shape[axis]
        idx = (n - 1) - fn(xp.flip(data, axis), axis=axis)
    else:
        idx = fn(data, axis=axis)
    idx = xp.asarray(idx).astype(np.int64, copy=False)
    if keepdims:
        idx = xp.expand_dims(idx, axis)
    return (idx,)


@kernel("ArgMax")
def ArgMax(xp, data, axis=0, keepdims=1, select_last_index=0):
    return _arg(xp, xp.argmax, data, axis, keepdims, select_last_index)


@kernel("ArgMin")
def ArgMin(xp, data, axis=0, keepdims=1, select_last_index=0):
    return _arg(xp, xp.argmin, data, axis, keepdims, select_last_index)


# ---------------------------------------------------------------- CumSum / CumProd
def _cum(xp, fn, x, axis, exclusive, reverse, ident):
    ax = norm_axis(host_ints(axis)[0], x.ndim)
    if x.shape[ax] == 0:
        return (x.copy(),)
    y = xp.flip(x, ax) if reverse else x
    acc = _acc_dtype(x.dtype) if x.dtype.kind == "f" or _is_ml(x.dtype) else x.dtype
    y = fn(y, axis=ax, dtype=acc)
    if exclusive:
        head = [slice(None)] * x.ndim
        head[ax] = slice(0, -1)
        pad_shape = list(x.shape)
        pad_shape[ax] = 1
        y = xp.concatenate([xp.full(pad_shape, ident, dtype=y.dtype), y[tuple(head)]], axis=ax)
    if reverse:
        y = xp.flip(y, ax)
    return (xp.ascontiguousarray(y.astype(x.dtype, copy=False)),)


@kernel("CumSum", 11, host_inputs=(1,))
def CumSum(xp, x, axis, exclusive=0, reverse=0):
    return _cum(xp, xp.cumsum, x, axis, exclusive, reverse, 0)


@kernel("CumProd", 26, host_inputs=(1,))
def CumProd(xp, x, axis, exclusive=0, reverse=0):
    return _cum(xp, xp.cumprod, x, axis, exclusive, reverse, 1)


# ---------------------------------------------------------------- Softmax family
def _as_2d(x, axis):
    """Opset<13 semantics: the input seen as a 2-D [prod(shape[:axis]), prod(shape[axis:])]."""
    axis = norm_axis(axis, x.ndim)
    return x.reshape(math.prod(x.shape[:axis]), math.prod(x.shape[axis:]))


#: exp(x) of float32 falls into the subnormals below -87.34 (exp(-87) = 1.6e-38 is still
#: normal), where every later multiply and divide takes ~100 cycles on x86 instead of
#: one: Swin's shifted-window mask (-100) made a 2 ms attention take 13 ms
_EXP_FLOOR32 = np.float32(-87.0)


def _exp_at_floor() -> np.float32 | None:
    """numpy's exp(-87.0) in float32, when it is the same on every path (SIMD lanes and
    the tail of a loop); None when it is not, and the trick below is off."""
    vals = {np.exp(np.full(n, _EXP_FLOOR32, np.float32)).tobytes()[:4] for n in (1, 3, 8, 17, 33, 64)}
    vals.add(np.exp(np.full((3, 7), _EXP_FLOOR32, np.float32)[:, 1:]).ravel().tobytes()[:4])
    return np.frombuffer(vals.pop(), np.float32)[0] if len(vals) == 1 else None


_EXP_AT_FLOOR32 = _exp_at_floor()


def exp_scores_inplace(xp, z):
    """exp(z) in place, for ``z`` = scores minus their maximum (<= 0): on numpy float32
    the results that would be subnormal are exact zeros (z is clamped at -87, whose exp
    is subtracted again; error below 1.7e-38), so nothing after it runs on subnormals."""
    if xp is np and z.dtype == np.float32 and _EXP_AT_FLOOR32 is not None:
        np.maximum(z, _EXP_FLOOR32, out=z)  # NaN stays NaN
        np.exp(z, out=z)
        z -= _EXP_AT_FLOOR32
    else:
        xp.exp(z, out=z)
    return z


def _softmax(xp, x, axis, log=False):
    dt = x.dtype
    if _is_ml(dt):  # bfloat16 & co in float32; float16 stays float16 as the ONNX reference
        x = x.astype(np.float32)  # computes it (the fp16 attention cases depend on it)
    if not log and xp is np and axis == x.ndim - 1 and row_kernels.softmax_fits(x):
        return row_kernels.softmax_rows(x.copy()).astype(dt, copy=False)  # native/softmax.c
    z = x - xp.max(x, axis=axis, keepdims=True)
    if log:
        z -= xp.log(xp.sum(xp.exp(z), axis=axis, keepdims=True))
    else:
        exp_scores_inplace(xp, z)
        z /= xp.sum(z, axis=axis, keepdims=True)
    return z.astype(dt, copy=False)


def _hardmax(xp, x, axis):
    axis = norm_axis(axis, x.ndim)
    idx = xp.expand_dims(xp.argmax(x, axis=axis), axis)
    shape = [1] * x.ndim
    shape[axis] = x.shape[axis]
    rng = xp.arange(x.shape[axis]).reshape(shape)
    return (rng == idx).astype(x.dtype)


@kernel("Softmax", (1, 11))
def Softmax_1(xp, input, axis=1):  # noqa: A002
    if input.size == 0:
        return (input,)
    return (_softmax(xp, _as_2d(input, axis), 1).reshape(input.shape),)


@kernel("Softmax", 13)
def Softmax(xp, input, axis=-1):  # noqa: A002
    if input.size == 0:
        return (input,)
    return (_softmax(xp, input, norm_axis(axis, input.ndim)),)


@kernel("LogSoftmax", (1, 11))
def LogSoftmax_1(xp, input, axis=1):  # noqa: A002
    if input.size == 0:
        return (input,)
    return (_softmax(xp, _as_2d(input, axis), 1, log=True).reshape(input.shape),)


@kernel("LogSoftmax", 13)
def LogSoftmax(xp, input, axis=-1):  # noqa: A002
    if input.size == 0:
        return (input,)
    return (_softmax(xp, input, norm_axis(axis, input.ndim), log=True),)


@kernel("Hardmax", (1, 11))
def Hardmax_1(xp, input, axis=1):  # noqa: A002
    if input.size == 0:
        return (input,)
    return (_hardmax(xp, _as_2d(input, axis), 1).reshape(input.shape),)


@kernel("Hardmax", 13)
def Hardmax(xp, input, axis=-1):  # noqa: A002
    if input.size == 0:
        return (input,)
    return (_hardmax(xp, input, axis),)


# ---------------------------------------------------------------- TopK
def _stable_argsort(xp, x, axis):
    if xp is np:
        return np.argsort(x, axis=axis, kind="stable")
    return xp.argsort(x, axis=axis)  # cupy's sort is always stable


def _topk_sorted(xp, X, kk, ax, largest):
    """Ties keep the lower index first: for ``largest`` sort the flipped axis ascending
    (stable) and read it backwards, so equal values come out in increasing index."""
    n = X.shape[ax]
    sel = [slice(None)] * X.ndim
    sel[ax] = slice(0, kk)
    sel = tuple(sel)
    if largest:
        order = _stable_argsort(xp, xp.flip(X, ax), ax)
        idx = (n - 1) - xp.flip(order, ax)[sel]
    else:
        idx = _stable_argsort(xp, X, ax)[sel]
    idx = idx.astype(np.int64, copy=False)
    return xp.take_along_axis(X, idx, axis=ax), idx


def _topk_partition(X, kk, ax, largest):
    """numpy, k much smaller than the axis: select by partition instead of a full sort.
    Everything strictly beyond the k-th value is in; of the values equal to it, the
    lowest indices fill the rest. Then only the k winners are sorted."""
    xm = np.moveaxis(X, ax, -1)
    n = xm.shape[-1]
    if largest:
        thr = np.partition(xm, n - kk, axis=-1)[..., n - kk:n - kk + 1]
        better = xm > thr
    else:
        thr = np.partition(xm, kk - 1, axis=-1)[..., kk - 1:kk]
        better = xm < thr
    eq = xm == thr
    need = kk - np.count_nonzero(better, axis=-1)[..., None]
    if np.array_equal(np.count_nonzero(eq, axis=-1)[..., None], need):
        chosen = better | eq  # the usual case: no tie crosses the boundary
    else:
        chosen = better | (eq & (np.cumsum(eq, axis=-1) <= need))
    # exactly kk per row, in index order (flatnonzero is far faster than 2-D nonzero)
    idx = (np.flatnonzero(chosen) % n).reshape(xm.shape[:-1] + (kk,))
    vals = np.take_along_axis(xm, idx, axis=-1)
    v, i = _topk_sorted(np, vals, kk, vals.ndim - 1, largest)
    idx = np.take_along_axis(idx, i, axis=-1)
    return np.moveaxis(v, -1, ax), np.moveaxis(idx, -1, ax)


@kernel("TopK", (1, 10, 11), host_inputs=(1,))
def TopK(xp, X, K=None, axis=-1, largest=1, sorted=1, k=None):  # noqa: A002
    # opset 1: k is an attribute; later input 1. Output is always sorted.
    kk = host_ints(K if K is not None else k)[0]
    ax = norm_axis(axis, X.ndim)
    n = X.shape[ax]
    if (xp is np and 0 < kk and kk * 2 <= n and n >= 64 and X.dtype.kind in "fiu"
            and not (X.dtype.kind == "f" and np.isnan(X).any())):
        return _topk_partition(X, kk, ax, largest)
    return _topk_sorted(xp, X, kk, ax, largest)


# ---------------------------------------------------------------- Det
@kernel("Det", 11)
def Det(xp, X):
    dt = X.dtype
    x = X.astype(np.float32) if dt == np.float16 or _is_ml(dt) else X
    return (xp.asarray(xp.linalg.det(x)).astype(dt, copy=False),)
