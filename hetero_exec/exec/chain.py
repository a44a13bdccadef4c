"""A run of compiled segments in one process: each on its provider's arrays, values
moved between providers at their seams (a host/device copy, never a Ray hop).

This is what a pipeline stage runs inside its actor: the segments of one device and
the cpu segments beside them, one request at a time.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Sequence

from hetero_exec.exec.bound import ShapeBoundPlans
from hetero_exec.exec.plan import RunPlan
from hetero_exec.kernels._threads import intra_op_threads, run_threads
from hetero_exec.kernels.registry import has_op
from hetero_exec.providers.base import Provider

#: called after each segment run: (segment index in the chain, start and end in ns)
OnRun = Callable[[int, int, int], None]

#: ops whose kernels call the BLAS; a node of any other op with no kernel of its own (a
#: function body, a custom domain) counts as one too
BLAS_OPS = frozenset({
    "MatMul", "Gemm", "Conv", "ConvTranspose", "ConvInteger", "MatMulInteger", "QLinearConv",
    "QLinearMatMul", "Einsum", "LSTM", "GRU", "RNN", "Attention", "DeformConv", "FusedMatMul",
    "FusedConv", "FusedAttention", "FlexAttention", "LinearAttention", "MultiHeadAttention"})


def calls_blas(nodes) -> bool:
    """Whether running ``nodes`` (bodies included) may call the BLAS: holding it at one
    thread costs microseconds a run, so only runs that call it pay them."""
    for node in nodes:
        if node.op_type in BLAS_OPS or not has_op(node.domain, node.op_type):
            return True
        if any(calls_blas(sub.nodes) for sub in node.subgraphs.values()):
            return True
    return False


def move_value(v: Any, src: Any, dst: Any) -> Any:
    """A value held by provider ``src`` (None: the host) made ready for ``dst``
    (None: the host): device values come to the host, then go to a device."""
    if v is None:
        return v
    direct = getattr(dst, "receive_from", None) if src is not None and src is not dst else None
    moved = direct(v, src) if direct is not None else None
    if moved is not None:  # device to device (GPU peers, providers/gpu.py): no host staging
        return moved
    if src is not None and src.is_device:
        v = src.to_host(v)
    if dst is not None and dst.is_device:
        v = dst.to_device(v)
    return v


def folded_seams(provider: Provider, plan: RunPlan) -> dict[str, Any]:
    """The outputs of ``plan`` that are the same on every run (a Transpose of a weight
    pinned to cpu, folded there), as host values. A later segment compiles them as
    constants (`Compiler.compile`'s ``known``): moved to its provider once, at build,
    rather than across the seam on every run (gpt2's tied LM head: 8.4 MB a run), and
    constants its kernels can specialise on (a packed weight)."""
    return {name: provider.to_host(v) if provider.is_device else v
            for name, v in plan.constant_outputs.items()}


class SegmentChain:
    """``(provider, RunPlan)`` pairs, run in order.

    >>> import numpy as np, onnx.helper as h
    >>> from hetero_exec.ir import load
    >>> from hetero_exec.exec.plan import Compiler
    >>> from hetero_exec.providers import parse_provider
    >>> g = h.make_graph([h.make_node("Relu", ["x"], ["a"]), h.make_node("Neg", ["a"], ["y"])],
    ...     "g", [h.make_tensor_value_info("x", 1, [2])], [h.make_tensor_value_info("y", 1, [2])])
    >>> _, graph = load(h.make_model(g))
    >>> dev, cpu = parse_provider("sim-gpu"), parse_provider("cpu")
    >>> parts = [(dev, Compiler.for_provider(dev).compile(graph, graph.nodes[:1], ["x"], ["a"])),
    ...          (cpu, Compiler.for_provider(cpu).compile(graph, graph.nodes[1:], ["a"], ["y"]))]
    >>> SegmentChain(parts).run({"x": np.array([-1.0, 2.0], np.float32)}, ["y"])
    [array([-0., -2.], dtype=float32)]
    """

    def __init__(self, parts: Sequence[tuple[Provider, RunPlan]], threads: int | None = None,
                 blas: bool = True):
        self.parts = list(parts)
        # each plan bound to the input shapes that repeat (exec/bound.py), as in process
        self.bound = [ShapeBoundPlans(plan) for _, plan in self.parts]
        self.threads = threads  # what a run splits its work over (None: the cores)
        self.blas = blas  # whether its plans call the BLAS (`calls_blas`)

    def run(self, feeds: Mapping[str, Any], outputs: Sequence[str],
            on_run: OnRun | None = None, threads: int | None = None) -> list[Any]:
        """``outputs`` as host values, from ``feeds`` (host values, by name); ``threads``
        overrides the chain's own split width for this run."""
        with intra_op_threads(threads or self.threads):
            if not self.blas:
                return self.run_inside(feeds, outputs, on_run)
            with run_threads():  # the BLAS's width, or held when runs overlap (_threads)
                return self.run_inside(feeds, outputs, on_run)

    def run_inside(self, feeds: Mapping[str, Any], outputs: Sequence[str],
                   on_run: OnRun | None = None) -> list[Any]:
        """`run` for a caller already inside a run (a control-flow body's segments)."""
        env = {k: v for k, v in feeds.items() if v is not None}
        where: dict[str, Provider] = {}  # provider holding each value (absent: the host)
        for k, (prov, plan) in enumerate(self.parts):
            args = []
            for name, _slot in plan.input_slots:
                v = env.get(name)
                if v is not None and where.get(name) is not prov:
                    v = move_value(v, where.get(name), prov)
                args.append(v)
            t0 = time.time_ns()
            outs = self.bound[k].run(args)
            if on_run is not None:
                on_run(k, t0, time.time_ns())
            for name, v in zip(plan.output_names, outs):
                env[name] = v
                where[name] = prov
        return [move_value(env.get(n), where.get(n), None) for n in outputs]
