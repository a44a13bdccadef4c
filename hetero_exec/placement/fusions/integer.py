"""``fuse_integer_scale``: a ``quantize_dynamic`` model's product as onnxruntime runs it:
MatMulInteger(x_q, W_q, x_zp, W_zp) -> Cast(to float) -> Mul(scale) [-> Add(bias)] ->
com.microsoft MatMulIntegerToFloat(x_q, W_q, 1, scale, x_zp, W_zp, bias), the integer
product scaled and biased as its tile is stored (native/qgemm.c) instead of three more
passes over the output.

``scale`` is the model's own (the product of x's dynamic scale and W's), given as
b_scale with an a_scale of exactly 1, so the result rounds as the Mul did. Matched when
W_q is a constant 2-D 8-bit weight, x's zero point a scalar, ``scale`` float32 of shape
``()`` or ``(N,)``, the bias a float32 ``[N]`` constant, and each value in the
chain has the next node as its only reader. onnxruntime's MatMulIntegerToFloat fusion
does the same.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from hetero_exec.ir.graph import Graph, Node
from hetero_exec.placement.fusions.rewriter import Region, Rewriter, attr

MS_DOMAIN = "com.microsoft"
_BYTES = (np.dtype(np.uint8), np.dtype(np.int8))


def _scalar_or_columns(rw: Rewriter, name: str, N: int) -> bool:
    shape = rw.shape(name)
    return shape is not None and tuple(shape) in ((), (1,), (N,))


def _product(rw: Rewriter, node: Node) -> None:
    ins = list(node.inputs) + [""] * (4 - len(node.inputs))
    a, w, azp, wzp = ins
    wv = rw.const(w)
    if rw.dtype(a) not in _BYTES or wv is None or wv.ndim != 2 or wv.dtype not in _BYTES:
        return
    N = wv.shape[1]
    if azp and not _scalar_or_columns(rw, azp, 1):
        return
    cast = rw.sole_reader(node.outputs[0])
    if not rw.onnx_op(cast, "Cast") or attr(cast, "to", 0) != TensorProto.FLOAT:
        return
    mul = rw.sole_reader(cast.outputs[0])
    if not rw.onnx_op(mul, "Mul"):
        return
    scale = mul.inputs[1] if mul.inputs[0] == cast.outputs[0] else mul.inputs[0]
    shape = rw.shape(scale)
    if rw.dtype(scale) != np.float32 or shape is None or tuple(shape) not in ((), (N,)):
        return  # (MatMulIntegerToFloat takes a scalar scale or one per column)
    chain, bias, out = [node, cast, mul], "", mul.outputs[0]
    add = rw.sole_reader(out)
    if rw.onnx_op(add, "Add"):
        other = add.inputs[1] if add.inputs[0] == out else add.inputs[0]
        b = rw.const(other)
        if b is not None and b.dtype == np.float32 and b.shape == (N,):
            chain, bias, out = chain + [add], other, add.outputs[0]
    one = rw.add_const(f"{node.outputs[0]}_one", np.array(1.0, np.float32))
    rw.fuse(chain, "MatMulIntegerToFloat", MS_DOMAIN, [a, w, one, scale, azp, wzp, bias],
            out, {})


def fuse_integer_scale(graph: Graph, region: Region | None = None) -> Graph | None:
    rw = Rewriter(graph, region)
    for node in list(graph.nodes):
        if rw.onnx_op(node, "MatMulInteger"):
            _product(rw, node)
    if not rw.finish():
        return None
    graph.opsets.setdefault(MS_DOMAIN, 1)
    return graph
