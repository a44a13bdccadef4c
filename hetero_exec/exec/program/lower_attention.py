"""A decoder's cache and attention steps: the generator's in-place cache append
(KVAppend, KVPrefix views), Llama's rotary embedding (FusedRotary as element-wise
records), and onnxruntime's GroupQueryAttention (native/gqa.c) over a shared past/present
buffer, or over a present made from a distinct past."""

from __future__ import annotations

import numpy as np

from hetero_exec.exec.program.place import NotLowered, Place, coalesce
from hetero_exec.exec.program.registry import lowers
from hetero_exec.kernels.contrib.schemas import MS_DOMAIN
from hetero_exec.kernels.fused import FUSED_DOMAIN
from hetero_exec.kernels.kv_cache import is_shared

F32 = np.dtype(np.float32)
I64 = np.dtype(np.int64)


def _axis(st, rank: int) -> int:
    return int(st.kwargs.get("axis", -2)) % rank


@lowers("KVAppend", domain=FUSED_DOMAIN)
def kv_append(b, st, ins, outs):
    cache, new, past_length = ins[0], b.readable(ins[1]), b.readable(ins[2])
    past = ins[3] if len(ins) > 3 else None
    if cache is None or b.buffers[cache.buf].kind != "feed" or not cache.contiguous:
        raise NotLowered("a cache that is not a fed buffer")
    if past is None or past_length.dtype != I64 or past_length.size != 1:
        raise NotLowered("a cache append without its past's shape")
    if new.dtype != cache.dtype:
        raise NotLowered("new entries of another type")
    axis = _axis(st, len(cache.shape))
    s, n, cap = new.shape[axis], past.shape[axis], cache.shape[axis]
    if n + s > cap:
        raise NotLowered("past the capacity")
    dims, (sc, sn) = coalesce(new.shape, [cache.strides, new.strides])
    if not dims:
        dims, sc, sn = (1,), (0,), (0,)
    b.emit("OP_KV_APPEND", dims=dims, tensors=[cache, new, past_length], strides=[sc, sn, ()],
           p=[cache.strides[axis] * cache.itemsize, s, cap])
    return [cache.slice(axis, 0, n + s, 1)]


@lowers("KVPrefix", domain=FUSED_DOMAIN)
def kv_prefix(b, st, ins, outs):
    cache, past = ins
    axis = _axis(st, len(cache.shape))
    return [cache.slice(axis, 0, past.shape[axis], 1)]


@lowers("FusedRotary", domain=FUSED_DOMAIN)
def fused_rotary(b, st, ins, outs):
    """X * cos + rotate_half(X) * sin, rotate_half(X) = [-X[..., h:], X[..., :h]]."""
    X, cos, sin = (b.readable(x) for x in ins)
    if any(x.dtype != F32 for x in (X, cos, sin)) or tuple(outs[0].shape) != X.shape:
        raise NotLowered("a rotary of another type or shape")
    h = int(st.kwargs.get("split", 0))
    D = X.shape[-1]
    w = D - h
    last = len(X.shape) - 1
    rh = b.scratch(X.shape, F32)
    c = b.codes
    b.elementwise("OP_UNARY", c["U_NEG"], rh.slice(last, 0, w, 1), [X.slice(last, h, D, 1)])
    if h:
        b.elementwise("OP_COPY", 0, rh.slice(last, w, D, 1), [X.slice(last, 0, h, 1)])
    b.elementwise("OP_BINARY", c["B_MUL"], rh, [rh, sin])
    out = b.like(outs[0])
    b.elementwise("OP_BINARY", c["B_MUL"], out, [X, cos])
    b.elementwise("OP_BINARY", c["B_ADD"], out, [out, rh])
    return [out]


def _const_ref(b, place: Place) -> tuple[int, int]:
    if b.buffers[place.buf].kind != "const" or not place.contiguous or place.dtype != F32:
        raise NotLowered("rotary caches that are not constants")
    b.use(place)
    return place.buf, place.off


@lowers("GroupQueryAttention", domain=MS_DOMAIN)
def group_query_attention(b, st, ins, outs):
    ins = list(ins) + [None] * (17 - len(ins))
    query, key, value, past_k, past_v, seqlens = ins[:6]
    kw = st.kwargs
    if any(ins[i] is not None for i in range(9, 17)):
        raise NotLowered("position ids, a bias, a sink or quantized caches")
    if kw.get("smooth_softmax", -1) == 1 or not kw.get("causal", 1) or len(outs) > 3:
        raise NotLowered("smooth softmax, non-causal attention or the qk output")
    if query.dtype != F32 or seqlens.dtype != np.dtype(np.int32) or any(
            p is not None and p.dtype != F32 for p in (past_k, past_v)):
        raise NotLowered("GroupQueryAttention of float16")
    total = int(b.static(st.inputs[6]).reshape(-1)[0])
    heads, kv_heads = int(kw["num_heads"]), int(kw["kv_num_heads"])
    batch, seq = query.shape[0], query.shape[1]
    packed = key is None
    head = query.shape[2] // (heads + 2 * kv_heads) if packed else query.shape[2] // heads
    query = b.contiguous(query)
    key = None if packed else b.contiguous(b.readable(key))
    value = None if packed else b.contiguous(b.readable(value))
    seqlens = b.contiguous(b.readable(seqlens))
    if _shared(b, st, past_k, past_v, outs):
        cap = past_k.shape[2]
        if cap < total or past_v.shape != past_k.shape:
            raise NotLowered("a buffer smaller than the total length")
    else:
        past_k, past_v = (_present(b, p, o, seqlens, (batch, kv_heads, total, head), seq, total)
                          for p, o in ((past_k, outs[1:2]), (past_v, outs[2:3])))
        cap = past_k.shape[2]
    rotary = int(kw.get("do_rotary", 0))
    cos = sin = (0, 0)
    rd = max_pos = 0
    if rotary:
        if ins[7] is None or ins[8] is None:
            raise NotLowered("rotary without its caches")
        cos, sin = _const_ref(b, ins[7]), _const_ref(b, ins[8])
        max_pos, rd = ins[7].shape[0], 2 * ins[7].shape[-1]
    out = b.like(outs[0])
    scale = float(kw.get("scale", 0.0)) or 1.0 / float(np.sqrt(head))
    window = int(kw.get("local_window_size", -1))
    b.emit("OP_GQA", tensors=[out, query, key, value, past_k, past_v, seqlens],
           p=[batch, seq, heads, kv_heads, head, cap, total, int(packed), rotary,
              int(kw.get("rotary_interleaved", 0)), cos[0], cos[1], sin[0], sin[1], max_pos,
              window, rd],
           f=[scale, float(kw.get("softcap", 0.0))],
           parts=b.parts(batch * heads, 4.0 * batch * heads * seq * total * head))
    return [out, past_k, past_v]


def _shared(b, st, past_k: Place | None, past_v: Place | None, outs) -> bool:
    """Whether past and present are one buffer (a generator's cache, kv_cache.share_buffer)."""
    if past_k is None or past_v is None or len(outs) < 3:
        return False
    return all(b.buffers[p.buf].kind == "feed" and is_shared(b.vals[slot]) and p.contiguous
               for p, slot in ((past_k, st.inputs[3]), (past_v, st.inputs[4])))


def _present(b, past: Place | None, out: list, seqlens: Place, shape: tuple, seq: int,
             total: int) -> Place:
    """A present distinct from its past: a new value of the past's capacity (at least the
    total length), each row's past positions copied in and the rest zeroed by an
    OP_GQA_PAST record, for OP_GQA to append to in place."""
    batch, kv_heads, _, head = shape
    if past is None and seq != total:
        raise NotLowered("a later call with no past")
    if past is not None and (len(past.shape) != 4 or past.shape[:2] != shape[:2]
                             or past.shape[3] != head):
        raise NotLowered("a past of another shape")
    have = past.shape[2] if past is not None else 0
    cap = max(total, have)
    if out and out[0] is not None and tuple(out[0].shape) != (batch, kv_heads, cap, head):
        raise NotLowered("a present of another shape")
    present = b.scratch((batch, kv_heads, cap, head), F32)
    past = None if not have else b.contiguous(b.readable(past))  # (an empty past: none read)
    rows = batch * kv_heads
    b.emit("OP_GQA_PAST", tensors=[present, past, seqlens],
           p=[batch, seq, kv_heads, head, cap, have, total],
           parts=b.parts(rows, 0.25 * rows * cap * head))
    return present


def _grouped(b, a: Place, other: Place, groups_of: int, out_example) -> Place:
    """a (B, Hq, L, X) @ other (B, Hkv, X, Y), query head h reading kv head h // g: the
    g query heads of a kv head as one taller matrix (no operand repeated)."""
    from hetero_exec.exec.program.lower_linalg import product

    B, hq, L, X = a.shape
    if groups_of <= 1 or hq == groups_of:
        return product(b, a, other, out_example)
    kv = groups_of
    tall = b.contiguous(a).reshape((B, kv, (hq // kv) * L, X))
    y = product(b, tall, other, np.empty((B, kv, (hq // kv) * L, other.shape[-1]), F32))
    return y.reshape((B, hq, L, other.shape[-1]))


def _attention_rows(b, Q: Place, KT: Place, V: Place, mask: Place | None, cond: Place | None,
                    fill: Place | None, out_example, kv_groups: int, kw) -> Place:
    """The attention a row at a time (native/attention.c, as the kernel's numpy path
    calls it): the keys each row's mask or condition hides at either end never computed."""
    B, hq, L, D = Q.shape
    S = KT.shape[-1]
    hkv = KT.shape[1] if kv_groups > 1 else hq
    if hkv <= 0 or hq % hkv or KT.shape[2] != D or tuple(V.shape[2:]) != (S, D):
        raise NotLowered("attention operands of other shapes")
    K = KT.broadcast((B, hkv, D, S)).transpose((0, 1, 3, 2))  # (batch, kv head, key, dim)
    V = V.broadcast((B, hkv, S, D))
    mask = None if mask is None else mask.broadcast((B, hq, L, S))
    cond = None if cond is None else cond.broadcast((B, hq, L, S))
    out = b.like(out_example)
    rows = B * hq * L
    b.emit("OP_ATTENTION", tensors=[out, Q, K, V, mask, cond, fill if cond is not None else None],
           p=[B, hq, hkv, L, S, D, int(kw.get("nan_to_zero", 0))],
           f=[float(kw.get("scale", 1.0))], parts=b.parts(rows, 4.0 * rows * S * D))
    return out


@lowers("FusedAttention", domain=FUSED_DOMAIN)
def fused_attention(b, st, ins, outs):
    """Softmax(scale * Q @ K^T [where condition else fill] [+ mask]) @ V, its scores in
    one scratch value, each step in place on it."""
    ins = list(ins) + [None] * (6 - len(ins))
    Q, K, V, mask, cond, fill = (b.readable(x) if x is not None else None for x in ins[:6])
    kw = st.kwargs
    if any(x is not None and x.dtype != F32 for x in (Q, K, V, mask, fill)) or len(Q.shape) != 4:
        raise NotLowered("attention of another type or rank")
    KT = K if kw.get("k_transposed", 1) else K.transpose((0, 1, 3, 2))
    kv_groups = int(kw.get("kv_groups", 1))
    B, hq, L, _ = Q.shape
    S = KT.shape[-1]
    if not int(kw.get("mask_groups", 0)) and len(KT.shape) == len(V.shape) == 4 and (
            cond is None or (cond.dtype == np.bool_ and fill is not None and fill.size == 1)):
        return [_attention_rows(b, Q, KT, V, mask, cond, fill, outs[0], kv_groups, kw)]
    s = _grouped(b, Q, KT, KT.shape[1] if kv_groups > 1 else 0, np.empty((B, hq, L, S), F32))
    c = b.codes
    scale = float(kw.get("scale", 1.0))
    if scale != 1.0:
        b.elementwise("OP_BINARY", c["B_MUL"], s, [s, b.const(np.full((1,), scale, F32))])
    if cond is not None:
        b.elementwise("OP_WHERE", 0, s, [cond, s, fill])
    if mask is not None:
        groups = int(kw.get("mask_groups", 0))
        view = s.reshape((-1, groups) + s.shape[1:]) if groups else s
        b.elementwise("OP_BINARY", c["B_ADD"], view, [view, mask])
    rows = s.size // S
    b.emit("OP_SOFTMAX", tensors=[s, s], p=[rows, S], parts=b.parts(rows, 16.0 * s.size))
    if kw.get("nan_to_zero", 0):
        b.elementwise("OP_UNARY", c["U_NAN_TO_ZERO"], s, [s])
    out = _grouped(b, s, V, V.shape[1] if kv_groups > 1 else 0, outs[0])
    return [out]
