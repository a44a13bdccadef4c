"""Fusion passes of the cpu provider (registered through placement/passes.py).

Each rewrites a chain of nodes into one node whose kernel does the later steps in
place on the first step's fresh output, saving a pass over memory and an allocation
per fused node:

* ``fold_batchnorm``: an inference BatchNormalization after a Conv becomes part of the
  Conv's weights and bias (w' = w s, b' = (b - mean) s + beta, s = scale/sqrt(var+eps)),
  computed in float64 and stored in the weights' dtype;
* ``fuse_conv``: Conv [+ Add(residual of the output's shape)] [+ Relu] -> FusedConv;
* ``fuse_matmul``: MatMul + Add(1-D bias) [+ Relu], and Gemm (alpha = beta = 1,
  transA = 0, constant B: transB is folded into a transposed copy) [+ Relu] ->
  FusedMatMul;
* ``fuse_gelu``: the node chains of torch's nn.GELU (x/sqrt2 -> Erf -> +1 -> *x -> *0.5)
  and gelu_new (0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))) -> FusedGelu.

A chain is fused only when each intermediate value has the next node as its only
reader (subgraph captures included) and is not a graph output; constants must be
initializers the caller cannot override (not graph inputs). The fused node keeps the
first node's id and name and takes the last node's place in the node order (so the
order stays topological). Results change by float rounding only.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper

from hetero_exec.ir.graph import Graph, Node, Value, attr_value

log = logging.getLogger(__name__)

FUSED_DOMAIN = "hetero_exec"
_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


# --------------------------------------------------------------------------- helpers


class _Rewriter:
    """Collects replacements of node chains over one graph, applied at the end."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.outputs = set(graph.outputs)
        self.inputs = set(graph.inputs)
        self.consumed: set[int] = set()  # id() of nodes already part of a fusion
        self.replace: dict[int, Node | None] = {}  # id(node) -> replacement (None: drop)
        self.used_ids = {n.id for n in graph.nodes}
        self.changed = False

    # -- queries -------------------------------------------------------------------

    def onnx_op(self, node: Node | None, op_type: str) -> bool:
        return (node is not None and node.op_type == op_type and node.canonical_domain == "ai.onnx"
                and not node.subgraphs and id(node) not in self.consumed)

    def sole_reader(self, name: str) -> Node | None:
        """The one node reading ``name``, if exactly one does and it is no graph output."""
        if not name or name in self.outputs:
            return None
        readers = self.graph.consumers.get(name, [])
        if len(readers) != 1 or id(readers[0]) in self.consumed:
            return None
        node = readers[0]
        if sum(1 for i in node.inputs if i == name) != 1:
            return None  # e.g. Add(y, y): not the pattern
        return node

    def producer(self, name: str) -> Node | None:
        node = self.graph.producer.get(name)
        if node is None or id(node) in self.consumed:
            return None
        return node

    def const(self, name: str) -> np.ndarray | None:
        """The initializer ``name`` when the caller cannot feed another value for it."""
        if not name or name in self.inputs:
            return None
        return self.graph.initializers.get(name)

    def scalar(self, name: str) -> float | None:
        c = self.const(name)
        if c is None or c.size != 1 or c.dtype.kind not in "fiu":
            return None
        return float(c.reshape(-1)[0])

    def dtype(self, name: str) -> np.dtype | None:
        c = self.graph.initializers.get(name)
        if c is not None:
            return c.dtype
        v = self.graph.values.get(name)
        return v.dtype if v is not None else None

    def shape(self, name: str):
        c = self.graph.initializers.get(name)
        if c is not None:
            return tuple(c.shape)
        v = self.graph.values.get(name)
        if v is None or v.kind != "tensor" or v.shape is None or any(d is None for d in v.shape):
            return None
        return tuple(v.shape)

    # -- edits ---------------------------------------------------------------------

    def add_const(self, base: str, arr: np.ndarray) -> str:
        name = base
        for i in itertools.count(1):
            if name not in self.graph.initializers and name not in self.graph.values \
                    and name not in self.graph.producer:
                break
            name = f"{base}_{i}"
        self.graph.initializers[name] = arr
        self.graph.values[name] = Value(name, "tensor", helper.np_dtype_to_tensor_dtype(arr.dtype),
                                        tuple(arr.shape))
        return name

    def fuse(self, chain: list[Node], op_type: str, domain: str, inputs: list[str],
             output: str, attrs: dict[str, onnx.AttributeProto]) -> Node:
        """Replace ``chain`` (first to last, in graph order) by one node at the last one's place."""
        first = chain[0]
        while inputs and not inputs[-1]:
            inputs = inputs[:-1]
        node = Node(id=first.id, op_type=op_type, domain=domain, inputs=list(inputs),
                    outputs=[output], attrs=attrs, scope=first.scope, name=first.name)
        ordered = sorted(chain, key=self.position)
        # the model's nodes it stands for, in graph order: saved plans list these, so that
        # a plan saved from a fused session loads onto the model as written
        node.fused_from = [i for n in ordered for i in fused_identities(n)]
        last = ordered[-1]
        for n in chain:
            self.consumed.add(id(n))
            self.replace[id(n)] = node if n is last else None
        self.changed = True
        return node

    def position(self, node: Node) -> int:
        if not hasattr(self, "_pos"):
            self._pos = {id(n): i for i, n in enumerate(self.graph.nodes)}
        return self._pos[id(node)]

    def finish(self) -> bool:
        """Apply the replacements; drop initializers nothing reads any more."""
        if not self.changed:
            return False
        g = self.graph
        nodes = []
        for n in g.nodes:
            r = self.replace.get(id(n), n)
            if r is not None:
                nodes.append(r)
        g.nodes = nodes
        if domain_used(g, FUSED_DOMAIN):
            g.opsets.setdefault(FUSED_DOMAIN, 1)
        g.reindex()
        keep = set(g.inputs) | set(g.outputs)
        for name in list(g.initializers):
            if name not in g.consumers and name not in keep and not _captured(g, name):
                del g.initializers[name]
        for name in list(g.values):
            if name not in g.consumers and name not in g.producer and name not in keep \
                    and name not in g.initializers:
                del g.values[name]
        self.replace.clear()
        self.consumed.clear()
        self.changed = False
        if hasattr(self, "_pos"):
            del self._pos
        return True


def fused_identities(node: Node) -> list[str]:
    """The identities of the model's nodes ``node`` computes (itself, unless fused)."""
    return list(getattr(node, "fused_from", None) or [node.identity])


def domain_used(graph: Graph, domain: str) -> bool:
    return any(n.domain == domain for n in graph.nodes)


def _captured(graph: Graph, name: str) -> bool:
    return any(name in sub.captures for n in graph.nodes for sub in n.subgraphs.values())


def _attr(node: Node, name: str, default):
    a = node.attrs.get(name)
    return default if a is None else attr_value(a)


def _str_attr(name: str, value: str) -> onnx.AttributeProto:
    return helper.make_attribute(name, value)


def _other(node: Node, name: str) -> str:
    """The input of a two-input node that is not ``name``."""
    a, b = node.inputs
    return b if a == name else a


def _near(v: float | None, want: float, rtol: float = 1e-6) -> bool:
    return v is not None and abs(v - want) <= rtol * abs(want)


# --------------------------------------------------------------------------- BatchNormalization


def _bn_inference(node: Node, graph: Graph) -> bool:
    """Inference mode: only Y asked for (older opsets switch to training statistics when
    the extra outputs are), training_mode unset, per-channel statistics."""
    if not node.outputs or not node.outputs[0] or any(node.outputs[1:]):
        return False
    if _attr(node, "training_mode", 0):
        return False
    return graph.opset("") >= 9 or bool(_attr(node, "spatial", 1))


def fold_batchnorm(graph: Graph) -> Graph | None:
    rw = _Rewriter(graph)
    for bn in list(graph.nodes):
        if not rw.onnx_op(bn, "BatchNormalization") or not _bn_inference(bn, graph):
            continue
        if len(bn.inputs) != 5:
            continue
        conv = rw.producer(bn.inputs[0])
        if not rw.onnx_op(conv, "Conv") or rw.sole_reader(conv.outputs[0]) is not bn:
            continue
        w = rw.const(conv.inputs[1]) if len(conv.inputs) > 1 else None
        b = rw.const(conv.inputs[2]) if len(conv.inputs) > 2 and conv.inputs[2] else None
        has_b = len(conv.inputs) > 2 and bool(conv.inputs[2])
        params = [rw.const(n) for n in bn.inputs[1:]]
        if w is None or (has_b and b is None) or any(p is None for p in params):
            continue
        if w.dtype not in _FLOATS or w.ndim < 3:
            continue
        M = w.shape[0]
        if any(p.dtype not in _FLOATS or p.shape != (M,) for p in params):
            continue
        if b is not None and (b.dtype != w.dtype or b.shape != (M,)):
            continue
        scale, beta, mean, var = (p.astype(np.float64) for p in params)
        eps = float(_attr(bn, "epsilon", 1e-5))
        s = scale / np.sqrt(var + eps)
        w2 = (w.astype(np.float64) * s.reshape((M,) + (1,) * (w.ndim - 1))).astype(w.dtype)
        b0 = b.astype(np.float64) if b is not None else np.zeros(M)
        b2 = ((b0 - mean) * s + beta).astype(w.dtype)
        wname = rw.add_const(f"{conv.inputs[1]}_bn", w2)
        bname = rw.add_const(f"{conv.inputs[2] if has_b else conv.inputs[1] + '_bias'}_bn", b2)
        rw.fuse([conv, bn], "Conv", conv.domain, [conv.inputs[0], wname, bname], bn.outputs[0],
                dict(conv.attrs))
    return graph if rw.finish() else None


# --------------------------------------------------------------------------- Conv


def fuse_conv(graph: Graph) -> Graph | None:
    """Conv [+ Add(Z)] [+ Relu] -> FusedConv(X, W, B, Z, activation)."""
    rw = _Rewriter(graph)
    for conv in list(graph.nodes):
        if not rw.onnx_op(conv, "Conv"):
            continue
        y = conv.outputs[0]
        if rw.dtype(y) not in _FLOATS:
            continue
        chain = [conv]
        z = ""
        nxt = rw.sole_reader(y)
        if rw.onnx_op(nxt, "Add") and len(nxt.inputs) == 2:
            other = _other(nxt, y)
            ys, zs = rw.shape(y), rw.shape(other)
            if ys is not None and ys == zs and rw.dtype(other) == rw.dtype(y):
                z = other
                chain.append(nxt)
                y = nxt.outputs[0]
                nxt = rw.sole_reader(y)
        act = ""
        if rw.onnx_op(nxt, "Relu"):
            act = "Relu"
            chain.append(nxt)
            y = nxt.outputs[0]
        if len(chain) == 1:
            continue
        attrs = dict(conv.attrs)
        attrs["activation"] = _str_attr("activation", act)
        ins = list(conv.inputs) + [""] * (3 - len(conv.inputs)) + [z]
        rw.fuse(chain, "FusedConv", FUSED_DOMAIN, ins, y, attrs)
    return graph if rw.finish() else None


# --------------------------------------------------------------------------- MatMul / Gemm


def _relu_after(rw: _Rewriter, y: str, chain: list[Node]) -> tuple[str, str]:
    nxt = rw.sole_reader(y)
    if rw.onnx_op(nxt, "Relu"):
        chain.append(nxt)
        return nxt.outputs[0], "Relu"
    return y, ""


def fuse_matmul(graph: Graph) -> Graph | None:
    rw = _Rewriter(graph)
    for node in list(graph.nodes):
        if rw.onnx_op(node, "MatMul"):
            a, w = node.inputs
            ws = rw.shape(w)
            y = node.outputs[0]
            add = rw.sole_reader(y)
            if ws is None or len(ws) != 2 or rw.dtype(y) not in _FLOATS:
                continue
            if not rw.onnx_op(add, "Add") or len(add.inputs) != 2:
                continue
            bias_name = _other(add, y)
            bias = rw.const(bias_name)
            if bias is None or bias.dtype != rw.dtype(y) or bias.shape != (ws[1],):
                continue
            chain = [node, add]
            out, act = _relu_after(rw, add.outputs[0], chain)
            attrs = {"activation": _str_attr("activation", act)}
            rw.fuse(chain, "FusedMatMul", FUSED_DOMAIN, [a, w, bias_name], out, attrs)
        elif rw.onnx_op(node, "Gemm") and graph.opset("") >= 7:
            ins = list(node.inputs) + [""] * (3 - len(node.inputs))
            a, b, c = ins[:3]
            bw = rw.const(b)
            if bw is None or bw.ndim != 2 or bw.dtype not in _FLOATS:
                continue
            if _attr(node, "transA", 0) or _attr(node, "alpha", 1.0) != 1.0:
                continue
            if c and _attr(node, "beta", 1.0) != 1.0:
                continue
            w = bw.T if _attr(node, "transB", 0) else bw
            N = w.shape[1]
            bias_name = ""
            if c:
                cv = rw.const(c)
                if cv is None or cv.dtype != bw.dtype or cv.size != N or cv.shape not in ((N,), (1, N)):
                    continue
                bias_name = c if cv.shape == (N,) else rw.add_const(f"{c}_row", cv.reshape(N))
            chain = [node]
            out, act = _relu_after(rw, node.outputs[0], chain)
            if not act and not _attr(node, "transB", 0):
                continue  # nothing to gain: Gemm already adds its bias in place
            if _attr(node, "transB", 0):
                b = rw.add_const(f"{b}_t", np.ascontiguousarray(w))
            attrs = {"activation": _str_attr("activation", act)}
            rw.fuse(chain, "FusedMatMul", FUSED_DOMAIN, [a, b, bias_name], out, attrs)
    return graph if rw.finish() else None


# --------------------------------------------------------------------------- Gelu

_SQRT2 = math.sqrt(2.0)
_SQRT_2_PI = math.sqrt(2.0 / math.pi)


def _const_operand(rw: _Rewriter, node: Node, name: str, want: float) -> bool:
    """``node`` (two inputs) combines ``name`` with a scalar constant close to ``want``."""
    if node is None or len(node.inputs) != 2 or name not in node.inputs:
        return False
    return _near(rw.scalar(_other(node, name)), want)


def _half_times(rw: _Rewriter, mul: Node, x: str, a: str) -> list[Node] | None:
    """The tail of both Gelu chains: y = x * a * 0.5 in any of the exporters' orders,
    starting at ``mul``, the sole reader of ``a``. Returns the tail nodes (last is y's)."""
    if not rw.onnx_op(mul, "Mul") or len(mul.inputs) != 2:
        return None
    other = _other(mul, a)
    if other == x:  # (x * a) * 0.5
        last = rw.sole_reader(mul.outputs[0])
        if rw.onnx_op(last, "Mul") and _const_operand(rw, last, mul.outputs[0], 0.5):
            return [mul, last]
        return None
    half = rw.producer(other)  # (x * 0.5) * a
    if rw.onnx_op(half, "Mul") and _const_operand(rw, half, x, 0.5) \
            and rw.sole_reader(half.outputs[0]) is mul:
        return [half, mul]
    return None


def _plus_one_half_times(rw: _Rewriter, f: Node, x: str) -> list[Node] | None:
    """The shared end of both Gelu chains after erf/tanh ``f``: (f + 1), then the
    `_half_times` tail. Returns those nodes."""
    add = rw.sole_reader(f.outputs[0])
    if not rw.onnx_op(add, "Add") or not _const_operand(rw, add, f.outputs[0], 1.0):
        return None
    tail = _half_times(rw, rw.sole_reader(add.outputs[0]), x, add.outputs[0])
    return None if tail is None else [add] + tail


def _gelu_erf(rw: _Rewriter, erf: Node):
    d = rw.producer(erf.inputs[0])
    if d is None or rw.sole_reader(d.outputs[0]) is not erf or len(d.inputs) != 2:
        return None
    if rw.onnx_op(d, "Div") and _near(rw.scalar(d.inputs[1]), _SQRT2):
        x = d.inputs[0]
    elif rw.onnx_op(d, "Mul") and (_near(rw.scalar(d.inputs[1]), 1 / _SQRT2)
                                   or _near(rw.scalar(d.inputs[0]), 1 / _SQRT2)):
        x = d.inputs[0] if _near(rw.scalar(d.inputs[1]), 1 / _SQRT2) else d.inputs[1]
    else:
        return None
    tail = _plus_one_half_times(rw, erf, x)
    return None if tail is None else (x, [d, erf] + tail, "none")


def _gelu_tanh(rw: _Rewriter, tanh: Node):
    k = rw.producer(tanh.inputs[0])  # inner * sqrt(2/pi)
    if not rw.onnx_op(k, "Mul") or rw.sole_reader(k.outputs[0]) is not tanh or len(k.inputs) != 2:
        return None
    inner_name = next((i for i in k.inputs if _near(rw.scalar(_other(k, i)), _SQRT_2_PI)), None)
    inner = rw.producer(inner_name) if inner_name else None
    if not rw.onnx_op(inner, "Add") or rw.sole_reader(inner.outputs[0]) is not k \
            or len(inner.inputs) != 2:
        return None
    for x, cubed in (inner.inputs, inner.inputs[::-1]):  # x + 0.044715 x^3
        m = rw.producer(cubed)
        if not rw.onnx_op(m, "Mul") or rw.sole_reader(cubed) is not inner or len(m.inputs) != 2:
            continue
        p_name = next((i for i in m.inputs if _near(rw.scalar(_other(m, i)), 0.044715)), None)
        p = rw.producer(p_name) if p_name else None
        if not rw.onnx_op(p, "Pow") or rw.sole_reader(p.outputs[0]) is not m \
                or p.inputs[0] != x or not _near(rw.scalar(p.inputs[1]), 3.0):
            continue
        tail = _plus_one_half_times(rw, tanh, x)
        return None if tail is None else (x, [p, m, inner, k, tanh] + tail, "tanh")
    return None


def fuse_gelu(graph: Graph) -> Graph | None:
    rw = _Rewriter(graph)
    for node in list(graph.nodes):
        if rw.onnx_op(node, "Erf"):
            found = _gelu_erf(rw, node)
        elif rw.onnx_op(node, "Tanh"):
            found = _gelu_tanh(rw, node)
        else:
            continue
        if found is None:
            continue
        x, chain, approx = found
        if rw.dtype(x) not in _FLOATS:
            continue
        chain.sort(key=rw.position)
        rw.fuse(chain, "FusedGelu", FUSED_DOMAIN, [x], chain[-1].outputs[0],
                {"approximate": _str_attr("approximate", approx)})
    return graph if rw.finish() else None


# --------------------------------------------------------------------------- the pass

#: in order: the BatchNormalization fold must see plain Convs
CPU_FUSIONS: tuple[Callable[[Graph], Graph | None], ...] = (
    fold_batchnorm, fuse_conv, fuse_matmul, fuse_gelu)


def fuse_cpu(graph: Graph) -> Graph | None:
    """Every fusion above, in one provider pass (one copy of the graph)."""
    changed = False
    for fn in CPU_FUSIONS:
        try:
            if fn(graph) is not None:
                changed = True
        except Exception:  # a fusion that trips on an odd graph must not break the session
            log.exception("fusion %s failed; graph left as it was before it", fn.__name__)
            return None
    return graph if changed else None


from hetero_exec.placement.passes import register_pass  # noqa: E402  (passes imports this module last)

register_pass("cpu", fuse_cpu)
