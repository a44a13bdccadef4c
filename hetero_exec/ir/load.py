"""Loading: path | bytes | ModelProto -> (ModelProto, Graph).

onnx does the reading, checking and shape inference; we add node ids, the cycle
check (naming the nodes in the cycle), subgraph captures and symbolic dims.
"""

from __future__ import annotations

import copy
import logging
import os
import re
from typing import Union

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import numpy_helper

from hetero_exec.errors import ControlFlowError, GraphCycleError, ModelLoadError
from hetero_exec.ir.graph import Graph, Node, Shape, Value

log = logging.getLogger(__name__)

ModelSource = Union[str, os.PathLike, bytes, onnx.ModelProto]


def read_model(source: ModelSource, base_dir: str | None = None) -> onnx.ModelProto:
    """Read a model (with external data) without checking it; typed errors on bad input."""
    if isinstance(source, onnx.ModelProto):
        return source
    try:
        if isinstance(source, (bytes, bytearray, memoryview)):
            model = onnx.load_from_string(bytes(source))
            if base_dir:
                onnx.external_data_helper.load_external_data_for_model(model, base_dir)
            else:
                external = [t.name for t in onnx.external_data_helper._get_all_tensors(model)
                            if onnx.external_data_helper.uses_external_data(t)]
                if external:
                    raise ModelLoadError(
                        f"model bytes reference external data (tensor(s) {external[:3]}); "
                        f"pass base_dir=, the folder holding the data files")
            return model
        path = os.fspath(source)
        if not os.path.exists(path):
            raise ModelLoadError(f"model file not found: {path}")
        return onnx.load(path)
    except ModelLoadError:
        raise
    except (DecodeError, ValueError, RuntimeError, OSError, IndexError, TypeError,
            onnx.checker.ValidationError) as e:  # ValidationError: missing external data
        where = f"file {os.fspath(source)!r}" if not isinstance(source, (bytes, bytearray, memoryview)) else "bytes"
        raise ModelLoadError(f"cannot parse ONNX model from {where}: {type(e).__name__}: {e}") from None


def _register_contrib_schemas() -> None:
    """onnx knows none of onnxruntime's contrib ops: their schemas (kernels/contrib) are
    registered with onnx before its checker and shape inference see a model. The one
    import of kernels from ir, and only of what onnx itself needs."""
    from hetero_exec.kernels.contrib import ensure_schemas

    ensure_schemas()


#: "... OpType: X" in onnx's checker messages: the node the failure is about
_CHECKED_OP = re.compile(r"OpType: (\S+)")


def _contrib_failure(model: onnx.ModelProto, message: str) -> str | None:
    """The ``domain::op`` a checker failure is about when that op is in a domain other
    than onnx's own that hetero_exec has kernels for (onnxruntime's com.microsoft): the
    checker judged it by our copy of onnxruntime's schema, so the model is not known to
    be invalid and the kernel decides. None for any other failure."""
    from hetero_exec.kernels.registry import has_op

    match = _CHECKED_OP.search(message)
    if match is None:
        return None
    for node in model.graph.node:
        if node.op_type == match.group(1) and node.domain not in ("", "ai.onnx", "ai.onnx.ml") \
                and has_op(node.domain, node.op_type):
            return f"{node.domain}::{node.op_type}"
    return None


#: initializers from this many bytes on are held apart while onnx's checker and shape
#: inference run: each serializes the whole model (a weight-heavy model's build was
#: mostly that), and neither needs a weight's values, only its type and shape
DETACH_BYTES = 16 * 1024


def _detach_weights(model: onnx.ModelProto) -> tuple[list[onnx.TensorProto], int]:
    """Take the large initializers (raw data of exactly their size: the checker would
    find nothing to say about them) out of ``model``'s graph, each standing in as a
    graph input of its type and shape; returns them and how many inputs were added."""
    g = model.graph
    inputs = {i.name for i in g.input}
    kept, detached = [], []
    for t in g.initializer:
        size = _itemsize(t.data_type)
        if size and t.data_location != onnx.TensorProto.EXTERNAL and t.raw_data \
                and len(t.raw_data) >= DETACH_BYTES \
                and len(t.raw_data) == size * int(np.prod(t.dims, dtype=np.int64)):
            detached.append(t)
        else:
            kept.append(t)
    if not detached:
        return [], 0
    del g.initializer[:]
    g.initializer.extend(kept)
    added = [t for t in detached if t.name not in inputs]
    g.input.extend(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                   for t in added)
    return detached, len(added)


def _itemsize(data_type: int) -> int:
    """Bytes an element of ``data_type`` takes in raw data; 0 where that is not fixed."""
    if data_type in _UNSIZED:
        return 0
    try:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(data_type)).itemsize
    except Exception:  # a type this onnx maps to no numpy dtype
        return 0


def _attach_weights(model: onnx.ModelProto, detached: list[onnx.TensorProto],
                    added: int) -> None:
    if added:
        del model.graph.input[len(model.graph.input) - added:]
    model.graph.initializer.extend(detached)


#: element types without a fixed byte size (strings, 4-bit and sub-byte packings)
_UNSIZED = {onnx.TensorProto.STRING, onnx.TensorProto.UNDEFINED}
_UNSIZED |= {getattr(onnx.TensorProto, n) for n in ("INT4", "UINT4", "FLOAT4E2M1", "INT2",
                                                    "UINT2") if hasattr(onnx.TensorProto, n)}


def prepare_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """Inline local functions, check, and infer shapes (symbolic dims kept)."""
    model = copy.deepcopy(model)
    if model.functions:
        model = onnx.inliner.inline_local_functions(model)
    _register_contrib_schemas()
    detached, added = _detach_weights(model)
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as e:
        contrib = _contrib_failure(model, str(e))
        if contrib is None:
            raise ModelLoadError(f"invalid ONNX model: {str(e).strip().splitlines()[0]}") from None
        log.warning("onnx's checker refused %s (%s); its kernel checks the node instead",
                    contrib, str(e).strip().splitlines()[0])
    try:
        inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception as e:  # inference is advisory: run-time shapes still work
        log.warning("shape inference failed, continuing without it: %s", e)
        inferred = model
    _attach_weights(inferred, detached, added)
    return inferred


def load(source: ModelSource, base_dir: str | None = None) -> tuple[onnx.ModelProto, Graph]:
    """Read, validate (control-flow signatures, then cycles) and build the IR.

    The order is SEMANTICS.md section 1: signatures, DAG check, then onnx's checker
    and shape inference on a topologically sorted copy.
    """
    raw = read_model(source, base_dir)
    opsets = {("" if o.domain == "ai.onnx" else o.domain): o.version for o in raw.opset_import}
    draft = build_graph(raw.graph, opsets, "graph")
    validate_control_flow(draft)
    order = check_acyclic(draft)
    sorted_model = copy.deepcopy(raw)
    if order != list(range(len(draft.nodes))):
        nodes = [copy.deepcopy(raw.graph.node[i]) for i in order]
        del sorted_model.graph.node[:]
        sorted_model.graph.node.extend(nodes)
    model = prepare_model(sorted_model)
    return model, build_graph(model.graph, opsets, "graph")


# --- IR construction ----------------------------------------------------------


def build_graph(g: onnx.GraphProto, opsets: dict[str, int], scope: str,
                parent: Graph | None = None) -> Graph:
    values: dict[str, Value] = {}
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        values[vi.name] = value_from_type(vi.name, vi.type)
    initializers: dict[str, np.ndarray] = {}
    for t in g.initializer:
        try:
            arr = numpy_helper.to_array(t)
        except (ValueError, TypeError) as e:  # data that does not fill its dims, say
            raise ModelLoadError(f"invalid ONNX model: initializer {t.name!r} "
                                 f"(dims {list(t.dims)}): {e}") from None
        initializers[t.name] = arr
        values.setdefault(t.name, Value(t.name, "tensor", t.data_type, tuple(arr.shape)))
    for sp in g.sparse_initializer:
        from hetero_exec.ir.graph import sparse_to_dense

        arr = sparse_to_dense(sp)
        initializers[sp.values.name] = arr
        values.setdefault(sp.values.name, Value(sp.values.name, "tensor", sp.values.data_type, tuple(arr.shape)))

    graph = Graph(name=g.name, scope=scope, nodes=[], inputs=[i.name for i in g.input],
                  outputs=[o.name for o in g.output], initializers=initializers,
                  values=values, opsets=opsets, parent=parent)
    for idx, n in enumerate(g.node):
        node = Node(id=idx, op_type=n.op_type, domain=n.domain, inputs=list(n.input),
                    outputs=list(n.output), attrs={a.name: a for a in n.attribute},
                    scope=scope, name=n.name)
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                node.subgraphs[a.name] = build_graph(a.g, opsets, f"{scope}/node#{idx}/{a.name}", graph)
        graph.nodes.append(node)
    graph.reindex()
    graph.captures = compute_captures(graph)
    return graph


def compute_captures(graph: Graph) -> list[str]:
    defined = set(graph.inputs) | set(graph.initializers)
    for node in graph.nodes:
        defined.update(o for o in node.outputs if o)
    captures: list[str] = []
    seen: set[str] = set()
    for node in graph.nodes:
        reads = [i for i in node.inputs if i]
        for sub in node.subgraphs.values():
            reads.extend(sub.captures)
        for name in reads:
            if name not in defined and name not in seen:
                seen.add(name)
                captures.append(name)
    return captures


def _symbol(name: str) -> str | None:
    """A declared symbolic dim; onnx's inference names unknown dims ``unk__N``: unknown."""
    if not name or (name.startswith("unk__") and name[5:].isdigit()):
        return None
    return name


def value_from_type(name: str, tp: onnx.TypeProto) -> Value:
    which = tp.WhichOneof("value")
    if which == "tensor_type":
        tt = tp.tensor_type
        shape: Shape | None = None
        if tt.HasField("shape"):
            shape = tuple(
                d.dim_value if d.HasField("dim_value") else _symbol(d.dim_param)
                for d in tt.shape.dim
            )
        return Value(name, "tensor", tt.elem_type, shape)
    if which == "sparse_tensor_type":
        return Value(name, "tensor", tp.sparse_tensor_type.elem_type, None)
    if which == "sequence_type":
        inner = tp.sequence_type.elem_type
        elem = inner.tensor_type.elem_type if inner.WhichOneof("value") == "tensor_type" else 0
        return Value(name, "sequence", elem, None)
    if which == "map_type":
        return Value(name, "map", 0, None)
    if which == "optional_type":
        inner = tp.optional_type.elem_type
        kind = inner.WhichOneof("value")
        elem = inner.tensor_type.elem_type if kind == "tensor_type" else 0
        return Value(name, "optional", elem, None)
    return Value(name, "unknown")


# --- validation -----------------------------------------------------------------


def validate_control_flow(graph: Graph) -> None:
    """Every If (recursively) has branches with matching output counts and dtypes."""
    for node in graph.walk():
        if node.op_type != "If" or node.canonical_domain != "ai.onnx":
            continue
        then_b, else_b = node.subgraphs.get("then_branch"), node.subgraphs.get("else_branch")
        if then_b is None or else_b is None:
            raise ControlFlowError(node.identity, "If", "missing then_branch or else_branch")
        nt, ne = len(then_b.outputs), len(else_b.outputs)
        if nt != ne:
            raise ControlFlowError(
                node.identity, "If",
                f"branches declare different output counts: then_branch has {nt}, else_branch has {ne}")
        if nt != len(node.outputs):
            raise ControlFlowError(
                node.identity, "If",
                f"branches declare {nt} outputs but the node has {len(node.outputs)}")
        for i, (a, b) in enumerate(zip(then_b.outputs, else_b.outputs)):
            ta, tb = then_b.value(a), else_b.value(b)
            if ta.kind == tb.kind == "tensor" and ta.elem_type and tb.elem_type and ta.elem_type != tb.elem_type:
                raise ControlFlowError(
                    node.identity, "If",
                    f"branch output {i} dtypes differ: then_branch {ta.dtype_name}, "
                    f"else_branch {tb.dtype_name}")


def check_acyclic(graph: Graph) -> list[int]:
    """A topological order (positions in ``graph.nodes``) of the top-level nodes (stable
    w.r.t. file order), or GraphCycleError naming the nodes of one cycle.

    Positions, not node ids: a provider pass may drop nodes, leaving ids with gaps."""
    import heapq

    n = len(graph.nodes)
    producer = {o: pos for pos, node in enumerate(graph.nodes) for o in node.outputs if o}
    deps: list[set[int]] = [set() for _ in range(n)]
    users: list[list[int]] = [[] for _ in range(n)]
    from hetero_exec.ir.graph import node_reads

    for pos, node in enumerate(graph.nodes):
        for name in node_reads(node):
            p = producer.get(name)
            if p is not None and p != pos and p not in deps[pos]:
                deps[pos].add(p)
                users[p].append(pos)
            elif p == pos:
                raise GraphCycleError([node.identity])
    indeg = [len(d) for d in deps]
    ready = [i for i in range(n) if indeg[i] == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for u in users[i]:
            indeg[u] -= 1
            if indeg[u] == 0:
                heapq.heappush(ready, u)
    if len(order) == n:
        return order
    raise GraphCycleError([graph.nodes[i].identity for i in find_cycle(deps, set(range(n)) - set(order))])


def find_cycle(deps: list[set[int]], remaining: set[int]) -> list[int]:
    """Walk dependencies inside the unsorted remainder until a node repeats."""
    start = min(remaining)
    path: list[int] = []
    pos: dict[int, int] = {}
    cur = start
    while cur not in pos:
        pos[cur] = len(path)
        path.append(cur)
        cur = min(d for d in deps[cur] if d in remaining)
    return sorted(path[pos[cur]:])
