"""Multi-GPU pipeline stages: a per-node cost model and three split strategies.

* ``greedy``: walk the order, fill each device to an equal share of the total cost;
* ``balanced``: dynamic programming over the order, minimising the slowest stage
  (its compute plus the seam transfer into it);
* ``memory``: fill each device up to its ``mem_limit`` (weights + activations).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np

from hetero_exec.errors import MemoryAdmissionError
from hetero_exec.ir.graph import Graph, Node, node_reads
from hetero_exec.placement.sizes import (
    cost_bounds,
    nodes_need,
    resolve_shape,
    value_bytes,
)
from hetero_exec.providers.base import Provider

log = logging.getLogger(__name__)

STRATEGIES = ("greedy", "balanced", "memory")


@dataclass
class CostModel:
    """seconds = flops / flops_per_s + bytes / bytes_per_s + per_node_s; seams cost
    bytes / link_bytes_per_s + link_latency_s. Defaults are a nominal GPU; `calibrate`
    fits them to a short profile."""

    flops_per_s: float = 2e12
    bytes_per_s: float = 5e11
    per_node_s: float = 10e-6
    link_bytes_per_s: float = 1.2e10
    link_latency_s: float = 20e-6
    #: the host threads ``flops_per_s`` was measured with (large products split over
    #: them); None: a device's rate, which host threads do not change
    threads: int | None = None
    #: the same host measured at one thread, when it was: a segment's cost at both
    #: thread counts gives the part of it that more threads shorten (`annotate_costs`)
    single: "CostModel | None" = None

    def node_seconds(self, flops: float, nbytes: float) -> float:
        return flops / self.flops_per_s + nbytes / self.bytes_per_s + self.per_node_s

    def product_seconds(self, flops: float) -> float:
        """The part of `node_seconds` that more host threads make shorter."""
        return flops / self.flops_per_s if self.threads else 0.0

    def seam_seconds(self, nbytes: float) -> float:
        return nbytes / self.link_bytes_per_s + self.link_latency_s if nbytes else 0.0

    @classmethod
    def calibrate(cls, graph: Graph, samples: Sequence[tuple[float, float, float]],
                  threads: int | None = None) -> "CostModel":
        """Fit (flops, bytes, seconds) samples by non-negative least squares.

        When the joint fit drops the FLOP term (a profile of many memory-bound nodes and a
        few products explains them with bytes and a per-node cost), the products are fit
        apart: bytes and the per-node cost from the nodes that move more bytes than they
        compute, then the FLOP rate from what that leaves of the products' times."""
        if not samples:
            return cls()
        a = np.array([[f, b, 1.0] for f, b, _ in samples], dtype=np.float64)
        y = np.array([s for _, _, s in samples], dtype=np.float64)
        coef = _nonnegative_lstsq(a, y)
        intense = a[:, 0] > 4 * a[:, 1]
        if coef[0] <= 0 and intense.any() and (~intense).sum() >= 2:
            rest = _nonnegative_lstsq(a[~intense][:, 1:], y[~intense])
            left = y[intense] - a[intense][:, 1:] @ rest
            flops = a[intense][:, 0]
            coef = np.array([max(0.0, float(left @ flops) / float(flops @ flops)), *rest])
        default = cls()
        return cls(flops_per_s=float(1.0 / coef[0]) if coef[0] > 0 else default.flops_per_s,
                   bytes_per_s=float(1.0 / coef[1]) if coef[1] > 0 else default.bytes_per_s,
                   per_node_s=float(coef[2]), threads=threads)


_HOST_MODEL: CostModel | None = None


def host_cost_model() -> CostModel:
    """A CostModel for kernels that run on this host's CPU (the cpu provider, and
    sim-gpu, which emulates a GPU over NumPy): its GEMM rate, memory bandwidth and
    per-op overhead, probed once per process (about 30 ms).

    >>> m = host_cost_model(); m.flops_per_s > 1e8 and m.per_node_s > 0
    True
    """
    global _HOST_MODEL
    if _HOST_MODEL is None:
        _HOST_MODEL = _probe_host()
        log.info("host cost model: %.1f GFLOP/s, %.1f GB/s, %.1f us per node",
                 _HOST_MODEL.flops_per_s / 1e9, _HOST_MODEL.bytes_per_s / 1e9,
                 _HOST_MODEL.per_node_s * 1e6)
    return _HOST_MODEL


def _probe_host() -> CostModel:
    """Time what a run does: a product inside a run alone (the BLAS at the run's width:
    kernels/_threads.py), an element-wise pass, and a tiny op."""
    import time

    from hetero_exec.kernels._threads import intra_op_threads, run_threads, split_width

    def best(fn, reps: int) -> float:
        fn()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    rng = np.random.default_rng(0)
    a = rng.standard_normal((256, 512)).astype(np.float32)
    b = rng.standard_normal((512, 512)).astype(np.float32)
    with run_threads():
        gemm = best(lambda: a @ b, 5)
    width = split_width()
    gemm1 = gemm
    if width > 1:
        with intra_op_threads(1), run_threads():
            gemm1 = best(lambda: a @ b, 5)
    x = np.ones(1 << 18, np.float32)
    stream = best(lambda: np.tanh(x) * x, 5)  # reads 2, writes 2: a kernel's passes
    tiny = np.ones(4, np.float32)
    per_op = best(lambda: [np.add(tiny, tiny) for _ in range(100)], 3) / 100
    flops = 2 * 256 * 512 * 512
    model = CostModel(flops_per_s=flops / gemm, bytes_per_s=4 * x.nbytes / stream,
                      # our run loop and the kernel's Python around the ufunc
                      per_node_s=per_op + 3e-6, link_bytes_per_s=4 * x.nbytes / stream,
                      link_latency_s=0.0, threads=width)
    if width > 1:
        model.single = replace(model, flops_per_s=flops / gemm1, threads=1)
    return model


def provider_cost_model(provider: Provider, given: CostModel | None = None) -> CostModel:
    """The model a provider's nodes are costed with: ``given`` (calibrated) when there is
    one, else the host's for cpu and sim-gpu, else the nominal GPU."""
    if given is not None:
        return given
    return CostModel() if provider.kind == "gpu" else host_cost_model()


def _nonnegative_lstsq(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with the negative coefficients dropped (refit without them)."""
    scale = np.maximum(np.abs(a).max(axis=0), 1e-30)
    active = list(range(a.shape[1]))
    coef = np.zeros(a.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active] / scale[active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol / scale[active]
            break
        active = [c for c, v in zip(active, sol) if v >= 0]
    return coef


def calibrate(session: Any, feed: dict[str, Any], runs: int = 3) -> CostModel:
    """Fit a CostModel to a short profile: every node of ``session``'s segments timed
    on ``feed`` (its actual shapes give each node's FLOPs and bytes)."""
    from hetero_exec.exec.chain import move_value
    from hetero_exec.exec.profiling import timed_execute
    from hetero_exec.kernels._threads import intra_op_threads, run_threads, split_width

    graph = session._build.graph
    bounds = _symbols_from(graph, {k: tuple(np.shape(v)) for k, v in feed.items()})

    def fit(threads: int | None) -> CostModel:
        best: dict[Any, float] = {}
        with intra_op_threads(threads), run_threads():  # as a run at that width does
            width = split_width()
            for _ in range(runs):
                env, where = dict(feed), {}
                for cs in session._executor.segments:
                    prov = cs.provider
                    args = [move_value(env.get(n), where.get(n), prov) if where.get(n) is not prov
                            else env.get(n) for n, _ in cs.plan.input_slots]
                    outs, timings = timed_execute(cs.plan, args)
                    env.update(zip(cs.plan.output_names, outs))
                    where.update((n, prov) for n in cs.plan.output_names)
                    for node, sec in timings:
                        best[node] = min(best.get(node, sec), sec)
        samples = []
        for node, sec in best.items():
            nbytes = sum(value_bytes(graph, n, bounds) for n in node.inputs + node.outputs if n)
            samples.append((node_flops(graph, node, bounds), float(nbytes), sec))
        return CostModel.calibrate(graph, samples, threads=width)

    model = fit(None)
    if model.threads and model.threads > 1:  # and at one thread, for stages on fewer cores
        model.single = fit(1)
    return model


def _symbols_from(graph: Graph, shapes: dict[str, tuple[int, ...]]) -> dict[str, int]:
    bounds: dict[str, int] = {}
    for name, shape in shapes.items():
        for d, n in zip(graph.value(name).shape or (), shape):
            if isinstance(d, str):
                bounds[d] = int(n)
    return bounds


#: products, fused ones (kernels/fused.py, conv.py, attention.py) as their unfused op
_PRODUCTS = {"MatMul": "MatMul", "FusedMatMul": "MatMul", "Gemm": "Gemm",
             "MatMulInteger": "MatMul", "QLinearMatMul": "MatMul", "Conv": "Conv",
             "FusedConv": "Conv", "ConvTranspose": "ConvTranspose", "ConvInteger": "Conv",
             "QLinearConv": "Conv", "Attention": "Attention", "FusedAttention": "Attention"}


def node_flops(graph: Graph, node: Node, bounds: dict[str, int]) -> float:
    """A rough FLOP count: GEMM-like ops (fused ones too) from their shapes, others per
    output element."""
    outs = [resolve_shape(graph, o, bounds) for o in node.outputs if o]
    out_elems = sum(math.prod(s) for s in outs if s is not None)
    ins = [resolve_shape(graph, i, bounds) if i else None for i in node.inputs]
    op = _PRODUCTS.get(node.op_type, node.op_type)
    if op in ("MatMul", "Gemm") and ins and ins[0]:
        k = ins[0][-1] if op != "Gemm" or not _attr_int(node, "transA") else ins[0][0]
        return 2.0 * out_elems * k
    if op in ("Conv", "ConvTranspose") and len(ins) > 1 and ins[1]:
        w = ins[1]
        group = _attr_int(node, "group") or 1
        per_out = math.prod(w[1:]) if op != "ConvTranspose" else w[0] * math.prod(w[2:]) / group
        return 2.0 * out_elems * per_out
    if op == "Attention" and ins and ins[0]:
        q = ins[0]
        if node.op_type == "FusedAttention" and len(ins) > 1 and ins[1]:
            keys = ins[1][-1] if _attr_int(node, "k_transposed") else ins[1][-2]
            return 4.0 * out_elems * keys  # Q K^T and the weights times V
        return 4.0 * out_elems * (q[-2] if len(q) > 1 else 1)
    return float(out_elems)


def _attr_int(node: Node, name: str) -> int:
    a = node.attrs.get(name)
    return int(a.i) if a is not None else 0


def node_cost(graph: Graph, node: Node, bounds: dict[str, int], model: CostModel) -> float:
    nbytes = sum(value_bytes(graph, n, bounds) for n in node.inputs + node.outputs if n)
    return model.node_seconds(node_flops(graph, node, bounds), nbytes)


def split_devices(graph: Graph, order: Sequence[Node], assign: dict[Node, Provider],
                  devices: Sequence[Provider], strategy: str, bounds: dict[str, int],
                  pinned: set[Node], cost_model: CostModel | None = None) -> None:
    """Reassign the device-eligible nodes of ``order`` to ``devices`` as pipeline stages."""
    if strategy not in STRATEGIES:
        from hetero_exec.errors import PlacementError

        raise PlacementError(f"unknown multi-GPU strategy {strategy!r}; use one of {STRATEGIES}")
    model = provider_cost_model(devices[0], cost_model)
    dev_nodes = [n for n in order if assign[n].is_device and n not in pinned]
    if not dev_nodes:
        return
    costs = [node_cost(graph, n, bounds, model) for n in dev_nodes]
    k = len(devices)
    if strategy == "greedy":
        cuts = _greedy_cuts(costs, k)
    elif strategy == "balanced":
        cuts = _balanced_cuts(graph, dev_nodes, costs, k, bounds, model)
    else:
        cuts = _memory_cuts(graph, dev_nodes, devices, bounds)
    for stage, (lo, hi) in enumerate(zip([0] + cuts, cuts + [len(dev_nodes)])):
        for n in dev_nodes[lo:hi]:
            assign[n] = devices[stage]


def _greedy_cuts(costs: Sequence[float], k: int) -> list[int]:
    share = sum(costs) / k
    cuts: list[int] = []
    acc = 0.0
    for i, c in enumerate(costs):
        acc += c
        if len(cuts) < k - 1 and acc >= share * (len(cuts) + 1) and i + 1 < len(costs):
            cuts.append(i + 1)
    return cuts


def _balanced_cuts(graph: Graph, nodes: Sequence[Node], costs: Sequence[float], k: int,
                   bounds: dict[str, int], model: CostModel) -> list[int]:
    """DP: best[j][i] = the minimal slowest stage covering nodes[:i] with j stages."""
    n = len(nodes)
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
    # transfer into a stage starting at i: bytes of values produced before i, read at/after i
    produced_at = {}
    for idx, node in enumerate(nodes):
        for o in node.outputs:
            if o:
                produced_at[o] = idx
    last_read: dict[str, int] = {}
    for idx, node in enumerate(nodes):
        for i in node.inputs:
            if i in produced_at:
                last_read[i] = max(last_read.get(i, -1), idx)
    cut_bytes = np.zeros(n + 1)
    for name, p in produced_at.items():
        r = last_read.get(name, -1)
        if r > p:
            cut_bytes[p + 1:r + 1] += value_bytes(graph, name, bounds)
    seam = np.array([model.seam_seconds(b) for b in cut_bytes])
    inf = float("inf")
    best = np.full((k + 1, n + 1), inf)
    arg = np.zeros((k + 1, n + 1), dtype=np.int64)
    best[0][0] = 0.0
    for j in range(1, k + 1):
        for i in range(1, n + 1):
            for s in range(j - 1, i):
                stage = prefix[i] - prefix[s] + (seam[s] if s > 0 else 0.0)
                val = max(best[j - 1][s], stage)
                if val < best[j][i]:
                    best[j][i], arg[j][i] = val, s
    j = min(k, n)
    cuts = []
    i = n
    while j > 1:
        i = int(arg[j][i])
        cuts.append(i)
        j -= 1
    return sorted(c for c in cuts if 0 < c < n)


def _memory_cuts(graph: Graph, nodes: Sequence[Node], devices: Sequence[Provider],
                 bounds: dict[str, int]) -> list[int]:
    """Fill each device in order while the stage's need, computed as admission computes
    it (weights + peak live activations + workspaces), fits its mem_limit."""
    cuts: list[int] = []
    dev, start = 0, 0
    for i, node in enumerate(nodes):
        limit = devices[dev].mem_limit
        if limit is None or _stage_need(graph, nodes[start:i + 1], bounds) <= limit:
            continue
        if i == start or dev + 1 >= len(devices):
            need = _stage_need(graph, nodes[start:i + 1], bounds)
            raise MemoryAdmissionError(f"stage of {node.identity}", devices[dev].name, need,
                                       limit, "memory strategy: no device left")
        cuts.append(i)
        dev, start = dev + 1, i
        limit = devices[dev].mem_limit
        need = _stage_need(graph, nodes[i:i + 1], bounds)
        if limit is not None and need > limit:
            raise MemoryAdmissionError(f"stage of {node.identity}", devices[dev].name, need, limit,
                                       "memory strategy: one node does not fit a device")
    return cuts


def _stage_need(graph: Graph, stage: Sequence[Node], bounds: dict[str, int]) -> int:
    members = set(stage)
    produced = {o for n in stage for o in n.outputs if o}
    inputs = list(dict.fromkeys(r for n in stage for r in node_reads(n) if r not in produced))
    outputs = [o for o in produced if o in graph.outputs
               or any(c not in members for c in graph.consumers.get(o, []))]
    weights, peak = nodes_need(graph, list(stage), inputs, outputs, bounds)
    return weights + peak


def _threaded_part(graph: Graph, nodes: Sequence[Node], bounds: dict[str, int],
                   model: CostModel, cost: float) -> float:
    """The seconds of ``cost`` (at ``model.threads``) that more threads shorten.

    With the host measured at one thread too (``model.single``), Amdahl's law through
    both: t(1) = s + p and t(w) = s + p/w give p/w, whatever the kernels split (products,
    our pool's blocks) and however well; else the products' seconds, as if they split
    perfectly."""
    w, single = model.threads, model.single
    if not w:
        return 0.0
    if single is None or w <= 1:
        return sum(model.product_seconds(node_flops(graph, n, bounds)) for n in nodes)
    one = sum(node_cost(graph, n, bounds, single) for n in nodes)
    return min(cost, max(0.0, (one - cost) / (w - 1)))


def annotate_costs(plan: Any, bounds: dict[str, int], cost_model: CostModel | None = None) -> None:
    """Each segment's predicted seconds: ``compute_cost`` (its nodes, on its provider's
    model) and ``predicted_cost`` (plus the seams it reads over the link model)."""
    graph = plan.graph
    for s in plan.seams:
        if s.nbytes is None and resolve_shape(graph, s.value, bounds) is not None:
            s.nbytes = value_bytes(graph, s.value, bounds)
    estimate = cost_bounds(graph, bounds)
    seam_bytes = {s.value: value_bytes(graph, s.value, estimate) for s in plan.seams}
    for seg in plan.segments:
        model = provider_cost_model(seg.provider, cost_model)
        seg.compute_cost = sum(node_cost(graph, n, estimate, model) for n in seg.nodes)
        seg.product_cost = _threaded_part(graph, seg.nodes, estimate, model, seg.compute_cost)
        seg.cost_threads = model.threads
        transfer = sum(model.seam_seconds(seam_bytes.get(i, 0)) for i in seg.inputs if i in seam_bytes)
        seg.predicted_cost = seg.compute_cost + transfer
