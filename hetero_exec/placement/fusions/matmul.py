"""``fuse_matmul``: MatMul [+ Add(1-D bias)] [+ activation] (one of the two at least), and Gemm (alpha = beta = 1,
transA = 0, constant B: transB is folded into a transposed copy) [+ activation] ->
FusedMatMul, the activation one of `activation.match_activation`'s."""

from __future__ import annotations

import numpy as np

from hetero_exec.ir.graph import Graph, Node
from hetero_exec.kernels.fused import FUSED_DOMAIN
from hetero_exec.placement.fusions.activation import match_activation
from hetero_exec.placement.fusions.rewriter import FLOATS, Region, Rewriter, attr, other, str_attr


def _with_activation(rw: Rewriter, y: str, chain: list[Node]) -> tuple[str, dict]:
    act = match_activation(rw, y)
    if act is None:
        return y, {"activation": str_attr("activation", "")}
    chain += act.nodes
    return act.output, act.attrs()


def _matmul_add(rw: Rewriter, node: Node) -> None:
    a, w = node.inputs
    ws = rw.shape(w)
    y = node.outputs[0]
    if ws is None or len(ws) != 2 or not rw.float_value(y):
        return
    add = rw.sole_reader(y)
    bias_name = other(add, y) if rw.onnx_op(add, "Add") and len(add.inputs) == 2 else ""
    bias = rw.const(bias_name) if bias_name else None
    if bias is None or bias.dtype != rw.dtype(y) or bias.shape != (ws[1],):
        _matmul_activation(rw, node)  # no bias: the activation alone (SiLU of a gate)
        return
    if bias_name not in rw.graph.initializers:  # a Constant node's value: an initializer now
        bias_name = rw.add_const(f"{bias_name}_bias", bias)
    chain = [node, add]
    out, attrs = _with_activation(rw, add.outputs[0], chain)
    rw.fuse(chain, "FusedMatMul", FUSED_DOMAIN, [a, w, bias_name], out, attrs)


def _matmul_activation(rw: Rewriter, node: Node) -> None:
    chain = [node]
    out, attrs = _with_activation(rw, node.outputs[0], chain)
    if len(chain) > 1:
        rw.fuse(chain, "FusedMatMul", FUSED_DOMAIN, list(node.inputs), out, attrs)


def _gemm(rw: Rewriter, node: Node) -> None:
    ins = list(node.inputs) + [""] * (3 - len(node.inputs))
    a, b, c = ins[:3]
    bw = rw.const(b)
    if bw is None or bw.ndim != 2 or bw.dtype not in FLOATS:
        return
    if attr(node, "transA", 0) or attr(node, "alpha", 1.0) != 1.0:
        return
    if c and attr(node, "beta", 1.0) != 1.0:
        return
    w = bw.T if attr(node, "transB", 0) else bw
    N = w.shape[1]
    bias_name = ""
    if c:
        cv = rw.const(c)
        if cv is None or cv.dtype != bw.dtype or cv.size != N or cv.shape not in ((N,), (1, N)):
            return
        bias_name = c if cv.shape == (N,) and c in rw.graph.initializers else rw.add_const(
            f"{c}_row", cv.reshape(N))
    chain = [node]
    out, attrs = _with_activation(rw, node.outputs[0], chain)
    if len(chain) == 1 and not attr(node, "transB", 0):
        return  # nothing to gain: Gemm already adds its bias in place
    if attr(node, "transB", 0):
        b = rw.add_const(f"{b}_t", np.ascontiguousarray(w))
    rw.fuse(chain, "FusedMatMul", FUSED_DOMAIN, [a, b, bias_name], out, attrs)


def fuse_matmul(graph: Graph, region: Region | None = None) -> Graph | None:
    rw = Rewriter(graph, region)
    for node in list(graph.nodes):
        if rw.onnx_op(node, "MatMul"):
            _matmul_add(rw, node)
        elif rw.onnx_op(node, "Gemm") and graph.opset("") >= 7:
            _gemm(rw, node)
    return graph if rw.finish() else None
