"""RayExecutor: a PlacementPlan's pipeline stages run by Ray actors, pipelined and
fault tolerant.

A plan's segments are grouped into *stages* (`hetero_exec.placement.stages`): one
actor per device, with the cpu segments beside it running on that actor's host
through in-process seam moves, and a cpu-only stage only where the cost model says it
shortens the pipeline period. With ``stages="auto"`` the stages are re-planned here
with the hop cost measured on this cluster (`actors.cluster_plan`).

The coordinator holds no weights and no activations. For each request it checks the
feeds (typed errors, before anything is dispatched); then every request takes the one
submit path (`_submit`): it takes an in-flight slot and a Future
(`actors.request_pool`; at most ``max_inflight`` requests are in flight, callers block
beyond), and is served one of three ways: `run` in the caller's thread, `run_async`
queued with concurrent callers into shared tasks, `run_many` in groups of up to
``coalesce`` requests per task (`actors.async_results`). Every stage's task for a
group is submitted at once (`actors.dispatch`): stages pass seams actor to actor, the
driver fetches only graph outputs, and while stage 2 works on request k stage 1
already works on k+1. With ``ray_compiled=True`` a compiled Ray graph runs the chain
instead (`actors.compiled`). However it ends, a request is answered in one place,
`RequestPool.answer`, which gives its slot back.

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
from typing import Any, Literal, Mapping, Sequence

import ray

from actors.async_results import AsyncResults
from actors.cluster_plan import auto_transport, connect_for, replan_stages, stage_bundles
from actors.compiled import CompiledChain, CompiledGraphFailure
from actors.connect import close_at_exit, ray_usable
from actors.dispatch import Dispatcher
from actors.options import RayOptions
from actors.profile import SpanRecorder, write_trace
from actors.replay import Replay
from actors.request import InflightLimit, Request
from actors.request_pool import RequestPool
from actors.reservation import ActorSlot, Reservation, plan_slots
from actors.stage_model import StageSpec, stage_spec
from actors.transport import SeamConfig, make_transport
from hetero_exec.errors import ActorError, BuildError
from hetero_exec.exec.feeds import FeedChecker
from hetero_exec.ir.graph import Graph

log = logging.getLogger(__name__)


class RayExecutor:
    """Runs a session's placement plan on Ray stage actors. Thread-safe.

    Built by ``InferenceSession(model, providers, executor="ray", **options)``; the
    options are those of `actors.options.RayOptions`, and the session's ``stages``.
    Its examples need a Ray cluster, so they do not run as doctests:

    >>> sess = InferenceSession(model, ["sim-gpu", "cpu"], hetero=True, executor="ray")  # doctest: +SKIP
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
        self.connected = connect_for(plan, self.opts)
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
        self.seam_config = SeamConfig(self.opts.seam_transport,
                                      f"hetero_exec-{uuid.uuid4().hex[:12]}",
                                      int(self.opts.shm_seam_bytes))
        # the driver's end of the seams: it writes large feeds and reads graph outputs
        self.driver_seam = make_transport(self.seam_config.for_owner("driver"))
        self.dispatcher = Dispatcher(graph, self.slots, self.driver_seam, self.profiling)
        self.requests = RequestPool(int(self.opts.max_inflight), self._forget)
        self.closed = False
        self._lock = threading.Lock()  # the thread pool, the compiled graph, closing
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._ids = itertools.count(1)
        self._driver_spans = SpanRecorder()
        self.reservation = Reservation(self.slots, bundles, self.opts, self.seam_config,
                                       self.profiling)
        try:
            self.reservation.start()  # on failure: everything released, then the error
        except BaseException:
            self.driver_seam.close()  # the driver's buffers (the actors' go with their processes)
            raise
        self.replay = Replay(self.slots, self.reservation, self.dispatcher, self.opts,
                             is_closed=lambda: self.closed)
        self.results = AsyncResults(self.dispatcher, self.replay.recover, self.pool,
                                    self.requests.answer, self.group_limit())
        self.compiled: CompiledChain | None = None
        if self.opts.ray_compiled:
            self._start_compiled()
        close_at_exit(self)
        self.build_s = time.perf_counter() - started
        log.info("ray placement (built in %.2fs): %s", self.build_s, self.placement_report())

    def _start_compiled(self) -> None:
        try:
            self.compiled = CompiledChain([slot.handle for slot in self.slots], self.specs,
                                          self.graph, max_inflight=int(self.opts.max_inflight))
        except BaseException as build_error:  # the build fails whole (SEMANTICS.md 6)
            try:
                self.reservation.release()
                self.driver_seam.close()
            except Exception as release_error:
                raise BuildError(build_error, release_error) from build_error
            raise

    # -- what the session reads --------------------------------------------------------

    @property
    def actors(self) -> list[Any]:
        """The stage actors' handles, in stage order (``session.stage_actors``)."""
        return [slot.handle for slot in self.slots]

    @property
    def inflight(self) -> InflightLimit:
        """The in-flight slots (``.free`` of ``max_inflight``)."""
        return self.requests.inflight

    @property
    def replays(self) -> int:
        """Requests replayed after faults, over the session's life."""
        return self.replay.replays

    def placement_report(self) -> str:
        """Which actor runs which stage, with what it reserved: ``stage#0 (sim-gpu:0) ->
        actor 0 [0.25 CPU, 1 GPU, 2 thread(s)]: segment#0..segment#18, 40 nodes; ...``"""
        parts = []
        for slot in self.slots:
            res = f"{slot.num_cpus:g} CPU" + (f", {slot.num_gpus:g} GPU" if slot.num_gpus else "")
            nodes = sum(p.nodes[1] - p.nodes[0] for p in slot.spec.segments)
            parts.append(f"{slot.spec.label} -> actor {slot.index} [{res}, {slot.threads} "
                         f"thread(s)]: {slot.spec.segment_labels}, {nodes} nodes")
        return "; ".join(parts)

    def stage_stats(self) -> dict[str, dict[str, Any]]:
        """Per stage label: tasks, requests run, mean milliseconds per request (measured
        inside its actor, its segments summed), compile seconds, and the same per
        segment."""
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
        """`stage_stats` as printable lines (what ``hetero-exec demo`` shows)."""
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
        """Run one request and wait for its outputs (served in this thread)."""
        [fut] = self._submit([self._new_request(names, feed)], "here")
        return fut.result()

    def run_async(self, names: Sequence[str], feed: Mapping[str, Any]) -> concurrent.futures.Future:
        """A Future of `run`'s result; blocks only while ``max_inflight`` requests are in flight.

        Feed errors raise here, before anything is dispatched; errors of the run itself
        (a KernelError naming segment, node and op; an ActorError) come from the Future.
        """
        req = self._new_request(names, feed)  # typed input errors raise here, not in the future
        return self._submit([req], "queue")[0]

    def run_many(
        self,
        names: Sequence[str] | None,
        feeds: Sequence[Mapping[str, Any]],
        return_exceptions: bool = False,
    ) -> list[Any]:
        """Every feed through the pipeline at once; results in feed order.

        All feeds are checked before any is dispatched. They go in groups of up to
        ``coalesce`` requests per actor task (each request still runs on its own), sized
        so the pipeline still has at least 16 groups to overlap (`group_size`): Ray's
        per-task cost is then paid once per group. A request that fails fails alone:
        with ``return_exceptions`` its error takes its place in the results (as in
        ``asyncio.gather``), otherwise the first error raises once all have finished.
        """
        names = list(names) if names else list(self.graph.outputs)
        reqs = [self._new_request(names, f) for f in feeds]
        size = self.group_size(len(reqs))
        futures: list[concurrent.futures.Future] = []
        for i in range(0, len(reqs), size):
            futures += self._submit(reqs[i : i + size], "group")
        concurrent.futures.wait(futures)
        if return_exceptions:
            return [f.exception() or f.result() for f in futures]
        return [f.result() for f in futures]

    def group_size(self, requests: int) -> int:
        """Requests per actor task for a batch of ``requests`` (`run_many`)."""
        return group_size(requests, self.group_limit())

    def group_limit(self) -> int:
        """The most requests one task may carry: ``coalesce``, within ``max_inflight``."""
        return max(1, min(int(self.opts.coalesce), int(self.opts.max_inflight)))

    def pool(self) -> concurrent.futures.ThreadPoolExecutor:
        """The threads that answer landed groups, replay after faults, and serve on the
        compiled graph; ActorError once the session is closed."""
        with self._lock:
            if self.closed:
                raise ActorError("the session is closed")
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=int(self.opts.max_inflight), thread_name_prefix="hetero-exec-ray"
                )
            return self._pool

    def _new_request(self, names: Sequence[str], feed: Mapping[str, Any]) -> Request:
        if self.closed:
            raise ActorError("the session is closed")
        ordered, _symbols = self.checker.check(feed)
        feeds = {name: v for name, v in zip(self.graph.inputs, ordered) if v is not None}
        return Request(next(self._ids), list(names), feeds)

    def _submit(self, reqs: list[Request], how: Literal["here", "queue", "group"]
                ) -> list[concurrent.futures.Future]:
        """The one submit path: each request takes a slot and a Future (blocking while
        ``max_inflight`` are in flight), then is served ``here`` (in this thread), on
        the compiled graph (a pool thread each), or on the task path: ``queue``d with
        concurrent callers, or dispatched as one ``group``."""
        futures = self.requests.admit(reqs)
        pairs = list(zip(reqs, futures))
        if how == "here":
            for req, fut in pairs:
                self._serve(req, fut)
        elif self.compiled is not None:
            for req, fut in pairs:
                try:
                    self.pool().submit(self._serve, req, fut)
                except Exception as e:  # closed meanwhile
                    self.requests.answer(req, error=e)
        elif how == "queue":
            for pair in pairs:
                self.results.enqueue(pair)
        else:
            self.results.start(pairs)
        return futures

    def _serve(self, req: Request, fut: concurrent.futures.Future) -> None:
        """Serve one admitted request in this thread, then answer it."""
        try:
            running = fut.set_running_or_notify_cancel()
        except RuntimeError:  # answered already: the session closed under it
            return
        if not running:
            self.requests.answer(req, error=concurrent.futures.CancelledError())
            return
        req.started_ns = time.time_ns()
        try:
            out = self._outputs(req)
        except BaseException as e:
            self.requests.answer(req, error=e)
        else:
            self.requests.answer(req, result=out)

    def _outputs(self, req: Request) -> list[Any]:
        """``req``'s outputs: on the compiled graph while it works, else on the task path,
        replayed after faults."""
        compiled = self.compiled
        if compiled is not None:
            try:
                return compiled.run(req)
            except CompiledGraphFailure as e:
                self._drop_compiled(compiled, e)  # then serve it on the task path
        self.dispatcher.dispatch([req], 0)
        return self.replay.collect(req)

    def _forget(self, req: Request) -> None:
        """``req`` is answered: release what it held, record its span."""
        self.dispatcher.forget(req)
        if self.profiling and req.started_ns:  # (one closed before it started has no span)
            self._driver_spans.record(
                f"request {req.id}", req.started_ns, "request", {"replays": req.replays}
            )

    def _drop_compiled(self, compiled: CompiledChain, error: BaseException) -> None:
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
        segment run); returns its path (``hetero_exec_profile_<time>.json``)."""
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
        """Answer what is in flight, tear the actors and the placement group down
        (idempotent)."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        self.requests.close()  # requests the pool will now never answer
        if self.compiled is not None and ray_usable():
            self.compiled.close()
        try:
            self.reservation.release()
        finally:
            self.driver_seam.close()


def group_size(requests: int, limit: int) -> int:
    """Requests per actor task for a batch of ``requests``: up to ``limit``, so that the
    pipeline still has at least 16 groups to overlap.

    >>> group_size(8, 4), group_size(32, 4), group_size(256, 4), group_size(256, 2)
    (1, 2, 4, 2)
    """
    return max(1, min(limit, requests // 16))


__all__ = ["RayExecutor", "ActorSlot", "group_size", "stage_bundles", "replan_stages",
           "auto_transport"]
