"""Products: a constant weight is packed once, when the plan is bound, and its product
runs on gemm.c's packed GEMM with the bias (and Relu/Clip) added as tiles are stored;
other float32 products run on small loops over strided operands (a transposed or
sliced operand is not copied), or as one-thread OpenBLAS calls split over the library's
workers (native/blas.c) when they are large."""

from __future__ import annotations

import math

import numpy as np

from hetero_exec.exec.program.place import NotLowered, Place, coalesce
from hetero_exec.exec.program.registry import lowers
from hetero_exec.kernels import _threads
from hetero_exec.kernels.fused import FUSED_DOMAIN
from hetero_exec.kernels.native import library, packed_gemm
from hetero_exec.kernels.native.activation import NO_ACTIVATION, activation_args

F32 = np.dtype(np.float32)
#: a product of this many FLOPs or more goes to OpenBLAS (below, the loops' own cost
#: is less than a BLAS call's)
BLAS_FLOPS = 1 << 18


def _f32(*places) -> None:
    for p in places:
        if p is None or p.dtype != F32:
            raise NotLowered(f"a product of {None if p is None else p.dtype}")


def packed(b, weight: np.ndarray, shared=None) -> Place:
    """The weight packed for gemm.c, as a constant: the plan's own packed copy when its
    step has one for this very array (kernels/_packed.PackedWeight), else packed here."""
    if shared is not None and shared.value is not None:
        source = shared.value.T if shared.transpose else shared.value
        if source.shape == weight.shape and np.shares_memory(source, weight) \
                and source.strides == weight.strides:
            return b.const(shared.packed().data)
    return b.const(packed_gemm.PackedRight(np.asarray(weight, F32)).data)


def product(b, A: Place, B: Place, out_example: np.ndarray, bias: Place | None = None,
            activation: str = "", params=None, weight: np.ndarray | None = None,
            shared=None) -> Place:
    """act(A @ B + bias) into a new place shaped like ``out_example``; ``weight``: B's
    value when it is a constant 2-D matrix (packed)."""
    _f32(A, B)
    if bias is not None:
        _f32(bias)
        if bias.size != out_example.shape[-1] or len(bias.shape) > 1 and bias.size != bias.shape[-1]:
            raise NotLowered(f"a bias of {bias.shape}")
        bias = b.contiguous(bias)
    full = activation_args(activation or "", params)
    if full is None:
        raise NotLowered(f"activation {activation!r}")
    code, p0, p1 = full
    out = b.like(out_example)
    if len(A.shape) < 2 or len(B.shape) < 2:
        raise NotLowered("a product of vectors")
    K, N = B.shape[-2], B.shape[-1]
    if weight is not None and len(B.shape) == 2:
        A2 = b.contiguous(A)
        M = A2.size // K
        store = activation_args(activation, params, store_only=True)
        act, lo, hi = store if store is not None else NO_ACTIVATION
        items = -(-M // packed_gemm.MR_RIGHT) if M >= 8 * packed_gemm.MR_RIGHT else -(-N // packed_gemm.NR)
        b.emit("OP_GEMM_PACKED", tensors=[out, A2, packed(b, weight, shared), bias, None],
               p=[M, N, K, K, N, act, N], f=[lo, hi],
               parts=b.parts(items, 2.0 * M * K * N))
        if store is None:
            b.emit("OP_BIAS_ACT", tensors=[out, None], p=[M, N, code], f=[p0, p1],
                   parts=b.parts(M, 8.0 * M * N))
        return out
    _matmul(b, A, B, out)
    if bias is not None or code:
        M = out.size // N
        b.emit("OP_BIAS_ACT", tensors=[out, bias], p=[M, N, code],
               f=[p0, p1], parts=b.parts(M, 8.0 * M * N))
    return out


def _matmul(b, A: Place, B: Place, out: Place) -> None:
    M, K = A.shape[-2:]
    N = B.shape[-1]
    batch = out.shape[:-2]
    a = A.broadcast(batch + (M, K))
    bb = B.broadcast(batch + (K, N))
    dims, (sa, sb, sc) = coalesce(batch, [a.strides[:-2], bb.strides[:-2], out.strides[:-2]])
    if len(dims) > 4:
        raise NotLowered(f"a product over {len(dims)} batch dims")
    pad = [0] * (4 - len(dims))
    strides = [tuple(sc) + tuple(pad) + out.strides[-2:], tuple(sa) + tuple(pad) + a.strides[-2:],
               tuple(sb) + tuple(pad) + bb.strides[-2:]]
    p = [M, N, K, len(dims), *dims, *pad] + [0] * 13
    flops = 2.0 * math.prod(batch) * M * N * K
    blas = _blas(a, bb, dims, sa, sb, flops) if flops >= BLAS_FLOPS else None
    parts = 1
    if blas is not None:
        p[8:21] = blas
        parts = b.parts(blas[8] if blas[8] > 1 else max(M // 16, N // 64, 1), flops)
    b.emit("OP_MATMUL", tensors=[out, a, bb], strides=strides, p=p, parts=parts)


def _blas(a: Place, bb: Place, dims, sa, sb, flops) -> list[int] | None:
    """The BLAS call's fields (p8..p20 of the record) when A and B are CBLAS operands
    and the batch is one stride apart, else None."""
    gemm = _threads.blas_gemm()
    if gemm is None or len(dims) > 1:
        return None
    la, lb = _layout(a), _layout(bb)
    if la is None or lb is None:
        return None
    count = dims[0] if dims else 1
    M, N = a.shape[-2], bb.shape[-1]
    es = 4
    return [gemm.sgemm, gemm.sgemv, gemm.ilp64, 1, la[0], la[1], lb[0], lb[1], count,
            (sa[0] if dims else 0) * es, (sb[0] if dims else 0) * es, M * N * es,
            16 if M >= N else 64]


def _layout(x: Place) -> tuple[int, int] | None:
    """(stored transposed, leading dimension) of x's matrix as a CBLAS operand."""
    r, c = x.shape[-2:]
    s0, s1 = x.strides[-2:]
    if c <= 1 or s1 == 1:
        ld = s0 if r > 1 else max(c, 1)
        if ld >= max(c, 1):
            return 0, ld
    if r <= 1 or s0 == 1:
        ld = s1 if c > 1 else max(r, 1)
        if ld >= max(r, 1):
            return 1, ld
    return None


def _weight(b, st, i: int) -> np.ndarray | None:
    """Input ``i``'s value when it is the same on every run (a weight), else None."""
    slot = st.inputs[i]
    return b.vals[slot] if slot in b.known_value and isinstance(b.vals[slot], np.ndarray) else None


@lowers("MatMul")
def matmul(b, st, ins, outs):
    if not library.available():
        raise NotLowered("no C library")
    return [product(b, ins[0], ins[1], outs[0], weight=_weight(b, st, 1),
                    shared=getattr(st.fn, "packed_weight", None))]


@lowers("FusedMatMul", domain=FUSED_DOMAIN)
def fused_matmul(b, st, ins, outs):
    bias = ins[2] if len(ins) > 2 else None
    return [product(b, ins[0], ins[1], outs[0], bias, st.kwargs.get("activation", ""),
                    st.kwargs.get("activation_params"), weight=_weight(b, st, 1),
                    shared=getattr(st.fn, "packed_weight", None))]


@lowers("Gemm")
def gemm(b, st, ins, outs):
    kw = st.kwargs
    if float(kw.get("alpha", 1.0)) != 1.0 or (len(ins) > 2 and ins[2] is not None
                                             and float(kw.get("beta", 1.0)) != 1.0):
        raise NotLowered("Gemm with alpha or beta")
    A, B = ins[0], ins[1]
    if kw.get("transA", 0):
        A = A.transpose((1, 0))
    weight = _weight(b, st, 1)
    if kw.get("transB", 0):
        B = B.transpose((1, 0))
        weight = None if weight is None else weight.T
    bias = ins[2] if len(ins) > 2 else None
    if bias is not None and bias.size != outs[0].shape[-1]:
        raise NotLowered(f"a Gemm bias of {bias.shape}")
    if bias is not None:
        bias = b.contiguous(bias).reshape((bias.size,))
    return [product(b, A, B, outs[0], bias, weight=weight,
                    shared=getattr(st.fn, "packed_weight", None))]
