"""Shape and data-movement kernels: Reshape, Transpose, Concat, Split, Slice, Pad, ...
(the ops that make a tensor from attributes or scalars, Range, Constant..., are
creation.py).

Shape ops run on every model and dominate per-op overhead: they compute the target
shape on the host from Python ints and return views wherever numpy/cupy allow it.
"""

from __future__ import annotations

import math

import numpy as np

from hetero_exec.kernels._common import norm_axes, norm_axis
from hetero_exec.kernels._tensor_common import ints, scalar, to_host
from hetero_exec.kernels.registry import kernel

_I64 = np.int64


# --------------------------------------------------------------------------- reshaping


@kernel("Reshape", since=(1, 5, 14), host_inputs=(1,))
def Reshape(xp, data, shape=None, allowzero=0, consumed_inputs=None):
    new = ints(shape)
    if not allowzero and 0 in new:
        in_shape = data.shape
        new = [in_shape[i] if s == 0 else s for i, s in enumerate(new)]
    return (data.reshape(new),)


@kernel("Transpose", since=1)
def Transpose(xp, data, perm=None):
    if perm is None:
        return (data.transpose(),)
    return (data.transpose(perm),)


@kernel("Squeeze", since=(1, 13), host_inputs=(1,))
def Squeeze(xp, data, axes=None):
    if axes is None:
        return (xp.squeeze(data),)
    ax = norm_axes(ints(axes), data.ndim)
    if not ax:  # an empty axes input squeezes every 1 (as onnxruntime does)
        return (xp.squeeze(data),)
    shape = data.shape
    if any(shape[a] != 1 for a in ax):
        raise ValueError(f"Squeeze: axes {ax} of shape {shape} are not all 1")
    return (data.reshape([d for i, d in enumerate(shape) if i not in ax]),)


@kernel("Unsqueeze", since=(1, 13), host_inputs=(1,))
def Unsqueeze(xp, data, axes=None):
    ax = ints(axes)
    out_rank = data.ndim + len(ax)
    ax = sorted(norm_axes(ax, out_rank))
    shape = list(data.shape)
    for a in ax:
        shape.insert(a, 1)
    return (data.reshape(shape),)


@kernel("Flatten", since=1)
def Flatten(xp, input, axis=1):
    axis = norm_axis(axis, input.ndim)
    shape = input.shape
    return (input.reshape(math.prod(shape[:axis]), math.prod(shape[axis:])),)


@kernel("DepthToSpace", since=(1, 11))
def DepthToSpace(xp, input, blocksize, mode="DCR"):
    b, c, h, w = input.shape
    bs = blocksize
    if mode == "DCR":
        t = input.reshape(b, bs, bs, c // (bs * bs), h, w).transpose(0, 3, 4, 1, 5, 2)
    else:  # CRD
        t = input.reshape(b, c // (bs * bs), bs, bs, h, w).transpose(0, 1, 4, 2, 5, 3)
    return (t.reshape(b, c // (bs * bs), h * bs, w * bs),)


@kernel("SpaceToDepth", since=(1, 28))
def SpaceToDepth(xp, input, blocksize, mode="DCR"):
    b, c, h, w = input.shape
    bs = blocksize
    t = input.reshape(b, c, h // bs, bs, w // bs, bs)
    if mode == "DCR":
        t = t.transpose(0, 3, 5, 1, 2, 4)
    else:  # CRD
        t = t.transpose(0, 1, 3, 5, 2, 4)
    return (t.reshape(b, c * bs * bs, h // bs, w // bs),)


# --------------------------------------------------------------------------- shape info


@kernel("Shape", since=(1, 15))
def Shape(xp, data, start=0, end=None):
    return (xp.asarray(np.array(data.shape[start:end], dtype=_I64)),)


@kernel("Size", since=1)
def Size(xp, data):
    return (xp.asarray(np.array(math.prod(data.shape), dtype=_I64)),)


# --------------------------------------------------------------------------- joining / splitting


@kernel("Concat", since=(1, 4))
def Concat(xp, *inputs, axis=0):
    if len(inputs) == 1:
        return (inputs[0],)
    return (xp.concatenate(inputs, axis=axis),)


@kernel("Split", since=(1, 2, 13, 18), host_inputs=(1,))
def Split(xp, input, split=None, axis=0, *, num_outputs=None, **attrs):
    # ``num_outputs`` is both the opset-18 attribute and the executor's context value;
    # they agree in a valid model, so it is taken as a context parameter and **attrs keeps
    # the attribute from being refused as unknown.
    if "num_outputs" in attrs:
        num_outputs = attrs.pop("num_outputs")
    if attrs:
        raise TypeError(f"Split: unexpected attributes {sorted(attrs)}")
    axis = norm_axis(axis, input.ndim)
    dim = input.shape[axis]
    sizes = ints(split) if split is not None else []
    if not sizes:
        n = num_outputs or 1
        chunk = -(-dim // n)
        sizes = [chunk] * (n - 1) + [dim - chunk * (n - 1)]
    lead = (slice(None),) * axis
    outs = []
    pos = 0
    for size in sizes:
        outs.append(input[lead + (slice(pos, pos + size),)])
        pos += size
    return tuple(outs)


@kernel("Slice", since=(1, 10), host_inputs=(1, 2, 3, 4))
def Slice(xp, data, starts=None, ends=None, axes=None, steps=None):
    starts = ints(starts)
    ends = ints(ends)
    rank = data.ndim
    axes = norm_axes(ints(axes), rank) if axes is not None and len(axes) else range(len(starts))
    steps = ints(steps) if steps is not None and len(steps) else [1] * len(starts)
    index = [slice(None)] * rank
    shape = data.shape
    for start, end, axis, step in zip(starts, ends, axes, steps):
        dim = shape[axis]
        if start < 0:
            start += dim
        if end < 0:
            end += dim
        if step > 0:
            start = min(max(start, 0), dim)
            end = min(max(end, 0), dim)
        else:
            start = min(max(start, 0), dim - 1)
            end = min(max(end, -1), dim - 1)
        index[axis] = slice(start, end if end >= 0 else None, step)
    return (data[tuple(index)],)


# --------------------------------------------------------------------------- expand / tile / pad


@kernel("Expand", since=8, host_inputs=(1,))
def Expand(xp, input, shape):
    target = ints(shape)
    in_shape = input.shape
    n = max(len(target), len(in_shape))
    a = (1,) * (n - len(in_shape)) + in_shape
    b = [1] * (n - len(target)) + target
    out_shape = tuple(x if y == 1 else y for x, y in zip(a, b))
    for x, y in zip(a, out_shape):
        if x != y and x != 1:
            raise ValueError(f"Expand: shape {in_shape} cannot broadcast to {target}")
    if out_shape == in_shape:
        return (input,)
    return (xp.broadcast_to(input, out_shape),)


@kernel("Tile", since=(1, 6), host_inputs=(1, 2))
def Tile(xp, input, repeats, axis=None):
    if axis is not None:  # Tile-1: (input, tiles, axis)
        reps = [1] * input.ndim
        reps[norm_axis(int(scalar(axis)), input.ndim)] = int(scalar(repeats))
    else:
        reps = ints(repeats)
    if all(r == 1 for r in reps):
        return (input,)
    # one copy: broadcast a (1, d0, 1, d1, ...) view to (r0, d0, r1, d1, ...) and merge pairs
    shape = input.shape
    view = input.reshape([v for d in shape for v in (1, d)])
    big = xp.broadcast_to(view, [v for r, d in zip(reps, shape) for v in (r, d)])
    return (big.reshape([r * d for r, d in zip(reps, shape)]),)


@kernel("Pad", since=(1, 2, 11, 18), host_inputs=(1, 2, 3))
def Pad(xp, data, pads=None, constant_value=None, axes=None, mode="constant", value=0.0,
        paddings=None):
    rank = data.ndim
    raw = ints(pads if pads is not None else paddings)
    ax = norm_axes(ints(axes), rank) if axes is not None else range(rank)
    n = len(ax)
    begin = [0] * rank
    end = [0] * rank
    for i, a in enumerate(ax):
        begin[a] = raw[i]
        end[a] = raw[n + i]
    if any(p < 0 for p in begin + end):  # negative pads crop
        data = data[tuple(slice(max(-b, 0), d - max(-e, 0))
                          for b, e, d in zip(begin, end, data.shape))]
        begin = [max(b, 0) for b in begin]
        end = [max(e, 0) for e in end]
    if not any(begin) and not any(end):
        return (data,)
    if mode == "constant":
        if constant_value is not None and math.prod(constant_value.shape) > 0:
            value = scalar(constant_value)
        out_shape = tuple(d + b + e for d, b, e in zip(data.shape, begin, end))
        out = xp.full(out_shape, value, dtype=data.dtype)
        out[tuple(slice(b, b + d) for b, d in zip(begin, data.shape))] = data
        return (out,)
    if mode not in ("reflect", "edge", "wrap"):
        raise ValueError(f"Pad: unsupported mode {mode!r}")
    return (xp.pad(data, list(zip(begin, end)), mode=mode),)


@kernel("CenterCropPad", since=18, host_inputs=(1,))
def CenterCropPad(xp, input_data, shape, axes=None):
    rank = input_data.ndim
    target = ints(shape)
    ax = norm_axes(axes, rank) if axes is not None else range(rank)
    in_shape = input_data.shape
    crop = [slice(None)] * rank
    place = [slice(None)] * rank
    new_shape = list(in_shape)
    padded = False
    for a, sh in zip(ax, target):
        dim = in_shape[a]
        if sh < dim:
            d = (dim - sh) // 2
            crop[a] = slice(d, d + sh)
        elif sh > dim:
            d = (sh - dim) // 2
            place[a] = slice(d, d + dim)
            padded = True
        new_shape[a] = sh
    cropped = input_data[tuple(crop)]
    if not padded:
        return (cropped,)
    out = xp.zeros(new_shape, dtype=input_data.dtype)
    out[tuple(place)] = cropped
    return (out,)


# --------------------------------------------------------------------------- selection


@kernel("NonZero", since=9)
def NonZero(xp, X):
    if X.ndim == 0:
        return (xp.zeros((0, int(bool(X))), dtype=_I64),)
    return (xp.stack(xp.nonzero(X)).astype(_I64, copy=False),)


@kernel("Compress", since=(9, 11))
def Compress(xp, input, condition, axis=None):
    if axis is None:
        input = input.reshape(-1)
        axis = 0
    axis = norm_axis(axis, input.ndim)
    cond = condition.reshape(-1)[: input.shape[axis]]
    idx = xp.nonzero(cond)[0]
    return (xp.take(input, idx, axis=axis),)


@kernel("Trilu", since=14, host_inputs=(1,))
def Trilu(xp, input, k=None, upper=1):
    kk = int(scalar(k)) if k is not None else 0
    n, m = input.shape[-2:]
    diff = xp.arange(m).reshape(1, m) - xp.arange(n).reshape(n, 1)
    keep = diff >= kk if upper else diff <= kk
    return (xp.where(keep, input, xp.zeros((), dtype=input.dtype)),)


@kernel("ReverseSequence", since=10)
def ReverseSequence(xp, input, sequence_lens, batch_axis=1, time_axis=0):
    rank = input.ndim
    t_len = input.shape[time_axis]
    b_len = input.shape[batch_axis]
    t = xp.arange(t_len).reshape(-1, 1)  # (T, 1)
    lens = sequence_lens.astype(_I64).reshape(1, -1)  # (1, B)
    src = xp.where(t < lens, lens - 1 - t, t)  # (T, B)
    if time_axis > batch_axis:
        src = src.T
    shape = [1] * rank
    shape[time_axis] = t_len
    shape[batch_axis] = b_len
    src = xp.broadcast_to(src.reshape(shape), input.shape)
    return (xp.take_along_axis(input, src, axis=time_axis),)


@kernel("Unique", since=11, host_only="data-dependent sort and grouping (np.unique)")
def Unique(xp, X, axis=None, sorted=1, *, num_outputs=None):
    x = to_host(X)
    if axis is None:
        y, idx, inv, cnt = np.unique(x.reshape(-1), return_index=True, return_inverse=True,
                                     return_counts=True)
        take_axis = 0
        flat = x.reshape(-1)
    else:
        axis = norm_axis(axis, x.ndim)
        y, idx, inv, cnt = np.unique(x, return_index=True, return_inverse=True,
                                     return_counts=True, axis=axis)
        take_axis = axis
        flat = x
    inv = inv.reshape(-1)
    if not sorted:
        order = np.argsort(idx, kind="stable")
        rank = np.empty_like(order)
        rank[order] = np.arange(order.size)
        idx = idx[order]
        cnt = cnt[order]
        inv = rank[inv]
        y = np.take(flat, idx, axis=take_axis)
    outs = (y, idx.astype(_I64), inv.astype(_I64), cnt.astype(_I64))
    outs = outs[:num_outputs] if num_outputs else outs
    return tuple(xp.asarray(o) for o in outs)


# --------------------------------------------------------------------------- dropout


@kernel("Dropout", since=(1, 6, 7, 12), host_inputs=(1, 2))
def Dropout(xp, data, ratio=None, training_mode=None, seed=None, is_test=0,
            consumed_inputs=None, *, num_outputs=None, opset=None):
    want_mask = (num_outputs or 1) > 1
    training = False
    r = 0.5
    if opset is None or opset >= 12:  # older versions are inference-only in practice
        if training_mode is not None and math.prod(training_mode.shape) > 0:
            training = bool(scalar(training_mode))
        if ratio is not None and not isinstance(ratio, float) and math.prod(ratio.shape) > 0:
            r = float(scalar(ratio))
    if not training or r == 0:
        if not want_mask:
            return (data,)
        mask_dtype = data.dtype if opset is not None and opset < 7 else bool
        return (data, xp.ones(data.shape, dtype=mask_dtype))
    if seed is not None:
        mask = xp.asarray(np.random.RandomState(seed).uniform(0.0, 1.0, data.shape) >= r)
    else:
        mask = xp.random.uniform(0.0, 1.0, data.shape) >= r
    if r >= 1.0:
        y = xp.zeros_like(data)
    else:
        y = (mask * data * (1.0 / (1.0 - r))).astype(data.dtype, copy=False)
    return (y, mask) if want_mask else (y,)
