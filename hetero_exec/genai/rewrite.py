"""The decoder rewritten for a generator: each cache ``Concat(past, new)`` becomes
``KVAppend(cache, new, past_length)`` over a buffer the generator allocates once at
capacity (the in-place append onnxruntime-genai calls past/present buffer sharing).

The original past inputs stay, for the nodes that read only their shapes (an export's
``Shape(past)`` for the past length): the generator feeds them a zero-stride
placeholder of the right shape, so no step moves or copies the context. Any other
reader of a past input reads ``KVPrefix(cache, past)``, a view of the buffer.

The logits become the last position's only, gathered before the lm_head's MatMul: a
prompt's other positions never reach the vocabulary product or leave the step.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from hetero_exec.genai.layout import CacheLayout
from hetero_exec.kernels.fused import FUSED_DOMAIN

PAST_LENGTH = "hetero_exec.past_length"
#: the index of a chunk's last position (Gather's indices: [-1], so the rank stays)
LAST_POSITION = "hetero_exec.last_position"
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
    _last_position_logits(g, layout.logits)
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


def _last_position_logits(g: onnx.GraphProto, logits: str) -> None:
    """The logits of a chunk's last position only ([batch, 1, vocab]): a generator reads
    no other (the next token's; onnxruntime-genai's `get_logits` is the same). The Gather
    goes before the lm_head's MatMul where a constant weight makes the logits, so a
    prompt's other positions never reach it (Qwen2-0.5B's: 271 MFLOP a position, and a
    [prompt, 151936] copy out of the step), else before the output."""
    out = next((o for o in g.output if o.name == logits), None)
    if out is None or len(out.type.tensor_type.shape.dim) != 3:
        return
    made = {o: n for n in g.node for o in n.output}
    node = made.get(logits)
    if node is None:
        return
    g.initializer.append(helper.make_tensor(LAST_POSITION, TensorProto.INT64, [1], [-1]))
    if node.op_type == "MatMul" and _constant_matrix(g, made, node.input[1]):
        last = f"{node.input[0]}.last_position"
        at = list(g.node).index(node)
        g.node.insert(at, helper.make_node("Gather", [node.input[0], LAST_POSITION], [last],
                                           name=f"{node.name}.last_position", axis=1))
        node.input[0] = last
    else:
        every = f"{logits}.every_position"
        for i, name in enumerate(node.output):
            if name == logits:
                node.output[i] = every
        g.node.append(helper.make_node("Gather", [every, LAST_POSITION], [logits],
                                       name="hetero_exec.last_position_logits", axis=1))
    dim = out.type.tensor_type.shape.dim[1]
    dim.Clear()
    dim.dim_value = 1


def _constant_matrix(g: onnx.GraphProto, made: dict, name: str) -> bool:
    """Whether ``name`` is a 2-D initializer, or the Transpose of one (a tied embedding)."""
    inits = {i.name: i for i in g.initializer}
    node = made.get(name)
    if node is not None and node.op_type == "Transpose":
        name = node.input[0]
    return name in inits and len(inits[name].dims) == 2


def _prefix(nodes: list, e) -> str:
    """The past of entry ``e`` as a view of its buffer (made once)."""
    name = f"hetero_exec.prefix.{e.past}"
    if not any(name in n.output for n in nodes):
        nodes.insert(0, helper.make_node("KVPrefix", [cache_input(e.past), e.past], [name],
                                         name=f"kv_prefix_{e.layer}_{e.kind}", domain=FUSED_DOMAIN,
                                         axis=e.axis))
    return name
