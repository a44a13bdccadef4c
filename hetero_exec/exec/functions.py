"""Ops without a kernel but with a function body in their onnx schema run as that body.

onnx defines many newer ops (and context-dependent ones) as functions of older ops;
expanding them gives those ops to every provider that runs the body's ops.
"""

from __future__ import annotations

import logging

import onnx
import onnx.defs
from onnx import helper

from hetero_exec.ir.graph import Graph, Node

log = logging.getLogger(__name__)


def function_proto(graph: Graph, node: Node) -> onnx.FunctionProto | None:
    domain = "" if node.domain in ("", "ai.onnx") else node.domain
    opset = graph.opset(domain)
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, domain)
    except onnx.defs.SchemaError:
        return None
    node_proto = _node_proto(node)
    fn = onnx.FunctionProto()
    versions = [v for v in schema.function_opset_versions if v <= opset]
    if versions:
        fn.ParseFromString(schema.get_function_with_opset_version(max(versions)))
        return fn if fn.node else None
    ctx_versions = [v for v in schema.context_dependent_function_opset_versions if v <= opset]
    if ctx_versions:
        types = []
        for name in node.inputs:
            v = graph.value(name) if name else None
            if v is None or v.kind != "tensor" or not v.elem_type:
                if name:
                    return None  # the body depends on input types we do not know
                types.append(onnx.TypeProto().SerializeToString())
                continue
            types.append(helper.make_tensor_type_proto(v.elem_type, None).SerializeToString())
        try:
            data = schema.get_context_dependent_function_with_opset_version(
                max(ctx_versions), node_proto.SerializeToString(), types)
        except Exception as e:
            log.debug("no context-dependent body for %s: %s", node.identity, e)
            return None
        fn.ParseFromString(data)
        return fn if fn.node else None
    return None


def expand_function(graph: Graph, node: Node) -> Graph | None:
    """The node's schema function body as a Graph whose inputs are the node's positions."""
    from hetero_exec.ir.load import build_graph

    fn = function_proto(graph, node)
    if fn is None:
        return None
    domain = "" if node.domain in ("", "ai.onnx") else node.domain
    schema = onnx.defs.get_schema(node.op_type, graph.opset(domain), domain)
    bound = {name: attr for name, attr in node.attrs.items()}
    for name, a in schema.attributes.items():
        if name not in bound and a.default_value.type != onnx.AttributeProto.UNDEFINED:
            bound[name] = a.default_value
    nodes = [_bind_attributes(n, bound) for n in fn.node]
    body = helper.make_graph(
        nodes, f"{node.op_type}_body",
        [helper.make_value_info(i, onnx.TypeProto()) for i in fn.input],
        [helper.make_value_info(o, onnx.TypeProto()) for o in fn.output],
    )
    opsets = dict(graph.opsets)
    for imp in fn.opset_import:
        opsets["" if imp.domain == "ai.onnx" else imp.domain] = imp.version
    return build_graph(body, opsets, f"{node.scope}/node#{node.id}/function")


def _bind_attributes(n: onnx.NodeProto, bound: dict[str, onnx.AttributeProto]) -> onnx.NodeProto:
    out = onnx.NodeProto()
    out.CopyFrom(n)
    del out.attribute[:]
    for a in n.attribute:
        if a.ref_attr_name:
            src = bound.get(a.ref_attr_name)
            if src is None:
                continue  # unset optional attribute: the op's own default applies
            b = onnx.AttributeProto()
            b.CopyFrom(src)
            b.name = a.name
            out.attribute.append(b)
        else:
            out.attribute.append(a)
    return out


def _node_proto(node: Node) -> onnx.NodeProto:
    p = helper.make_node(node.op_type, node.inputs, node.outputs, domain=node.domain, name=node.name)
    p.attribute.extend(node.attrs.values())
    return p


def function_proto_for_support(node: Node, opset: int) -> bool:
    """Whether the op's schema has a function body at ``opset`` (types not needed)."""
    domain = "" if node.domain in ("", "ai.onnx") else node.domain
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, domain)
    except onnx.defs.SchemaError:
        return False
    return any(v <= opset for v in schema.function_opset_versions) or any(
        v <= opset for v in schema.context_dependent_function_opset_versions)
