"""optimized_model_filepath: the model as this session runs it, written as ONNX.

That is the build's graph (after the provider's passes, i.e. fusions, unless
``optimize`` is off) with constant subgraphs folded into initializers (unless
``fold_constants`` is off), folded as the run plan folds them. It loads back into
hetero_exec; fused nodes are in the ``hetero_exec`` domain, which only we run.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import onnx

from hetero_exec.errors import OptionError
from hetero_exec.ir.export import graph_proto, model_proto, reads
from hetero_exec.ir.graph import Graph, Node

log = logging.getLogger(__name__)


def optimized_model(model: onnx.ModelProto, graph: Graph, fold: bool) -> onnx.ModelProto:
    nodes: list[Node] = list(graph.nodes)
    weights = dict(graph.initializers)
    folded = _folded(graph) if fold else None
    if folded is not None:
        nodes, weights = folded
    wanted = reads(nodes) | set(graph.outputs) | set(graph.inputs)
    weights = {n: a for n, a in weights.items() if n in wanted}
    gp = graph_proto(graph, nodes, weights, doc_string=model.graph.doc_string)
    return model_proto(model, gp, graph.opsets)


def _folded(graph: Graph) -> tuple[list[Node], dict[str, np.ndarray]] | None:
    """The nodes left after folding and every value they read that folding made constant."""
    from hetero_exec.exec.plan import Compiler

    try:
        plan = Compiler(fold_constants=True).compile_graph(graph)
    except Exception as e:  # an op that compiles only later (symbolic shapes): write it unfolded
        log.debug("optimized model written unfolded: %s", e)
        return None
    nodes = [s.node for s in plan.steps]
    fed = set(graph.inputs) - set(graph.initializers)
    weights: dict[str, np.ndarray] = {}
    for name in (reads(nodes) | set(graph.outputs)) - fed:
        slot = plan.slot_of.get(name)
        value = plan.template[slot] if slot is not None else None
        if value is None:
            continue
        if not isinstance(value, (np.ndarray, np.generic)):
            return None  # a folded sequence or map has no initializer form: keep the nodes
        weights[name] = np.asarray(value)
    for name in graph.inputs:  # overridable initializers stay as they are
        if name in graph.initializers:
            weights[name] = graph.initializers[name]
    return nodes, weights


def write_optimized_model(path: str, model: onnx.ModelProto, graph: Graph, fold: bool) -> str:
    out = optimized_model(model, graph, fold)
    try:
        onnx.save(out, path)
    except OSError as e:
        raise OptionError(f"optimized_model_filepath {path!r}: cannot write: {e}") from None
    log.info("optimized model written to %s (%d nodes, was %d)", path, len(out.graph.node),
             len(model.graph.node))
    return os.path.abspath(path)
