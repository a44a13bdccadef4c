"""Fusion passes: chains of ONNX nodes rewritten into one node whose kernel does the
later steps in place on the first step's fresh output, saving a pass over memory and
an allocation per fused node (kernels in the "hetero_exec" domain, kernels/fused.py).

One module per family, run in this order by `fuse`:

* layout: Transpose/Reshape chains that cancel; Identity, inference Dropout and no-op
  Casts dropped (so the chains below see through them);
* conv: BatchNormalization folded into Conv;
* gelu: the erf and tanh GELU chains;
* conv: Conv [+ residual Add] [+ activation (GELU included)];
* norm: LayerNorm and RMSNorm written out as primitives;
* rotary: Llama's rotate_half rotary embedding;
* attention: MatMul-[scale]-[Where]-[Add mask]-Softmax-MatMul;
* qdq: MatMul of two DequantizeLinear (a QDQ model's product) -> MatMulIntegerToFloat;
* integer: MatMulInteger -> Cast -> Mul(scale) [-> Add(bias)] (a quantize_dynamic
  model's product) -> MatMulIntegerToFloat;
* matmul: MatMul + bias [+ activation], Gemm [+ activation].

A chain is fused only when each intermediate value has the next node as its only
reader (subgraph captures included) and is no graph output; constants must be
initializers the caller cannot override (or Constants). The fused node keeps the first
node's id and name and takes the last node's place in the order (so the order stays
topological). Results change by float rounding only.

`fuse` runs on a whole graph and its control-flow bodies (the cpu provider's pass,
SEMANTICS.md 1.4) or on one
segment of a placed plan (`Region`): then only the segment's nodes change, values read
by other segments are kept, and each fused node must be one the segment's provider runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from hetero_exec.ir.graph import Graph
from hetero_exec.kernels.fused import FUSED_DOMAIN
from hetero_exec.placement.fusions.attention import fuse_attention
from hetero_exec.placement.fusions.conv import fold_batchnorm, fuse_conv
from hetero_exec.placement.fusions.float16 import float16_in_float32
from hetero_exec.placement.fusions.gelu import fuse_gelu
from hetero_exec.placement.fusions.integer import fuse_integer_scale
from hetero_exec.placement.fusions.layout import cancel_layout
from hetero_exec.placement.fusions.matmul import fuse_matmul
from hetero_exec.placement.fusions.norm import fuse_norms
from hetero_exec.placement.fusions.qdq import fuse_qdq
from hetero_exec.placement.fusions.rewriter import Region, domain_used, fused_identities
from hetero_exec.placement.fusions.rotary import fuse_rotary

log = logging.getLogger(__name__)

Fusion = Callable[[Graph, "Region | None"], "Graph | None"]

#: in order: layout first (it exposes the others' chains); the BatchNormalization fold
#: must see plain Convs; gelu before conv and matmul (its FusedGelu becomes their
#: activation); rotary before attention (Q and K come out of it); matmul last
#: (attention's MatMuls are not bias products), qdq just before it (its MatMuls are
#: integer products, not float ones)
FUSIONS: tuple[Fusion, ...] = (
    cancel_layout, fold_batchnorm, fuse_gelu, fuse_conv, fuse_norms, fuse_rotary,
    fuse_attention, fuse_qdq, fuse_integer_scale, fuse_matmul)


def fuse(graph: Graph, region: Region | None = None) -> Graph | None:
    """Every fusion of `FUSIONS` over ``graph`` (in place); None when nothing changed.

    A fusion that fails is undone and skipped (the reason logged); the others' work
    stays.
    """
    changed = False
    for fn in FUSIONS:
        saved = _snapshot(graph, region)
        try:
            if fn(graph, region) is not None:
                changed = True
        except Exception:  # a matcher that trips on an odd graph must not cost the others
            _restore(graph, region, saved)
            log.warning("fusion %s failed and was skipped; the other fusions still apply",
                        fn.__name__, exc_info=True)
    if region is None:  # control-flow bodies too (a segment's bodies are placed on their own)
        for node in graph.nodes:
            for body in node.subgraphs.values():
                changed = fuse(body) is not None or changed
    return graph if changed else None


def fuse_cpu(graph: Graph) -> Graph | None:
    """The cpu provider's pass (placement/passes.py): a float16 graph's float32 chains
    kept in float32 (`float16.py`), then `fuse` over the whole graph."""
    halves = float16_in_float32(graph) is not None
    fused = fuse(graph)
    return graph if halves or fused is not None else None


def _snapshot(graph: Graph, region: Region | None) -> tuple:
    return (list(graph.nodes), dict(graph.initializers), dict(graph.values), dict(graph.opsets),
            [(n, list(n.inputs)) for n in graph.nodes],
            None if region is None else list(region.nodes))


def _restore(graph: Graph, region: Region | None, saved: tuple) -> None:
    nodes, inits, values, opsets, inputs, region_nodes = saved
    graph.nodes = nodes
    graph.initializers.clear()
    graph.initializers.update(inits)
    graph.values.clear()
    graph.values.update(values)
    graph.opsets.clear()
    graph.opsets.update(opsets)
    for node, ins in inputs:
        node.inputs = ins
    if region is not None:
        region.nodes = region_nodes
    graph.reindex()


__all__ = ["FUSED_DOMAIN", "FUSIONS", "Region", "fuse", "fuse_cpu", "fused_identities",
           "domain_used", "cancel_layout", "fold_batchnorm", "fuse_conv", "fuse_norms",
           "fuse_gelu", "fuse_rotary", "fuse_attention", "fuse_qdq", "fuse_matmul"]
