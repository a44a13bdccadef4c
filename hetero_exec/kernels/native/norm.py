"""Row normalisations, compiled: LayerNorm and RMSNorm over the last axis of a
(rows, cols) matrix, one row at a time while it is in L1.

numpy makes five passes over a block of rows (mean, centre, variance, scale, shift);
here a row is read for its mean, again for its variance (two passes, not sum of
squares minus squared mean, which cancels), and once more for the output. Sums run in
float64 whatever the input; "reassoc" lets LLVM split them into vector lanes.
"""

from __future__ import annotations

import math

import numba


@numba.njit(nogil=True, cache=True, boundscheck=False, error_model="numpy",
            fastmath={"reassoc", "contract"})
def layer_norm(x, scale, bias, eps, out, mean, inv, r0, r1):
    """out[r] = (x[r] - mean) / sqrt(var + eps) * scale + bias for rows [r0, r1); scale
    and bias of size cols or 0 (absent); mean[r] and inv[r] (1 / sqrt(var + eps)) kept."""
    cols = x.shape[1]
    has_s, has_b = scale.shape[0] > 0, bias.shape[0] > 0
    for r in range(r0, r1):
        row = x[r]
        o = out[r]
        s = 0.0
        for k in range(cols):
            s += row[k]
        m = s / cols
        v = 0.0
        for k in range(cols):
            d = row[k] - m
            v += d * d
        iv = 1.0 / math.sqrt(v / cols + eps)
        mean[r] = m
        inv[r] = iv
        mt, it = o.dtype.type(m), o.dtype.type(iv)
        if has_s and has_b:
            for k in range(cols):
                o[k] = (row[k] - mt) * it * scale[k] + bias[k]
        elif has_s:
            for k in range(cols):
                o[k] = (row[k] - mt) * it * scale[k]
        elif has_b:
            for k in range(cols):
                o[k] = (row[k] - mt) * it + bias[k]
        else:
            for k in range(cols):
                o[k] = (row[k] - mt) * it


@numba.njit(nogil=True, cache=True, boundscheck=False, error_model="numpy",
            fastmath={"reassoc", "contract"})
def rms_norm(x, scale, eps, out, r0, r1):
    """out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * scale for rows [r0, r1); scale of size
    cols or 0 (absent)."""
    cols = x.shape[1]
    has_s = scale.shape[0] > 0
    for r in range(r0, r1):
        row = x[r]
        o = out[r]
        s = 0.0
        for k in range(cols):
            s += row[k] * row[k]
        it = o.dtype.type(1.0 / math.sqrt(s / cols + eps))
        if has_s:
            for k in range(cols):
                o[k] = row[k] * it * scale[k]
        else:
            for k in range(cols):
                o[k] = row[k] * it
