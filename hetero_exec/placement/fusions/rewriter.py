"""What every fusion uses: the graph queries a matcher asks and the edits it records.

A `Rewriter` collects replacements of node chains over one graph and applies them at
the end (`finish`), so a matcher that gives up half-way leaves nothing behind. A
`Region` restricts it to some of the graph's nodes (a segment of a placed plan): it
then matches only those nodes and keeps every value read outside them.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import helper

from hetero_exec.ir.graph import Graph, Node, Value, attr_value
from hetero_exec.kernels.fused import FUSED_DOMAIN

log = logging.getLogger(__name__)

FLOATS = (np.dtype(np.float32), np.dtype(np.float64))

#: ops `Rewriter.value_of` evaluates on constants: the shape arithmetic exporters write
#: (Shape -> Gather -> Div -> Unsqueeze -> Concat) around Slice and Reshape
_SHAPE_ARITHMETIC = frozenset({
    "Gather", "Unsqueeze", "Squeeze", "Concat", "Cast", "Slice", "Div", "Mul", "Add", "Sub",
    "Reshape", "Identity", "Neg", "Floor", "Sqrt", "Reciprocal", "Pow",
})
_EVAL_MAX_SIZE = 64  # elements: shape vectors and scalars, never weights
#: ops never dropped for being unread (their effect is not their output)
_KEEP_WHEN_DEAD = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike",
                             "RandomUniformLike", "Bernoulli", "Multinomial"})


@dataclass
class Region:
    """The nodes a fusion may rewrite, in their run order, and the values it must keep
    (read by other segments). ``provider``, when given, must support each fused node."""

    nodes: list[Node]
    keep: set[str] = field(default_factory=set)
    provider: Any = None


class Rewriter:
    """Collects replacements of node chains over one graph, applied at the end."""

    def __init__(self, graph: Graph, region: Region | None = None):
        self.graph = graph
        self.region = region
        self.allowed = None if region is None else {id(n) for n in region.nodes}
        self.outputs = set(graph.outputs) | (region.keep if region is not None else set())
        self.inputs = set(graph.inputs)
        self.consumed: set[int] = set()  # id() of nodes already part of a fusion
        self.replace: dict[int, Node | None] = {}  # id(node) -> replacement (None: drop)
        self.rename: dict[str, str] = {}  # value -> the value its readers read instead
        self.changed = False
        self._values: dict[str, np.ndarray | None] = {}
        self._pos: dict[int, int] | None = None

    # -- queries -------------------------------------------------------------------

    def mine(self, node: Node | None) -> bool:
        """A node this rewrite may change: in the region and not yet part of a fusion."""
        return (node is not None and id(node) not in self.consumed
                and (self.allowed is None or id(node) in self.allowed))

    def onnx_op(self, node: Node | None, op_type: str) -> bool:
        return (self.mine(node) and node.op_type == op_type and node.canonical_domain == "ai.onnx"
                and not node.subgraphs)

    def readers(self, name: str) -> list[Node] | None:
        """Every node reading ``name`` when all are this rewrite's to change and ``name`` is
        no kept value (graph output, read by another segment, captured by a body)."""
        if not name or name in self.outputs:
            return None
        readers = self.graph.consumers.get(name, [])
        if not readers or not all(self.mine(r) and not r.subgraphs for r in readers):
            return None
        return readers

    def sole_reader(self, name: str) -> Node | None:
        """The one node reading ``name``, if exactly one does and it is no kept value."""
        readers = self.readers(name)
        if readers is None or len(readers) != 1:
            return None
        node = readers[0]
        if sum(1 for i in node.inputs if i == name) != 1:
            return None  # e.g. Add(y, y): not the pattern
        return node

    def producer(self, name: str) -> Node | None:
        node = self.graph.producer.get(name)
        return node if self.mine(node) else None

    def feeds_only(self, node: Node | None, reader: Node) -> bool:
        """``node``'s single output is read by ``reader`` alone."""
        return node is not None and len(node.outputs) == 1 and self.sole_reader(node.outputs[0]) is reader

    def value_of(self, name: str) -> np.ndarray | None:
        """The value of ``name`` when it is known before running: an initializer the caller
        cannot override, a Constant, or shape arithmetic over those and static shapes."""
        if not name:
            return None
        if name not in self._values:
            self._values[name] = None  # cycles and failures resolve to unknown
            self._values[name] = self._evaluate(name)
        return self._values[name]

    def const(self, name: str) -> np.ndarray | None:
        return self.value_of(name)

    def scalar(self, name: str) -> float | None:
        c = self.value_of(name)
        if c is None or c.size != 1 or c.dtype.kind not in "fiu":
            return None
        return float(c.reshape(-1)[0])

    def ints(self, name: str) -> list[int] | None:
        c = self.value_of(name)
        if c is None or c.dtype.kind not in "iu" or c.ndim > 1:
            return None
        return [int(v) for v in c.reshape(-1)]

    def defining(self, name: str) -> Graph:
        """The graph whose value ``name`` is: this one, or the enclosing graph a body
        captures it from."""
        return self.graph.defining(name)

    def dtype(self, name: str) -> np.dtype | None:
        g = self.defining(name)
        c = g.initializers.get(name)
        if c is not None:
            return c.dtype
        v = g.values.get(name) or self.graph.values.get(name)
        return v.dtype if v is not None and v.kind == "tensor" else None

    def shape(self, name: str):
        """The declared shape (static or symbolic dims), None when any dim is unknown."""
        g = self.defining(name)
        c = g.initializers.get(name)
        if c is not None:
            return tuple(c.shape)
        v = g.values.get(name) or self.graph.values.get(name)
        if v is None or v.kind != "tensor" or v.shape is None or any(d is None for d in v.shape):
            return None
        return tuple(v.shape)

    def rank(self, name: str) -> int | None:
        g = self.defining(name)
        if name in g.initializers:
            return g.initializers[name].ndim
        v = g.values.get(name) or self.graph.values.get(name)
        return None if v is None or v.shape is None else len(v.shape)

    def float_value(self, name: str) -> bool:
        return self.dtype(name) in FLOATS

    # -- constants -----------------------------------------------------------------

    def _evaluate(self, name: str) -> np.ndarray | None:
        g = self.graph
        outer = self.defining(name)
        if outer is not g:  # a body's capture: a constant when the enclosing graph's is
            return outer.initializers.get(name) if name not in outer.inputs else None
        if name in g.initializers:
            return None if name in self.inputs else g.initializers[name]
        node = g.producer.get(name)
        if node is None or node.subgraphs or node.canonical_domain != "ai.onnx":
            return None
        if node.op_type == "Constant":
            return _constant_value(node)
        if node.op_type == "Shape":
            return self._shape_value(node)
        if node.op_type not in _SHAPE_ARITHMETIC or len(node.outputs) != 1:
            return None
        args = [self.value_of(i) if i else None for i in node.inputs]
        if args[0] is None and node.op_type in ("Gather", "Slice"):
            args[0] = self._partial_shape(node.inputs[0])
            if args[0] is not None:  # the dims picked must all be static
                out = _run_kernel(g, node, args) if all(
                    a is not None for a, i in zip(args, node.inputs) if i) else None
                return None if out is None or (out < 0).any() else out
        if any(a is None for a, i in zip(args, node.inputs) if i):
            return None
        if any(a is not None and a.size > _EVAL_MAX_SIZE for a in args):
            return None
        return _run_kernel(g, node, args)

    def _shape_value(self, node: Node) -> np.ndarray | None:
        dims = self._shape_dims(node)
        return None if dims is None or (dims < 0).any() else dims

    def _partial_shape(self, name: str) -> np.ndarray | None:
        """A Shape's output whose input has some symbolic dims, those as -1 (a dim is never
        negative): Gather or Slice of its static dims then still evaluates (the head size
        of a (batch, heads, sequence, 16) query, which SDPA exports scale by)."""
        node = self.graph.producer.get(name)
        if node is None or node.op_type != "Shape" or node.canonical_domain != "ai.onnx":
            return None
        return self._shape_dims(node)

    def _shape_dims(self, node: Node) -> np.ndarray | None:
        """The dims a Shape node gives (its start and end), -1 for each one not static;
        None when its input's rank is unknown."""
        x = node.inputs[0]
        g = self.defining(x)
        c = g.initializers.get(x)
        v = None if c is not None else (g.values.get(x) or self.graph.values.get(x))
        if c is None and (v is None or v.kind != "tensor" or v.shape is None):
            return None
        shape = c.shape if c is not None else v.shape
        start = int(attr(node, "start", 0))
        end = attr(node, "end", None)
        dims = shape[start:] if end is None else shape[start:int(end)]
        return np.array([d if isinstance(d, int) else -1 for d in dims], dtype=np.int64)

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
             output: str, attrs: dict[str, onnx.AttributeProto]) -> Node | None:
        """Replace ``chain`` by one node at the place of its last node in the graph order;
        None (and nothing replaced) when the region's provider cannot run the new node."""
        first = chain[0]
        while inputs and not inputs[-1]:
            inputs = inputs[:-1]
        node = Node(id=first.id, op_type=op_type, domain=domain, inputs=list(inputs),
                    outputs=[output], attrs=attrs, scope=first.scope, name=first.name)
        if not self._runnable(node):
            return None
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

    def bypass(self, node: Node, source: str) -> None:
        """Drop ``node`` (one output); its readers read ``source`` instead."""
        self.consumed.add(id(node))
        self.replace[id(node)] = None
        self.rename[node.outputs[0]] = source
        self.changed = True

    def position(self, node: Node) -> int:
        if self._pos is None:
            self._pos = {id(n): i for i, n in enumerate(self.graph.nodes)}
        return self._pos[id(node)]

    def _runnable(self, node: Node) -> bool:
        prov = self.region.provider if self.region is not None else None
        if prov is None:
            return True
        from hetero_exec.placement.coverage import node_signature

        shapes, dtypes, kinds = node_signature(self.graph, node)
        sup = prov.supports_op(node, self.graph.opset(node.domain), shapes, dtypes, kinds)
        if not sup:
            log.debug("not fusing into %s on %s: %s", node.op_type, prov.name, sup.reason)
        return bool(sup)

    def finish(self) -> bool:
        """Apply the replacements; drop the nodes and initializers nothing reads any more."""
        if not self.changed:
            return False
        g = self.graph
        dropped = [n for n in g.nodes if id(n) in self.replace]
        g.nodes = self._apply(g.nodes)
        if self.region is not None:
            self.region.nodes = self._apply(self.region.nodes)
        if self.rename:
            for n in g.nodes:
                n.inputs = [_resolve(self.rename, i) for i in n.inputs]
        if domain_used(g, FUSED_DOMAIN):
            g.opsets.setdefault(FUSED_DOMAIN, 1)
        g.reindex()
        self._drop_dead_producers(dropped)
        self._prune()
        self.replace.clear()
        self.consumed.clear()
        self.rename.clear()
        self.changed = False
        self._pos = None
        return True

    def _apply(self, nodes: list[Node]) -> list[Node]:
        out = []
        for n in nodes:
            r = self.replace.get(id(n), n)
            if r is not None:
                out.append(r)
        return out

    def _drop_dead_producers(self, dropped: list[Node]) -> None:
        """Nodes whose every output only the replaced nodes read (a Constant, the shape
        arithmetic of a Slice bound) go too, and then what only they read."""
        g = self.graph
        dead: set[int] = set()
        work = [g.producer.get(i) for n in dropped for i in n.inputs if i]
        while work:
            p = work.pop()
            if p is None or id(p) in dead or not self.mine(p) or p.subgraphs \
                    or p.canonical_domain != "ai.onnx" or p.op_type in _KEEP_WHEN_DEAD:
                continue
            if any(o and (o in self.outputs or _captured(g, o)
                          or any(id(r) not in dead for r in g.consumers.get(o, ())))
                   for o in p.outputs):
                continue
            dead.add(id(p))
            work.extend(g.producer.get(i) for i in p.inputs if i)
        if not dead:
            return
        g.nodes = [n for n in g.nodes if id(n) not in dead]
        if self.region is not None:
            self.region.nodes = [n for n in self.region.nodes if id(n) not in dead]
        g.reindex()

    def _prune(self) -> None:
        g = self.graph
        keep = set(g.inputs) | self.outputs
        for name in list(g.initializers):
            if name not in g.consumers and name not in keep and not _captured(g, name):
                del g.initializers[name]
        for name in list(g.values):
            if name not in g.consumers and name not in g.producer and name not in keep \
                    and name not in g.initializers:
                del g.values[name]


# --------------------------------------------------------------------------- helpers


def fused_identities(node: Node) -> list[str]:
    """The identities of the model's nodes ``node`` computes (itself, unless fused)."""
    return list(getattr(node, "fused_from", None) or [node.identity])


def domain_used(graph: Graph, domain: str) -> bool:
    return any(n.domain == domain for n in graph.nodes)


def _captured(graph: Graph, name: str) -> bool:
    return any(name in sub.captures for n in graph.nodes for sub in n.subgraphs.values())


def _resolve(rename: dict[str, str], name: str) -> str:
    while name in rename:
        name = rename[name]
    return name


def attr(node: Node, name: str, default):
    """An attribute of ``node`` as a plain value, ``default`` when unset."""
    a = node.attrs.get(name)
    return default if a is None else attr_value(a)


def str_attr(name: str, value: str) -> onnx.AttributeProto:
    return helper.make_attribute(name, value)


def other(node: Node, name: str) -> str:
    """The input of a two-input node that is not ``name``."""
    a, b = node.inputs
    return b if a == name else a


def near(v: float | None, want: float, rtol: float = 1e-6) -> bool:
    return v is not None and abs(v - want) <= rtol * max(abs(want), 1e-30)


def _constant_value(node: Node) -> np.ndarray | None:
    for key, a in node.attrs.items():
        v = attr_value(a)
        if key == "value":
            return np.asarray(v)
        if key == "value_float":
            return np.array(v, dtype=np.float32)
        if key == "value_floats":
            return np.array(v, dtype=np.float32)
        if key in ("value_int", "value_ints"):
            return np.array(v, dtype=np.int64)
    return None


def _run_kernel(graph: Graph, node: Node, args: list) -> np.ndarray | None:
    from hetero_exec.kernels.registry import lookup

    kdef = lookup(node.domain, node.op_type, graph.opset(node.domain))
    if kdef is None:
        return None
    kwargs = {k: attr_value(a) for k, a in node.attrs.items()}
    if "num_outputs" in kdef.wants:
        kwargs["num_outputs"] = 1
    if "opset" in kdef.wants:
        kwargs["opset"] = kdef.since
    while args and args[-1] is None:
        args = args[:-1]
    try:
        out = kdef.fn(np, *args, **kwargs)[0]
    except Exception as e:  # unknown is a fine answer: the matcher then gives up
        log.debug("cannot evaluate %s at build time: %s", node.identity, e)
        return None
    return np.asarray(out)
