"""The in-memory graph: nodes with ids, values with dtypes and (symbolic) shapes,
producers/consumers, nested subgraphs and the outer-scope names they capture."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import onnx

#: a dim is a static size, a symbol name, or None (unknown)
Dim = int | str | None
Shape = tuple[Dim, ...]


@dataclass
class Value:
    """What is known of one named value before running."""

    name: str
    kind: str = "tensor"  # tensor | sequence | map | optional | unknown
    elem_type: int = 0  # onnx TensorProto element type (0 = unknown)
    shape: Shape | None = None  # None: rank unknown

    @property
    def dtype(self) -> np.dtype | None:
        if not self.elem_type:
            return None
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(self.elem_type))

    @property
    def dtype_name(self) -> str:
        if not self.elem_type:
            return "unknown"
        return onnx.TensorProto.DataType.Name(self.elem_type).lower()

    @property
    def static(self) -> bool:
        return self.shape is not None and all(isinstance(d, int) for d in self.shape)

    def nbytes(self) -> int | None:
        if not self.static or self.kind != "tensor" or self.dtype is None:
            return None
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


@dataclass
class Node:
    id: int
    op_type: str
    domain: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, onnx.AttributeProto]
    scope: str
    name: str = ""
    subgraphs: dict[str, "Graph"] = field(default_factory=dict)

    @property
    def identity(self) -> str:
        """``graph/node#ID "name"``, as SEMANTICS.md's reports spell it."""
        ident = f"{self.scope}/node#{self.id}"
        return f'{ident} "{self.name}"' if self.name else ident

    @property
    def canonical_domain(self) -> str:
        return self.domain if self.domain not in ("", "ai.onnx") else "ai.onnx"

    @property
    def op_class(self) -> str:
        return f"{self.canonical_domain}::{self.op_type}"

    def __hash__(self) -> int:
        return hash((self.scope, self.id))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Node) and (self.scope, self.id) == (other.scope, other.id)


@dataclass
class Graph:
    name: str
    scope: str
    nodes: list[Node]
    inputs: list[str]
    outputs: list[str]
    initializers: dict[str, np.ndarray]
    values: dict[str, Value]
    opsets: dict[str, int]
    #: names this graph (or a graph nested in it) reads from enclosing scopes
    captures: list[str] = field(default_factory=list)
    parent: "Graph | None" = None

    def __post_init__(self) -> None:
        self.reindex()

    def reindex(self) -> None:
        self.producer: dict[str, Node] = {}
        self.consumers: dict[str, list[Node]] = {}
        for node in self.nodes:
            for o in node.outputs:
                if o:
                    self.producer[o] = node
            for i in node_reads(node):
                self.consumers.setdefault(i, []).append(node)

    def value(self, name: str) -> Value:
        v = self.values.get(name)
        if v is None:
            v = self.values[name] = Value(name, kind="unknown")
        return v

    def defining(self, name: str) -> "Graph":
        """The graph whose value ``name`` is: this one, or the enclosing graph a body
        captures it from (the nearest that initializes, produces or takes it)."""
        g = self
        while g.parent is not None and name not in g.initializers and name not in g.producer \
                and name not in g.inputs:
            g = g.parent
        return g

    def opset(self, domain: str) -> int:
        d = "" if domain in ("", "ai.onnx") else domain
        return self.opsets.get(d, 1)

    def walk(self) -> Iterator[Node]:
        """Every node, recursively through subgraphs (bodies after their owner)."""
        for node in self.nodes:
            yield node
            for sub in node.subgraphs.values():
                yield from sub.walk()

    def graph_inputs(self) -> list[str]:
        """Inputs the caller must or may feed (initializer-backed ones are optional)."""
        return list(self.inputs)


def node_reads(node: Node) -> list[str]:
    """Every name a node reads: its explicit inputs plus its bodies' outer captures."""
    reads = [i for i in node.inputs if i]
    for sub in node.subgraphs.values():
        reads.extend(sub.captures)
    return reads


def attr_value(attr: onnx.AttributeProto) -> Any:
    """An attribute as a plain Python value (strings decoded, tensors as numpy)."""
    from onnx import numpy_helper

    t = attr.type
    A = onnx.AttributeProto
    if t == A.FLOAT:
        return float(attr.f)
    if t == A.INT:
        return int(attr.i)
    if t == A.STRING:
        return attr.s.decode("utf-8", errors="replace")
    if t == A.TENSOR:
        return numpy_helper.to_array(attr.t)
    if t == A.SPARSE_TENSOR:
        return sparse_to_dense(attr.sparse_tensor)
    if t == A.FLOATS:
        return [float(x) for x in attr.floats]
    if t == A.INTS:
        return [int(x) for x in attr.ints]
    if t == A.STRINGS:
        return [s.decode("utf-8", errors="replace") for s in attr.strings]
    if t == A.TENSORS:
        return [numpy_helper.to_array(x) for x in attr.tensors]
    if t == A.TYPE_PROTO:
        return attr.tp
    if t == A.TYPE_PROTOS:
        return list(attr.type_protos)
    return onnx.helper.get_attribute_value(attr)


def sparse_to_dense(sp: onnx.SparseTensorProto) -> np.ndarray:
    from onnx import numpy_helper

    values = numpy_helper.to_array(sp.values)
    idx = numpy_helper.to_array(sp.indices) if sp.HasField("indices") else np.zeros((0,), np.int64)
    dims = tuple(sp.dims)
    dense = np.zeros(dims, dtype=values.dtype)
    if idx.ndim == 1:  # linearised indices
        dense.reshape(-1)[idx] = values
    else:
        dense[tuple(idx.T)] = values
    return dense
