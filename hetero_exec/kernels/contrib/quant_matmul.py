"""com.microsoft quantized products: MatMulNBits, and the 8-bit DynamicQuantizeMatMul,
MatMulIntegerToFloat and QGemm (exact integer products, kernels/_int_gemm.py).

MatMulNBits: ``A @ dequantize(B).T (+ bias)`` with B quantized along K.

B is uint8 ``[N, k_blocks, blob]`` (``blob = block_size * bits / 8``; 2, 4 or 8-bit codes
packed low bits first), ``scales`` ``[N, k_blocks]`` (or flat), ``zero_points`` either
packed uint8 ``[N, ceil(k_blocks * bits / 8)]`` or unpacked in A's dtype ``[N, k_blocks]``
(absent: ``2 ** (bits - 1)``), ``g_idx`` (int32 ``[K]``, the block of each k, for
act-order GPTQ weights) and ``bias`` ``[N]``. The product is in float32 whatever A's
dtype (float16 A is upcast, the result cast back), as onnxruntime's cpu kernel does at
its default accuracy level.

Three ways to run it:

* the kernel (the definition, for numpy and CuPy alike) dequantizes B one tile of
  `TILE_BYTES` of float32 rows at a time inside the product, so no float copy of the
  whole weight is ever made;
* on cpu with the C kernels loaded, 4- and 8-bit B without g_idx run native/nbits.c,
  which unpacks one block of codes at a time inside the product from B as the model
  holds it (no copy of the weight at all; a decode step reads the 4-bit weight once,
  split over the workers by columns);
* on cpu, when B, scales and zero points are constants and A has more than
  `NATIVE_ROWS` rows (a prompt), the ``specialize`` hook dequantizes once into a float32
  ``[K, N]`` matrix and runs the packed float GEMM on it. That costs ``4 * K * N`` bytes
  per node, 8x the 4-bit weight (and the packed GEMM keeps its own packed copy of the
  same size), made on the first such call, so a session that only decodes never pays it
  (where the C kernels are off it is made at compile time); a node whose float copy would
  pass `DEQUANT_ONCE_MAX_BYTES` never makes it.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np

from hetero_exec.kernels._int_gemm import (
    CenteredWeight,
    centered_weight_hook,
    int_matmul,
    native_product,
)
from hetero_exec.kernels._packed import PackedWeight, packed_product
from hetero_exec.kernels._threads import matmul
from hetero_exec.kernels.native import library, packed_gemm
from hetero_exec.kernels.registry import KnownInput, kernel

log = logging.getLogger(__name__)

MS_DOMAIN = "com.microsoft"

#: float32 bytes of B dequantized per tile by the tiled kernel
TILE_BYTES = 1 << 22
#: the largest float32 copy of one node's weight the cpu hook makes
DEQUANT_ONCE_MAX_BYTES = 256 << 20
#: rows of A up to which the C kernel runs even where a float32 copy of B could be made
#: (it reads 8x fewer bytes of weight; past this, the packed float GEMM's tiles win)
NATIVE_ROWS = 16


def unpack_codes(xp, packed: Any, bits: int) -> Any:
    """uint8 ``[..., n]`` holding ``8 // bits`` codes a byte, low bits first ->
    uint8 ``[..., n * 8 // bits]``."""
    if bits == 8:
        return packed
    mask = (1 << bits) - 1
    parts = [(packed >> shift) & mask for shift in range(0, 8, bits)]
    stacked = xp.stack(parts, axis=-1)
    return stacked.reshape(packed.shape[:-1] + (packed.shape[-1] * len(parts),))


def _check(A, B, K: int, N: int, bits: int, block_size: int) -> int:
    if bits not in (2, 4, 8):
        raise ValueError(f"MatMulNBits: bits must be 2, 4 or 8, got {bits}")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"MatMulNBits: block_size must be a power of 2 >= 16, got {block_size}")
    k_blocks = -(-K // block_size)
    blob = block_size * bits // 8
    if B.dtype != np.uint8 or B.size != N * k_blocks * blob:
        raise ValueError(f"MatMulNBits: B must be uint8 [N={N}, {k_blocks}, {blob}] for K={K}, "
                         f"bits={bits}, block_size={block_size}; got {B.dtype}{list(B.shape)}")
    if A is not None and A.shape[-1] != K:
        raise ValueError(f"MatMulNBits: A's last dim {A.shape[-1]} is not K={K}")
    return k_blocks


def dequantize_rows(xp, B, scales, zero_points, g_idx, K: int, N: int, bits: int,
                    block_size: int, n0: int = 0, n1: int | None = None) -> Any:
    """Rows ``n0:n1`` of the float32 weight ``[N, K]`` (B's layout, not transposed)."""
    n1 = N if n1 is None else n1
    k_blocks = -(-K // block_size)
    rows = n1 - n0
    codes = unpack_codes(xp, B.reshape(N, k_blocks, -1)[n0:n1], bits)  # [rows, kb, bs]
    sc = scales.reshape(N, k_blocks)[n0:n1].astype(np.float32)
    if zero_points is None:
        zp = np.float32(1 << (bits - 1))
    elif zero_points.dtype == np.uint8:
        zp = unpack_codes(xp, zero_points.reshape(N, -1)[n0:n1], bits)[:, :k_blocks]
        zp = zp.astype(np.float32)
    else:
        zp = zero_points.reshape(N, k_blocks)[n0:n1].astype(np.float32)
    if g_idx is None:
        zp3 = zp if np.ndim(zp) == 0 else zp[:, :, None]
        W = (codes.astype(np.float32) - zp3) * sc[:, :, None]
        return W.reshape(rows, k_blocks * block_size)[:, :K]
    flat = codes.reshape(rows, k_blocks * block_size)[:, :K].astype(np.float32)
    gi = g_idx.reshape(K).astype(np.int64)
    if (gi.size and (int(gi.min()) < 0 or int(gi.max()) >= k_blocks)):
        raise ValueError(f"MatMulNBits: g_idx holds a block outside [0, {k_blocks})")
    zk = zp if np.ndim(zp) == 0 else xp.take(zp, gi, axis=1)
    return (flat - zk) * xp.take(sc, gi, axis=1)


def _finish(xp, Y, bias, out_dtype, lead: tuple) -> Any:
    if bias is not None:
        Y += bias.reshape(-1).astype(np.float32)
    return Y.reshape(lead + (Y.shape[-1],)).astype(out_dtype, copy=False)


def _tile_rows(K: int, N: int) -> int:
    return max(1, min(N, TILE_BYTES // max(1, 4 * K)))


@kernel("MatMulNBits", since=1, domain=MS_DOMAIN, specialize=lambda xp, kw, ins: _hook(xp, kw, ins))
def MatMulNBits(xp, A, B, scales, zero_points=None, g_idx=None, bias=None, K=0, N=0, bits=4,
                block_size=0, accuracy_level=0):
    _check(A, B, K, N, bits, block_size)
    lead = A.shape[:-1]
    A2 = A.reshape(-1, K).astype(np.float32, copy=False)
    if xp is np and g_idx is None:
        Y = native_nbits(A2, B, scales, zero_points, bias, K, N, bits, block_size)
        if Y is not None:
            return (Y.reshape(lead + (N,)).astype(A.dtype, copy=False),)
    Y = xp.empty((A2.shape[0], N), dtype=np.float32)
    step = _tile_rows(K, N)
    for n0 in range(0, N, step):  # one float32 tile of B at a time, never the whole matrix
        n1 = min(N, n0 + step)
        W = dequantize_rows(xp, B, scales, zero_points, g_idx, K, N, bits, block_size, n0, n1)
        Y[:, n0:n1] = matmul(xp, A2, W.T)
    return (_finish(xp, Y, bias, A.dtype, lead),)


def native_nbits(A2: np.ndarray, B: np.ndarray, scales: np.ndarray, zero_points: Any,
                 bias: Any, K: int, N: int, bits: int, block_size: int) -> np.ndarray | None:
    """float32 ``A2 @ dequantize(B).T + bias`` by native/nbits.c (A2 ``[M, K]``), or None
    where it does not run (C kernels off, 2 bits, blocks over 256, odd shapes)."""
    if bits not in (4, 8) or block_size > 256 or not library.available() or not A2.size:
        return None
    kb = -(-K // block_size)
    sc = np.ascontiguousarray(scales, dtype=np.float32).reshape(-1)
    zp = zpf = None
    if zero_points is not None:
        if zero_points.dtype == np.uint8:
            zp = np.ascontiguousarray(zero_points).reshape(-1)
            if zp.size != N * ((kb * bits + 7) // 8):
                return None
        else:
            zpf = np.ascontiguousarray(zero_points, dtype=np.float32).reshape(-1)
            if zpf.size != N * kb:
                return None
    b = None if bias is None else np.ascontiguousarray(bias, dtype=np.float32).reshape(-1)
    if sc.size != N * kb or (b is not None and b.size != N):
        return None
    A2 = np.ascontiguousarray(A2, dtype=np.float32)
    Bc = np.ascontiguousarray(B)
    M = A2.shape[0]
    Y = np.empty((M, N), np.float32)
    parts = library.parts(N, 2.0 * M * K * N)
    rc = library.lib().he_nbits_mt(M, N, K, library.address(A2), K, library.address(Bc),
                                   library.address(sc), library.pointer(zp),
                                   library.pointer(zpf), bits, block_size,
                                   library.pointer(b), library.address(Y), N, parts)
    return Y if rc == 0 else None


def _constant(known: KnownInput | None) -> bool:
    return known is None or known.value is not None


def _hook(xp, kwargs: dict, inputs: Sequence[KnownInput]):
    """On cpu, B (and its scales / zero points / g_idx) constant and small enough:
    dequantize once here, run a float32 product per call."""
    if xp is not np or len(inputs) < 3:
        return None
    K, N = int(kwargs.get("K", 0)), int(kwargs.get("N", 0))
    bits, block_size = int(kwargs.get("bits", 4)), int(kwargs.get("block_size", 0))
    quant = list(inputs[1:5]) + [None] * (5 - len(inputs[1:5]))
    if not all(_constant(k) for k in quant[:4]) or inputs[1].value is None:
        return None
    if 4 * K * N > DEQUANT_ONCE_MAX_BYTES:
        log.info("MatMulNBits %dx%d: %d MiB as float32 is over the compile-time limit; "
                 "dequantized by tiles each run", K, N, 4 * K * N >> 20)
        return None
    vals = [None if k is None else k.value for k in quant[:4]]
    B = vals[0]
    native = (library.available() and bits in (4, 8) and block_size <= 256
              and vals[3] is None)
    made: dict[str, Any] = {}

    def dequantized() -> tuple[np.ndarray, PackedWeight | None]:
        if "W" not in made:  # the float copy: 4 * K * N bytes, 8x a 4-bit B
            W = np.ascontiguousarray(
                dequantize_rows(np, B, vals[1], vals[2], vals[3], K, N, bits, block_size).T)
            made["W"] = W
            made["pw"] = (PackedWeight(KnownInput(value=W, overridable=True))
                          if packed_gemm.available() else None)
        return made["W"], made["pw"]

    try:
        _check(None, B, K, N, bits, block_size)
        if not native:
            dequantized()
    except (ValueError, TypeError):
        return None  # the kernel reports the error at run time
    fed = [k is not None and k.overridable for k in quant[:4]]
    consts = vals

    def MatMulNBits_dequantized(xp, A, B, scales, zero_points=None, g_idx=None, bias=None,
                                **attrs):
        given = (B, scales, zero_points, g_idx)
        if any(f and g is not c for f, g, c in zip(fed, given, consts)):
            return MatMulNBits(xp, A, B, scales, zero_points, g_idx, bias, **attrs)
        if A.shape[-1] != K:
            _check(A, B, K, N, bits, block_size)
        lead = A.shape[:-1]
        A2 = A.reshape(-1, K).astype(np.float32, copy=False)
        if native and A2.shape[0] <= NATIVE_ROWS:
            Y = native_nbits(A2, B, scales, zero_points, bias, K, N, bits, block_size)
            if Y is not None:
                return (Y.reshape(lead + (N,)).astype(A.dtype, copy=False),)
        W, pw = dequantized()
        if pw is not None and pw.takes(A2, W):
            Y = packed_product(pw, A2, bias)
            if Y is not None:
                return (Y.reshape(lead + (N,)).astype(A.dtype, copy=False),)
        Y = matmul(np, A2, W)
        return (_finish(np, Y, bias, A.dtype, lead),)

    return MatMulNBits_dequantized


# ------------------------------------------------------------------ 8-bit integer products


def _per_column(xp, v: Any) -> Any:
    """A scalar, or a per-column scale / bias broadcast along the last axis."""
    return v.reshape(()) if v.size == 1 else v.reshape(-1)


def _dynamic_quantize(xp, A: Any) -> tuple[Any, Any, Any]:
    """A's uint8 quantization as DynamicQuantizeLinear (and onnxruntime) computes it."""
    from hetero_exec.kernels.quant import DynamicQuantizeLinear

    return DynamicQuantizeLinear(xp, A.astype(np.float32, copy=False))


def _dynamic_quantize_matmul(cw: CenteredWeight | None = None):
    def DynamicQuantizeMatMul(xp, A, B, b_scale, b_zero_point=None, bias=None):
        q, a_scale, a_zp = _dynamic_quantize(xp, A)
        scale = a_scale.astype(np.float32) * _per_column(xp, b_scale).astype(np.float32)
        Y = _scaled_product(xp, cw, q, B, a_zp, b_zero_point, scale, bias)
        return (Y.astype(A.dtype, copy=False),)

    return DynamicQuantizeMatMul


DynamicQuantizeMatMul = kernel(
    "DynamicQuantizeMatMul", since=1, domain=MS_DOMAIN,
    specialize=centered_weight_hook(1, 3, lambda: _dynamic_quantize_matmul))(
        _dynamic_quantize_matmul())


def _scaled_product(xp, cw: CenteredWeight | None, A, B, a_zp, b_zp, scale, bias):
    """``scale * ((A - a_zp) @ (B - b_zp)) + bias`` in float32, the exact integer product
    on the weight centred at compile time when ``cw`` holds it for this B."""
    cw = cw if cw is not None and cw.serves(B, b_zp) else None
    if bias is None or np.ndim(bias) <= 1:
        Y = native_product(xp, A, B, a_zp, b_zp, cw, scale, bias)
        if Y is not None:
            return Y
    acc = int_matmul(xp, A, B, a_zp, b_zp, cw=cw)
    Y = acc.astype(np.float32) * scale
    if bias is not None:
        Y += bias.astype(np.float32)
    return Y


def _matmul_integer_to_float(cw: CenteredWeight | None = None):
    def MatMulIntegerToFloat(xp, A, B, a_scale, b_scale, a_zero_point=None, b_zero_point=None,
                             bias=None):
        scale = (_per_column(xp, a_scale).astype(np.float32)
                 * _per_column(xp, b_scale).astype(np.float32))
        Y = _scaled_product(xp, cw, A, B, a_zero_point, b_zero_point, scale, bias)
        return (Y.astype(a_scale.dtype, copy=False),)

    return MatMulIntegerToFloat


MatMulIntegerToFloat = kernel(
    "MatMulIntegerToFloat", since=1, domain=MS_DOMAIN,
    specialize=centered_weight_hook(1, 5, lambda: _matmul_integer_to_float))(
        _matmul_integer_to_float())


def _qgemm(cw: CenteredWeight | None = None):
    def QGemm(xp, A, a_scale, a_zero_point, B, b_scale, b_zero_point, C=None, y_scale=None,
              y_zero_point=None, alpha=1.0, transA=0, transB=0):
        """alpha * a_scale * b_scale * ((A - azp) @ (B - bzp) + C), C int32 already at that
        scale; requantized to y_zero_point's dtype when y_scale is given, else float32."""
        At = A.T if transA else A
        if cw is not None and cw.serves(B, b_zero_point):
            acc = int_matmul(xp, At, B, a_zero_point, cw=cw)
        else:
            Bt = B.T if transB else B
            acc = int_matmul(xp, At, Bt, a_zero_point, b_zero_point)
        if C is not None:
            acc = acc + C.astype(np.int32)
        scale = (np.float32(alpha) * a_scale.astype(np.float32).reshape(())
                 * _per_column(xp, b_scale).astype(np.float32))
        Y = acc.astype(np.float32) * scale
        if y_scale is None:
            return (Y,)
        out_dt = np.dtype(y_zero_point.dtype if y_zero_point is not None else np.uint8)
        R = xp.rint(Y / y_scale.astype(np.float32).reshape(()))
        if y_zero_point is not None:
            R = R + y_zero_point.astype(np.float32).reshape(())
        info = np.iinfo(out_dt)
        return (xp.clip(R, info.min, info.max).astype(out_dt),)

    return QGemm


QGemm = kernel("QGemm", since=1, domain=MS_DOMAIN,
               specialize=centered_weight_hook(3, 5, lambda: _qgemm, "transB"))(_qgemm())
