"""Exact integer products of 8-bit operands on float32 BLAS (MatMulInteger, QLinearMatMul,
ConvInteger, DynamicQuantizeMatMul, MatMulIntegerToFloat, QGemm).

numpy has no integer GEMM (its int32 matmul is a plain loop, ~100x slower than sgemm),
and float64 BLAS is twice float32's cost. float32 holds every integer up to 2**24
exactly, so a product whose partial sums stay under 2**24 is exact in float32: with
zero points subtracted an 8-bit operand is at most 255 in magnitude, so the reduction
axis is cut into chunks of at most ``2**24 // (max|a| * max|b|)`` terms (258 for two
arbitrary 8-bit operands, 518 for a weight within [-127, 127]), each chunk is one
float32 GEMM whose result is an exact integer, and the chunks are summed in int32 (which
wraps as the spec allows). The same code runs on CuPy (cuBLAS sgemm).

A constant weight is centred and converted to float32 once, at compile time, by the
ops' ``specialize`` hooks (`CenteredWeight`), which also measure its actual magnitude
(longer chunks).

On cpu, when the C kernels are loaded, the product is an integer GEMM instead
(native/qgemm.c: AVX512-VNNI, AVX2 vpmaddwd or plain C, int32 accumulation, zero points
by row and column sums): `CenteredWeight` then holds B packed once for it (``K * N``
bytes, twice that off VNNI, instead of the float32 copy), a non-constant 2-D B is packed
per call, and the float32 chunks above stay the definition and the path on devices.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from hetero_exec.kernels._threads import matmul
from hetero_exec.kernels.native import library
from hetero_exec.kernels.registry import KnownInput

#: float32 represents every integer of magnitude up to this exactly
EXACT_F32 = 1 << 24


def span(dtype: Any) -> int:
    """The largest ``|x - zero_point|`` of an integer dtype (255 for 8-bit)."""
    info = np.iinfo(np.dtype(dtype))
    return int(info.max) - int(info.min)


def centered(xp, x: Any, zero_point: Any, axis: int) -> Any:
    """``x - zero_point`` as float32; a zero point of more than one value runs along
    ``axis`` of x (-2: per row of a left operand, -1: per column of a right one)."""
    xf = x.astype(np.float32)
    if zero_point is None:
        return xf
    z = zero_point.astype(np.float32)
    if z.size == 1:
        z = z.reshape(())
    elif z.ndim == 1:
        z = z.reshape(-1, 1) if axis == -2 else z.reshape(1, -1)
    elif axis == -2 and z.shape[-1] != 1:
        z = z[..., None]
    return xf - z


def chunk_for(a_max: int, b_max: int) -> int:
    """How many terms of a reduction stay exact in float32."""
    return max(1, EXACT_F32 // max(1, a_max * b_max))


def exact_matmul(xp, Af: Any, Bf: Any, chunk: int) -> Any:
    """int32 ``Af @ Bf`` of integer-valued float32 operands, exact when ``chunk`` terms of
    the reduction stay under 2**24."""
    K = Af.shape[-1]
    if K <= chunk:
        return matmul(xp, Af, Bf).astype(np.int32)
    acc = None
    for k0 in range(0, K, chunk):
        part = matmul(xp, Af[..., k0:k0 + chunk], Bf[..., k0:k0 + chunk, :]).astype(np.int32)
        if acc is None:
            acc = part
        else:
            acc += part
    return acc


_BYTES = (np.dtype(np.uint8), np.dtype(np.int8))


class PackedInt8:
    """A 2-D 8-bit B ``[K, N]`` packed for native/qgemm.c (``transpose``: B given as
    ``[N, K]``), with its zero points as int32 ``[N]``."""

    __slots__ = ("K", "N", "packed", "zp")

    def __init__(self, B: np.ndarray, b_zero_point: Any, transpose: bool = False):
        lib = library.lib()
        K, N = (B.shape[1], B.shape[0]) if transpose else B.shape
        self.K, self.N = int(K), int(N)
        B = np.ascontiguousarray(B)
        rs, cs = (1, K) if transpose else (N, 1)
        self.packed = np.empty(lib.he_qgemm_pack_size(self.K, self.N), np.uint8)
        lib.he_qgemm_pack(self.K, self.N, library.address(B), rs, cs,
                          int(B.dtype == np.int8), library.address(self.packed))
        self.zp = _zero_points(b_zero_point, self.N)

    def product(self, A: np.ndarray, a_zero_point: Any, scale: Any = None,
                bias: Any = None) -> np.ndarray | None:
        """int32 ``(A - azp) @ (B - bzp)`` (float32 ``* scale + bias`` with ``scale``),
        A ``[..., M, K]``; None where the kernel does not take these operands."""
        if A.dtype not in _BYTES or A.ndim < 1 or A.shape[-1] != self.K or self.zp is None:
            return None
        lead = A.shape[:-1]
        rows = int(np.prod(lead)) if lead else 1
        az = _row_zero_points(a_zero_point, lead, rows)
        N = self.N
        if az is None or rows == 0 or N == 0 or self.K == 0 or not (
                _fits(scale, N) and _fits(bias, N)):
            return None
        A2 = np.ascontiguousarray(A.reshape(rows, self.K))
        if scale is None:
            Y = np.empty((rows, N), np.int32)
            yi, yf, sc, b = library.address(Y), None, None, None
        else:
            Y = np.empty((rows, N), np.float32)
            sc = np.ascontiguousarray(np.broadcast_to(
                np.asarray(scale, np.float32).reshape(-1), (N,)))
            b = None if bias is None else np.ascontiguousarray(np.broadcast_to(
                np.asarray(bias, np.float32).reshape(-1), (N,)))
            yi, yf = None, library.address(Y)
        lib = library.lib()
        # an 8-bit multiply-add costs about a quarter of a float32 one (VNNI: 64 a
        # vector against 16), so a split pays from 4x the float GEMM's work
        parts = library.parts(max(1, -(-N // 32) * -(-rows // 64)), 0.5 * rows * self.K * N)
        rc = lib.he_qgemm_mt(rows, N, self.K, library.address(A2), self.K,
                             int(A.dtype == np.int8), library.address(self.packed),
                             library.address(az), library.address(self.zp), yi, yf, N,
                             library.pointer(sc), library.pointer(b), parts)
        if rc != 0:
            return None
        return Y.reshape(lead + (N,))


def _fits(v: Any, n: int) -> bool:
    """A scale or bias the kernel takes: none, one value, or one per column."""
    return v is None or np.size(v) in (1, n)


def _zero_points(zp: Any, n: int) -> np.ndarray | None:
    """A scalar or per-column zero point as int32 ``[n]``; None for any other shape."""
    if zp is None:
        return np.zeros(n, np.int32)
    zp = np.asarray(zp)
    if zp.size == 1:
        return np.full(n, int(zp.reshape(())), np.int32)
    if zp.size == n and zp.ndim <= 2 and zp.shape[-1] == n:
        return np.ascontiguousarray(zp.reshape(n), dtype=np.int32)
    return None


def _row_zero_points(zp: Any, lead: tuple, rows: int) -> np.ndarray | None:
    """A's zero point (scalar, or one per row of its last two axes) as int32 ``[rows]``."""
    if zp is None or np.size(zp) == 1:
        return _zero_points(zp, rows)
    zp = np.asarray(zp)
    M = lead[-1] if lead else 1
    if zp.ndim == 1 and zp.size == M:
        return np.ascontiguousarray(np.tile(zp.astype(np.int32), rows // M))
    return None


def _native(xp, A: Any, B: Any) -> bool:
    return (xp is np and isinstance(A, np.ndarray) and A.dtype in _BYTES and B is not None
            and B.dtype in _BYTES and library.available())


def int_matmul(xp, A: Any, B: Any, a_zero_point: Any = None, b_zero_point: Any = None,
               cw: "CenteredWeight | None" = None) -> Any:
    """int32 ``(A - azp) @ (B - bzp)``; ``cw`` the weight prepared at compile time for
    this B."""
    Y = native_product(xp, A, B, a_zero_point, b_zero_point, cw)
    if Y is not None:
        return Y
    Af = centered(xp, A, a_zero_point, -2)
    if cw is not None:
        return exact_matmul(xp, Af, cw.Bf, chunk_for(span(A.dtype), cw.b_max or 1))
    Bf = centered(xp, B, b_zero_point, -1)
    return exact_matmul(xp, Af, Bf, chunk_for(span(A.dtype), span(B.dtype)))


def native_product(xp, A: Any, B: Any, a_zero_point: Any, b_zero_point: Any,
                   cw: "CenteredWeight | None" = None, scale: Any = None,
                   bias: Any = None) -> Any:
    """The C integer GEMM's ``(A - azp) @ (B - bzp)`` (int32, or float32 ``* scale +
    bias``), or None where it does not run (a device, batched B, odd zero points)."""
    if not _native(xp, A, B if cw is None else cw.source):
        return None
    if cw is not None and cw.packed is not None:
        return cw.packed.product(A, a_zero_point, scale, bias)
    if cw is not None or B.ndim != 2 or A.ndim < 2 or A.shape[-1] != B.shape[0]:
        return None
    pb = PackedInt8(B, b_zero_point)
    return pb.product(A, a_zero_point, scale, bias)


class CenteredWeight:
    """A constant right operand made ready once at compile time: packed for the C integer
    GEMM when it is loaded, else centred and in float32."""

    __slots__ = ("source", "zero_point", "fed", "transpose", "packed", "_Bf", "_b_max")

    def __init__(self, B: np.ndarray, b_zero_point: np.ndarray | None, overridable: bool,
                 transpose: bool = False):
        self.source = B
        self.zero_point = b_zero_point
        self.fed = overridable  # a run may feed another B: check it is this one
        self.transpose = transpose  # B given as [N, K]: its zero points still run along N
        self._Bf = self._b_max = None
        self.packed = None
        if library.available() and B.dtype in _BYTES:
            packed = PackedInt8(B, b_zero_point, transpose)
            self.packed = packed if packed.zp is not None else None

    @property
    def Bf(self) -> np.ndarray:
        """B centred, float32 ``[K, N]`` (made on first use: not at all where the C GEMM
        serves every call)."""
        if self._Bf is None:
            B = self.source.T if self.transpose else self.source
            self._Bf = np.ascontiguousarray(centered(np, B, self.zero_point, -1))
            self._b_max = int(np.abs(self._Bf).max()) if self._Bf.size else 1
        return self._Bf

    @property
    def b_max(self) -> int:
        self.Bf
        return self._b_max

    def serves(self, B: Any, b_zero_point: Any) -> bool:
        """Whether this run's (B, zero point) are the constants it was made from."""
        if (b_zero_point is None) != (self.zero_point is None):
            return False
        return not self.fed or B is self.source


def centered_weight_hook(b_index: int, zp_index: int, make: Callable[[], Callable],
                         transpose_attr: str | None = None) -> Callable:
    """A ``specialize`` hook for an op whose input ``b_index`` is an 8-bit right operand
    with its zero point at ``zp_index``: on cpu, a constant 2-D B is centred and made
    float32 once (`CenteredWeight`) and ``make()(weight)`` gives the node's function
    (``make()()`` is the op's kernel). On a device the kernel converts B each run: a
    copy made here would be memory the planner does not see."""

    def hook(xp, kwargs: dict, inputs: Sequence[KnownInput]):
        if xp is not np or len(inputs) <= b_index or inputs[b_index].value is None:
            return None
        B = inputs[b_index].value
        zp = inputs[zp_index] if len(inputs) > zp_index else None
        if B.ndim != 2 or B.dtype.kind not in "iu" or (zp is not None and zp.overridable):
            return None
        transpose = bool(transpose_attr and kwargs.get(transpose_attr, 0))
        cw = CenteredWeight(B, None if zp is None else zp.value, inputs[b_index].overridable,
                            transpose)
        fn = make()(cw)
        fn.centered_weight = cw  # a program's lowering reuses its packed copy
        return fn

    return hook
