"""In-process execution: segments run in order, each on its provider's arrays,
with explicit copies at seams (counted, and shown in the placement report)."""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from typing import Any, Mapping, Sequence

from hetero_exec.exec.bound import ShapeBoundPlans
from hetero_exec.exec.chain import calls_blas, folded_seams, move_value
from hetero_exec.exec.executor import execute
from hetero_exec.exec.feeds import FeedChecker
from hetero_exec.exec.plan import Compiler, RunPlan
from hetero_exec.ir.graph import Graph
from hetero_exec.kernels._threads import run_threads

BIND_SHAPES = os.environ.get("HETERO_EXEC_BIND_SHAPES", "1").lower() not in ("0", "false", "off")


class CompiledSegment:
    def __init__(self, graph: Graph, segment, fold_constants: bool = True, providers=None,
                 profiled: bool = False, folded: dict[str, Any] | None = None):
        """``folded``: seams earlier segments folded (`folded_seams`); those this segment
        reads become its constants, and its own are added."""
        prov = segment.provider
        self.segment = segment
        self.provider = prov
        placer = None
        if providers is not None and len(providers) > 1:
            from hetero_exec.exec.placed_body import make_body_placer

            placer = make_body_placer(providers, fold_constants)
        compiler = Compiler.for_provider(prov, fold_constants, placer)
        if profiled:  # a profile times every node: no merged element-wise runs
            compiler.merge_elementwise = False
        folded = {} if folded is None else folded
        self.plan: RunPlan = compiler.compile(
            graph, segment.nodes, segment.inputs, segment.outputs,
            known={n: folded[n] for n in segment.inputs if n in folded})
        folded.update(folded_seams(prov, self.plan))
        #: the plan bound to each input-shape signature that repeats (exec/bound.py)
        # (HETERO_EXEC_BIND_SHAPES=0: every run on the compiled plan, for A/B runs)
        self.bound = ShapeBoundPlans(self.plan) if not profiled and BIND_SHAPES else None
        self.runs = 0
        self.seconds = 0.0
        self._lock = threading.Lock()

    def record(self, seconds: float) -> None:
        with self._lock:
            self.runs += 1
            self.seconds += seconds


class LocalExecutor:
    """Runs a PlacementPlan's segments in one process. Thread-safe."""

    def __init__(self, graph: Graph, build, options):
        self.graph = graph
        self.build = build
        self.checker = FeedChecker(graph)
        # a heterogeneous session places control-flow bodies with the same rules
        ranked = build.all_providers if len(build.placement.segments) > 1 else None
        folded: dict[str, Any] = {}
        self.segments = [CompiledSegment(graph, s, options.fold_constants, ranked,
                                         bool(options.enable_profiling), folded)
                         for s in build.placement.segments]
        self.copies = 0
        self.copy_bytes = 0
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.trace = None
        if options.enable_profiling:
            from hetero_exec.exec.profiling import ChromeTrace

            self.trace = ChromeTrace(options.profile_file_prefix)
        single = (len(self.segments) == 1 and not self.segments[0].provider.is_device
                  and self.trace is None)
        self._single = self.segments[0] if single else None
        # graph-input positions of the first plan's inputs (single-provider and IO-binding runs)
        pos = {n: i for i, n in enumerate(graph.inputs)}
        self._feed_pos = [pos.get(n) for n, _ in self.segments[0].plan.input_slots]
        # holding the BLAS costs microseconds a run: only plans that call it pay them
        self._blas = any(calls_blas(s.nodes) for s in build.placement.segments)

    def run(self, names: Sequence[str], feed: Mapping[str, Any], on_device: bool = False) -> list[Any]:
        """``on_device``: feeds already live on the (single) provider's device and
        outputs stay there (IO binding)."""
        if not self._blas:
            return self._run(names, feed, on_device)
        with run_threads():  # the BLAS's width alone, held when runs overlap (kernels/_threads)
            return self._run(names, feed, on_device)

    def _run(self, names: Sequence[str], feed: Mapping[str, Any], on_device: bool) -> list[Any]:
        ordered, _symbols = self.checker.check(feed)
        if on_device or self._single is not None:
            seg = self.segments[0]
            args = [ordered[i] if i is not None else None for i in self._feed_pos]
            outs = seg.bound.run(args) if seg.bound is not None else execute(seg.plan, args)
            by_name = dict(zip(seg.plan.output_names, outs))
            return [by_name[n] for n in names]
        return self._run_segments(names, dict(zip(self.graph.inputs, ordered)))

    def _run_segments(self, names: Sequence[str], env: dict[str, Any]) -> list[Any]:
        env = {k: v for k, v in env.items() if v is not None}
        where: dict[str, Any] = {k: None for k in env}  # provider holding each value (None: host)
        for seg in self.segments:
            prov = seg.provider
            args = []
            for name, _slot in seg.plan.input_slots:
                v = env.get(name)
                if v is not None and where.get(name) is not prov:
                    v = self._move(v, where.get(name), prov)
                args.append(v)
            t0 = time.perf_counter()
            if self.trace is not None:
                outs = self._traced(seg, args, t0)
            else:
                outs = seg.bound.run(args) if seg.bound is not None else execute(seg.plan, args)
            seg.record(time.perf_counter() - t0)
            for name, v in zip(seg.plan.output_names, outs):
                env[name] = v
                where[name] = prov
        return [move_value(env[n], where.get(n), None) for n in names]

    def _traced(self, seg: CompiledSegment, args: list[Any], t0: float) -> list[Any]:
        from hetero_exec.exec.profiling import timed_execute

        lane = f"{seg.segment.name} ({seg.provider.name})"
        outs, timings = timed_execute(seg.plan, args)
        t = t0
        for node, sec in timings:
            self.trace.span(node.op_type, lane, t, t + sec, node=node.identity)
            t += sec
        self.trace.span(seg.segment.name, lane, t0, time.perf_counter(), kind="segment")
        return outs

    def _move(self, v: Any, src, dst) -> Any:
        t0 = time.perf_counter()
        nbytes = int(getattr(v, "nbytes", 0) or 0)
        v = move_value(v, src, dst)
        with self._lock:
            self.copies += 1
            self.copy_bytes += nbytes
        if self.trace is not None:
            self.trace.span("seam copy", f"seams to {dst.name}", t0, time.perf_counter(), bytes=nbytes)
        return v

    def run_async(self, names: Sequence[str], feed: Mapping[str, Any]) -> concurrent.futures.Future:
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)
        return self._pool.submit(self.run, names, feed)

    def segment_timings(self) -> list[str]:
        """Mean wall time per segment run (heterogeneous sessions time each segment)."""
        lines = []
        for cs in self.segments:
            mean = cs.seconds / cs.runs * 1e3 if cs.runs else 0.0
            lines.append(f"{cs.segment.name} on {cs.provider.name}: {cs.runs} runs, {mean:.3f} ms mean")
        lines.append(f"seam copies: {self.copies} ({self.copy_bytes} bytes)")
        return lines

    def end_profiling(self) -> str | None:
        """Write the Chrome trace (enable_profiling=True) and return its path."""
        return self.trace.write() if self.trace is not None else None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
