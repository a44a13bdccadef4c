"""The decoder rewritten for a generator: each cache ``Concat(past, new)`` becomes
``KVAppend(cache, new, past_length)`` over a buffer the generator allocates once at
capacity (the in-place append onnxruntime-genai calls past/present buffer sharing).

The original past inputs stay, for the nodes that read only their shapes (an export's
``Shape(past)`` for the past length): the generator feeds them a zero-stride
placeholder of the right shape, so no step moves or copies the context. Any other
reader of a past input reads ``KVPrefix(cache, past)``, a view of the buffer.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from hetero_exec.genai.layout import CacheLayout
from hetero_exec.kernels.fused import FUSED_DOMAIN

PAST_LENGTH = "hetero_exec.past_length"
#: the cache buffers' symbolic length (the generator's capacity)
CAPACITY = "hetero_exec_capacity"
SHAPE_ONLY = frozenset({"Shape", "Size"})


def cache_input(past: str) -> str:
    return f"hetero_exec.cache.{past}"


def rewrite(model: onnx.ModelProto, layout: CacheLayout) -> onnx.ModelProto:
    """A copy of ``model`` whose ``concat`` entries append in place."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    concat = {e.node: e for e in layout.entries if e.mode == "concat"}
    if not concat:
        return out
    by_past = {e.past: e for e in concat.values()}
    nodes = []
    for n in g.node:
        e = concat.get(n.name)
        if e is not None and n.op_type == "Concat" and len(n.input) == 2:
            nodes.append(helper.make_node("KVAppend", [cache_input(e.past), n.input[1], PAST_LENGTH, e.past],
                                          [n.output[0]], name=n.name, domain=FUSED_DOMAIN,
                                          axis=e.axis))
            continue
        if n.op_type not in SHAPE_ONLY:
            for i, name in enumerate(n.input):
                if name in by_past:
                    n.input[i] = _prefix(nodes, by_past[name])
        nodes.append(n)
    del g.node[:]
    g.node.extend(nodes)
    for vi in list(g.input):
        e = by_past.get(vi.name)
        if e is None:
            continue
        dims = [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]
        dims[e.axis] = CAPACITY
        g.input.append(helper.make_tensor_value_info(cache_input(e.past),
                                                     vi.type.tensor_type.elem_type, dims))
    g.input.append(helper.make_tensor_value_info(PAST_LENGTH, TensorProto.INT64, []))
    if not any(o.domain == FUSED_DOMAIN for o in out.opset_import):
        out.opset_import.append(helper.make_opsetid(FUSED_DOMAIN, 1))
    return out


def _prefix(nodes: list, e) -> str:
    """The past of entry ``e`` as a view of its buffer (made once)."""
    name = f"hetero_exec.prefix.{e.past}"
    if not any(name in n.output for n in nodes):
        nodes.insert(0, helper.make_node("KVPrefix", [cache_input(e.past), e.past], [name],
                                         name=f"kv_prefix_{e.layer}_{e.kind}", domain=FUSED_DOMAIN,
                                         axis=e.axis))
    return name
