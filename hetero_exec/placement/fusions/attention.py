"""Scaled dot-product attention written out -> FusedAttention::

    s = MatMul(Q [* a], K^T [* b]) [* c | / c] [Where(cond, s, fill)] [+ mask]
    y = MatMul(Softmax(s, last axis), V)

K^T is a Transpose of the last two axes of K (absorbed: the kernel reads K) or any
value already laid out (..., D, S), such as a Transpose(0, 2, 3, 1) of the key's heads.
The scalars a, b, c (the dynamo exporter splits sqrt(scale) over Q and K^T) fold into
one scale. Grouped KV heads: when K and V come from repeat_kv's Unsqueeze -> Expand ->
Reshape, the kernel reads the unrepeated heads (and each query group shares them).
"""

from __future__ import annotations

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
    found = {"mask": "", "cond": "", "fill": "", "scale": 1.0, "nodes": []}
    node = rw.producer(name)
    if rw.onnx_op(node, "Add") and len(node.inputs) == 2 and rw.feeds_only(node, reader):
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
    return kt, 1, []


def _repeated_kv(rw: Rewriter, name: str, reader: Node) -> tuple[str, int, list[Node]] | None:
    """repeat_kv(x, g): Reshape(Expand(Unsqueeze(x, 2), (B, Hkv, g, S, D)), (B, Hkv*g, S, D)),
    read by ``reader`` only: (x, g, nodes)."""
    rs = rw.producer(name)
    if not rw.onnx_op(rs, "Reshape") or not rw.feeds_only(rs, reader):
        return None
    ex = rw.producer(rs.inputs[0])
    if not rw.onnx_op(ex, "Expand") or not rw.feeds_only(ex, rs):
        return None
    un = rw.producer(ex.inputs[0])
    if not rw.onnx_op(un, "Unsqueeze") or not rw.feeds_only(un, ex):
        return None
    axes = attr(un, "axes", None) if rw.graph.opset("") < 13 else rw.ints(un.inputs[1])
    xs, es, out = rw.shape(un.inputs[0]), rw.shape(ex.outputs[0]), rw.shape(name)
    if axes not in ([2], [-3]) or xs is None or es is None or out is None:
        return None
    if len(xs) != 4 or len(es) != 5 or len(out) != 4 or not isinstance(es[2], int) or es[2] <= 1:
        return None
    g = es[2]
    if not isinstance(xs[1], int) or es[1] != xs[1] or out[1] != xs[1] * g:
        return None
    if (out[0], out[2], out[3]) != (es[0], es[3], es[4]) or (es[0], es[3], es[4]) != (xs[0], xs[2], xs[3]):
        return None
    return un.inputs[0], g, [un, ex, rs]


def _attention(rw: Rewriter, sm: Node) -> None:
    if not _softmax_last(rw, sm) or not rw.float_value(sm.inputs[0]):
        return
    out_mm = rw.sole_reader(sm.outputs[0])
    if not rw.onnx_op(out_mm, "MatMul") or out_mm.inputs[0] != sm.outputs[0]:
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
    chain = (q_nodes + k_nodes + t_nodes + kv_nodes + [qk] + found["nodes"] + [sm, out_mm])
    attrs = {"scale": helper.make_attribute("scale", float(a * b * found["scale"])),
             "k_transposed": helper.make_attribute("k_transposed", k_transposed),
             "kv_groups": helper.make_attribute("kv_groups", groups)}
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
