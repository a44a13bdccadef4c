"""numpy's own BLAS GEMM, held at one thread, split over the C library's workers
(native/blas.c): one pool of threads for a whole run (kernels/_c_workers_split.py).
In a run alone the workers take the products that stay on OpenBLAS too, as one-thread
BLAS calls, instead of OpenBLAS's own spinning pool beside ours.
"""

from __future__ import annotations

import math

import numpy as np

from hetero_exec.kernels import _c_workers_split, _threads
from hetero_exec.kernels.native import library
from hetero_exec.kernels.native.library import address
from hetero_exec.kernels.native.library import lib as _lib

#: a BLAS product split over gemm.c's workers (`blas_matmul`) from this many FLOPs: a
#: hand-off to a spinning worker costs a few us, and OpenBLAS's own rule splits from
#: 2**19 (its threshold of m*n*k >= 65536 * 4)
BLAS_SPLIT_FLOPS = 1e6


#: a part's least rows, or columns, of one matrix product (OpenBLAS's float32 tile is
#: 16 x 4 on AVX-512, its float64 one 16 x 2)
BLAS_UNIT_ROWS, BLAS_UNIT_COLS = 16, 64


def _blas_layout(x: np.ndarray) -> tuple[int, int] | None:
    """(stored transposed, leading dimension) of x's last two axes as a CBLAS row-major
    operand, or None when neither axis is unit-stride."""
    r, c = x.shape[-2:]
    s0, s1 = x.strides[-2:]
    es = x.itemsize
    if s0 % es or s1 % es:
        return None
    if c <= 1 or s1 == es:
        ld = s0 // es if r > 1 else max(c, 1)
        if ld >= max(c, 1):
            return 0, ld
    if r <= 1 or s0 == es:
        ld = s1 // es if c > 1 else max(r, 1)
        if ld >= max(r, 1):
            return 1, ld
    return None


def _batch_stride(x: np.ndarray, batch: tuple[int, ...]) -> int | None:
    """Bytes from one matrix of x to the next over the flattened ``batch`` (0: x is one
    matrix, broadcast), or None when x's batch axes are not one stride apart."""
    xb = x.shape[:-2]
    if math.prod(xb) == 1:
        return 0
    if (1,) * (len(batch) - len(xb)) + xb != batch:
        return None  # broadcast along some of the batch axes only
    stride, inner = None, 1
    for n, st in zip(reversed(xb), reversed(x.strides[:-2])):
        if n == 1:
            continue
        if stride is None:
            stride = st
        elif st != stride * inner:
            return None
        inner *= n
    return stride


def blas_matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray | None:
    """``a @ b`` (float32 or float64, both at least 2-D, numpy's broadcasting over the
    batch axes) as one-thread calls of numpy's OpenBLAS split over gemm.c's workers
    (native/blas.c), `_threads.split_parts` deciding the parts; None when the product is
    not one to split (too small for a second part, another dtype, no OpenBLAS GEMM found,
    batch axes that are not one stride apart, an ``out`` that is not C-contiguous): the
    caller's own matmul then runs it, at one thread."""
    dt = a.dtype
    M, K = a.shape[-2:]
    N = b.shape[-1]
    if a.ndim == 2 and b.ndim == 2:
        batch: tuple[int, ...] = ()
        count = 1
    else:
        try:
            batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        except ValueError:
            return None
        count = math.prod(batch)
    flops = 2.0 * count * M * N * K
    # (the cheap tests first: most small products stop here)
    if flops < BLAS_SPLIT_FLOPS or dt != b.dtype or dt not in _BLAS_DTYPES or K != b.shape[-2]:
        return None
    if count == 1:
        items = -(-M // BLAS_UNIT_ROWS) if M >= N else -(-N // BLAS_UNIT_COLS)
    else:
        items = count
    parts = _threads.split_parts(items, flops, alone_flops=BLAS_SPLIT_FLOPS)
    gemm = _threads.blas_gemm()
    if parts < 2 or gemm is None or count >= 2**31:
        return None
    if out is None:
        out = np.empty(batch + (M, N), dt)
    elif (out.shape != batch + (M, N) or out.dtype != dt or not out.flags.c_contiguous
          or np.may_share_memory(out, a) or np.may_share_memory(out, b)):
        return None
    la, lb = _blas_layout(a), _blas_layout(b)
    if la is None:
        a = np.ascontiguousarray(a)
        la = (0, K)
    if lb is None:
        b = np.ascontiguousarray(b)
        lb = (0, N)
    sa = 0 if count == 1 else _batch_stride(a, batch)
    sb = 0 if count == 1 else _batch_stride(b, batch)
    if sa is None or sb is None:
        return None
    f64 = dt == np.float64
    _lib().he_blas_gemm_mt(gemm.dgemm if f64 else gemm.sgemm, gemm.dgemv if f64 else gemm.sgemv,
                           gemm.ilp64, f64, la[0], lb[0], count, M, N, K,
                           address(a), la[1], sa, address(b), lb[1], sb,
                           address(out), N, M * N * out.itemsize,
                           BLAS_UNIT_ROWS if M >= N else BLAS_UNIT_COLS, parts)
    return out


_BLAS_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


_c_workers_split.register_c_blas_split(blas_matmul, library.available)
