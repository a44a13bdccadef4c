"""Quantized products as records of a program.

MatMulInteger on a constant 8-bit weight (scalar zero point of A) as one record on
native/qgemm.c's integer GEMM, reusing the weight its kernel packed; DynamicQuantizeLinear
of float32 as one record (qgemm.c); MatMulIntegerToFloat (what placement/fusions/qdq.py
and integer.py make of quantized models' products) as that record storing float32 with
its scale and bias. With the element-wise lowerings, a ``quantize_dynamic`` model's step
then runs as one program.

QuantizeLinear and DequantizeLinear (8-bit codes, per tensor or per axis; not blocked) as
one element-wise record each (program.c's OP_QUANTIZE, rounding half to even, and
OP_DEQUANTIZE), so the Q/DQ pairs a QDQ model keeps around its float ops stay inside the
program with the products between them.

MatMulNBits (com.microsoft, 4 or 8 bits) as one record on native/nbits.c: its weight,
scales and zero points constants of the plan, A float32 and at most
kernels/contrib/quant_matmul.NATIVE_ROWS rows (a decode step; a prompt's product stays
the kernel's, on the float copy's GEMM). A decoder quantized to 4 bits then runs its
step as one program, as the float32 one does."""

from __future__ import annotations

import numpy as np

from hetero_exec.exec.program.lower_linalg import _f32, _weight
from hetero_exec.exec.program.place import NotLowered, Place
from hetero_exec.exec.program.registry import lowers
from hetero_exec.kernels import _int_gemm
from hetero_exec.kernels.contrib import quant_matmul
from hetero_exec.kernels.native import library

_BYTES = (np.dtype(np.uint8), np.dtype(np.int8))
F32 = np.dtype(np.float32)


def _per_axis(b, v: Place, x: Place, axis: int, block_size: int, what: str) -> Place:
    """A scale or zero point broadcastable to ``x``: one value, or one per index of
    ``axis`` (kernels/quant.py's _param; blocks are not lowered)."""
    if block_size:
        raise NotLowered(f"{what} in blocks")
    b.readable(v)
    if v.size == 1:
        return v.reshape(())
    rank = len(x.shape)
    axis = axis + rank if axis < 0 else axis
    axis = min(axis, rank - 1)
    if len(v.shape) != 1 or rank == 0 or v.size != x.shape[axis]:
        raise NotLowered(f"{what} of {v.shape} for {x.shape} along {axis}")
    return v.reshape(tuple(v.size if d == axis else 1 for d in range(rank)))


@lowers("QuantizeLinear")
def quantize_linear(b, st, ins, outs):
    x, scale = ins[0], ins[1]
    zp = ins[2] if len(ins) > 2 else None
    kw = st.kwargs
    out_dt = np.dtype(outs[0].dtype)
    if x.dtype != F32 or scale.dtype != F32 or out_dt not in _BYTES or kw.get("precision", 0):
        raise NotLowered(f"QuantizeLinear of {x.dtype} to {out_dt}")
    if zp is not None and zp.dtype != out_dt:
        raise NotLowered("QuantizeLinear with a zero point of another type")
    scale, zp = _scale_and_zero_point(b, x, scale, zp, out_dt, kw, "QuantizeLinear")
    out = b.like(outs[0], [x])
    b.elementwise("OP_QUANTIZE", 0, out, [x, scale, zp])
    return [out]


def _scale_and_zero_point(b, x, scale, zp, zp_dtype, kw, what: str):
    """The scale and zero point (0 of ``zp_dtype`` when absent) laid along x's axis."""
    axis, block = int(kw.get("axis", 1)), int(kw.get("block_size", 0))
    scale = _per_axis(b, scale, x, axis, block, f"{what} scales")
    zp = b.const(np.zeros((), zp_dtype)) if zp is None else _per_axis(
        b, zp, x, axis, block, f"{what} zero points")
    return scale, zp


@lowers("DequantizeLinear")
def dequantize_linear(b, st, ins, outs):
    x, scale = ins[0], ins[1]
    zp = ins[2] if len(ins) > 2 else None
    kw = st.kwargs
    if x.dtype not in _BYTES + (np.dtype(np.int32),) or scale.dtype != F32 \
            or np.dtype(outs[0].dtype) != F32:
        raise NotLowered(f"DequantizeLinear of {x.dtype} to {outs[0].dtype}")
    if zp is not None and zp.dtype != x.dtype:
        raise NotLowered("DequantizeLinear with a zero point of another type")
    scale, zp = _scale_and_zero_point(b, x, scale, zp, x.dtype, kw, "DequantizeLinear")
    out = b.like(outs[0], [x])
    b.elementwise("OP_DEQUANTIZE", 0, out, [x, scale, zp])
    return [out]


@lowers("DynamicQuantizeLinear")
def dynamic_quantize_linear(b, st, ins, outs):
    if not library.available():
        raise NotLowered("no C library")
    _f32(ins[0])
    x = b.contiguous(ins[0])
    y, scale, zp = b.like(outs[0]), b.like(outs[1]), b.like(outs[2])
    b.emit("OP_DQL", tensors=[y, scale, zp, x], p=[x.size])
    return [y, scale, zp]


@lowers("MatMulInteger")
def matmul_integer(b, st, ins, outs):
    out = b.like(outs[0])
    _integer_product(b, st, ins, out, zp_slots=(2, 3), what="MatMulInteger")
    return [out]


@lowers("MatMulIntegerToFloat", domain=quant_matmul.MS_DOMAIN)
def matmul_integer_to_float(b, st, ins, outs):
    """One OP_QGEMM record storing float32 from its tile: ``acc * scale[n] + bias[n]``,
    scale the float32 product a_scale * b_scale as the kernel computes it (folded here
    when both are constants, else one record into an ``[N]`` scratch: a quantize_dynamic
    model's scale comes from its DynamicQuantizeLinear, placement/fusions/integer.py)."""
    if outs[0].dtype != np.float32:
        raise NotLowered("MatMulIntegerToFloat not float32")
    N = outs[0].shape[-1]
    a_scale, b_scale = ins[2], ins[3]
    if a_scale is None or b_scale is None or a_scale.dtype != np.float32 \
            or b_scale.dtype != np.float32:
        raise NotLowered("MatMulIntegerToFloat with scales that are not float32")
    if a_scale.size != 1 or b_scale.size not in (1, N) or len(b_scale.shape) > 1:
        raise NotLowered(f"MatMulIntegerToFloat scales of {a_scale.shape} and {b_scale.shape}")
    bias = _bias(b, ins, 6, N, "MatMulIntegerToFloat")
    ca, cb = _weight(b, st, 2), _weight(b, st, 3)
    if ca is not None and cb is not None:
        scale = b.const(np.ascontiguousarray(np.broadcast_to(
            (ca.reshape(()) * cb.reshape(-1 if cb.size > 1 else ())).astype(np.float32), (N,))))
    else:
        scale = b.scratch((N,), np.float32)
        b.elementwise("OP_BINARY", b.codes["B_MUL"], scale,
                      [a_scale.reshape(()), b_scale.reshape((N,) if b_scale.size > 1 else ())])
    out = b.like(outs[0])
    _integer_product(b, st, ins, out, zp_slots=(4, 5), what="MatMulIntegerToFloat",
                     epilogue=(scale, bias))
    return [out]


def _bias(b, ins, at: int, N: int, what: str):
    """Input ``at`` as a contiguous float32 bias of N values, or None when not given."""
    bias = ins[at] if len(ins) > at else None
    if bias is None:
        return None
    _f32(bias)
    if bias.size != N:
        raise NotLowered(f"{what} bias of {bias.shape}")
    return b.contiguous(bias)


def _integer_product(b, st, ins, out, zp_slots: tuple[int, int], what: str,
                     epilogue: tuple | None = None) -> None:
    """``out`` int32 = (A - a_zp) @ (B - b_zp) on qgemm.c, B the constant weight of slot 1
    (packed once, or reused from the kernel's CenteredWeight); with ``epilogue`` (scale
    ``[N]``, bias ``[N]`` or None) ``out`` is float32 ``that * scale + bias``."""
    if not library.available():
        raise NotLowered("no C library")
    A = ins[0]
    weight = _weight(b, st, 1)
    if A.dtype not in _BYTES or weight is None or weight.ndim != 2 or weight.dtype not in _BYTES:
        raise NotLowered(f"{what} without a constant 2-D 8-bit weight")
    azp = ins[zp_slots[0]] if len(ins) > zp_slots[0] else None
    if azp is not None and azp.size != 1:
        raise NotLowered(f"{what} with a zero point per row of A")
    bzp = None
    if len(ins) > zp_slots[1] and ins[zp_slots[1]] is not None:
        bzp = _weight(b, st, zp_slots[1])
        if bzp is None:
            raise NotLowered(f"{what} with a fed zero point of B")
    K, N = weight.shape
    if len(A.shape) < 2 or A.shape[-1] != K:
        raise NotLowered(f"{what} of A {A.shape} and B {weight.shape}")
    cw = getattr(st.fn, "centered_weight", None)
    packed = cw.packed if cw is not None and cw.source is weight and not cw.transpose else None
    if packed is None or not (bzp is None and cw.zero_point is None or bzp is not None
                              and cw.zero_point is not None
                              and np.array_equal(bzp, cw.zero_point)):
        packed = _int_gemm.PackedInt8(weight, bzp)
    if packed.zp is None:
        raise NotLowered(f"{what} with a zero point of B of another shape")
    A2 = b.contiguous(A)
    M = A2.size // K
    scale, bias = epilogue if epilogue is not None else (None, None)
    b.emit("OP_QGEMM", tensors=[out, A2, b.const(packed.packed),
                                None if azp is None else b.contiguous(azp), b.const(packed.zp),
                                scale, bias],
           p=[M, N, K], parts=b.parts(-(-N // 32) * -(-M // 64), 0.5 * M * K * N))


@lowers("MatMulNBits", domain=quant_matmul.MS_DOMAIN)
def matmul_nbits(b, st, ins, outs):
    if not library.available():
        raise NotLowered("no C library")
    kw = st.kwargs
    K, N = int(kw.get("K", 0)), int(kw.get("N", 0))
    bits, block = int(kw.get("bits", 4)), int(kw.get("block_size", 0))
    if bits not in (4, 8) or not 16 <= block <= 256 or block & (block - 1):
        raise NotLowered(f"MatMulNBits of {bits} bits, blocks of {block}")
    if len(ins) > 4 and ins[4] is not None:
        raise NotLowered("MatMulNBits with g_idx")
    A = ins[0]
    _f32(A)
    if outs[0].dtype != np.float32 or A.shape[-1] != K:
        raise NotLowered("MatMulNBits not float32 [.., K]")
    M = A.size // max(K, 1)
    if M > quant_matmul.NATIVE_ROWS or M == 0:
        raise NotLowered(f"MatMulNBits of {M} rows")
    B, scales = _weight(b, st, 1), _weight(b, st, 2)
    zp = _weight(b, st, 3) if len(ins) > 3 and ins[3] is not None else None
    if B is None or scales is None or (len(ins) > 3 and ins[3] is not None and zp is None):
        raise NotLowered("MatMulNBits whose weight is not a constant")
    kb = -(-K // block)
    if B.dtype != np.uint8 or B.size != N * kb * block * bits // 8 or scales.size != N * kb:
        raise NotLowered("MatMulNBits with a weight of the wrong size")  # the kernel says why
    zpb = zpf = None
    if zp is not None and zp.dtype == np.uint8:
        if zp.size != N * ((kb * bits + 7) // 8):
            raise NotLowered("MatMulNBits zero points of the wrong size")
        zpb = b.const(np.ascontiguousarray(zp).reshape(-1))
    elif zp is not None:
        if zp.size != N * kb:
            raise NotLowered("MatMulNBits zero points of the wrong size")
        zpf = b.const(np.ascontiguousarray(zp, dtype=np.float32).reshape(-1))
    bias = _bias(b, ins, 5, N, "MatMulNBits")
    A2 = b.contiguous(A)
    out = b.like(outs[0])
    b.emit("OP_NBITS", tensors=[out, A2, b.const(np.ascontiguousarray(B).reshape(-1)),
                                b.const(np.ascontiguousarray(scales, dtype=np.float32)
                                        .reshape(-1)), zpb, zpf, bias],
           p=[M, N, K, bits, block], parts=b.parts(N, 2.0 * M * K * N))
    return [out]

