"""Layout chains that cancel, and nodes that do nothing:

* Transpose(Transpose(x, p), q): dropped when the perms compose to the identity, else
  one Transpose; a Transpose by the identity perm is dropped;
* Reshape(Reshape(x, s), t) -> Reshape(x, t) when t is known and copies no dim (no 0);
  a Reshape to the input's own shape is dropped;
* inference Dropout, and Cast to the dtype the input already has (exporters write
  these around norms and softmaxes computed "in float32" on float32 models), are
  dropped. (Identity stays: one cheap step on cpu, and the device passes drop it.)

A dropped node's readers read its input instead, so the node's output must be no kept
value (graph output, read by another segment).
"""

from __future__ import annotations

from onnx import helper

from hetero_exec.ir.graph import Graph, Node
from hetero_exec.placement.fusions.rewriter import Region, Rewriter, attr


def _perm(rw: Rewriter, node: Node) -> list[int] | None:
    p = attr(node, "perm", None)
    if p is not None:
        return list(p)
    rank = rw.rank(node.inputs[0])
    return None if rank is None else list(range(rank))[::-1]


def _bypassable(rw: Rewriter, node: Node) -> bool:
    return rw.readers(node.outputs[0]) is not None


def _transpose(rw: Rewriter, node: Node) -> None:
    q = _perm(rw, node)
    if q is None:
        return
    if q == list(range(len(q))):
        if _bypassable(rw, node):
            rw.bypass(node, node.inputs[0])
        return
    first = rw.producer(node.inputs[0])
    if not rw.onnx_op(first, "Transpose"):
        return
    p = _perm(rw, first)
    if p is None or len(p) != len(q):
        return
    composed = [p[i] for i in q]
    if composed == list(range(len(q))):
        if not _bypassable(rw, node):
            return
        sole = rw.sole_reader(first.outputs[0]) is node
        rw.bypass(node, first.inputs[0])  # ``first`` goes too when nothing else reads it
        if sole:
            rw.bypass(first, first.inputs[0])
    elif rw.sole_reader(first.outputs[0]) is node:
        rw.fuse([first, node], "Transpose", node.domain, [first.inputs[0]], node.outputs[0],
                {"perm": helper.make_attribute("perm", composed)})


def _same_shape(rw: Rewriter, a: str, b: str) -> bool:
    sa, sb = rw.shape(a), rw.shape(b)
    if sa is None or sa != sb:
        return False
    declared = {d for n in rw.graph.inputs for d in (rw.shape(n) or ()) if isinstance(d, str)}
    return all(isinstance(d, int) or d in declared for d in sa)


def _reshape(rw: Rewriter, node: Node) -> None:
    if len(node.inputs) < 2:
        return
    if _same_shape(rw, node.inputs[0], node.outputs[0]):
        if _bypassable(rw, node):
            rw.bypass(node, node.inputs[0])
        return
    first = rw.producer(node.inputs[0])
    if not rw.onnx_op(first, "Reshape") or len(first.inputs) < 2 or rw.sole_reader(first.outputs[0]) is not node:
        return
    target = rw.ints(node.inputs[1])
    if target is None or 0 in target:
        return
    rw.fuse([first, node], "Reshape", node.domain, [first.inputs[0], node.inputs[1]],
            node.outputs[0], dict(node.attrs))


def _no_op(rw: Rewriter, node: Node) -> None:
    if not _bypassable(rw, node) or not node.inputs or not node.inputs[0]:
        return
    if node.op_type == "Cast":
        src = rw.dtype(node.inputs[0])
        if src is None or src != rw.dtype(node.outputs[0]):
            return
    if node.op_type == "Dropout" and not _inference_dropout(rw, node):
        return
    rw.bypass(node, node.inputs[0])


def _inference_dropout(rw: Rewriter, node: Node) -> bool:
    """Dropout that passes its input through: no mask asked for, not in training mode."""
    if any(o and rw.graph.consumers.get(o) for o in node.outputs[1:]) or \
            any(o in rw.outputs for o in node.outputs[1:] if o):
        return False
    if rw.graph.opset("") < 12:
        return True  # inference-only before opset 12, as the kernel runs it
    training = node.inputs[2] if len(node.inputs) > 2 else ""
    if not training:
        return True
    v = rw.value_of(training)
    return v is not None and not bool(v.reshape(-1)[0])


def cancel_layout(graph: Graph, region: Region | None = None) -> Graph | None:
    rw = Rewriter(graph, region)
    for node in list(graph.nodes):
        if not node.outputs or not node.outputs[0]:
            continue
        if rw.onnx_op(node, "Dropout"):
            _no_op(rw, node)
        elif len(node.outputs) != 1:
            continue
        elif rw.onnx_op(node, "Transpose"):
            _transpose(rw, node)
        elif rw.onnx_op(node, "Reshape"):
            _reshape(rw, node)
        elif rw.onnx_op(node, "Cast"):
            _no_op(rw, node)
    return graph if rw.finish() else None
