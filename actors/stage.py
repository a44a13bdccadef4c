"""StageActor: one pipeline stage, its segments compiled where they run.

A stage is a contiguous run of the plan's segments holding at most one device
(`hetero_exec.placement.stages`). Its actor builds the stage's graph from its ONNX
bytes once and compiles each segment in ``__init__`` (so a restarted actor reloads
its weights by itself), then runs every request through its segments in order, with
in-process seam moves between providers (`hetero_exec.exec.chain`). One Ray task
carries a group of requests through the whole stage: values that stay inside a stage
never touch Ray. Inputs arrive as Ray resolved them (or through the seam transport);
each output goes back through the transport. Errors a segment raises on purpose
travel back as `SegmentRunError`, naming the segment.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
import uuid
from typing import Any, Sequence

import ray

from actors.code_version import code_identity
from actors.remote_errors import FailedValue, SegmentRunError, StageNotLoaded
from actors.request import Layout, pick
from actors.stage_model import SegmentPart, StageSpec, load_stage_graph
from actors.transport import make_transport
from actors.transport.base import SeamConfig, SeamKey
from hetero_exec.errors import HeteroExecError, KernelError
from hetero_exec.exec.chain import SegmentChain, calls_blas, folded_seams
from hetero_exec.exec.plan import Compiler
from hetero_exec.providers import Provider, parse_provider

log = logging.getLogger(__name__)


class SegmentStats:
    """What a stage actor counts per segment."""

    __slots__ = ("part", "provider", "compile_s", "runs", "run_s")

    def __init__(self, part: SegmentPart, provider: Provider, compile_s: float):
        self.part, self.provider, self.compile_s = part, provider, compile_s
        self.runs = 0
        self.run_s = 0.0


def compile_stage(spec: StageSpec, device_id: int | None = None
                  ) -> tuple[SegmentChain, list[SegmentStats]]:
    """The stage's segments compiled in order (weights loaded once for all of them)."""
    graph = load_stage_graph(spec)
    placer = None
    if len(spec.body_providers) > 1:  # a heterogeneous session places bodies too
        from hetero_exec.exec.placed_body import make_body_placer

        placer = make_body_placer([parse_provider(p) for p in spec.body_providers],
                                  spec.fold_constants)
    parts, stats = [], []
    blas = calls_blas(graph.nodes)
    providers: dict[str, Provider] = {}  # one per device: a seam between two segments of
    # the same device is then no move at all (the chain compares providers by identity)
    folded: dict[str, Any] = {}  # seams an earlier segment folded: constants here
    for part in spec.segments:
        started = time.perf_counter()
        provider = providers.get(part.provider_name)
        if provider is None:
            provider = providers[part.provider_name] = part.make_provider(device_id)
        compiler = Compiler.for_provider(provider, spec.fold_constants, placer)
        lo, hi = part.nodes
        try:
            plan = compiler.compile(graph, graph.nodes[lo:hi], part.inputs, part.outputs,
                                    known={n: folded[n] for n in part.inputs if n in folded})
        except Exception as e:
            raise SegmentRunError(part.label, e) from None
        folded.update(folded_seams(provider, plan))
        parts.append((provider, plan))
        stats.append(SegmentStats(part, provider, time.perf_counter() - started))
    return SegmentChain(parts, blas=blas), stats


class StageActor:
    """The actor class (made remote by `remote_class`); one per stage.

    >>> import ray  # doctest: +SKIP
    >>> actor = remote_class().options(num_cpus=0.25).remote(spec)  # doctest: +SKIP
    >>> ray.get(actor.ready.remote())["stage"]  # doctest: +SKIP
    'stage#0 (cpu)'
    """

    def __init__(
        self,
        spec: StageSpec | None,
        seam: SeamConfig | None = None,
        profile: bool = False,
        threads: int | None = None,  # BLAS threads; negative: a share of the host's cores
    ):
        # the stage comes inline when small; else None, and `load` brings it (from the
        # coordinator's object, which it holds): no constructor argument lives in the
        # object store, so a restart never needs one (ray-project/ray#53727), and a
        # restarted actor answers ping with "" until the coordinator loads it again
        self.spec: StageSpec | None = None
        self.incarnation = uuid.uuid4().hex
        self.threads = stage_threads(threads)
        # this incarnation's end of the seams (a restart's files are named apart)
        self.seam = make_transport((seam or SeamConfig()).for_owner(self.incarnation[:8]))
        self.profile = profile
        self.spans: list[dict[str, Any]] = []
        self.tasks = 0
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._stats_lock = threading.Lock()
        self.init_error: BaseException | None = None
        self.chain: SegmentChain | None = None
        self.segments: list[SegmentStats] = []
        self.compile_s = 0.0
        self._load_lock = threading.Lock()
        if spec is not None:
            self._compile(spec)

    def load(self, box: list[ray.ObjectRef]) -> None:
        """Take the stage from ``box[0]`` (a ref in a list: Ray does not resolve it, the
        actor fetches it) and compile it, unless it has one already."""
        with self._load_lock:
            if self.spec is None:
                self._compile(ray.get(box[0]))

    def _compile(self, spec: StageSpec) -> None:
        self.spec = spec
        device_id = 0 if ray.is_initialized() and ray.get_gpu_ids() else None
        started = time.perf_counter()
        try:
            self.chain, self.segments = compile_stage(spec, device_id)
            self.chain.threads = self.threads
        except SegmentRunError as e:  # reported by ready(), so the build names the failure
            self.init_error = e
        except Exception as e:
            self.init_error = SegmentRunError(spec.label, e)
        self.compile_s = time.perf_counter() - started
        log.info("%s compiled in %.3fs", spec.label, self.compile_s)

    # -- lifecycle ----------------------------------------------------------------

    def ready(self) -> dict[str, Any]:
        """Start-up report: incarnation, pid, node, threads and each segment's compile time."""
        self._loaded()
        if self.init_error is not None:
            raise self.init_error
        return {
            "incarnation": self.incarnation,
            "pid": os.getpid(),
            "node": ray.get_runtime_context().get_node_id() if ray.is_initialized() else "",
            "stage": self.spec.label,
            "threads": self.threads,
            "compile_s": self.compile_s,
            "weight_bytes": self.spec.weight_bytes,
            "segments": [{"segment": s.part.segment_id, "provider": s.provider.name,
                          "compile_s": s.compile_s} for s in self.segments],
            "code": code_identity(),
        }

    def code(self) -> dict[str, str]:
        """The sources this actor runs (`code_version.code_identity`)."""
        return code_identity()

    def ping(self) -> str:
        """This actor's incarnation (a new one after each restart); "" while it has no
        stage (restarted, not loaded again yet)."""
        if self.spec is None:
            return ""
        if self.init_error is not None:
            raise self.init_error
        return self.incarnation

    # -- running --------------------------------------------------------------------

    def run(self, meta: tuple[list[int], Layout, int], *flat: Any) -> Any:
        """Run the stage for each request of a group: ``meta`` is (request ids, `Layout`,
        floor), one argument so Ray serializes it once; ``flat`` the values.

        One return per stage output, each a list with one value per request, so a group
        of requests costs Ray one task and one object per output. A request whose run
        fails on purpose (a kernel error, an input refused) gets a `FailedValue` in its
        place and the others still run; a later stage passes it on. Every request before
        ``floor`` has finished, so the seam transport may reuse what they held.
        """
        requests, layout, floor = meta
        self._loaded()
        self.seam.release_below(floor)
        return self._run_group(requests, layout, flat)

    def _loaded(self) -> None:
        if self.spec is None:
            raise StageNotLoaded(f"stage actor {self.incarnation[:8]} was restarted and has "
                                 f"no stage yet")

    def run_fetching(self, meta: tuple[list[int], Layout, int], flat: list[Any]) -> Any:
        """Like `run`, with seam ObjectRefs fetched here (profiling times each fetch)."""
        requests, layout, floor = meta
        self._loaded()
        self.seam.release_below(floor)
        fetched = []
        for item in flat:
            if isinstance(item, ray.ObjectRef):
                t0 = time.time_ns()
                item = ray.get(item)
                self._span(f"seam -> {self.spec.name}", t0, time.time_ns(), "seam",
                           {"requests": list(requests), "bytes": _nbytes(item)})
            fetched.append(item)
        return self._run_group(requests, layout, fetched)

    def _run_group(self, requests: list[int], layout: Layout, flat: Sequence[Any]) -> Any:
        """The group's requests, side by side on the stage's threads when there are
        several (each then splits its products over its share of them): many of a
        model's ops are too small to split, so two requests at once keep two cores
        busier than one request split in two."""
        self.tasks += 1
        n_out = len(self.spec.outputs)
        workers = min(self.threads or 1, len(requests))
        width = max(1, (self.threads or 1) // workers)

        def one(j: int) -> list[Any]:
            carried = [pick(flat, entries[j]) for entries in layout]
            failed = next((c for c in carried if isinstance(c, FailedValue)), None)
            if failed is not None:
                return [failed] * n_out  # an upstream failure, passed on
            try:
                return self._run(requests[j], carried, width)
            except SegmentRunError as e:
                return [FailedValue(e)] * n_out

        if workers > 1:
            results = list(self._workers().map(one, range(len(requests))))
        else:
            results = [one(j) for j in range(len(requests))]
        columns = [list(column) for column in zip(*results)] if n_out else []
        return columns[0] if n_out == 1 else tuple(columns)

    def _workers(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=self.threads or 1, thread_name_prefix="stage-request")
        return self._pool

    def _run(self, request: int, carried: list[Any], width: int | None = None) -> list[Any]:
        spec = self.spec
        t0 = time.time_ns()
        feeds = {name: self._read(request, name, item) for name, item in zip(spec.inputs, carried)}
        outs = self._execute(feeds, request, width)
        results = [self._write(request, name, v) for name, v in zip(spec.outputs, outs)]
        if self.profile:
            self._span(f"{spec.name} run", t0, time.time_ns(), "stage", {"request": request})
        return results

    def _execute(self, feeds: dict[str, Any], request: int | None = None,
                 width: int | None = None) -> list[Any]:
        """The chain over ``feeds``; a segment's typed error names that segment."""
        running = [0]

        def on_run(k: int, start: int, end: int) -> None:
            seg = self.segments[k]
            with self._stats_lock:
                seg.runs += 1
                seg.run_s += (end - start) / 1e9
            running[0] = k + 1
            if self.profile:
                self._span(f"{seg.part.name} run", start, end, "segment",
                           {"request": request, "provider": seg.provider.name})

        try:
            return self.chain.run(feeds, self.spec.outputs, on_run, width)
        except KernelError as e:
            label = self.segments[running[0]].part.label
            raise SegmentRunError(label, KernelError(e.node, e.op, e.detail, label)) from None
        except HeteroExecError as e:
            raise SegmentRunError(self.segments[running[0]].part.label, e) from None

    def run_dict(self, *sources: dict[str, Any]) -> dict[str, Any]:
        """The compiled-graph form: named values in (feeds, upstream outputs), named out."""
        merged: dict[str, Any] = {}
        for src in sources:
            merged.update(src)
        self._loaded()
        self.tasks += 1
        outs = self._execute({n: merged.get(n) for n in self.spec.inputs})
        return dict(zip(self.spec.outputs, outs))

    def _read(self, request: int, name: str, item: Any) -> Any:
        t0 = time.time_ns()
        value = self.seam.read(SeamKey(request, name), item)
        if self.profile and self.seam.carries(item):
            self._span(f"seam {name} read ({self.seam.label})", t0, time.time_ns(), "seam",
                       {"request": request, "bytes": _nbytes(value)})
        return value

    def _write(self, request: int, name: str, value: Any) -> Any:
        t0 = time.time_ns()
        carried = self.seam.write(SeamKey(request, name), value)
        if self.profile and self.seam.carries(carried):
            self._span(f"seam {name} written ({self.seam.label})", t0, time.time_ns(), "seam",
                       {"request": request, "bytes": _nbytes(value)})
        return carried

    # -- observability ------------------------------------------------------------------

    def _span(self, name: str, start_ns: int, end_ns: int, cat: str, args: dict[str, Any]) -> None:
        self.spans.append({"name": name, "cat": cat, "ts": start_ns / 1e3,
                           "dur": (end_ns - start_ns) / 1e3, "args": args})

    def take_spans(self) -> list[dict[str, Any]]:
        """The profile spans recorded since the last call (wall-clock microseconds)."""
        spans, self.spans = self.spans, []
        return spans

    def stats(self) -> dict[str, Any]:
        """Tasks run, and per segment: requests run, seconds spent running, compile time."""
        return {
            "tasks": self.tasks,
            "compile_s": self.compile_s,
            "segments": {s.part.segment_id: {"runs": s.runs, "run_s": s.run_s,
                                             "compile_s": s.compile_s} for s in self.segments},
        }


def stage_threads(threads: int | None) -> int | None:
    """The threads a run of this stage splits its work over: ``threads``, or, when
    negative, this host's cores over ``-threads`` stages (a lone stage on a 2-core node
    uses both, two stages one each); None: all the cores. Runs hold the BLAS at one
    thread and split large products over our own pool (`hetero_exec.kernels._threads`),
    so Ray's OMP_NUM_THREADS=1 for a fractional-CPU actor does not matter."""
    if not threads:
        return None
    if threads < 0:
        from hetero_exec.kernels._threads import cores

        return max(1, cores() // -threads)
    return int(threads)


def _nbytes(value: Any) -> int:
    if isinstance(value, list):
        return sum(_nbytes(v) for v in value)
    return int(getattr(value, "nbytes", 0) or 0)


_REMOTE_CLASS: Any = None


def remote_class() -> Any:
    """`StageActor` as a Ray actor class (made once, on first use)."""
    global _REMOTE_CLASS
    if _REMOTE_CLASS is None:
        _REMOTE_CLASS = ray.remote(StageActor)
    return _REMOTE_CLASS
