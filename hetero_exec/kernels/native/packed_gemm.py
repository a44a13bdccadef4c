"""float32 products on weights packed once (native/gemm.c, conv.c), and the other C
kernels' wrappers.

A BLAS call packs both of its operands every time. For a product with a constant weight
and few rows (an MLP at batch 8) that is most of the call, and onnxruntime, which packs
its weights once, runs those products 2-3x faster than numpy's OpenBLAS.
`PackedRight` (``A @ B``, B constant: MatMul, Gemm, FusedMatMul) and `PackedLeft`
(``W @ X`` per image, W constant: Conv's pointwise path; `PackedLeft.conv`: the other
ungrouped Convs, each tap read through its offset from one padded copy of the input,
no im2col) hold their weight packed in the micro-kernel's order and add bias, residual
and Relu/Clip as each tile is stored, which also saves the epilogue's pass over the
output. The same library holds the float32 passes numpy makes slow: `depthwise_2d` (the
depthwise Conv, by planes or along the channels: native/depthwise.c, depthwise_cl.c),
`max_pool_2d` (by depthwise.c's runs), `softmax_rows` (softmax.c), `last_axis` (the
FusedMatMul epilogue, act.c) and `layer_norm_channels` (norm.c). The `*_call` forms bind a
kernel's arguments once for a Conv node's input shape (kernels/_conv_bound.py).

The library is built by the package's build and loaded by native/library.py, which
picks its instruction-set variant and says why it is off where it is (`unavailable_reason`:
the callers then keep numpy's BLAS).

A product is split over gemm.c's own worker threads (one per core but the caller's),
which spin ``HETERO_EXEC_WORKER_SPIN_US`` (400) microseconds after each part before they
sleep: handing a part to kernels/_threads.py's Python helpers, which sleep and need the
GIL back, cost 40-130 us here, more than a small product. How many parts follows
`_threads.split_parts`, the rule of the numba kernels' splits; ctypes releases the GIL
for the whole call. In a run alone the same workers take the products that stay on
numpy's OpenBLAS too (`blas_matmul`, native/blas.c), as one-thread BLAS calls: one pool
of threads for the whole run (kernels/_threads.py).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np

from hetero_exec.kernels import _threads
from hetero_exec.kernels.native import ACT_DEFAULTS, library
from hetero_exec.kernels.native.library import address, available, reset, unavailable_reason
from hetero_exec.kernels.native.library import lib as _lib
from hetero_exec.kernels.native.library import pointer as _ptr

__all__ = ["available", "reset", "unavailable_reason"]  # (the library's, re-exported)
log = logging.getLogger(__name__)
ENV = library.ENV

#: the micro-kernel's tile (kernels.h): 32 columns; rows per tile on each side. The
#: library exports these (abi.c); its self-check fails were they to differ.
NR = 32
MR_RIGHT = 8
MR_LEFT = 12
#: activation codes of the kernels' store (kernels.h; the others run after it, as before)
ACT_NONE, ACT_RELU, ACT_CLIP = 0, 1, 2
library.expect(NR=NR, MR_RIGHT=MR_RIGHT, MR_LEFT=MR_LEFT, ACT_NONE=ACT_NONE, ACT_RELU=ACT_RELU,
               ACT_CLIP=ACT_CLIP, SEG=16)  # SEG: `RUN` below
#: the rows a right-hand product takes the packed path for, whatever its width (below:
#: a GEMV-like product is memory-bound, and 1-3 rows leave the tile's FMA chains too
#: short to hide their latency)
MIN_ROWS, MAX_ROWS = 4, 96
#: more rows take it too for a weight of at least WIDE_COLUMNS columns, up to an output
#: of WIDE_OUTPUT values: split on gemm.c's workers it ran at 0.65-1.0x the time of
#: OpenBLAS on its own threads on the benchmark models' shapes (128-6272 rows), and
#: 1.02-1.10x at 512 x 4096 and 1024 x 8192 (gpt2's LM head at batch 8); narrower
#: weights leave a panel's lanes empty (48 columns: 1.0-1.9x, 40: 1.2x)
WIDE_COLUMNS, WIDE_OUTPUT = 64, 2**22


def right_takes(rows: int, cols: int) -> bool:
    """Whether a right-hand product of ``rows`` by a weight of ``cols`` columns runs packed."""
    return MIN_ROWS <= rows and (rows <= MAX_ROWS
                                 or (cols >= WIDE_COLUMNS and rows * cols <= WIDE_OUTPUT))


#: a product is split over gemm.c's workers from this many FLOPs (~30 us of work: a
#: hand-off to a spinning worker costs a few us, to a sleeping one 40-130 us here)
SPLIT_FLOPS = 4e6
#: microseconds gemm.c's workers spin after a part before they sleep (0: never spin).
#: As long as OpenBLAS's workers after our shortening (2**20 cycles, kernels/_threads.py),
#: since they now take a run's BLAS products too (`blas_matmul`): at 100 us they slept
#: between BERT's products and each woke at 40-130 us (BERT at batch 1 1.15x the time)
SPIN_ENV, DEFAULT_SPIN_US = library.SPIN_ENV, library.DEFAULT_SPIN_US

#: the least share of a conv's lanes that must hold output pixels (`conv_fits`)
LANES_FILLED = 0.8
#: output pixels of a conv tile's run (conv.c: two runs of 16 lanes a tile)
RUN = 16


def store_act(activation: str, params=None) -> tuple[int, float, float] | None:
    """(code, lo, hi) of ``activation`` as the kernels' store applies it: none, Relu or
    Clip (its bounds, or none); None for any other."""
    if activation == "":
        return ACT_NONE, 0.0, 0.0
    if activation == "Relu":
        return ACT_RELU, 0.0, 0.0
    if activation == "Clip":
        lo, hi = params or ACT_DEFAULTS["Clip"]
        return ACT_CLIP, float(lo), float(hi)
    return None


def _parts(n: int, flops: float) -> int:
    """Parts to cut ``n`` work items into over gemm.c's workers (1: none), as
    kernels/_threads.parallel_for would for work that calls no BLAS."""
    return _threads.split_parts(n, flops, alone_flops=SPLIT_FLOPS)


def _threads_width() -> int:
    return _threads.split_width()


def _left_cut(items: int, M: int) -> tuple[int, int]:
    """(by_rows, units to split) for a left-hand product or conv of ``items`` (image,
    panel or tile) pairs by a weight of ``M`` rows: too few pairs to share evenly (a
    small plane at batch 1) and the work is cut by blocks of the weight's rows instead,
    each part then copying the same panels."""
    blocks = -(-M // MR_LEFT)
    by_rows = items < 4 * _threads_width() and blocks > items
    return int(by_rows), blocks if by_rows else items


def _contiguous_f32(a: np.ndarray | None) -> np.ndarray | None:
    return None if a is None else np.ascontiguousarray(a, dtype=np.float32)


class PackedRight:
    """A constant B (K, N), packed for ``A (..., K) @ B``."""

    __slots__ = ("K", "N", "panels", "data")

    def __init__(self, B: np.ndarray):
        if B.ndim != 2 or B.dtype != np.float32:
            raise ValueError(f"PackedRight takes a 2-D float32 weight, got {B.dtype} {B.shape}")
        self.K, self.N = (int(d) for d in B.shape)
        self.panels = -(-self.N // NR)
        lib = _lib()
        self.data = np.empty(lib.he_pack_right_size(self.K, self.N), np.float32)
        rs, cs = (s // B.itemsize for s in B.strides)
        lib.he_pack_right(self.K, self.N, B.ctypes.data, rs, cs, self.data.ctypes.data)

    def matmul(self, A: np.ndarray, out: np.ndarray | None = None, bias: np.ndarray | None = None,
               z: np.ndarray | None = None, act: int = ACT_NONE, lo: float = 0.0,
               hi: float = 0.0) -> np.ndarray:
        """act(A @ B + bias + z): A (..., K) float32, bias (N,), z of the output's shape
        (C-contiguous), ``out`` C-contiguous when given."""
        K, N = self.K, self.N
        A2 = np.ascontiguousarray(A).reshape(-1, K)
        M = A2.shape[0]
        Y = np.empty(A.shape[:-1] + (N,), np.float32) if out is None else out
        Y2 = Y.reshape(M, N)
        bias = _contiguous_f32(bias)
        z2 = None if z is None else np.ascontiguousarray(z, np.float32).reshape(M, N)
        lib = _lib()
        # (split by row tiles for many rows, else by panels: gemm.c's he_gemm_right_mt)
        items = -(-M // MR_RIGHT) if M >= 8 * MR_RIGHT else self.panels
        lib.he_gemm_right_mt(M, N, K, address(A2), K, address(self.data), address(Y2),
                             N, _ptr(bias), _ptr(z2), N, act, lo, hi,
                             _parts(items, 2.0 * M * K * N))
        return Y


class PackedLeft:
    """A constant W (M, K), packed for ``W @ X_n`` over images X (n, K, L), or as a 2-D
    convolution's weight (M, C*KH*KW) for `conv`."""

    __slots__ = ("M", "K", "data", "_offsets")

    def __init__(self, W: np.ndarray):
        if W.ndim != 2 or W.dtype != np.float32:
            raise ValueError(f"PackedLeft takes a 2-D float32 weight, got {W.dtype} {W.shape}")
        self.M, self.K = (int(d) for d in W.shape)
        lib = _lib()
        self.data = np.empty(lib.he_pack_left_size(self.M, self.K), np.float32)
        rs, cs = (s // W.itemsize for s in W.strides)
        lib.he_pack_left(self.M, self.K, W.ctypes.data, rs, cs, self.data.ctypes.data)
        self._offsets: dict[tuple, np.ndarray] = {}

    def matmul(self, X: np.ndarray, out: np.ndarray | None = None, bias: np.ndarray | None = None,
               z: np.ndarray | None = None, act: int = ACT_NONE, lo: float = 0.0,
               hi: float = 0.0) -> np.ndarray:
        """act(W @ X_n + bias[:, None] + z_n) per image: X (n, K, L) float32 with unit
        stride along L, bias (M,), z (n, M, L) C-contiguous; returns (n, M, L)."""
        n, K, L = X.shape
        if K != self.K:
            raise ValueError(f"PackedLeft: X has {K} rows, the weight {self.K} columns")
        if X.strides[2] != X.itemsize:
            X = np.ascontiguousarray(X)
        ldx, xs = X.strides[1] // X.itemsize, X.strides[0] // X.itemsize
        return self.matmul_call(n, L, ldx, xs, bias, act, lo, hi)(X, z, out)

    def matmul_call(self, n: int, L: int, ldx: int, xs: int, bias: np.ndarray | None = None,
                    act: int = ACT_NONE, lo: float = 0.0, hi: float = 0.0):
        """`matmul` bound to images X (n, K, L) with rows ``ldx`` and images ``xs`` floats
        apart: ``call(X, z=None, out=None) -> Y``, its arguments worked out once (a
        Conv node's call at one input shape, kernels/_conv_bound.py)."""
        M, K = self.M, self.K
        bias = _contiguous_f32(bias)
        panels = -(-L // NR)
        items = n * panels
        by_rows, tail_items = _left_cut(items, M)
        flops = 2.0 * n * M * K * L
        fn = _lib().he_gemm_left_mt
        head = (M, K, L, address(self.data))
        mid = (ldx, xs)
        shape = (n, M, L)
        b = _ptr(bias)

        def call(X: np.ndarray, z: np.ndarray | None = None,
                 out: np.ndarray | None = None) -> np.ndarray:
            Y = np.empty(shape, np.float32) if out is None else out
            if z is not None:  # (held here while the kernel reads it)
                z = np.ascontiguousarray(z, np.float32).reshape(shape)
            if fn(*head, address(X), *mid, address(Y), M * L, items, b, _ptr(z), act, lo, hi,
                  by_rows, _parts(tail_items, flops)):
                raise MemoryError(f"PackedLeft: no memory for a {K} x {NR} panel")
            return Y

        call.keep = (self, bias)  # (the call holds their pointers only)
        return call

    def conv(self, X: np.ndarray, kernel: tuple[int, int], dilations: tuple[int, int],
             strides: tuple[int, int], pads: tuple[int, int, int, int],
             out_sp: tuple[int, int], bias: np.ndarray | None = None,
             z: np.ndarray | None = None, act: int = ACT_NONE, lo: float = 0.0,
             hi: float = 0.0) -> np.ndarray:
        """act(conv(X, W) + bias + z) of X (n, C, H, W) with this weight as (M, C*KH*KW),
        ``pads`` (top, left, bottom, right); returns (n, M, OH, OW). Each tap is read in
        place through its offset (no im2col) from one padded copy of X, whose rows a
        column stride s > 1 splits into their s phases (columns p, p + s, ...), so that
        the output pixels of a run read a run of one phase."""
        return self.conv_call(X.shape, kernel, dilations, strides, pads, out_sp, bias, act,
                              lo, hi)(X, z)

    def conv_call(self, x_shape: tuple[int, ...], kernel: tuple[int, int],
                  dilations: tuple[int, int], strides: tuple[int, int],
                  pads: tuple[int, int, int, int], out_sp: tuple[int, int],
                  bias: np.ndarray | None = None, act: int = ACT_NONE, lo: float = 0.0,
                  hi: float = 0.0):
        """`conv` bound to inputs of ``x_shape``: ``call(X, z=None) -> Y``, the taps'
        offsets, the tiling and the kernel's arguments worked out once."""
        n, C, H, Wd = x_shape
        KH, KW = kernel
        dh, dw = dilations
        sh, sw = strides
        OH, OW = out_sp
        if C * KH * KW != self.K:
            raise ValueError(f"PackedLeft.conv: {C}x{KH}x{KW} taps for a weight of {self.K}")
        lib = _lib()
        Hp, Wq = H + pads[0] + pads[2], -(-(Wd + pads[1] + pads[3]) // sw)
        pitch = sw * Wq
        key = (C, Hp, pitch, KH, KW, dh, dw, sw)
        off = self._offsets.get(key)
        if off is None:
            off = _tap_offsets(C, Hp, Wq, KH, KW, dh, dw, sw)
            self._offsets[key] = off
        M, K = self.M, self.K
        shape = (n, M, OH, OW)
        bias = _contiguous_f32(bias)
        flat = int(sh == 1 and sw == 1)  # runs over the padded grid, across its rows
        items = n * lib.he_conv_tiles(flat, OH, OW, pitch)  # (image, tile of two runs) pairs
        flops = 2.0 * n * M * K * OH * OW
        by_rows, parts_of = _left_cut(items, M)  # (a 14 x 14 plane at batch 1: 7 tiles)
        fn = lib.he_conv_left_mt
        head = (M, K, address(self.data), address(off))
        mid = (C * Hp * pitch, pitch, sh, flat, OH, OW)
        b = _ptr(bias)

        def call(X: np.ndarray, z: np.ndarray | None = None) -> np.ndarray:
            Xr = _padded(X, pads, sw, 0.0)[0]
            Y = np.empty(shape, np.float32)
            if z is not None:  # (held here while the kernel reads it)
                z = np.ascontiguousarray(z, np.float32).reshape(shape)
            if fn(*head, address(Xr), *mid, address(Y), items, b, _ptr(z), act, lo, hi,
                  by_rows, _parts(parts_of, flops)):
                raise MemoryError(f"PackedLeft.conv: no memory for a {K} x {NR} panel")
            return Y

        call.keep = (self, off, bias)  # (the call holds their pointers only)
        return call

def _padded(X: np.ndarray, pads: tuple[int, int, int, int], sw: int,
            fill: float) -> tuple[np.ndarray, int, int]:
    """X (n, C, H, W) padded by ``pads`` (top, left, bottom, right) with ``fill``, each
    row split into its ``sw`` column phases of Wq columns: (that array, Hp, Wq). The
    array is a scratch buffer (kernels._nn_common.scratch, slot 1): never return it."""
    n, C, H, Wd = X.shape
    pt, pl, pb, pr = pads
    Hp, Wp = H + pt + pb, Wd + pl + pr
    Wq = -(-Wp // sw)
    X = np.ascontiguousarray(X, dtype=np.float32)
    if sw == 1 and Wp == Wd and Hp == H:  # nothing to pad or split
        return X, Hp, Wq
    from hetero_exec.kernels._nn_common import scratch

    Xr = scratch(np, (n, C, Hp, sw * Wq), np.float32, slot=1)
    _lib().he_pad_mt(address(X), address(Xr), n * C, H, Wd, pt, pl, Hp, sw, Wq, fill,
                     _parts(n * C, 4.0 * Xr.size))
    return Xr, Hp, Wq


def _tap_offsets(C: int, Hp: int, Wq: int, KH: int, KW: int, dh: int, dw: int,
                 sw: int) -> np.ndarray:
    """Each tap's offset (int32) from an output pixel's origin in a `_padded` input."""
    pitch = sw * Wq
    c, i, j = np.meshgrid(np.arange(C), np.arange(KH), np.arange(KW), indexing="ij")
    col = j * dw
    off = c * (Hp * pitch) + i * (dh * pitch) + (col % sw) * Wq + col // sw
    return off.astype(np.int32).reshape(-1)


def max_pool_2d(X: np.ndarray, kernel: tuple[int, int], strides: tuple[int, int],
                dilations: tuple[int, int], pads: tuple[int, int, int, int],
                out_sp: tuple[int, int]) -> np.ndarray:
    """MaxPool of X (n, C, H, W) float32 without indices: each plane padded with -inf (and
    phased by the column stride) into a worker's own buffer, which stays in cache, then
    the maximum over the taps 16 output pixels at a time by the depthwise conv's runs
    (native/depthwise.c; NaN propagates, as numpy's maximum does). ``pads`` (top, left,
    bottom, right): the bottom and right ones follow from ``out_sp``. (Padding the whole
    input first, as before, wrote and read it once more: ResNet-18's MaxPool at batch 8
    took 4x onnxruntime's time.)"""
    n, C, H, Wd = X.shape
    KH, KW = kernel
    OH, OW = out_sp
    X = np.ascontiguousarray(X, dtype=np.float32)
    Y = np.empty((n, C, OH, OW), np.float32)
    if _lib().he_maxpool_plane_mt(address(X), address(Y), n * C, H, Wd, OH, OW, KH, KW,
                                  strides[0], strides[1], dilations[0], dilations[1], pads[0],
                                  pads[1], _parts(n * C, 2.0 * Y.size * KH * KW)):
        raise MemoryError("max_pool_2d: no memory for a padded plane or the run tables")
    return Y


#: a depthwise output pixel's tap in `_parts`' FLOPs: with its loads and the plane's
#: padding, small planes run at a few GFLOP/s against a GEMM's 100, so that counting 2
#: left MobileNetV2's 8x8 and 4x4 layers at batch 8 on one thread (32: 0.87-0.97x the
#: model's time in two A/B runs; ConvNeXt 0.95-1.02x)
DEPTHWISE_COST = 32.0
#: the same at one image while gemm.c's workers sleep (`he_pool_hot`): waking them cost
#: more than a small plane's work (1.14-1.36x; ConvNeXt at batch 1, whose products are
#: OpenBLAS's, 1.17-1.19x at 32). MobileNetV2 at batch 1, whose pointwise products keep
#: the workers spinning, runs 0.91-0.92x with them split
DEPTHWISE_COST_COLD = 2.0


def depthwise_2d(X: np.ndarray, W: np.ndarray, strides: tuple[int, int],
                 dilations: tuple[int, int], pads: tuple[int, int], out_sp: tuple[int, int],
                 bias: np.ndarray | None = None, z: np.ndarray | None = None,
                 act: int = ACT_NONE, lo: float = 0.0, hi: float = 0.0) -> np.ndarray:
    """act(depthwise(X, W) + bias + z) for X (n, C, H, W) float32 and W (C, KH, KW) (one
    input channel a group, multiplier 1), ``pads`` the top and left ones (the bottom and
    right follow from ``out_sp``); returns (n, C, OH, OW). Each plane is padded into a
    small buffer of the C worker's own (native/depthwise.c)."""
    return depthwise_call(X.shape, W, strides, dilations, pads, out_sp, bias, act, lo, hi)(X, z)


def depthwise_call(x_shape: tuple[int, ...], W: np.ndarray, strides: tuple[int, int],
                   dilations: tuple[int, int], pads: tuple[int, int], out_sp: tuple[int, int],
                   bias: np.ndarray | None = None, act: int = ACT_NONE, lo: float = 0.0,
                   hi: float = 0.0):
    """`depthwise_2d` bound to inputs of ``x_shape``: ``call(X, z=None) -> Y``, the
    kernel's arguments worked out once (a Conv node's call at one input shape)."""
    n, C, H, Wd = x_shape
    KH, KW = W.shape[-2:]
    OH, OW = out_sp
    W = np.ascontiguousarray(W, dtype=np.float32).reshape(C, KH, KW)
    bias = _contiguous_f32(bias)
    shape = (n, C, OH, OW)
    cost = DEPTHWISE_COST * n * C * OH * OW * KH * KW
    cold = DEPTHWISE_COST_COLD * n * C * OH * OW * KH * KW
    lib = _lib()
    hot = lib.he_pool_hot
    head = (address(W), _ptr(bias))
    # small planes along the channels (depthwise_cl.c), a vector of channels an item; else
    # by planes
    along = depthwise_along_channels(OH * OW, KH * KW)
    fn = lib.he_depthwise_cl_mt if along else lib.he_depthwise_mt
    vw = library.constant("VW")  # channels a vector (depthwise_cl.c): 16 on AVX-512
    items = n * -(-C // vw) if along else n * C
    mid = (n if along else n * C, C, H, Wd, OH, OW, KH, KW, strides[0], strides[1],
           dilations[0], dilations[1], pads[0], pads[1], act, lo, hi)

    def call(X: np.ndarray, z: np.ndarray | None = None) -> np.ndarray:
        X = np.ascontiguousarray(X, dtype=np.float32)
        Y = np.empty(shape, np.float32)
        if z is not None:  # (held here while the kernel reads it)
            z = np.ascontiguousarray(z, np.float32).reshape(shape)
        parts = _parts(items, cost if n > 1 or hot() else cold)
        if fn(address(X), *head, _ptr(z), address(Y), *mid, parts):
            raise MemoryError("depthwise_2d: no memory for a padded plane or the run tables")
        return Y

    call.keep = (W, bias)  # (the call holds their pointers only)
    return call


#: below this many values numpy's astype is as quick as a ctypes call
HALF_MIN_SIZE = 2048


def convert_half(a: np.ndarray, dtype: Any) -> np.ndarray | None:
    """A C-contiguous float16 array as float32, or a float32 one as float16
    (native/half.c: same bits as ``astype``); None when the native library is
    unavailable or the array is small, strided or of another dtype."""
    if (a.size < HALF_MIN_SIZE or not a.flags.c_contiguous or type(a) is not np.ndarray
            or not available()):
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
            and x.flags.c_contiguous and x.size < 2**31 and available())


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


def depthwise_along_channels(out_pixels: int, taps: int) -> bool:
    """Whether a depthwise conv runs along the channels (depthwise_cl.c) rather than by
    planes: output planes of at most 64 pixels, or 256 for 5x5 kernels and larger. On
    MobileNetV2's and ConvNeXt's layers it took 0.29-0.87x the plane kernel's time there
    (4x4 and 8x8 planes, strided ones, 7x7 on 16x16), and 0.74-1.3x for 3x3 on 16x16 and
    1.8-2.2x on ConvNeXt's 32x32 planes (bench/bench_conv.py)."""
    return out_pixels <= 64 or (out_pixels <= 256 and taps >= 25)


def depthwise_fits(x_shape: tuple[int, ...], w_shape: tuple[int, ...], strides: tuple[int, int],
                   dilations: tuple[int, int], out_sp: tuple[int, int]) -> bool:
    """Whether `depthwise_2d` computes this depthwise conv: its padded plane's offsets
    and an output plane within int32."""
    if len(x_shape) != 4 or len(w_shape) != 4 or len(out_sp) != 2:
        return False
    H, Wd = x_shape[2:]
    KH, KW = w_shape[2:]
    OH, OW = out_sp
    rows = max((OH - 1) * strides[0] + (KH - 1) * dilations[0] + 1, H) + KH * dilations[0]
    cols = max((OW - 1) * strides[1] + (KW - 1) * dilations[1] + 1, Wd) + 2 * strides[1] + 16
    return rows * cols < 2**31 - 1024 and OH * OW < 2**31


def conv_fits(K: int, padded: tuple[int, ...], out_sp: tuple[int, ...],
              strides: tuple[int, ...]) -> bool:
    """Whether `PackedLeft.conv` computes this 2-D conv: offsets within int32 and runs of
    output pixels that fill the lanes. Small convs take it too, on one thread (`_parts`):
    im2col and OpenBLAS ran ConvNeXt's 4x4 stem at batch 1 (4 MFLOP) at 5 GFLOP/s, and
    the small convs' packed path measured 0.84-0.96x the model's time (ConvNeXt,
    MobileNetV2, Whisper, ResNet-18; batches 1 and 8)."""
    if len(out_sp) != 2 or len(padded) != 3 or K <= 0:
        return False
    C, Hp, Wp = padded
    if C * Hp * (Wp + strides[1]) >= 2**31:
        return False
    OW = out_sp[1]
    # the lanes that hold output pixels, at least 4/5 (else im2col's GEMM, which shares
    # one wide product between images of small planes, is as fast or faster): of the
    # padded grid's rows at strides 1 (a 14-wide plane padded to 16: 7/8; a 7-wide one
    # to 9: 7/9, 121 against 134 GFLOP/s at batch 8), else of the runs of 16 pixels
    # within each output row
    lanes = Wp if strides[0] == strides[1] == 1 else RUN * -(-OW // RUN)
    return OW >= LANES_FILLED * lanes


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


def patches_fit(pixels: int, M: int) -> bool:
    """Whether a conv of ``pixels`` output pixels (all images) and ``M`` output channels
    runs as pixel-major patches by its packed, transposed weight (`conv_patches`, then
    `PackedRight`): for the ungrouped convs that `conv_fits` leaves out, on a weight as
    wide as `right_takes` asks (ResNet-18's 7 x 7 planes: 512 channels)."""
    return M >= WIDE_COLUMNS and right_takes(pixels, M)


def conv_patches(X: np.ndarray, kernel: tuple[int, int], dilations: tuple[int, int],
                 strides: tuple[int, int], pads: tuple[int, int], out_sp: tuple[int, int],
                 parts: int | None = None) -> np.ndarray:
    """X (n, C, H, W), C-contiguous float32, as its conv's patches, one output pixel's a
    row: (n * OH * OW, C * KH * KW), zero where ``pads`` (top, left) reach beyond X. A
    scratch buffer (kernels._nn_common.scratch, slot 1): never return it."""
    from hetero_exec.kernels._nn_common import scratch

    n, C, H, Wd = X.shape
    KH, KW = kernel
    OH, OW = out_sp
    P = scratch(np, (n * OH * OW, C * KH * KW), np.float32, slot=1)
    rows = n * OH
    _lib().he_patches_mt(address(X), address(P), n, C, H, Wd, KH, KW, strides[0], strides[1],
                         dilations[0], dilations[1], pads[0], pads[1], OH, OW,
                         _parts(rows, PATCH_COST * P.size) if parts is None else parts)
    return P


#: an element of `conv_patches` in `_parts`' FLOPs (a scattered copy: ~0.9 ns a value
#: on one core, where `_parts`' 4 MFLOP are ~30 us)
PATCH_COST = 64.0
