"""The C library's row kernels, float32 (native/softmax.c, norm.c, act.c): the softmax
over the last axis, LayerNorm over the channels, and act(y + bias) over the last axis,
each split by rows over the library's workers.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hetero_exec.kernels.native import library
from hetero_exec.kernels.native.library import address
from hetero_exec.kernels.native.library import contiguous_f32 as _contiguous_f32
from hetero_exec.kernels.native.library import lib as _lib
from hetero_exec.kernels.native.library import parts as _parts
from hetero_exec.kernels.native.library import pointer as _ptr


def softmax_rows(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis of ``x`` (C-contiguous float32), in place
    (native/softmax.c), its rows split over gemm.c's workers; returns x. NaN, and rows of
    +-inf, give what numpy's arithmetic gives (NaN rows)."""
    n = x.shape[-1]
    rows = x.size // n if n else 0
    if rows and n:
        _lib().he_softmax_mt(address(x), rows, n, _parts(rows, SOFTMAX_COST * x.size))
    return x


#: an element of a softmax in `_parts`' FLOPs (its exp polynomial, max, sum and divide)
SOFTMAX_COST = 16.0


def softmax_fits(x: Any) -> bool:
    """Whether `softmax_rows` computes ``x``'s softmax over its last axis."""
    return (type(x) is np.ndarray and x.dtype == np.float32 and x.ndim >= 1
            and x.flags.c_contiguous and x.size < 2**31 and library.available())


def layer_norm_channels(X: np.ndarray, scale: np.ndarray | None, bias: np.ndarray | None,
                        eps: float, channels_last: bool = False) -> np.ndarray:
    """LayerNorm over axis 1 of X (n, C, L), C-contiguous float32, scale and bias (C,) or
    None: each pixel normalised over its channels (a channels-first LayerNorm). Returns
    (n, C, L), or with ``channels_last`` (n, L, C): a LayerNorm over the last axis of
    X's permuted view (ConvNeXt's after its depthwise conv), written out in that order."""
    n, C, L = X.shape
    Y = np.empty((n, L, C) if channels_last else (n, C, L), np.float32)
    scale, bias = _contiguous_f32(scale), _contiguous_f32(bias)
    runs = -(-L // library.constant("VW"))  # pixels a vector (norm.c)
    if _lib().he_layer_norm_channels_mt(address(X), _ptr(scale), _ptr(bias), eps, address(Y),
                                        n, C, L, int(channels_last),
                                        _parts(n * runs, NORM_COST * X.size)):
        raise MemoryError(f"layer_norm_channels: no memory for a {C} x 16 block")
    return Y


#: an element of the channels' LayerNorm in `_parts`' FLOPs (three reads, the sums, the
#: scaling)
NORM_COST = 8.0


def last_axis(Y: np.ndarray, bias: np.ndarray | None, code: int, p0: float, p1: float) -> None:
    """act(Y + bias) in place over the last axis of Y (rows, cols), C-contiguous float32,
    bias (cols,) float32 or None; ``code`` one of kernels/native.ACT_CODES (native/act.c),
    the rows split over gemm.c's workers."""
    rows, cols = Y.shape
    if rows and cols:
        bias = _contiguous_f32(bias)
        _lib().he_last_axis_mt(address(Y), _ptr(bias), rows, cols, code, p0, p1,
                               _parts(rows, ACT_COST * Y.size))


#: an element of an activation pass in `_parts`' FLOPs (the rationals' ~20 operations)
ACT_COST = 8.0


def row_norm(X: np.ndarray, scale: np.ndarray | None, bias: np.ndarray | None, eps: float,
             rms: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """LayerNorm (``rms``: RMSNorm) of each row of X (rows, cols) float32, times scale and
    plus bias (cols,) where given (native/norm.c): (Y, mean, 1 / sqrt(var + eps)), the
    last two (rows,) (mean 0 for RMSNorm)."""
    X = np.ascontiguousarray(X, dtype=np.float32)
    rows, cols = X.shape
    Y = np.empty_like(X)
    mean = np.empty(rows, np.float32)
    inv = np.empty(rows, np.float32)
    scale, bias = _contiguous_f32(scale), _contiguous_f32(bias)
    if rows and cols:
        _lib().he_row_norm_mt(address(X), _ptr(scale), _ptr(bias), eps, address(Y),
                              address(mean), address(inv), rows, cols, int(rms),
                              _parts(rows, ROW_NORM_COST * X.size))
    return Y, mean, inv


#: an element of a row norm in `_parts`' FLOPs (three reads, the sums, the scaling)
ROW_NORM_COST = 8.0


#: below this many values numpy's astype is as quick as a ctypes call
HALF_MIN_SIZE = 2048


def convert_half(a: np.ndarray, dtype: Any) -> np.ndarray | None:
    """A C-contiguous float16 array as float32, or a float32 one as float16
    (native/half.c: same bits as ``astype``); None when the native library is
    unavailable or the array is small, strided or of another dtype."""
    if (a.size < HALF_MIN_SIZE or not a.flags.c_contiguous or type(a) is not np.ndarray
            or not library.available()):
        return None
    dt = np.dtype(dtype)
    if a.dtype == np.float16 and dt == np.float32:
        out = np.empty(a.shape, np.float32)
        _lib().he_half_to_float(address(a), address(out), a.size)
        return out
    if a.dtype == np.float32 and dt == np.float16:
        out = np.empty(a.shape, np.float16)
        _lib().he_float_to_half(address(a), address(out), a.size)
        return out
    return None


#: query rows from which attention_rows lays K out keys-first (a prompt, not a step)
KEYS_ACROSS_ROWS = 8


def attention_rows(Q: Any, K: Any, V: Any, mask: Any, scale: float, k_transposed: bool,
                   kv_groups: int, nan_to_zero: bool, condition: Any = None,
                   fill: Any = None) -> np.ndarray | None:
    """FusedAttention's softmax(where(condition, scale * Q @ K^T, fill) + mask) @ V on
    float32 4-d operands (native/attention.c: the keys each row hides at either end
    skipped), or None where its operands are not that (the numpy path then runs). Q (B,
    Hq, L, D); K as (B, Hkv, D, S) when ``k_transposed`` else (B, Hkv, S, D); V (B, Hkv,
    S, D); Hkv = Hq unless ``kv_groups`` > 1; the mask and the (bool) condition broadcast
    to (B, Hq, L, S), ``fill`` one value."""
    ops = [x for x in (Q, K, V, mask) if x is not None]
    if not library.available() or any(type(x) is not np.ndarray or x.dtype != np.float32
                                       for x in ops):
        return None
    if Q.ndim != 4 or K.ndim != 4 or V.ndim != 4 or any(
            x is not None and x.ndim > 4 for x in (mask, condition)):
        return None
    if condition is not None and (type(condition) is not np.ndarray or condition.dtype != np.bool_
                                  or np.size(fill) != 1):
        return None
    B, Hq, L, D = Q.shape
    KT = K if k_transposed else K.swapaxes(-1, -2)
    if not k_transposed and L >= KEYS_ACROSS_ROWS:
        # keys at unit stride: a row's scores go across keys in registers, not a dot
        # and a horizontal sum per key (the copy is one pass over K for L rows)
        KT = np.ascontiguousarray(KT)
    hkv = KT.shape[1] if kv_groups > 1 else Hq
    S = KT.shape[-1]
    if hkv <= 0 or Hq % hkv or KT.shape[2] != D or V.shape[2:] != (S, D):
        return None
    try:
        KT = np.broadcast_to(KT, (B, hkv, D, S))
        V = np.broadcast_to(V, (B, hkv, S, D))
        mask = None if mask is None else np.broadcast_to(mask, (B, Hq, L, S))
        condition = None if condition is None else np.broadcast_to(condition, (B, Hq, L, S))
    except ValueError:
        return None
    Y = np.empty((B, Hq, L, D), np.float32)
    if Y.size == 0:
        return Y
    views = (Q, KT.swapaxes(-1, -2), V, mask, condition, Y)  # (batch, head, row, column)
    strides = [s // x.itemsize if x is not None else 0 for x in views
               for s in (x.strides if x is not None else (0,) * 4)]
    if any(x is not None and any(s % x.itemsize for s in x.strides) for x in views):
        return None
    rows = B * Hq * L
    if _lib().he_attention_mt(
            address(Q), address(KT), address(V), _ptr(mask), _ptr(condition), address(Y),
            address(np.array([B, Hq, hkv, L, S, D], np.int64)),
            address(np.array(strides, np.int64)), float(scale),
            float(np.asarray(fill, np.float32).reshape(-1)[0]) if condition is not None else 0.0,
            int(bool(nan_to_zero)), _parts(rows, 4.0 * rows * S * D)):
        raise MemoryError(f"attention_rows: no memory for a row of {S} scores")
    return Y
