"""MatMulNBits (com.microsoft, 4 or 8 bits) as one record on native/nbits.c: its weight,
scales and zero points constants of the plan, A float32 and at most
kernels/contrib/quant_matmul.NATIVE_ROWS rows (a decode step; a prompt's product stays
the kernel's, on the float copy's GEMM). A decoder quantized to 4 bits then runs its
step as one program, as the float32 one does."""

from __future__ import annotations

import numpy as np

from hetero_exec.exec.program.lower_linalg import _f32, _weight
from hetero_exec.exec.program.place import NotLowered
from hetero_exec.exec.program.registry import lowers
from hetero_exec.kernels.contrib import quant_matmul
from hetero_exec.kernels.native import library


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
    bias = ins[5] if len(ins) > 5 else None
    if bias is not None:
        _f32(bias)
        if bias.size != N:
            raise NotLowered(f"a MatMulNBits bias of {bias.shape}")
        bias = b.contiguous(bias)
    A2 = b.contiguous(A)
    out = b.like(outs[0])
    b.emit("OP_NBITS", tensors=[out, A2, b.const(np.ascontiguousarray(B).reshape(-1)),
                                b.const(np.ascontiguousarray(scales, dtype=np.float32)
                                        .reshape(-1)), zpb, zpf, bias],
           p=[M, N, K, bits, block], parts=b.parts(N, 2.0 * M * K * N))
    return [out]
