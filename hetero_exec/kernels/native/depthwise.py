"""Depthwise convolution (one input channel per group, multiplier 1), compiled.

Per channel, the input is copied once into a zeroed buffer laid out as the stride's
phases (sh*sw sub-images of the padded plane, one per (row, column) residue); then every
kernel tap is one contiguous multiply-add over the whole output plane (rows of the phase
width, the few extra columns cropped at the end), which LLVM vectorizes. Small planes
stack a block of images per phase, so that a tap's run is long enough to amortise its
set-up. The bias, the activation (native/epilogue.py) and the crop happen in one pass on
the way out. Planes of a few pixels (MobileNet's 8x8 and 4x4 tails) run channels-last
instead (`depthwise2d_cl`): there the per-channel set-up costs more than the taps.

Indexing goes through slices, whose loop indices start at 0: an index numba cannot
prove non-negative gets a wrap-around branch that stops the vectorizer (3-10x here).
Measured against the numpy forms in bench/bench_conv.py (``native``).
"""

from __future__ import annotations

import numba
import numpy as np

from hetero_exec.kernels.native.epilogue import _zero, act_row

#: floats of a stack of images per phase (small planes share one run per tap)
_STACK = 4096


@numba.njit(nogil=True, cache=True, boundscheck=False, error_model="numpy")
def _store(acc, wq, out, code, p0, p1):
    """out[oh, k] = act(acc[oh * wq + k]): the crop and the activation in one pass."""
    OH, OW = out.shape
    zero = _zero(acc)
    for oh in range(OH):
        act_row(acc[oh * wq:oh * wq + OW], zero, out[oh], code, p0, p1)


@numba.njit(inline="always", boundscheck=False, error_model="numpy", fastmath={"contract"})
def _row_taps(acc, src, wr, L, KW):
    """acc[k] += sum over j of wr[j] * src[k + j], for KW = 3 or 7 (stride and dilation 1
    along the row)."""
    # one slice per tap (an index k + j could be negative to numba: a wrap-around branch)
    if KW == 3:
        w0, w1, w2 = wr[0], wr[1], wr[2]
        s0, s1, s2 = src[0:L], src[1:L + 1], src[2:L + 2]
        for k in range(L):
            acc[k] += w0 * s0[k] + w1 * s1[k] + w2 * s2[k]
    else:
        w0, w1, w2, w3, w4, w5, w6 = wr[0], wr[1], wr[2], wr[3], wr[4], wr[5], wr[6]
        s0, s1, s2, s3 = src[0:L], src[1:L + 1], src[2:L + 2], src[3:L + 3]
        s4, s5, s6 = src[4:L + 4], src[5:L + 5], src[6:L + 6]
        for k in range(L):
            acc[k] += (w0 * s0[k] + w1 * s1[k] + w2 * s2[k] + w3 * s3[k] + w4 * s4[k]
                       + w5 * s5[k] + w6 * s6[k])


# "contract" only: a multiply-add rounds once (as onnxruntime's FMA kernels do), no
# other reassociation
@numba.njit(nogil=True, cache=True, boundscheck=False, error_model="numpy",
            fastmath={"contract"})
def depthwise2d(x, w, b, out, sh, sw, dh, dw, pt, pl, code, p0, p1, c0, c1):
    """out[n, c] = act(b[c] + sum over (i, j) of w[c, i, j] * xpad[n, c, oh*sh + i*dh,
    ow*sw + j*dw]) for channels [c0, c1); x (N, C, H, W), w (C, KH, KW), b (C,) (zeros
    for no bias), out (N, C, OH, OW), all C-contiguous and of one float dtype; pt, pl the
    top and left pads (the bottom and right ones follow from the shapes)."""
    N, C, H, W = x.shape
    OH, OW = out.shape[2], out.shape[3]
    KH, KW = w.shape[1], w.shape[2]
    # each phase plane: enough rows and columns for every tap's shifted read of the
    # output plane, and at least the padded input's share (so the copy fits)
    hq = max(OH + ((KH - 1) * dh) // sh, (pt + H + sh - 1) // sh)
    wq = max(OW + ((KW - 1) * dw) // sw, (pl + W + sw - 1) // sw)
    plane = hq * wq
    # small planes: a block of images stacked in each phase, read by one run per tap
    # (the rows between two images' outputs computed and dropped); big ones: one image
    nb = max(1, min(N, _STACK // plane))
    tall = nb * plane
    phases = sh * sw
    # one more stack of zeros: the last rows of a tap's run may spill past its phase
    buf = np.zeros((phases + 1) * tall, dtype=x.dtype)
    bufp = buf[:phases * tall].reshape(phases, nb, hq, wq)
    acc = np.empty(((nb - 1) * hq + OH) * wq, dtype=x.dtype)
    for n0 in range(0, N, nb):
        n1 = min(N, n0 + nb)
        L = ((n1 - n0 - 1) * hq + OH) * wq  # the tall output plane, dropped rows included
        a_ = acc[:L]
        for c in range(c0, c1):
            for n in range(n0, n1):
                xc = x[n, c]
                if sh == 1 and sw == 1:  # one phase: a row copy each, the cheapest form
                    for h in range(H):
                        base = (n - n0) * plane + (h + pt) * wq + pl
                        dst = buf[base:base + W]
                        xr = xc[h]
                        for k in range(W):
                            dst[k] = xr[k]
                else:
                    for a in range(sh):  # phase (a, e): padded rows a mod sh, columns e mod sw
                        h0 = (a - pt) % sh
                        if h0 >= H:
                            continue
                        nr = (H - 1 - h0) // sh + 1
                        r0 = (h0 + pt) // sh
                        for e in range(sw):
                            w0 = (e - pl) % sw
                            if w0 >= W:
                                continue
                            ncol = (W - 1 - w0) // sw + 1
                            q0 = (w0 + pl) // sw
                            dst = bufp[a * sw + e, n - n0]
                            for r in range(nr):  # explicit loops: numba's strided slice
                                drow = dst[r0 + r, q0:q0 + ncol]  # copy is generic, slow
                                srow = xc[h0 + r * sh, w0:w0 + (ncol - 1) * sw + 1]
                                for k in range(ncol):
                                    drow[k] = srow[k * sw]
            bias = b[c]
            for k in range(L):
                a_[k] = bias
            for i in range(KH):
                ri = i * dh
                if sw == 1 and dw == 1 and (KW == 3 or KW == 7):
                    # a kernel row's taps in one pass: a third (a seventh) of the loops
                    # and of the traffic to the sums
                    off = (ri % sh) * tall + (ri // sh) * wq
                    _row_taps(a_, buf[off:off + L + KW - 1], w[c, i], L, KW)
                    continue
                if sw == 2 and dw == 1 and KW == 3:  # taps 0 and 2 in phase 0, 1 in phase 1
                    off = (ri % sh) * sw * tall + (ri // sh) * wq
                    e0, e1 = buf[off:off + L + 1], buf[off + tall:off + tall + L]
                    w0, w1, w2 = w[c, i, 0], w[c, i, 1], w[c, i, 2]
                    s2 = e0[1:L + 1]
                    for k in range(L):
                        a_[k] += w0 * e0[k] + w1 * e1[k] + w2 * s2[k]
                    continue
                for j in range(KW):
                    rj = j * dw
                    wt = w[c, i, j]
                    off = ((ri % sh) * sw + rj % sw) * tall + (ri // sh) * wq + rj // sw
                    src = buf[off:off + L]
                    for k in range(L):
                        a_[k] += wt * src[k]
            for n in range(n0, n1):
                _store(acc[(n - n0) * plane:], wq, out[n, c], code, p0, p1)


@numba.njit(nogil=True, cache=True, boundscheck=False, error_model="numpy",
            fastmath={"contract"})
def depthwise2d_cl(x, wt, b, out, sh, sw, dh, dw, pt, pl, code, p0, p1, c0, c1):
    """`depthwise2d` for small planes, computed channels-last: the channels [c0, c1) of
    each image are copied into a zero-padded (Hp, Wp, C) buffer, and each output pixel
    is a sum of KH*KW products along the (long, contiguous) channel axis with the tap's
    weight row ``wt[i, j]`` ((KH, KW, C), the weights transposed), so that the per-channel
    set-up that dominates a 4x4 or 8x8 plane is paid per pixel instead."""
    N, C, H, W = x.shape
    OH, OW = out.shape[2], out.shape[3]
    KH, KW = wt.shape[0], wt.shape[1]
    cb = c1 - c0
    hp = max(pt + H, (OH - 1) * sh + (KH - 1) * dh + 1)
    wp = max(pl + W, (OW - 1) * sw + (KW - 1) * dw + 1)
    buf = np.zeros((hp, wp, cb), dtype=x.dtype)
    acc = np.empty(cb, dtype=x.dtype)
    res = np.empty((OH, OW, cb), dtype=x.dtype)
    bias = b[c0:c1]
    zero = _zero(acc)
    for n in range(N):
        for c in range(cb):
            xc = x[n, c0 + c]
            for h in range(H):
                xr = xc[h]
                br = buf[h + pt]
                for q in range(W):
                    br[q + pl, c] = xr[q]
        for oh in range(OH):
            for ow in range(OW):
                for k in range(cb):
                    acc[k] = bias[k]
                for i in range(KH):
                    brow = buf[oh * sh + i * dh]
                    for j in range(KW):
                        src = brow[ow * sw + j * dw]
                        wr = wt[i, j, c0:c1]
                        for k in range(cb):
                            acc[k] += wr[k] * src[k]
                act_row(acc, zero, res[oh, ow], code, p0, p1)
        for c in range(cb):
            oc = out[n, c0 + c]
            for oh in range(OH):
                orow = oc[oh]
                rr = res[oh]
                for q in range(OW):
                    orow[q] = rr[q, c]
