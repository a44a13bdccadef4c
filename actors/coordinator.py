"""RayExecutor: a PlacementPlan's pipeline stages run by Ray actors, pipelined and
fault tolerant.

A plan's segments are grouped into *stages* (`hetero_exec.placement.stages`): one
actor per device, with the cpu segments beside it running on that actor's host
through in-process seam moves, and a cpu-only stage only where the cost model says it
shortens the pipeline period. With ``stages="auto"`` the stages are re-planned here
with the hop cost measured on this cluster (`actors.hop_cost`).

The coordinator holds no weights and no activations. For each request it checks the
feeds (typed errors, before anything is dispatched), then submits every stage's task
at once (`actors.dispatch`): stages pass seams actor to actor, the driver fetches only
graph outputs, and while stage 2 works on request k stage 1 already works on k+1; at
most ``max_inflight`` requests are in flight (callers block beyond). `run_many` sends
requests in groups (one task per stage for up to ``coalesce`` requests) and Futures
are answered from Ray's callbacks (`actors.async_results`). On a one-node cluster
seams travel through shared memory (`actors.transport.shared_memory`).

When an actor dies, the requests in flight through it are replayed from the first
segment of its stage, with the seam refs and feeds the request kept
(`actors.replay`): Ray restarts the actor (or it is re-created), it reloads its
weights, and each request still gets exactly one answer.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import threading
import time
import uuid
from typing import Any, Mapping, Sequence

import ray

from actors.async_results import AsyncResults
from actors.connect import close_at_exit, ensure_ray, ray_usable
from actors.dispatch import Dispatcher
from actors.options import RayOptions
from actors.profile import SpanRecorder, write_trace
from actors.replay import Replay
from actors.request import InflightLimit, Request
from actors.reservation import (
    ActorSlot,
    Reservation,
    bundles_for,
    cluster_has_gpus,
    plan_slots,
)
from actors.stage_model import StageSpec, stage_spec
from actors.transport import make_transport
from actors.transport.base import Transport
from actors.transport.compiled import CompiledGraphFailure
from hetero_exec.errors import ActorError, BuildError
from hetero_exec.exec.feeds import FeedChecker
from hetero_exec.ir.graph import Graph

log = logging.getLogger(__name__)


class RayExecutor:
    """Runs a session's placement plan on Ray stage actors. Thread-safe.

    Built by ``InferenceSession(model, providers, executor="ray", **options)``; the
    options are those of `actors.options.RayOptions`, and the session's ``stages``.

    >>> providers = ["sim-gpu", "cpu"]
    >>> sess = InferenceSession(model, providers, hetero=True, executor="ray")  # doctest: +SKIP
    >>> sess.run(None, {"x": x})  # doctest: +SKIP
    >>> sess.run_async(None, {"x": x}).result()  # doctest: +SKIP
    """

    def __init__(self, graph: Graph, build: Any, options: Any):
        started = time.perf_counter()
        self.graph = graph
        self.opts = RayOptions.parse(getattr(options, "executor_options", {}) or {})
        self.checker = FeedChecker(graph)
        self.profiling = bool(getattr(options, "enable_profiling", False))
        self.profile_prefix = getattr(options, "profile_file_prefix", "hetero_exec_profile")
        plan = build.placement
        devices = {s.provider_name for s in plan.segments if s.provider.is_device}
        emulated = all(s.provider.kind != "gpu" for s in plan.segments)
        self.connected = ensure_ray(self.opts, {"GPU": float(len(devices))}, logical_gpus=emulated)
        if self.opts.seam_transport == "auto":
            self.opts.seam_transport = auto_transport()
        replan_stages(plan, self.opts, options)
        source = plan.graph if getattr(plan, "graph", None) is not None else graph
        fold = bool(getattr(options, "fold_constants", True))
        by_id = {s.id: s for s in plan.segments}
        ranked = build.all_providers if len(plan.segments) > 1 else None
        self.stages = plan.stages
        self.specs: list[StageSpec] = [
            stage_spec(source, st, [by_id[i] for i in st.segments], fold, ranked or ())
            for st in plan.stages
        ]
        self.slots, bundles = plan_slots(self.specs, self.opts)
        self.shm_prefix = f"hetero_exec-{uuid.uuid4().hex[:12]}"
        self.seam = self._driver_transport()
        self.dispatcher = Dispatcher(graph, self.slots, self.seam, self.profiling)
        self.results = AsyncResults(self)
        self.closed = False
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._ids = itertools.count(1)
        self.inflight = InflightLimit(int(self.opts.max_inflight))
        self._lock = threading.Lock()
        self._driver_spans = SpanRecorder()
        self.reservation = Reservation(
            self.slots, bundles, self.opts, self.profiling, shm_prefix=self.shm_prefix
        )
        try:
            self.reservation.start()  # on failure: everything released, then the error
        except BaseException:
            self.seam.close()  # the driver's buffers (the actors' go with their processes)
            raise
        self.replay = Replay(self.slots, self.reservation, self.opts, is_closed=lambda: self.closed)
        self.compiled = None
        if self.opts.ray_compiled:
            try:
                self._start_compiled()
            except BaseException as build_error:  # the build fails whole (SEMANTICS.md 6)
                try:
                    self.reservation.release()
                    self.seam.close()
                except Exception as release_error:
                    raise BuildError(build_error, release_error) from build_error
                raise
        close_at_exit(self)
        self.build_s = time.perf_counter() - started
        log.info("ray placement (built in %.2fs): %s", self.build_s, self.placement_report())

    # -- what the session reads --------------------------------------------------------

    @property
    def actors(self) -> list[Any]:
        """The stage actors' handles, in stage order (``session.stage_actors``).

        >>> ray.get(executor.actors[0].ready.remote())["stage"]  # doctest: +SKIP
        'stage#0 (sim-gpu:0)'
        """
        return [slot.handle for slot in self.slots]

    def placement_report(self) -> str:
        """Which actor runs which stage, with what it reserved.

        >>> executor.placement_report()  # doctest: +SKIP
        'stage#0 (sim-gpu:0) -> actor 0 [0.25 CPU, 1 GPU, 2 threads]: segment#0..segment#18 ...'
        """
        parts = []
        for slot in self.slots:
            res = f"{slot.num_cpus:g} CPU" + (f", {slot.num_gpus:g} GPU" if slot.num_gpus else "")
            nodes = sum(p.nodes[1] - p.nodes[0] for p in slot.spec.segments)
            parts.append(f"{slot.spec.label} -> actor {slot.index} [{res}, {slot.threads} "
                         f"thread(s)]: {slot.spec.segment_labels}, {nodes} nodes")
        return "; ".join(parts)

    def stage_stats(self) -> dict[str, dict[str, Any]]:
        """Per stage: tasks, requests run, mean milliseconds per request (measured inside
        its actor, its segments summed), compile seconds, and the same per segment.

        >>> sess._executor.stage_stats()["stage#0 (sim-gpu:0)"]["mean_ms"]  # doctest: +SKIP
        3.1
        """
        stats = ray.get([slot.handle.stats.remote() for slot in self.slots])
        out: dict[str, dict[str, Any]] = {}
        for slot, s in zip(self.slots, stats):
            segs = {}
            for part in slot.spec.segments:
                seg = s["segments"][part.segment_id]
                segs[part.label] = {
                    "runs": seg["runs"], "compile_s": seg["compile_s"],
                    "mean_ms": 1e3 * seg["run_s"] / seg["runs"] if seg["runs"] else 0.0,
                }
            runs = max((v["runs"] for v in segs.values()), default=0)
            out[slot.spec.label] = {
                "tasks": s["tasks"],
                "runs": runs,
                "compile_s": s["compile_s"],
                "mean_ms": sum(v["mean_ms"] for v in segs.values()),
                "segments": segs,
            }
        return out

    def segment_timings(self) -> list[str]:
        """`stage_stats` as printable lines (what ``hetero-exec demo`` shows).

        >>> sess._executor.segment_timings()  # doctest: +SKIP
        ['stage#0 (sim-gpu:0) on actor 0: 3 runs in 3 tasks, 0.41 ms per run, compiled in 0.02 s', ...]
        """
        lines = []
        for k, (label, s) in enumerate(self.stage_stats().items()):
            lines.append(
                f"{label} on actor {k}: {s['runs']:.0f} runs in {s['tasks']} tasks, "
                f"{s['mean_ms']:.2f} ms per run, compiled in {s['compile_s']:.2f} s"
            )
            for seg_label, seg in s["segments"].items():
                lines.append(f"  {seg_label}: {seg['mean_ms']:.3f} ms per run")
        return lines

    # -- running -----------------------------------------------------------------------

    def run(self, names: Sequence[str], feed: Mapping[str, Any]) -> list[Any]:
        """Run one request and wait for its outputs (thread-safe).

        >>> executor.run(["y"], {"x": np.ones((2, 32), np.float32)})[0].shape  # doctest: +SKIP
        (2, 32)
        """
        req = self._new_request(names, feed)
        self.inflight.acquire(1)
        try:
            return self._serve(req)
        finally:
            self.inflight.release(1)

    def run_async(self, names: Sequence[str], feed: Mapping[str, Any]) -> concurrent.futures.Future:
        """A Future of `run`'s result; blocks only while ``max_inflight`` requests are in flight.

        Feed errors raise here, before anything is dispatched; errors of the run itself
        (a KernelError naming segment, node and op; an ActorError) come from the Future.

        >>> fut = executor.run_async(["y"], {"x": x})  # doctest: +SKIP
        >>> fut.result(timeout=10)[0].shape  # doctest: +SKIP
        (2, 32)
        """
        req = self._new_request(names, feed)  # typed input errors raise here, not in the future
        if self.compiled is not None:
            return self._submit([req])[0]
        self.inflight.acquire(1)
        return self.results.enqueue(req)

    def run_many(
        self,
        names: Sequence[str] | None,
        feeds: Sequence[Mapping[str, Any]],
        return_exceptions: bool = False,
    ) -> list[Any]:
        """Every feed through the pipeline at once; results in feed order.

        All feeds are checked before any is dispatched. They go in groups of up to
        ``coalesce`` requests per actor task (each request still runs on its own), sized
        so the pipeline still has at least 16 groups to overlap: Ray's per-task cost is
        then paid once per group. A request that fails fails alone: with
        ``return_exceptions`` its error takes its place in the results (as in
        ``asyncio.gather``), otherwise the first error raises once all have finished.

        >>> [out[0].shape for out in executor.run_many(None, [{"x": x}] * 3)]  # doctest: +SKIP
        [(2, 32), (2, 32), (2, 32)]
        """
        names = list(names) if names else list(self.graph.outputs)
        reqs = [self._new_request(names, f) for f in feeds]
        size = self.group_size(len(reqs))
        futures: list[concurrent.futures.Future] = []
        for i in range(0, len(reqs), size):
            futures += self._submit(reqs[i : i + size])
        concurrent.futures.wait(futures)
        if return_exceptions:
            return [f.exception() or f.result() for f in futures]
        return [f.result() for f in futures]

    def group_size(self, requests: int) -> int:
        """Requests per actor task for a batch of ``requests`` (`run_many`).

        >>> executor.group_size(8), executor.group_size(32), executor.group_size(256)  # doctest: +SKIP
        (1, 2, 4)
        """
        return max(1, min(self.group_limit(), requests // 16))

    def group_limit(self) -> int:
        """The most requests one task may carry: ``coalesce``, within ``max_inflight``."""
        return max(1, min(int(self.opts.coalesce), int(self.opts.max_inflight)))

    def pool(self) -> concurrent.futures.ThreadPoolExecutor:
        """The threads that answer landed groups and replay after faults."""
        with self._lock:
            if self.closed:
                raise ActorError("the session is closed")
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=int(self.opts.max_inflight), thread_name_prefix="hetero-exec-ray"
                )
            return self._pool

    def _submit(self, reqs: list[Request]) -> list[concurrent.futures.Future]:
        """Take ``len(reqs)`` in-flight places (blocking), dispatch as one group, return
        the Futures."""
        self.inflight.acquire(len(reqs))
        if self.compiled is not None:
            try:
                pool = self.pool()
                return [pool.submit(self._serve_then_release, r) for r in reqs]
            except BaseException:
                self.inflight.release(len(reqs))
                raise
        return self.results.submit_group(reqs)

    def _serve_then_release(self, req: Request) -> list[Any]:
        try:
            return self._serve(req)
        finally:
            self.inflight.release(1)

    def _new_request(self, names: Sequence[str], feed: Mapping[str, Any]) -> Request:
        if self.closed:
            raise ActorError("the session is closed")
        ordered, _symbols = self.checker.check(feed)
        feeds = {name: v for name, v in zip(self.graph.inputs, ordered) if v is not None}
        return Request(next(self._ids), list(names), feeds)

    def _serve(self, req: Request) -> list[Any]:
        req.started_ns = time.time_ns()
        try:
            compiled = self.compiled
            if compiled is not None:
                try:
                    return compiled.run(req, self)
                except CompiledGraphFailure as e:
                    self._drop_compiled(compiled, e)  # then serve it on the task path
            self.dispatcher.dispatch([req], 0)
            return self.serve_collect(req)
        finally:
            self.forget(req)

    def serve_collect(self, req: Request) -> list[Any]:
        """The outputs of a dispatched request, recovering and replaying after faults."""
        while True:
            try:
                return self.dispatcher.collect(req)
            except Exception as e:
                self.dispatcher.dispatch([req], self.replay.after_failure(req, e))

    def forget(self, req: Request) -> None:
        """``req`` is answered: release what it held, record its span."""
        self.dispatcher.forget(req)
        if self.profiling:
            self._driver_spans.record(
                f"request {req.id}", req.started_ns, "request", {"replays": req.replays}
            )

    @property
    def replays(self) -> int:
        """Requests replayed after faults, over the session's life."""
        return self.replay.replays

    # -- compiled graphs -----------------------------------------------------------------

    def _start_compiled(self) -> None:
        from actors.transport.compiled import CompiledChain

        self.compiled = CompiledChain.for_executor(self)

    def _drop_compiled(self, compiled: Any, error: BaseException) -> None:
        """A compiled graph that failed is torn down once; the task path serves from then on."""
        with self._lock:
            if self.compiled is not compiled:
                return
            self.compiled = None
        log.warning("compiled graph failed (%s); falling back to the task path", error)
        compiled.close()

    # -- profiling and teardown ----------------------------------------------------------

    def end_profiling(self) -> str | None:
        """Write the Chrome trace (driver lane, then one lane per stage actor, a span per
        segment run); returns its path.

        >>> sess = InferenceSession(m, p, executor="ray", enable_profiling=True)  # doctest: +SKIP
        >>> sess.end_profiling()  # doctest: +SKIP
        '/cwd/hetero_exec_profile_2026-11-29_10-35-52_281697.json'
        """
        if not self.profiling:
            return None
        lanes: list[tuple[str, list[dict[str, Any]]]] = [("driver", self._driver_spans.take())]
        spans = ray.get([slot.handle.take_spans.remote() for slot in self.slots])
        for slot, s in zip(self.slots, spans):
            lanes.append((f"actor {slot.index}: {slot.labels}", s))
        path = write_trace(lanes, self.profile_prefix)
        log.info("profile written to %s", path)
        return path

    def close(self) -> None:
        """Tear the actors and the placement group down (idempotent).

        >>> executor.close(); executor.close()  # doctest: +SKIP
        """
        with self._lock:
            if self.closed:
                return
            self.closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        self.results.close()  # requests the pool will now never answer
        if self.compiled is not None and ray_usable():
            self.compiled.close()
        try:
            self.reservation.release()
        finally:
            self.seam.close()

    # -- seams ------------------------------------------------------------------------

    def _driver_transport(self) -> Transport:
        """The driver's end of the seams: it writes large feeds and reads graph outputs."""
        name = self.opts.seam_transport
        if name != "shared_memory":
            return make_transport(name)
        return make_transport(
            name,
            prefix=f"{self.shm_prefix}-driver",
            node=ray.get_runtime_context().get_node_id(),
            budget=self.opts.shm_seam_bytes,
        )


def auto_transport() -> str:
    """``seam_transport="auto"``: shared memory when the cluster is one node (every actor
    and the driver share /dev/shm), Ray's object store otherwise.

    >>> auto_transport() in ("shared_memory", "object_store")  # doctest: +SKIP
    True
    """
    alive = [n for n in ray.nodes() if n.get("Alive")]
    return "shared_memory" if len(alive) == 1 else "object_store"


def replan_stages(plan: Any, opts: RayOptions, options: Any) -> None:
    """The plan's stages for Ray. ``stages="auto"``: cut where it pays on this cluster
    (its hop cost, its cores); a saved plan's cuts, or the session's own K or cuts,
    stand as planned. Needs Ray connected and ``opts.seam_transport`` resolved."""
    from hetero_exec.placement.stages import plan_stages

    spec = getattr(options, "stages", "auto")
    bounds = dict(getattr(options, "dim_bounds", None) or {})
    if spec == "auto" and plan.saved_cuts is not None:
        spec = plan.saved_cuts
    if spec != "auto":
        if not plan.stages:  # a plan made without the session's planner (by hand)
            plan.stages = plan_stages(plan, spec, bounds=bounds)
        return
    from actors.hop_cost import hop_model
    from actors.reservation import default_runtime_env
    from hetero_exec.placement.stages import HopModel

    cores = float(ray.cluster_resources().get("CPU", 1.0))
    hop = opts.hop_model
    if hop is None:
        # measuring the hop costs a probe actor (about half a second): skip it when the
        # choice cannot depend on it (free and prohibitive hops give the same cuts, as
        # for a plan whose one device spans all its segments)
        free = plan_stages(plan, "auto", HopModel(0.0, 1e30), cores=cores, bounds=bounds)
        dear = plan_stages(plan, "auto", HopModel(1.0, 1e6), cores=cores, bounds=bounds)
        if [s.segments for s in free] != [s.segments for s in dear]:
            one_node = opts.seam_transport == "shared_memory"
            hop = hop_model(one_node, opts.runtime_env or default_runtime_env())
    plan.stages = plan_stages(plan, "auto", hop or HopModel(), cores=cores, bounds=bounds)


def stage_bundles(model: Any, providers: Sequence[Any] | None = None,
                  **session_options: Any) -> list[dict[str, float]]:
    """The Ray resource bundles a Ray session of ``model`` reserves, one per stage.

    For a Serve replica that drives its own stage actors: deploy it with
    ``placement_group_bundles=[replica_bundle, *stage_bundles(...)]`` and build the
    session inside with ``executor="ray", placement_group="current"``. Plans the
    session without starting actors (connects to Ray for ``stages="auto"``, whose cuts
    depend on the cluster's hop cost).

    >>> stage_bundles(model, ["sim-gpu", "cpu"], hetero=True)  # doctest: +SKIP
    [{'CPU': 0.25, 'GPU': 1.0}]
    """
    from hetero_exec.ir import load
    from hetero_exec.placement.decide import build_session_plan
    from hetero_exec.session import SessionOptions

    opts = SessionOptions.from_kwargs({**session_options, "executor": "ray"})
    ray_opts = RayOptions.parse(opts.executor_options)
    _, graph = load(model, opts.base_dir)
    build = build_session_plan(graph, providers, opts)
    plan = build.placement
    if opts.stages == "auto" and plan.saved_cuts is None:
        devices = {s.provider_name for s in plan.segments if s.provider.is_device}
        ensure_ray(ray_opts, {"GPU": float(len(devices))},
                   logical_gpus=all(s.provider.kind != "gpu" for s in plan.segments))
        if ray_opts.seam_transport == "auto":
            ray_opts.seam_transport = auto_transport()
        replan_stages(plan, ray_opts, opts)
    return bundles_for([st.provider for st in plan.stages], ray_opts, cluster_has_gpus())


__all__ = ["RayExecutor", "ActorSlot", "stage_bundles", "replan_stages", "auto_transport"]
