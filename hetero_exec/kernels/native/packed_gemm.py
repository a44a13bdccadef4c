"""float32 products on weights packed once (native/gemm.c, conv.c).

A BLAS call packs both of its operands every time. For a product with a constant weight
and few rows (an MLP at batch 8) that is most of the call, and onnxruntime, which packs
its weights once, runs those products 2-3x faster than numpy's OpenBLAS.
`PackedRight` (``A @ B``, B constant: MatMul, Gemm, FusedMatMul) and `PackedLeft`
(``W @ X`` per image, W constant: Conv's pointwise path; `PackedLeft.conv`: the other
ungrouped Convs, each tap read through its offset from one padded copy of the input,
no im2col) hold their weight packed in the micro-kernel's order and add bias, residual
and Relu/Clip as each tile is stored, which also saves the epilogue's pass over the
output. The `*_call` forms bind a kernel's arguments once for a Conv node's input shape
(kernels/_conv_bound.py). The library's other kernels have their own wrappers:
native/plane_kernels.py (depthwise conv, MaxPool, patches), native/row_kernels.py (softmax, the
channels' LayerNorm, activations) and native/blas_split.py (numpy's BLAS on the C
workers); native/library.py loads the library (its variant, why it is off).

A product is split over the library's worker threads (workers.c: one per core but the
caller's), which spin ``HETERO_EXEC_WORKER_SPIN_US`` (400) microseconds after each part
before they sleep: handing a part to kernels/_threads.py's Python helpers, which sleep and
need the GIL back, cost 40-130 us here, more than a small product. How many parts follows
`_threads.split_parts` (`library.parts`); ctypes releases the GIL for the whole call.
"""

from __future__ import annotations

import logging

import numpy as np

from hetero_exec.kernels import _threads
from hetero_exec.kernels.native import library
from hetero_exec.kernels.native.library import address, available, reset, unavailable_reason
from hetero_exec.kernels.native.library import contiguous_f32 as _contiguous_f32
from hetero_exec.kernels.native.library import lib as _lib
from hetero_exec.kernels.native.library import parts as _parts
from hetero_exec.kernels.native.library import pointer as _ptr

__all__ = ["available", "reset", "unavailable_reason"]  # (the library's, re-exported)
log = logging.getLogger(__name__)
ENV = library.ENV

#: the micro-kernel's tile (kernels.h): 32 columns; rows per tile on each side. The
#: library exports these (abi.c); its self-check fails were they to differ.
NR = 32
MR_RIGHT = 8
MR_LEFT = 12
#: activation codes of the kernels' store (kernels.h; native/activation.py maps them)
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


#: microseconds gemm.c's workers spin after a part before they sleep (0: never spin).
#: As long as OpenBLAS's workers after our shortening (2**20 cycles, kernels/_threads.py),
#: since they now take a run's BLAS products too (`blas_matmul`): at 100 us they slept
#: between BERT's products and each woke at 40-130 us (BERT at batch 1 1.15x the time)
SPIN_ENV, DEFAULT_SPIN_US = library.SPIN_ENV, library.DEFAULT_SPIN_US


#: the least share of a conv's lanes that must hold output pixels (`conv_fits`)
LANES_FILLED = 0.8


#: output pixels of a conv tile's run (conv.c: two runs of 16 lanes a tile)
RUN = 16


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


def patches_fit(pixels: int, M: int) -> bool:
    """Whether a conv of ``pixels`` output pixels (all images) and ``M`` output channels
    runs as pixel-major patches by its packed, transposed weight (`conv_patches`, then
    `PackedRight`): for the ungrouped convs that `conv_fits` leaves out, on a weight as
    wide as `right_takes` asks (ResNet-18's 7 x 7 planes: 512 channels)."""
    return M >= WIDE_COLUMNS and right_takes(pixels, M)
