"""A decoder's cache layout, read from its graph (or from genai_config.json's names).

A cache entry is a rank-4 graph input ``[batch, kv_heads, past, head_size]`` that a
``Concat`` along the sequence axis grows into a graph output (Optimum's
``past_key_values.N.key`` -> ``present.N.key``, the dynamo wrapper's
``past_key_values_N_key`` -> ``present_N_key``), or, for onnxruntime's attention ops
(GroupQueryAttention, MultiHeadAttention, Attention), the past/present pair of one node.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper

from hetero_exec.genai.errors import CacheLayoutError

#: names the cache inputs are looked for under, for the error that names them
LOOKED_FOR = ("past_key_values.N.key/value", "past_key_values_N_key/value", "past.N.key/value",
              "past_key_N/past_value_N")
_LAYER = re.compile(r"(\d+)")
_ATTENTION_OPS = {"GroupQueryAttention": (3, 4, 1, 2), "MultiHeadAttention": (6, 7, 1, 2)}


@dataclass(frozen=True)
class CacheEntry:
    layer: int
    kind: str  # "key" or "value"
    past: str  # graph input
    present: str  # graph output
    node: str  # the Concat (or attention node) that grows it
    axis: int  # the sequence axis
    kv_heads: int
    head_size: int
    dtype: np.dtype
    #: "concat": a Concat we rewrite to append in place; "shared": an attention op whose
    #: past and present are one buffer at capacity (onnxruntime's buffer sharing)
    mode: str = "concat"


@dataclass
class CacheLayout:
    entries: list[CacheEntry]
    input_ids: str
    logits: str
    attention_mask: str | None = None
    position_ids: str | None = None
    #: other graph inputs the step feeds (GroupQueryAttention's derived lengths are
    #: computed in the graph from the mask; nothing else is expected)
    extra_inputs: list[str] = field(default_factory=list)
    vocab_size: int | None = None

    @property
    def layers(self) -> int:
        return len({e.layer for e in self.entries})

    def bytes_at(self, batch: int, capacity: int) -> int:
        """The cache's bytes: layers x 2 x batch x kv heads x capacity x head size x dtype."""
        return sum(batch * e.kv_heads * capacity * e.head_size * e.dtype.itemsize
                   for e in self.entries)


def _dims(vi: onnx.ValueInfoProto) -> list:
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
            for d in vi.type.tensor_type.shape.dim]


def _dtype(vi: onnx.ValueInfoProto) -> np.dtype:
    return np.dtype(helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type))


def _kind(name: str) -> str | None:
    low = name.lower().replace("key_values", "")  # past_key_values.N.value is a value
    if "key" in low or re.search(r"(^|[._])k($|[._])", low):
        return "key"
    if "value" in low or re.search(r"(^|[._])v($|[._])", low):
        return "value"
    return None


def discover(model: onnx.ModelProto, label: str = "model", names: dict | None = None) -> CacheLayout:
    """The layout of ``model``'s cache; ``names``: genai_config.json's input/output names
    (``past_key_names``, ``present_key_names`` with ``%d``), which take precedence."""
    g = model.graph
    inits = {i.name for i in g.initializer}
    inputs = {i.name: i for i in g.input if i.name not in inits}
    outputs = {o.name: o for o in g.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    entries: list[CacheEntry] = []
    for name, vi in inputs.items():
        dims = _dims(vi)
        if len(dims) != 4:
            continue
        for n in consumers.get(name, []):
            if n.op_type == "Concat" and n.input[0] == name and n.output[0] in outputs:
                axis = next((a.i for a in n.attribute if a.name == "axis"), 0)
                entries.append(_entry(name, n.output[0], n.name, axis % 4, dims, vi, "concat"))
            elif n.op_type in _ATTENTION_OPS:
                pk, pv, ok, ov = _ATTENTION_OPS[n.op_type]
                for pos, out in ((pk, ok), (pv, ov)):
                    if len(n.input) > pos and n.input[pos] == name and len(n.output) > out:
                        entries.append(_entry(name, n.output[out], n.name, 2, dims, vi, "shared",
                                              "key" if pos == pk else "value", names))
    if names:
        entries = _match_config(entries, names)
    if not entries:
        raise CacheLayoutError(label, "no cache inputs found", LOOKED_FOR)
    kinds = {(e.layer, e.kind) for e in entries}
    if len(kinds) != len(entries) or {k for _, k in kinds} != {"key", "value"}:
        raise CacheLayoutError(label, f"cache inputs {[e.past for e in entries]} do not pair up "
                               "as one key and one value per layer", LOOKED_FOR)
    entries.sort(key=lambda e: (e.layer, e.kind))
    ids = _pick(inputs, ("input_ids",), names and names.get("input_ids"))
    if ids is None:
        raise CacheLayoutError(label, "no input_ids input", ("input_ids",))
    logits = _pick(outputs, ("logits",), names and names.get("logits")) or next(iter(outputs))
    layout = CacheLayout(
        entries=entries, input_ids=ids, logits=logits,
        attention_mask=_pick(inputs, ("attention_mask",), names and names.get("attention_mask")),
        position_ids=_pick(inputs, ("position_ids",), names and names.get("position_ids")))
    known = {ids, layout.attention_mask, layout.position_ids} | {e.past for e in entries}
    layout.extra_inputs = [n for n in inputs if n not in known]
    last = _dims(outputs[logits])[-1] if logits in outputs else None
    layout.vocab_size = last if isinstance(last, int) else None
    return layout


def _entry(past: str, present: str, node: str, axis: int, dims: list, vi, mode: str,
           kind: str | None = None, names: dict | None = None) -> CacheEntry:
    m = _LAYER.findall(past)
    kind = kind or _kind(past)
    dims = list(dims)
    if names:  # genai_config.json's heads and head size where the graph's dims are symbols
        if not isinstance(dims[1], int) and names.get("num_key_value_heads"):
            dims[1] = int(names["num_key_value_heads"])
        if not isinstance(dims[3], int) and names.get("head_size"):
            dims[3] = int(names["head_size"])
    if not m or kind is None or not isinstance(dims[1], int) or not isinstance(dims[3], int):
        raise CacheLayoutError(past, "a cache input without a layer number, a key/value "
                               "name and static heads and head size", LOOKED_FOR)
    return CacheEntry(int(m[-1]), kind, past, present, node, axis, dims[1], dims[3], _dtype(vi),
                      mode)


def _match_config(entries: list[CacheEntry], names: dict) -> list[CacheEntry]:
    """Keep the entries genai_config.json names (its ``%d`` templates), in its order."""
    pk, pv = names.get("past_key_names"), names.get("past_value_names")
    if not pk or not pv:
        return entries
    wanted = {}
    for e in entries:
        template = pk if e.kind == "key" else pv
        if e.past == template % e.layer:
            wanted[e.past] = e
    return list(wanted.values())


def _pick(table: dict, defaults: tuple[str, ...], configured: str | None) -> str | None:
    for n in ((configured,) if configured else ()) + defaults:
        if n in table:
            return n
    return None
