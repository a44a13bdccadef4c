"""Sizes of values and of running nodes, in bytes: what memory admission
(`placement.memory`), the split strategies (`placement.partition`) and the stage
planner (`placement.stages`) all count with. Shared here so that those modules import
it, and not each other.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Sequence

import numpy as np

from hetero_exec.errors import UnboundedSymbolError, UnresolvedShapeError
from hetero_exec.ir.graph import Graph, Node, node_reads
from hetero_exec.placement.dims import bound_dim
from hetero_exec.placement.shape_bounds import ShapeBounds


def resolve_shape(graph: Graph, name: str, bounds: dict[str, int]) -> tuple[int, ...] | None:
    v = graph.value(name)
    if v.shape is None:
        return None
    out = []
    for d in v.shape:
        if isinstance(d, int):
            out.append(d)
        elif isinstance(d, str) and bound_dim(d, bounds) is not None:
            out.append(bound_dim(d, bounds))
        else:
            return None
    return tuple(out)


def value_bytes(graph: Graph, name: str, bounds: dict[str, int], default: int = 0) -> int:
    shape = resolve_shape(graph, name, bounds)
    v = graph.value(name)
    if shape is None or v.dtype is None or v.kind != "tensor":
        return default
    return int(np.prod(shape, dtype=np.int64)) * v.dtype.itemsize


def weight_bytes(graph: Graph, nodes: Sequence[Node]) -> int:
    seen: set[str] = set()
    total = 0
    for n in nodes:
        for i in n.inputs:
            if i in graph.initializers and i not in seen:
                seen.add(i)
                total += int(graph.initializers[i].nbytes)
    return total


def cost_bounds(graph: Graph, bounds: dict[str, int]) -> dict[str, int]:
    """``bounds`` with every other symbol at 1, for estimates only (admission never
    guesses): a batch or sequence dim without a bound is costed as one."""
    out = dict(bounds)
    for v in graph.values.values():
        for d in v.shape or ():
            if isinstance(d, str) and d not in out:
                out[d] = 1
    return out


#: the last graph's shape bounds: (graph, its node count, the bounds) -> ShapeBounds (the
#: stage planner sizes many node ranges of one graph)
_last: list[tuple[Any, int, tuple, ShapeBounds]] = []


def shape_bounds(graph: Graph, bounds: dict[str, int]) -> ShapeBounds:
    """The graph's shapes in its input symbols, under ``bounds`` (computed once)."""
    key = tuple(sorted(bounds.items()))
    if _last:
        ref, count, k, sb = _last[0]
        if ref() is graph and count == len(graph.nodes) and k == key:
            return sb
    sb = ShapeBounds(graph, bounds)
    _last[:] = [(weakref.ref(graph), len(graph.nodes), key, sb)]
    return sb


def tensor_bytes(graph: Graph, name: str, bounds: dict[str, int]) -> int:
    """Bytes of a value at its ceiling; UnboundedSymbolError for a symbol without a
    bound, UnresolvedShapeError for a dim nothing sizes."""
    v = graph.value(name)
    if v.kind != "tensor" or v.dtype is None:
        return 0  # sequences and unknown values are not admitted
    shape = shape_bounds(graph, bounds).ceiling(name)
    if shape is None:
        return 0  # nothing known of its rank
    return math.prod(shape) * v.dtype.itemsize


def workspace_bytes(graph: Graph, node: Node, bounds: dict[str, int]) -> int:
    """Scratch a kernel allocates beyond its outputs (im2col columns for convolutions)."""
    if node.op_type not in ("Conv", "ConvInteger", "QLinearConv") or len(node.inputs) < 2:
        return 0
    sb = shape_bounds(graph, bounds)
    try:
        w, out = sb.ceiling(node.inputs[1]), sb.ceiling(node.outputs[0])
    except (UnboundedSymbolError, UnresolvedShapeError):
        return 0  # the output's own bytes raise it where it counts
    v = graph.value(node.outputs[0])
    if w is None or out is None or v.dtype is None:
        return 0
    return out[0] * math.prod(w[1:]) * math.prod(out[2:]) * v.dtype.itemsize


def nodes_need(graph: Graph, nodes: list[Node], inputs: list[str], outputs: list[str],
               bounds: dict[str, int]) -> tuple[int, int]:
    """(weights, peak live activations + workspace) of running ``nodes`` in order."""
    weights = weight_bytes(graph, nodes)
    last_use: dict[str, int] = {}
    for i, node in enumerate(nodes):
        for name in node_reads(node):
            last_use[name] = i
    keep = set(outputs)
    live = {n: tensor_bytes(graph, n, bounds) for n in inputs if n not in graph.initializers}
    current = sum(live.values())
    peak = current
    for i, node in enumerate(nodes):
        outs = [o for o in node.outputs if o]
        sizes = {o: tensor_bytes(graph, o, bounds) for o in outs}
        peak = max(peak, current + sum(sizes.values()) + workspace_bytes(graph, node, bounds))
        live.update(sizes)
        current += sum(sizes.values())
        for name in set(node_reads(node)) | set(outs):
            if name in live and name not in keep and last_use.get(name, -1) <= i:
                current -= live.pop(name)
    return weights, peak
