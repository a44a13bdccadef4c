"""Shape arithmetic stays on the host, inside device segments.

In a device segment, Shape/Size and the small integer computations that only feed
host inputs (shape, axes, pads, starts...) of device kernels run on the host with
NumPy, as onnxruntime's CPU-preferred nodes do, but without splitting the segment:
no seam, no copy back and forth. Their outputs are converted to the device only where
a device kernel reads them as data.
"""

from __future__ import annotations

from typing import Sequence

from hetero_exec.ir.graph import Graph, Node
from hetero_exec.kernels.registry import lookup

#: ops whose output is metadata of their input: they read .shape only, never the data
METADATA_OPS = frozenset({"Shape", "Size"})
#: integer outputs at most this large count as shape arithmetic
HOST_VALUE_MAX_BYTES = 4096


def small_int(graph: Graph, name: str) -> bool:
    v = graph.value(name)
    if v.kind != "tensor" or v.dtype is None or v.dtype.kind not in "iub":
        return False
    n = v.nbytes()
    if n is not None:
        return n <= HOST_VALUE_MAX_BYTES
    return v.shape is not None and len(v.shape) <= 1  # a shape vector of unknown length


def host_step_nodes(graph: Graph, nodes: Sequence[Node]) -> set[Node]:
    """The nodes of a device segment that run on the host."""
    members = set(nodes)
    outputs = set(graph.outputs)
    host: set[Node] = set()
    for node in reversed(nodes):  # consumers are decided before their producers
        if node.op_type in METADATA_OPS:
            host.add(node)
            continue
        outs = [o for o in node.outputs if o]
        if node.subgraphs or not outs or any(o in outputs or not small_int(graph, o) for o in outs):
            continue
        used = False
        ok = True
        for o in outs:
            for consumer in graph.consumers.get(o, []):
                used = True
                if consumer not in members or consumer in host:
                    continue  # another segment, or a host step: a host value is what it wants
                if o not in consumer.inputs:  # a body reads it (a capture): as data, maybe
                    ok = False
                    break
                kdef = lookup(consumer.domain, consumer.op_type, graph.opset(consumer.domain))
                host_pos = kdef.host_inputs if kdef else frozenset()
                if not all(i in host_pos for i, n in enumerate(consumer.inputs) if n == o):
                    ok = False
                    break
            if not ok:
                break
        if ok and used:
            host.add(node)
    return host
