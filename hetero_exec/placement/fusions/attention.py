"""Scaled dot-product attention written out -> FusedAttention::

    s = MatMul(Q [* a], K^T [* b]) [* c | / c] [Where(cond, s, fill)] [+ mask]
    p = Softmax(s, last axis) [Where(IsNaN(p), 0, p)]
    y = MatMul(p, V)

The mask may be added in a view of the scores that splits their leading axis in
(-1, G) (Swin's shifted windows: Reshape, Add, Reshape).

K^T is a Transpose of the last two axes of K (absorbed: the kernel reads K) or any
value already laid out (..., D, S), such as a Transpose(0, 2, 3, 1) of the key's heads.
The scalars a, b, c (the dynamo exporter splits sqrt(scale) over Q and K^T) fold into
one scale. torch's exported scaled_dot_product_attention guards the probabilities of a
row with no key to attend (NaN) as zeros: kept as the kernel's ``nan_to_zero``. Grouped KV heads: when K and V come from repeat_kv's Unsqueeze -> Expand ->
Reshape, the kernel reads the unrepeated heads (and each query group shares them).
"""

from __future__ import annotations

import numpy as np
from onnx import helper

from hetero_exec.ir.graph import Graph, Node
from hetero_exec.kernels.fused import FUSED_DOMAIN
from hetero_exec.placement.fusions.rewriter import Region, Rewriter, attr, other


def _softmax_last(rw: Rewriter, node: Node) -> bool:
    rank = rw.rank(node.inputs[0])
    axis = int(attr(node, "axis", -1 if rw.graph.opset("") >= 13 else 1))
    if rank is None:
        return axis == -1
    return axis in (-1, rank - 1)


def _scaled(rw: Rewriter, name: str, reader: Node) -> tuple[str, float, list[Node]]:
    """``name`` = v * c (Mul by a scalar constant, read by ``reader`` only): (v, c, [mul]);
    otherwise (name, 1, [])."""
    p = rw.producer(name)
    if rw.onnx_op(p, "Mul") and len(p.inputs) == 2 and rw.feeds_only(p, reader):
        for v in p.inputs:
            c = rw.scalar(other(p, v))
            if c is not None and rw.shape(other(p, v)) in ((), (1,)):
                return v, c, [p]
    return name, 1.0, []


def _scores(rw: Rewriter, name: str, reader: Node):
    """Walk back from the softmax input to the QK MatMul: the pieces found on the way."""
    found = {"mask": "", "cond": "", "fill": "", "scale": 1.0, "nodes": [], "groups": 0}
    node = rw.producer(name)
    grouped = _grouped_mask(rw, node, reader)
    if grouped is not None:  # Swin's shifted windows: the mask added in a (-1, nW, ...) view
        mask, groups, nodes, r1 = grouped
        found.update(mask=mask, groups=groups)
        found["nodes"] += nodes
        reader, node = r1, rw.producer(r1.inputs[0])
    elif rw.onnx_op(node, "Add") and len(node.inputs) == 2 and rw.feeds_only(node, reader):
        for s, m in (node.inputs, node.inputs[::-1]):
            p = rw.producer(s)
            if p is not None and p.op_type in ("MatMul", "Mul", "Div", "Where") and rw.feeds_only(p, node):
                found["mask"] = m
                found["nodes"].append(node)
                reader, node = node, p
                break
    if rw.onnx_op(node, "Where") and len(node.inputs) == 3 and rw.feeds_only(node, reader):
        cond, s, fill = node.inputs
        if rw.scalar(fill) is not None and rw.dtype(cond) is not None and rw.dtype(cond).kind == "b":
            found.update(cond=cond, fill=fill)
            found["nodes"].append(node)
            reader, node = node, rw.producer(s)
    if (rw.onnx_op(node, "Mul") or rw.onnx_op(node, "Div")) and len(node.inputs) == 2 \
            and rw.feeds_only(node, reader):
        pos = [i for i, v in enumerate(node.inputs) if rw.scalar(v) is not None]
        if pos and (node.op_type == "Mul" or pos == [1]):
            c = rw.scalar(node.inputs[pos[-1]])
            found["scale"] = c if node.op_type == "Mul" else 1.0 / c
            found["nodes"].append(node)
            reader, node = node, rw.producer(node.inputs[1 - pos[-1]])
    if not rw.onnx_op(node, "MatMul") or not rw.feeds_only(node, reader) or not found["scale"]:
        return None
    found["matmul"] = node
    return found


def _grouped_mask(rw: Rewriter, r2: Node | None, reader: Node):
    """Reshape(Reshape(s, (-1, G, h, T, T)) + mask, (-1, h, T, T)): (mask, G, nodes, the
    first Reshape)."""
    if not rw.onnx_op(r2, "Reshape") or not rw.feeds_only(r2, reader):
        return None
    add = rw.producer(r2.inputs[0])
    if not rw.onnx_op(add, "Add") or len(add.inputs) != 2 or not rw.feeds_only(add, r2):
        return None
    for s, mask in (add.inputs, add.inputs[::-1]):
        r1 = rw.producer(s)
        if not rw.onnx_op(r1, "Reshape") or not rw.feeds_only(r1, add):
            continue
        scores = _dims(rw, r1.inputs[0])
        t1, t2 = rw.ints(r1.inputs[1]), rw.ints(r2.inputs[1])
        if scores is None or len(scores) != 4 or t1 is None or t2 is None:
            continue
        tail = list(scores[1:])
        if not all(isinstance(d, int) for d in tail) or t2 != [-1] + tail or len(t1) != 5 \
                or t1[0] != -1 or t1[2:] != tail or t1[1] <= 0:
            continue
        ms = _dims(rw, mask)
        want = (t1[1], *tail)
        if ms is None or len(ms) > 5 or any(d not in (1, w) for d, w in zip(ms[::-1], want[::-1])) \
                or (len(ms) == 5 and ms[0] != 1):
            continue
        return mask, t1[1], [r2, add, r1], r1
    return None


def _swaps_last_two(rw: Rewriter, node: Node) -> bool:
    perm = attr(node, "perm", None)
    if perm is None:
        return False
    r = len(perm)
    return r >= 2 and list(perm) == list(range(r - 2)) + [r - 1, r - 2]


def _key(rw: Rewriter, kt: str, reader: Node) -> tuple[str, int, list[Node]]:
    """K^T as (K, 0) when it is a Transpose of K's last two axes read here only, else (K^T, 1)."""
    t = rw.producer(kt)
    if rw.onnx_op(t, "Transpose") and _swaps_last_two(rw, t) and rw.feeds_only(t, reader):
        return t.inputs[0], 0, [t]
    folded = _flat_transpose(rw, kt, reader)
    if folded is not None:
        return folded
    return kt, 1, []


def _flat_transpose(rw: Rewriter, kt: str, reader: Node) -> tuple[str, int, list[Node]] | None:
    """The dynamo exporter's K^T: Reshape(Transpose(Reshape(K, (-1, S, D)), (0, 2, 1)),
    (B, H, D, S)), the batch and head axes flattened around the transpose: (K, 0, nodes)."""
    r2 = rw.producer(kt)
    if not rw.onnx_op(r2, "Reshape") or not rw.feeds_only(r2, reader):
        return None
    t = rw.producer(r2.inputs[0])
    if not rw.onnx_op(t, "Transpose") or list(attr(t, "perm", [])) != [0, 2, 1] \
            or not rw.feeds_only(t, r2):
        return None
    r1 = rw.producer(t.inputs[0])
    if not rw.onnx_op(r1, "Reshape") or not rw.feeds_only(r1, t):
        return None
    k = r1.inputs[0]
    ks, kts = _dims(rw, k), _dims(rw, kt)
    if ks is None or kts is None or len(ks) != 4 or len(kts) != 4:
        return None
    if any(a is None or a != b for a, b in zip(ks, (kts[0], kts[1], kts[3], kts[2]))):
        return None
    return k, 0, [r1, t, r2]


def _repeated_kv(rw: Rewriter, name: str, reader: Node) -> tuple[str, int, list[Node]] | None:
    """repeat_kv(x, g): Reshape(Expand(Unsqueeze(x, 2), (B, Hkv, g, S, D)), (B, Hkv*g, S, D)),
    read by ``reader`` (and maybe by Shape nodes: transformers reads the keys' length
    from it): (x, g, the nodes to fuse away: none while a Shape still reads them)."""
    rs = rw.producer(name)
    readers = rw.readers(name) if rw.onnx_op(rs, "Reshape") else None
    if not readers or reader not in readers or sum(1 for i in reader.inputs if i == name) != 1:
        return None
    shape_readers = [r for r in readers if r is not reader]
    if not all(rw.onnx_op(r, "Shape") for r in shape_readers):
        return None
    ex = rw.producer(rs.inputs[0])
    if not rw.onnx_op(ex, "Expand") or not rw.feeds_only(ex, rs):
        return None
    un = rw.producer(ex.inputs[0])
    if not rw.onnx_op(un, "Unsqueeze") or not rw.feeds_only(un, ex):
        return None
    axes = attr(un, "axes", None) if rw.graph.opset("") < 13 else rw.ints(un.inputs[1])
    xs, es, out = (_dims(rw, n) for n in (un.inputs[0], ex.outputs[0], name))
    if axes not in ([2], [-3]) or xs is None or out is None or len(xs) != 4 or len(out) != 4:
        return None
    kv, d = xs[1], xs[3]
    if not isinstance(kv, int) or not isinstance(d, int) or not isinstance(out[1], int) \
            or kv <= 0 or out[1] % kv:
        return None
    g = out[1] // kv
    # (B, kv, g, S, D) -> (B, kv*g, S, D): B, S and D kept (the same dims, named or not
    # known to differ), so the Expand repeats axis 2 only; onnx often leaves the
    # Expand's own dims unnamed (its target is computed), hence the Reshape's are read
    if g <= 1 or out[0] is None or out[0] != xs[0] or out[2] is None or out[2] != xs[2] \
            or out[3] != d:
        return None
    if es is not None and (len(es) != 5 or any(e is not None and e != want for e, want
                                               in zip(es, (xs[0], kv, g, xs[2], d)))):
        return None
    return un.inputs[0], g, [] if shape_readers else [un, ex, rs]


def _dims(rw: Rewriter, name: str):
    """The declared dims of ``name`` (unknown ones None), None when its rank is unknown."""
    v = rw.graph.values.get(name)
    return None if v is None or v.shape is None else tuple(v.shape)


def _nan_guard(rw: Rewriter, sm: Node) -> tuple[str, list[Node]] | None:
    """Where(IsNaN(p), 0, p) over the softmax's p, its only readers: (its output, nodes)."""
    readers = rw.readers(sm.outputs[0])
    if readers is None or len(readers) != 2:
        return None
    isnan = next((r for r in readers if rw.onnx_op(r, "IsNaN")), None)
    where = next((r for r in readers if rw.onnx_op(r, "Where")), None)
    if isnan is None or where is None or not rw.feeds_only(isnan, where):
        return None
    cond, zero, p = where.inputs
    if cond != isnan.outputs[0] or p != sm.outputs[0] or rw.scalar(zero) != 0.0:
        return None
    return where.outputs[0], [isnan, where]


def _attention(rw: Rewriter, sm: Node) -> None:
    # float32 only: the scale is a (32-bit) attribute, too coarse for float64 scores
    if not _softmax_last(rw, sm) or rw.dtype(sm.inputs[0]) != np.float32:
        return
    probs, guard = sm.outputs[0], []
    guarded = _nan_guard(rw, sm)
    if guarded is not None:
        probs, guard = guarded
    out_mm = rw.sole_reader(probs)
    if not rw.onnx_op(out_mm, "MatMul") or out_mm.inputs[0] != probs:
        return
    found = _scores(rw, sm.inputs[0], sm)
    if found is None:
        return
    qk = found["matmul"]
    q, a, q_nodes = _scaled(rw, qk.inputs[0], qk)
    kt, b, k_nodes = _scaled(rw, qk.inputs[1], qk)
    k, k_transposed, t_nodes = _key(rw, kt, k_nodes[0] if k_nodes else qk)
    v = out_mm.inputs[1]
    groups, kv_nodes = 1, []
    rk = _repeated_kv(rw, k, t_nodes[0] if t_nodes else (k_nodes[0] if k_nodes else qk))
    rv = _repeated_kv(rw, v, out_mm)
    if rk is not None and rv is not None and rk[1] == rv[1] and not k_transposed:
        k, groups, kv_nodes = rk[0], rk[1], rk[2] + rv[2]
        v = rv[0]
    chain = (q_nodes + k_nodes + t_nodes + kv_nodes + [qk] + found["nodes"] + [sm] + guard
             + [out_mm])
    attrs = {"scale": helper.make_attribute("scale", float(a * b * found["scale"])),
             "k_transposed": helper.make_attribute("k_transposed", k_transposed),
             "kv_groups": helper.make_attribute("kv_groups", groups)}
    if found["groups"]:
        attrs["mask_groups"] = helper.make_attribute("mask_groups", found["groups"])
    if guard:
        attrs["nan_to_zero"] = helper.make_attribute("nan_to_zero", 1)
    if not all(rw.dtype(n) == rw.dtype(q) for n in (k, v) + ((found["mask"],) if found["mask"] else ())):
        return
    rw.fuse(chain, "FusedAttention", FUSED_DOMAIN,
            [q, k, v, found["mask"], found["cond"], found["fill"]], out_mm.outputs[0], attrs)


def fuse_attention(graph: Graph, region: Region | None = None) -> Graph | None:
    rw = Rewriter(graph, region)
    for node in list(graph.nodes):
        if rw.onnx_op(node, "Softmax"):
            _attention(rw, node)
    return graph if rw.finish() else None
