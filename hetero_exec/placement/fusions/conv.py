"""Conv fusions.

* ``fold_batchnorm``: an inference BatchNormalization after a Conv becomes part of the
  Conv's weights and bias (w' = w s, b' = (b - mean) s + beta, s = scale/sqrt(var+eps)),
  computed in float64 and stored in the weights' dtype;
* ``fuse_conv``: Conv [+ Add(residual of the output's shape)] [+ activation] ->
  FusedConv, the activation one of `activation.match_activation`'s.
"""

from __future__ import annotations

import numpy as np

from hetero_exec.ir.graph import Graph, Node
from hetero_exec.kernels.fused import FUSED_DOMAIN
from hetero_exec.placement.fusions.activation import match_activation
from hetero_exec.placement.fusions.rewriter import FLOATS, Region, Rewriter, attr, other, str_attr


def _bn_inference(node: Node, graph: Graph) -> bool:
    """Inference mode: only Y asked for (older opsets switch to training statistics when
    the extra outputs are), training_mode unset, per-channel statistics."""
    if not node.outputs or not node.outputs[0] or any(node.outputs[1:]):
        return False
    if attr(node, "training_mode", 0):
        return False
    return graph.opset("") >= 9 or bool(attr(node, "spatial", 1))


def fold_batchnorm(graph: Graph, region: Region | None = None) -> Graph | None:
    rw = Rewriter(graph, region)
    for bn in list(graph.nodes):
        if not rw.onnx_op(bn, "BatchNormalization") or not _bn_inference(bn, graph):
            continue
        if len(bn.inputs) != 5:
            continue
        conv = rw.producer(bn.inputs[0])
        if not rw.onnx_op(conv, "Conv") or rw.sole_reader(conv.outputs[0]) is not bn:
            continue
        _fold(rw, conv, bn)
    return graph if rw.finish() else None


def _fold(rw: Rewriter, conv: Node, bn: Node) -> None:
    w = rw.const(conv.inputs[1]) if len(conv.inputs) > 1 else None
    has_b = len(conv.inputs) > 2 and bool(conv.inputs[2])
    b = rw.const(conv.inputs[2]) if has_b else None
    params = [rw.const(n) for n in bn.inputs[1:]]
    if w is None or (has_b and b is None) or any(p is None for p in params):
        return
    if w.dtype not in FLOATS or w.ndim < 3:
        return
    M = w.shape[0]
    if any(p.dtype not in FLOATS or p.shape != (M,) for p in params):
        return
    if b is not None and (b.dtype != w.dtype or b.shape != (M,)):
        return
    scale, beta, mean, var = (p.astype(np.float64) for p in params)
    eps = float(attr(bn, "epsilon", 1e-5))
    s = scale / np.sqrt(var + eps)
    w2 = (w.astype(np.float64) * s.reshape((M,) + (1,) * (w.ndim - 1))).astype(w.dtype)
    b0 = b.astype(np.float64) if b is not None else np.zeros(M)
    b2 = ((b0 - mean) * s + beta).astype(w.dtype)
    wname = rw.add_const(f"{conv.inputs[1]}_bn", w2)
    bname = rw.add_const(f"{conv.inputs[2] if has_b else conv.inputs[1] + '_bias'}_bn", b2)
    rw.fuse([conv, bn], "Conv", conv.domain, [conv.inputs[0], wname, bname], bn.outputs[0],
            dict(conv.attrs))


def fuse_conv(graph: Graph, region: Region | None = None) -> Graph | None:
    """Conv [+ Add(Z)] [+ activation] -> FusedConv(X, W, B, Z; activation)."""
    rw = Rewriter(graph, region)
    for conv in list(graph.nodes):
        if not rw.onnx_op(conv, "Conv"):
            continue
        y = conv.outputs[0]
        if not rw.float_value(y):
            continue
        chain = [conv]
        z = ""
        nxt = rw.sole_reader(y)
        if rw.onnx_op(nxt, "Add") and len(nxt.inputs) == 2:
            res = other(nxt, y)
            ys, zs = rw.shape(y), rw.shape(res)
            if ys is not None and ys == zs and rw.dtype(res) == rw.dtype(y):
                z = res
                chain.append(nxt)
                y = nxt.outputs[0]
        act = match_activation(rw, y)
        attrs = dict(conv.attrs)
        if act is not None:
            chain += act.nodes
            y = act.output
            attrs.update(act.attrs())
        else:
            attrs["activation"] = str_attr("activation", "")
        if len(chain) == 1:
            continue
        ins = list(conv.inputs) + [""] * (3 - len(conv.inputs)) + [z]
        rw.fuse(chain, "FusedConv", FUSED_DOMAIN, ins, y, attrs)
    return graph if rw.finish() else None
