"""NodeArg: what get_inputs()/get_outputs() return, spelled as onnxruntime spells it.

>>> import onnx.helper as h
>>> type_string(h.make_sequence_type_proto(h.make_tensor_type_proto(1, None)))
'seq(tensor(float))'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import onnx

from hetero_exec.ir.graph import Graph


@dataclass(frozen=True)
class NodeArg:
    name: str
    type: str
    shape: list[Any]


def _elem(elem_type: int) -> str:
    return onnx.TensorProto.DataType.Name(elem_type).lower() if elem_type else "undefined"


def type_string(tp: onnx.TypeProto) -> str:
    """onnxruntime's type names: tensor(float), seq(tensor(int64)), map(string,tensor(float))..."""
    which = tp.WhichOneof("value")
    if which == "tensor_type":
        return f"tensor({_elem(tp.tensor_type.elem_type)})"
    if which == "sparse_tensor_type":
        return f"sparse_tensor({_elem(tp.sparse_tensor_type.elem_type)})"
    if which == "sequence_type":
        return f"seq({type_string(tp.sequence_type.elem_type)})"
    if which == "map_type":
        return f"map({_elem(tp.map_type.key_type)},{type_string(tp.map_type.value_type)})"
    if which == "optional_type":
        return f"optional({type_string(tp.optional_type.elem_type)})"
    return "unknown"


def declared_types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    g = model.graph
    return {vi.name: vi.type for vi in list(g.input) + list(g.output)}


def node_arg(graph: Graph, types: dict[str, onnx.TypeProto], name: str) -> NodeArg:
    v = graph.value(name)
    if v.kind == "tensor":
        shape = list(v.shape) if v.shape is not None else None
        tp = types.get(name)
        spelled = type_string(tp) if tp is not None and tp.HasField("tensor_type") \
            else f"tensor({v.dtype_name})"
        return NodeArg(name, spelled, shape)
    tp = types.get(name)
    if tp is not None and tp.WhichOneof("value"):
        return NodeArg(name, type_string(tp), [])  # non-tensors: an empty shape, as onnxruntime
    kind = "seq" if v.kind == "sequence" else v.kind
    return NodeArg(name, f"{kind}(tensor({v.dtype_name}))" if v.elem_type else kind, [])
