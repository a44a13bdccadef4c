"""Graph -> ONNX protos: what the IR knows, written back (nodes, value types, weights)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from hetero_exec.ir.graph import Graph, Node, Value


def node_proto(node: Node) -> onnx.NodeProto:
    p = helper.make_node(node.op_type, node.inputs, node.outputs, domain=node.domain,
                         name=node.name or None)
    p.attribute.extend(node.attrs.values())
    return p


def value_proto(v: Value) -> onnx.ValueInfoProto | None:
    """The ValueInfoProto of what the IR knows of a value (None when nothing is known)."""
    if v.kind == "tensor" and v.elem_type:
        shape = None if v.shape is None else list(v.shape)
        return helper.make_tensor_value_info(v.name, v.elem_type, shape)
    if v.kind == "sequence" and v.elem_type:
        return helper.make_tensor_sequence_value_info(v.name, v.elem_type, None)
    if v.kind == "optional" and v.elem_type:
        inner = helper.make_tensor_type_proto(v.elem_type, None)
        return helper.make_value_info(v.name, helper.make_optional_type_proto(inner))
    return None


def graph_proto(graph: Graph, nodes: Sequence[Node], initializers: Mapping[str, np.ndarray],
                name: str | None = None, doc_string: str = "") -> onnx.GraphProto:
    """``nodes`` (in a valid order) with ``initializers``, over the graph's inputs and outputs."""
    def info(n: str) -> onnx.ValueInfoProto:
        return value_proto(graph.value(n)) or helper.make_value_info(n, onnx.TypeProto())

    ios = set(graph.inputs) | set(graph.outputs)
    inner = {o for node in nodes for o in node.outputs if o and o not in ios}
    value_info = [vi for vi in (value_proto(graph.value(n)) for n in sorted(inner)) if vi is not None]
    weights = [numpy_helper.from_array(np.asarray(a), n) for n, a in initializers.items()]
    return helper.make_graph([node_proto(n) for n in nodes], name or graph.name,
                             [info(n) for n in graph.inputs], [info(n) for n in graph.outputs],
                             weights, doc_string=doc_string or None, value_info=value_info)


def model_proto(like: onnx.ModelProto, graph: onnx.GraphProto, opsets: Mapping[str, int]) -> onnx.ModelProto:
    """A model around ``graph`` with ``like``'s metadata and the given opsets."""
    imports = [helper.make_opsetid(d, v) for d, v in sorted(opsets.items())]
    out = helper.make_model(graph, opset_imports=imports, ir_version=like.ir_version,
                            producer_name=like.producer_name, producer_version=like.producer_version,
                            domain=like.domain, model_version=like.model_version,
                            doc_string=like.doc_string)
    out.metadata_props.extend(like.metadata_props)
    return out


def reads(nodes: Sequence[Node]) -> set[str]:
    from hetero_exec.ir.graph import node_reads

    return {r for n in nodes for r in node_reads(n)}


__all__: list[Any] = ["node_proto", "value_proto", "graph_proto", "model_proto", "reads"]
