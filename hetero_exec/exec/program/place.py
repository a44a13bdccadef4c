"""Where a value lives in a program: a buffer, a byte offset, a shape and strides in
elements. Views (reshape of a contiguous value, transpose, slice, broadcast) are new
places over the same buffer: the steps that make them cost nothing at run time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


class NotLowered(Exception):
    """A step the program cannot take (its kernel keeps running in Python)."""


#: element types by ONNX's TensorProto codes (program.h's DT_*)
DTYPE_CODES = {np.dtype(np.float32): 1, np.dtype(np.uint8): 2, np.dtype(np.int8): 3,
               np.dtype(np.int32): 6, np.dtype(np.int64): 7, np.dtype(np.bool_): 9,
               np.dtype(np.float16): 10, np.dtype(np.float64): 11}


def dtype_code(dtype: np.dtype) -> int:
    code = DTYPE_CODES.get(np.dtype(dtype))
    if code is None:
        raise NotLowered(f"element type {dtype}")
    return code


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return tuple(reversed(out))


@dataclass(frozen=True)
class Place:
    buf: int  # index in the program's buffer table (-1: none)
    off: int  # bytes from the buffer's start
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # elements
    dtype: np.dtype
    #: a feed read only for its shape (a zero-stride placeholder): no step may read it
    shape_only: bool = False

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def contiguous(self) -> bool:
        """C-contiguous (size-1 dims' strides do not matter)."""
        acc = 1
        for d, s in zip(reversed(self.shape), reversed(self.strides)):
            if d != 1 and s != acc:
                return False
            acc *= d
        return True

    def rows_contiguous(self) -> bool:
        """The last dim at unit stride and the others a plain row layout (rows x cols)."""
        return self.contiguous

    # -- views ---------------------------------------------------------------------

    def reshape(self, shape: tuple[int, ...]) -> Place | None:
        """A view of the new shape, or None when no strides give it (numpy's rule: each
        group of dims merged or split must step through memory as one dim)."""
        shape = tuple(int(d) for d in shape)
        if math.prod(shape) != self.size:
            raise NotLowered(f"reshape of {self.shape} to {shape}")
        if self.contiguous:
            return Place(self.buf, self.off, shape, contiguous_strides(shape), self.dtype,
                         self.shape_only)
        strides = _nocopy_strides(self.shape, self.strides, shape)
        if strides is None:
            return None
        return Place(self.buf, self.off, shape, strides, self.dtype, self.shape_only)

    def transpose(self, perm: tuple[int, ...]) -> Place:
        return Place(self.buf, self.off, tuple(self.shape[p] for p in perm),
                     tuple(self.strides[p] for p in perm), self.dtype, self.shape_only)

    def slice(self, axis: int, start: int, stop: int, step: int) -> Place:
        """``[start:stop:step]`` along ``axis`` (normalised bounds, as range() takes them)."""
        n = len(range(start, stop, step))
        shape = list(self.shape)
        strides = list(self.strides)
        off = self.off + (start * strides[axis] * self.itemsize if n else 0)
        shape[axis] = n
        strides[axis] = strides[axis] * step
        return Place(self.buf, off, tuple(shape), tuple(strides), self.dtype, self.shape_only)

    def broadcast(self, shape: tuple[int, ...]) -> Place:
        """This value broadcast to ``shape`` (numpy's rule): stride 0 where it repeats."""
        lead = len(shape) - len(self.shape)
        if lead < 0:
            raise NotLowered(f"broadcast of {self.shape} to {shape}")
        strides = [0] * lead
        for i, (d, s) in enumerate(zip(self.shape, self.strides)):
            target = shape[lead + i]
            if d == target:
                strides.append(s if d != 1 else 0)
            elif d == 1:
                strides.append(0)
            else:
                raise NotLowered(f"broadcast of {self.shape} to {shape}")
        return Place(self.buf, self.off, tuple(shape), tuple(strides), self.dtype,
                     self.shape_only)

    def with_dtype(self, dtype: np.dtype) -> Place:
        return Place(self.buf, self.off, self.shape, self.strides, np.dtype(dtype),
                     self.shape_only)


def _nocopy_strides(old: tuple[int, ...], old_st: tuple[int, ...],
                    new: tuple[int, ...]) -> tuple[int, ...] | None:
    """Strides viewing (old, old_st) as ``new`` without a copy, or None (numpy's
    _attempt_nocopy_reshape, size-1 dims dropped first)."""
    dims = [(d, s) for d, s in zip(old, old_st) if d != 1]
    od = [d for d, _ in dims]
    os_ = [s for _, s in dims]
    nd = [d for d in new if d != 1]
    out: list[int] = []
    oi = ni = 0
    while oi < len(od) and ni < len(nd):
        op, np_ = od[oi], nd[ni]
        oj, nj = oi + 1, ni + 1
        while op != np_:
            if np_ < op:
                np_ *= nd[nj]
                nj += 1
            else:
                op *= od[oj]
                oj += 1
        for k in range(oi, oj - 1):  # the old dims of a group must be one stride run
            if os_[k] != os_[k + 1] * od[k + 1]:
                return None
        st = os_[oj - 1]
        group = []
        for k in range(nj - 1, ni - 1, -1):
            group.append(st)
            st *= nd[k]
        out.extend(reversed(group))
        oi, ni = oj, nj
    it = iter(out)
    return tuple(0 if d == 1 else next(it) for d in new)


def coalesce(shape: tuple[int, ...], strides: list[tuple[int, ...]]) -> tuple[tuple[int, ...], list[tuple[int, ...]]]:
    """The same iteration over fewer dims: size-1 dims dropped, and neighbours merged
    where every operand steps through them as through one dim."""
    dims = [(d, [s[i] for s in strides]) for i, d in enumerate(shape) if d != 1]
    merged: list[tuple[int, list[int]]] = []
    for d, st in dims:
        if merged:
            pd, pst = merged[-1]
            if all(ps == s * d for ps, s in zip(pst, st)):
                merged[-1] = (pd * d, st)
                continue
        merged.append((d, st))
    new_shape = tuple(d for d, _ in merged)
    new_strides = [tuple(st[k] for _, st in merged) for k in range(len(strides))]
    return new_shape, new_strides
