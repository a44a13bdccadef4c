"""LayerNorm and RMSNorm written out as primitives -> FusedLayerNorm / FusedRMSNorm.

LayerNorm (TorchScript below opset 17, hand-written modules everywhere)::

    m = ReduceMean(x); d = x - m; v = ReduceMean(d^2) ; s = Sqrt(v + eps)
    n = d / s  |  d * Reciprocal(s)  |  d * (1 / s);  [* gamma] [+ beta]

RMSNorm (T5, Llama; both exporters)::

    v = ReduceMean(x^2); s = Sqrt(v + eps); n = x / s | x * Reciprocal(s) | x * (1 / s)
    [* weight]

``d^2`` is Pow(d, 2) or Mul(d, d); ReduceMean's axes are an attribute or (opset 18) a
constant input: the trailing axes (LayerNormalization's layout), or for LayerNorm any
axes (ConvNeXt's channels-first LayerNorm reduces axis 1 of NCHW) with gamma and beta
varying along those only; eps is an initializer or a Constant.
"""

from __future__ import annotations

from onnx import helper

from hetero_exec.ir.graph import Graph, Node
from hetero_exec.kernels.fused import FUSED_DOMAIN
from hetero_exec.placement.fusions.rewriter import Region, Rewriter, attr, near, other


def _reduced_axes(rw: Rewriter, node: Node) -> tuple[int, ...] | None:
    """The axes (negative, sorted) a ReduceMean reduces keeping dims; None otherwise."""
    if not attr(node, "keepdims", 1):
        return None
    if rw.graph.opset("") >= 18:
        axes = rw.ints(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] else None
    else:
        axes = attr(node, "axes", None)
    if not axes:
        return None
    rank = rw.rank(node.inputs[0])
    if any(a >= 0 for a in axes):
        if rank is None:
            return None
        axes = [a - rank if a >= 0 else a for a in axes]
    return tuple(sorted(set(axes)))


def _trailing(axes: tuple[int, ...]) -> bool:
    return axes == tuple(range(-len(axes), 0))


def _square_of(rw: Rewriter, name: str, reader: Node) -> str | None:
    """What ``name`` squares (Pow(v, 2) or Mul(v, v)), when ``reader`` alone reads it."""
    p = rw.producer(name)
    if p is None or not rw.feeds_only(p, reader):
        return None
    if rw.onnx_op(p, "Pow") and near(rw.scalar(p.inputs[1]), 2.0):
        return p.inputs[0]
    if rw.onnx_op(p, "Mul") and len(p.inputs) == 2 and p.inputs[0] == p.inputs[1]:
        return p.inputs[0]
    return None


def _inverse_rms(rw: Rewriter, v: Node) -> tuple[list[Node], str, float] | None:
    """v -> Add(eps) -> Sqrt: the nodes, the Sqrt's output and eps."""
    add = rw.sole_reader(v.outputs[0])
    if not rw.onnx_op(add, "Add") or len(add.inputs) != 2:
        return None
    eps = rw.scalar(other(add, v.outputs[0]))
    sqrt = rw.sole_reader(add.outputs[0])
    if eps is None or not rw.onnx_op(sqrt, "Sqrt"):
        return None
    return [add, sqrt], sqrt.outputs[0], eps


def _divided(rw: Rewriter, num: str, s: str) -> tuple[list[Node], str] | None:
    """num / s as Div(num, s), Mul(num, Reciprocal(s)) or Mul(num, Div(1, s))."""
    node = rw.sole_reader(s)
    if rw.onnx_op(node, "Div") and node.inputs == [num, s]:
        return [node], node.outputs[0]
    recip = rw.onnx_op(node, "Reciprocal") or (
        rw.onnx_op(node, "Div") and node.inputs[1] == s and near(rw.scalar(node.inputs[0]), 1.0))
    if not recip:
        return None
    mul = rw.sole_reader(node.outputs[0])
    if rw.onnx_op(mul, "Mul") and len(mul.inputs) == 2 and other(mul, node.outputs[0]) == num:
        return [node, mul], mul.outputs[0]
    return None


def _affine(rw: Rewriter, y: str, op: str, axes: tuple[int, ...]) -> tuple[Node, str] | None:
    """y op p (Mul by gamma, Add beta) with p varying along the normalised axes only."""
    node = rw.sole_reader(y)
    if not rw.onnx_op(node, op) or len(node.inputs) != 2:
        return None
    p = other(node, y)
    shape, ys = rw.shape(p), rw.shape(y)
    if shape is None or rw.dtype(p) != rw.dtype(y):
        return None
    if _trailing(axes) and len(shape) <= len(axes):
        pass  # along the trailing axes, as LayerNormalization's scale
    elif ys is None or len(shape) > len(ys) or any(
            d != 1 and (i - len(shape) not in axes or d != ys[i - len(shape)])
            for i, d in enumerate(shape)):
        return None
    if ys is not None and any(d not in (1, yd) for d, yd in zip(shape[::-1], ys[::-1])):
        return None
    return node, p


def _scale_bias(rw: Rewriter, chain: list[Node], y: str, axes: tuple[int, ...], bias: bool):
    scale = b = ""
    found = _affine(rw, y, "Mul", axes)
    if found is not None:
        chain.append(found[0])
        y, scale = found[0].outputs[0], found[1]
        if bias:
            found = _affine(rw, y, "Add", axes)
            if found is not None:
                chain.append(found[0])
                y, b = found[0].outputs[0], found[1]
    return y, scale, b


def _layer_norm(rw: Rewriter, mean: Node) -> None:
    x = mean.inputs[0]
    axes = _reduced_axes(rw, mean)
    sub = rw.sole_reader(mean.outputs[0])
    if axes is None or not rw.onnx_op(sub, "Sub") or sub.inputs != [x, mean.outputs[0]]:
        return
    d = sub.outputs[0]
    readers = rw.readers(d)
    if readers is None or len({id(r) for r in readers}) != 2:
        return
    var = next((rw.sole_reader(r.outputs[0]) for r in readers if r.op_type in ("Pow", "Mul")
                and rw.sole_reader(r.outputs[0]) is not None), None)
    if not rw.onnx_op(var, "ReduceMean") or _square_of(rw, var.inputs[0], var) != d \
            or _reduced_axes(rw, var) != axes:
        return
    sq = rw.producer(var.inputs[0])
    tail = _inverse_rms(rw, var)
    if tail is None:
        return
    div = _divided(rw, d, tail[1])
    if div is None or {id(r) for r in readers} != {id(sq), id(div[0][-1])}:
        return
    chain = [mean, sub, sq, var] + tail[0] + div[0]
    y, scale, bias = _scale_bias(rw, chain, div[1], axes, bias=True)
    _emit(rw, chain, "FusedLayerNorm", [x, scale, bias], y, axes, tail[2])


def _rms_norm(rw: Rewriter, var: Node) -> None:
    axes = _reduced_axes(rw, var)
    x = _square_of(rw, var.inputs[0], var)
    if axes is None or not _trailing(axes) or x is None:
        return
    sq = rw.producer(var.inputs[0])
    tail = _inverse_rms(rw, var)
    if tail is None:
        return
    div = _divided(rw, x, tail[1])
    if div is None:
        return
    chain = [sq, var] + tail[0] + div[0]
    y, scale, _ = _scale_bias(rw, chain, div[1], axes, bias=False)
    _emit(rw, chain, "FusedRMSNorm", [x, scale], y, axes, tail[2])


def _emit(rw: Rewriter, chain: list[Node], op: str, inputs: list[str], y: str,
          axes: tuple[int, ...], eps: float) -> None:
    if not rw.float_value(inputs[0]) or rw.dtype(y) != rw.dtype(inputs[0]):
        return
    attrs = {"epsilon": helper.make_attribute("epsilon", float(eps))}
    if _trailing(axes):
        attrs["axis"] = helper.make_attribute("axis", -len(axes))
    else:  # e.g. ConvNeXt's channels-first LayerNorm over axis 1 of NCHW
        attrs["axes"] = helper.make_attribute("axes", list(axes))
    rw.fuse(chain, op, FUSED_DOMAIN, inputs, y, attrs)


def fuse_norms(graph: Graph, region: Region | None = None) -> Graph | None:
    """LayerNorm chains first: the tail of one (from d^2 on) is an RMSNorm of d."""
    rw = Rewriter(graph, region)
    for node in list(graph.nodes):
        if rw.onnx_op(node, "ReduceMean"):
            _layer_norm(rw, node)
    for node in list(graph.nodes):
        if rw.onnx_op(node, "ReduceMean"):
            _rms_norm(rw, node)
    return graph if rw.finish() else None
