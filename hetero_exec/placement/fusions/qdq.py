"""``fuse_qdq``: a QDQ model's product as onnxruntime runs it: MatMul(DequantizeLinear(x_q),
DequantizeLinear(W_q)) with W_q a constant 2-D 8-bit weight, and Gemm so (alpha = beta =
1, transA = 0, transB folded into a transposed copy of W_q; C a constant or the
DequantizeLinear of one, dequantized here) -> com.microsoft
MatMulIntegerToFloat(x_q, W_q, x_scale, W_scale, x_zp, W_zp, bias), the exact integer product
scaled once (kernels/contrib/quant_matmul.py; the integer GEMM of native/qgemm.c on cpu)
instead of two dequantizations and a float GEMM.

onnxruntime's QDQ transformer does the same (its MatMulIntegerToFloat / QLinearMatMul
selectors), so results move by float rounding of the scale only. Matched when x's scale
and zero point are scalars and W's are scalars or one per column (axis 1), the
DequantizeLinear of x is read by the MatMul alone, and nothing is blocked (opset 21's
block_size). x's DequantizeLinear may have other readers: it then stays for them.""" 

from __future__ import annotations

import numpy as np

from hetero_exec.ir.graph import Graph, Node
from hetero_exec.placement.fusions.rewriter import Region, Rewriter, attr

MS_DOMAIN = "com.microsoft"
_BYTES = (np.dtype(np.uint8), np.dtype(np.int8))


def _dq_parts(rw: Rewriter, node: Node | None) -> tuple[str, str, str] | None:
    """(x, scale, zero point or "") of a plain DequantizeLinear, None otherwise."""
    if not rw.onnx_op(node, "DequantizeLinear") or attr(node, "block_size", 0):
        return None
    ins = list(node.inputs) + [""] * (3 - len(node.inputs))
    if rw.dtype(ins[0]) not in _BYTES or rw.dtype(node.outputs[0]) != np.float32:
        return None
    return ins[0], ins[1], ins[2]


def _bias(rw: Rewriter, name: str, N: int) -> tuple[str, list[Node]] | None:
    """A Gemm's C as a float32 ``[N]`` constant (dequantized here when a DequantizeLinear of
    constants makes it) and the nodes it replaces; None when it is not one."""
    if not name:
        return "", []
    c = rw.const(name)
    chain: list[Node] = []
    if c is None:
        dq = rw.producer(name)
        if not rw.onnx_op(dq, "DequantizeLinear") or attr(dq, "block_size", 0) \
                or not rw.sole_reader(name):
            return None
        ins = list(dq.inputs) + [""] * (3 - len(dq.inputs))
        q, scale = rw.const(ins[0]), rw.const(ins[1])
        zp = rw.const(ins[2]) if ins[2] else None
        if q is None or scale is None or (ins[2] and zp is None) or q.ndim != 1:
            return None
        if scale.size not in (1, q.size) or (zp is not None and zp.size != scale.size):
            return None
        c = ((q.astype(np.float64) - (0 if zp is None else zp.astype(np.float64)))
             * scale.astype(np.float64)).astype(np.float32)  # as DequantizeLinear computes it
        chain = [dq]
    if c.dtype != np.float32 or c.size != N or c.shape not in ((N,), (1, N)):
        return None
    return rw.add_const(f"{name}_f32", np.ascontiguousarray(c.reshape(N))), chain


def _matmul(rw: Rewriter, node: Node) -> None:
    a, w = node.inputs[:2]
    gemm = node.op_type == "Gemm"
    if gemm and (attr(node, "transA", 0) or attr(node, "alpha", 1.0) != 1.0
                 or attr(node, "beta", 1.0) != 1.0):
        return
    trans_b = gemm and attr(node, "transB", 0)
    dq_a, dq_w = rw.producer(a), rw.producer(w)
    pa, pw = _dq_parts(rw, dq_a), _dq_parts(rw, dq_w)
    if pa is None or pw is None:
        return
    xq, xs, xz = pa
    wq, ws, wz = pw
    wv = rw.const(wq)
    if wv is None or wv.ndim != 2:
        return
    if trans_b:
        wv = np.ascontiguousarray(wv.T)
    xs_shape = rw.shape(xs)
    if xs_shape is None or int(np.prod([d if isinstance(d, int) else 2 for d in xs_shape])) != 1:
        return
    if xz and (rw.shape(xz) is None or rw.dtype(xz) != rw.dtype(xq)
               or int(np.prod([d if isinstance(d, int) else 2 for d in rw.shape(xz)])) != 1):
        return
    N = wv.shape[1]
    wsv = rw.const(ws)
    wzv = rw.const(wz) if wz else None
    if wsv is None or (wz and wzv is None):
        return
    per_column = wsv.size != 1
    column_axis = (0,) if trans_b else (1, -1)
    if per_column and (wsv.shape != (N,) or attr(dq_w, "axis", 1) not in column_axis):
        return
    if wzv is not None and wzv.size != wsv.size:
        return
    bias = _bias(rw, node.inputs[2] if gemm and len(node.inputs) > 2 else "", N)
    if bias is None:
        return
    if trans_b:
        wq = rw.add_const(f"{wq}_t", wv)
    # x's DequantizeLinear goes with the product when it is its only reader; otherwise it
    # stays for the others (quantize_static shares one for Q, K and V) until none is left
    head = [dq_a] if rw.feeds_only(dq_a, node) else []
    rw.fuse(head + [node] + bias[1], "MatMulIntegerToFloat", MS_DOMAIN,
            [xq, wq, xs, ws, xz, wz, bias[0]], node.outputs[0], {})


def fuse_qdq(graph: Graph, region: Region | None = None) -> Graph | None:
    rw = Rewriter(graph, region)
    for node in list(graph.nodes):
        if rw.onnx_op(node, "MatMul") and len(node.inputs) == 2 or rw.onnx_op(node, "Gemm") \
                and graph.opset("") >= 7:
            _matmul(rw, node)
    if not rw.finish():
        return None
    graph.opsets.setdefault(MS_DOMAIN, 1)
    return graph
