"""Helpers shared by the conv, pool, linalg, norm and quant kernel families.

Host-side geometry (output sizes, padding) is computed with Python ints; data
work goes through the ``xp`` module handed to each kernel.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

import numpy as np

_SAME = ("SAME_UPPER", "SAME_LOWER")


def is_numpy(xp) -> bool:
    return xp is np


def spatial_attrs(nd: int, strides, dilations) -> tuple[list[int], list[int]]:
    return (list(strides) if strides else [1] * nd, list(dilations) if dilations else [1] * nd)


def conv_geometry(
    in_sp: Sequence[int],
    kernel: Sequence[int],
    strides: Sequence[int],
    dilations: Sequence[int],
    pads: Sequence[int] | None,
    auto_pad: str,
) -> tuple[list[int], list[int], list[int]]:
    """Output spatial shape and (begin, end) pads of a convolution (ONNX Conv rules)."""
    nd = len(in_sp)
    eff = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    if auto_pad in _SAME:
        out = [-(-i // s) for i, s in zip(in_sp, strides)]
        need = [max(0, (o - 1) * s + e - i) for o, s, e, i in zip(out, strides, eff, in_sp)]
        if auto_pad == "SAME_UPPER":
            pb = [n // 2 for n in need]
        else:
            pb = [(n + 1) // 2 for n in need]
        pe = [n - b for n, b in zip(need, pb)]
        return out, pb, pe
    if auto_pad == "VALID" or not pads:
        pb, pe = [0] * nd, [0] * nd
    else:
        pads = list(pads)
        pb, pe = pads[:nd], pads[nd:]
    out = [(i + b + e - k) // s + 1 for i, b, e, k, s in zip(in_sp, pb, pe, eff, strides)]
    return out, pb, pe


def pad_spatial(xp, x, pb: Sequence[int], pe: Sequence[int], value: Any = 0):
    """Constant-pad the trailing len(pb) axes of x (non-negative pads); no copy when 0."""
    if not any(pb) and not any(pe):
        return x
    nd = len(pb)
    lead = x.shape[: x.ndim - nd]
    shape = lead + tuple(s + b + e for s, b, e in zip(x.shape[x.ndim - nd:], pb, pe))
    if value == 0:
        out = xp.zeros(shape, dtype=x.dtype)
    else:
        out = xp.full(shape, value, dtype=x.dtype)
    inner = tuple(slice(b, b + s) for b, s in zip(pb, x.shape[x.ndim - nd:]))
    sl = (slice(None),) * len(lead) + inner
    out[sl] = x
    return out


def acc_dtype(xp, dtype) -> np.dtype:
    """The dtype to compute a float kernel in: half/bfloat16/float8 go through float32
    on numpy (its half matmul/reductions are slow or missing), cupy keeps float16."""
    dtype = np.dtype(dtype)
    if dtype == np.float32 or dtype == np.float64:
        return dtype
    if dtype == np.float16 and not is_numpy(xp):
        return dtype
    if dtype.kind in "iub":
        return np.dtype(np.float64)
    return np.dtype(np.float32)


def window_view(xp, xp_arr, out_sp: Sequence[int], kernel: Sequence[int], strides: Sequence[int],
                dilations: Sequence[int], kernel_first: bool = True):
    """Strided windows over the trailing spatial axes of a padded array.

    kernel_first: shape (*lead, *K, *O) (im2col-friendly), else (*lead, *O, *K)."""
    nd = len(kernel)
    lead = xp_arr.shape[: xp_arr.ndim - nd]
    lead_st = xp_arr.strides[: xp_arr.ndim - nd]
    sp_st = xp_arr.strides[xp_arr.ndim - nd:]
    k_st = tuple(st * d for st, d in zip(sp_st, dilations))
    o_st = tuple(st * s for st, s in zip(sp_st, strides))
    if kernel_first:
        shape = lead + tuple(kernel) + tuple(out_sp)
        st = lead_st + k_st + o_st
    else:
        shape = lead + tuple(out_sp) + tuple(kernel)
        st = lead_st + o_st + k_st
    return xp.lib.stride_tricks.as_strided(xp_arr, shape=shape, strides=st)


def offset_slices(koff: Sequence[int], out_sp: Sequence[int], strides: Sequence[int],
                  dilations: Sequence[int]) -> tuple[slice, ...]:
    """Slices of a padded spatial block picking, for kernel offset koff, the input
    element under that tap for every output position."""
    return tuple(
        slice(k * d, k * d + (o - 1) * s + 1, s)
        for k, o, s, d in zip(koff, out_sp, strides, dilations)
    )


_SCRATCH = threading.local()
#: largest scratch buffer kept between calls (bytes); bigger requests are one-off
SCRATCH_KEEP = 64 << 20


def scratch(xp, shape: Sequence[int], dtype, slot: int = 0) -> Any:
    """A reusable, uninitialised work buffer (numpy only, one per thread and ``slot``).

    Kernel temporaries such as im2col columns are megabytes large; allocating them
    fresh each call costs page faults comparable to the copy itself. The buffer is
    overwritten by the next call on the same thread, so callers must never return it
    (or a view of it); a kernel needing two at once asks for two slots."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape)) if len(shape) else 1
    if not is_numpy(xp) or n * dtype.itemsize > SCRATCH_KEEP:
        return xp.empty(shape, dtype=dtype)
    bufs = getattr(_SCRATCH, "bufs", None)
    if bufs is None:
        bufs = _SCRATCH.bufs = {}
    buf = bufs.get(slot)
    if buf is None or buf.nbytes < n * dtype.itemsize:
        buf = np.empty(max(n * dtype.itemsize, 1 << 20), dtype=np.uint8)
        bufs[slot] = buf
    return buf[: n * dtype.itemsize].view(dtype).reshape(shape)


def pad_spatial_scratch(xp, x, pb: Sequence[int], pe: Sequence[int], slot: int = 1):
    """pad_spatial with zeros into scratch buffer ``slot`` (numpy; cupy gets a fresh array):
    only the border is zeroed, the inside is one copy. Same rule as scratch: never return
    it. No copy at all when unpadded."""
    if not any(pb) and not any(pe):
        return x
    if not is_numpy(xp):
        return pad_spatial(xp, x, pb, pe, 0)
    nd = len(pb)
    lead = x.shape[: x.ndim - nd]
    sp = x.shape[x.ndim - nd:]
    shape = lead + tuple(s + b + e for s, b, e in zip(sp, pb, pe))
    out = scratch(xp, shape, x.dtype, slot)
    pre = (slice(None),) * len(lead)
    for i, (b, e) in enumerate(zip(pb, pe)):
        axis_pre = pre + (slice(None),) * i
        if b:
            out[axis_pre + (slice(0, b),)] = 0
        if e:
            out[axis_pre + (slice(shape[len(lead) + i] - e, None),)] = 0
    out[pre + tuple(slice(b, b + s) for b, s in zip(pb, sp))] = x
    return out
