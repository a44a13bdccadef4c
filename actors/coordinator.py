"""RayExecutor: a PlacementPlan run by segment actors, pipelined and fault tolerant.

The coordinator holds no weights and no activations. For each request it checks the
feeds (typed errors, before anything is dispatched), then submits every segment's
task at once: seam values are the ObjectRefs one task returns and the next takes,
so they go actor to actor and the driver fetches only graph outputs. Actors run
their tasks in submission order, so while stage 2 works on request k stage 1 already
works on k+1; at most ``max_inflight`` requests are in flight (callers block beyond).

When an actor dies, the requests that were in flight through it are replayed from
the first segment it hosts, with the seam refs and feeds the request kept: Ray
restarts the actor (or the coordinator re-creates it), it reloads its weights, and
each request still gets exactly one answer. Bounded replays end in ActorError.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import threading
import time
from typing import Any, Mapping, Sequence

import numpy as np
import ray

from actors.connect import ensure_ray
from actors.options import RayOptions
from actors.profile import SpanRecorder, write_trace
from actors.recovery import Recovery
from actors.remote_errors import is_fault, root_cause, user_error
from actors.request import Request
from actors.reservation import ActorSlot, Reservation, plan_slots
from actors.segment_model import SegmentSpec, segment_spec
from actors.transport import make_transport
from actors.transport.base import SeamKey
from actors.transport.compiled import CompiledGraphFailure
from hetero_exec.errors import ActorError, BuildError
from hetero_exec.exec.feeds import FeedChecker
from hetero_exec.ir.graph import Graph

log = logging.getLogger(__name__)

#: feeds at least this large are put in the object store once per request
PUT_FEED_BYTES = 64 * 1024


class RayExecutor:
    """Runs a session's placement plan on Ray segment actors. Thread-safe.

    Built by ``InferenceSession(model, providers, executor="ray", **options)``; the
    options are those of `actors.options.RayOptions`.

    >>> providers = ["sim-gpu", "cpu"]
    >>> sess = InferenceSession(model, providers, hetero=True, executor="ray")  # doctest: +SKIP
    >>> sess.run(None, {"x": x})  # doctest: +SKIP
    >>> sess.run_async(None, {"x": x}).result()  # doctest: +SKIP
    """

    def __init__(self, graph: Graph, build: Any, options: Any):
        self.graph = graph
        self.opts = RayOptions.parse(getattr(options, "executor_options", {}) or {})
        self.checker = FeedChecker(graph)
        self.profiling = bool(getattr(options, "enable_profiling", False))
        self.profile_prefix = getattr(options, "profile_file_prefix", "hetero_exec_profile")
        plan = build.placement
        source = plan.graph if getattr(plan, "graph", None) is not None else graph
        fold = bool(getattr(options, "fold_constants", True))
        self.specs: list[SegmentSpec] = [segment_spec(source, s, fold) for s in plan.segments]
        self.slots, bundles = plan_slots(self.specs, graph.outputs, self.opts)
        demand: dict[str, float] = {}
        for b in bundles:
            for k, v in b.items():
                demand[k] = demand.get(k, 0.0) + v
        emulated = all(s.provider_kind != "gpu" for s in self.specs)
        ensure_ray(self.opts, demand, logical_gpus=emulated)
        self.slot_of: list[ActorSlot] = [
            next(sl for sl in self.slots if any(spec is x for x in sl.specs)) for spec in self.specs
        ]
        self.seam = make_transport(self.opts.seam_transport)
        self._closed = False
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._ids = itertools.count(1)
        self._inflight = threading.BoundedSemaphore(int(self.opts.max_inflight))
        self._dispatch_lock = threading.Lock()
        self._lock = threading.Lock()
        self._driver_spans = SpanRecorder()
        self.replays = 0  # requests replayed after faults, over the session's life
        self.reservation = Reservation(self.slots, bundles, self.opts, self.profiling)
        self.reservation.start()  # on failure: everything released, then the error
        self.recovery = Recovery(
            self.slots, self.slot_of, self.reservation, self.opts, is_closed=lambda: self._closed
        )
        self.compiled = None
        if self.opts.ray_compiled:
            try:
                self._start_compiled()
            except BaseException as build_error:  # the build fails whole (SEMANTICS.md 6)
                try:
                    self.reservation.release()
                except Exception as release_error:
                    raise BuildError(build_error, release_error) from build_error
                raise
        log.info("ray placement: %s", self.placement_report())

    # -- what the session reads --------------------------------------------------------

    @property
    def actors(self) -> list[Any]:
        """The segment actors' handles, one per slot (``session.segment_actors``).

        >>> ray.get(executor.actors[0].ready.remote())["segments"][0]["provider"]  # doctest: +SKIP
        'sim-gpu:0'
        """
        return [slot.handle for slot in self.slots]

    def placement_report(self) -> str:
        """Which actor runs which segment, with what it reserved.

        >>> executor.placement_report()  # doctest: +SKIP
        'segment#0 (sim-gpu:0) -> actor 0 [0.5 GPU, 14 nodes]; segment#1 (cpu) -> actor 1 ...'
        """
        parts = []
        for k, spec in enumerate(self.specs):
            slot = self.slot_of[k]
            res = f"{slot.num_gpus:g} GPU" if slot.num_gpus else f"{slot.num_cpus:g} CPU"
            parts.append(f"{spec.label} -> actor {slot.index} [{res}, {len(spec.node_ids)} nodes]")
        return "; ".join(parts)

    def segment_stats(self) -> dict[str, dict[str, float]]:
        """Per segment: runs, mean run milliseconds (measured inside its actor), compile seconds.

        >>> sess._executor.segment_stats()  # doctest: +SKIP
        {'segment#0 (sim-gpu:0)': {'runs': 3, 'mean_ms': 0.41, 'compile_s': 0.02}}
        """
        stats = ray.get([slot.handle.stats.remote() for slot in self.slots])
        out: dict[str, dict[str, float]] = {}
        for k, spec in enumerate(self.specs):
            s = stats[self.slot_of[k].index][spec.segment_id]
            out[spec.label] = {
                "runs": s["runs"],
                "compile_s": s["compile_s"],
                "mean_ms": 1e3 * s["run_s"] / s["runs"] if s["runs"] else 0.0,
            }
        return out

    def segment_timings(self) -> list[str]:
        """`segment_stats` as printable lines (what ``hetero-exec demo`` shows).

        >>> sess._executor.segment_timings()  # doctest: +SKIP
        ['segment#0 (sim-gpu:0) on actor 0: 3 runs, 0.41 ms per run, compiled in 0.02 s']
        """
        lines = []
        for k, (label, s) in enumerate(self.segment_stats().items()):
            lines.append(
                f"{label} on actor {self.slot_of[k].index}: {s['runs']:.0f} runs, "
                f"{s['mean_ms']:.2f} ms per run, compiled in {s['compile_s']:.2f} s"
            )
        return lines

    # -- running -----------------------------------------------------------------------

    def run(self, names: Sequence[str], feed: Mapping[str, Any]) -> list[Any]:
        """Run one request and wait for its outputs (thread-safe).

        >>> executor.run(["y"], {"x": np.ones((2, 32), np.float32)})[0].shape  # doctest: +SKIP
        (2, 32)
        """
        req = self._new_request(names, feed)
        with self._inflight:
            return self._serve(req)

    def run_async(self, names: Sequence[str], feed: Mapping[str, Any]) -> concurrent.futures.Future:
        """A Future of `run`'s result; blocks only while ``max_inflight`` requests are in flight.

        Feed errors raise here, before anything is dispatched; errors of the run itself
        (a KernelError naming segment, node and op; an ActorError) come from the Future.

        >>> fut = executor.run_async(["y"], {"x": x})  # doctest: +SKIP
        >>> fut.result(timeout=10)[0].shape  # doctest: +SKIP
        (2, 32)
        """
        req = self._new_request(names, feed)  # typed input errors raise here, not in the future
        self._inflight.acquire()
        try:
            if self.compiled is not None:
                return self._executor_pool().submit(self._serve_then_release, req)
            return self._start(req)
        except BaseException:
            self._inflight.release()
            raise

    def run_many(
        self, names: Sequence[str] | None, feeds: Sequence[Mapping[str, Any]]
    ) -> list[list[Any]]:
        """Every feed through the pipeline at once; results in feed order.

        >>> [out[0].shape for out in executor.run_many(None, [{"x": x}] * 3)]  # doctest: +SKIP
        [(2, 32), (2, 32), (2, 32)]
        """
        names = list(names) if names else list(self.graph.outputs)
        futures = [self.run_async(names, f) for f in feeds]
        return [f.result() for f in futures]

    def _executor_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._closed:
                raise ActorError("the session is closed")
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=int(self.opts.max_inflight), thread_name_prefix="hetero-exec-ray"
                )
            return self._pool

    def _start(self, req: Request) -> concurrent.futures.Future:
        """Dispatch ``req`` and return its Future, with no thread waiting for it.

        Ray calls back when each output lands; the last one hands the request to the
        pool, which answers it (or, after a failure, recovers and replays it there).
        A thread per waiting request costs the driver a core's worth of wake-ups on a
        small host; this costs one pool task per answer.
        """
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_running_or_notify_cancel()
        req.started_ns = time.time_ns()
        self._dispatch(req, 0)
        refs = [req.refs[n] for n in req.names if n in req.refs]
        if not refs:
            self._executor_pool().submit(self._finish, req, fut, [])
            return fut
        landed: list[concurrent.futures.Future] = [r.future() for r in refs]
        remaining = [len(landed)]
        count_lock = threading.Lock()

        def on_landed(_: concurrent.futures.Future) -> None:
            with count_lock:
                remaining[0] -= 1
                if remaining[0]:
                    return
            try:
                self._executor_pool().submit(self._finish, req, fut, landed)
            except Exception as e:  # the session closed under this request
                self._settle_future(req, fut, error=e)

        for f in landed:
            f.add_done_callback(on_landed)
        return fut

    def _finish(
        self, req: Request, fut: concurrent.futures.Future, landed: list[concurrent.futures.Future]
    ) -> None:
        """Answer a request whose outputs all landed: its values, or recovery then a replay."""
        try:
            failed = next((f.exception() for f in landed if f.exception() is not None), None)
            if failed is None:
                values = iter([f.result() for f in landed])
                out = self._assemble(req, lambda _ref: next(values))
            else:
                self._dispatch(req, self._after_failure(req, failed))
                out = self._serve_collect(req)
        except BaseException as e:
            self._settle_future(req, fut, error=e)
        else:
            self._settle_future(req, fut, result=out)

    def _settle_future(
        self,
        req: Request,
        fut: concurrent.futures.Future,
        result: list[Any] | None = None,
        error: BaseException | None = None,
    ) -> None:
        try:
            self._forget(req)
            if self.profiling:
                self._driver_spans.record(
                    f"request {req.id}", req.started_ns, "request", {"replays": req.replays}
                )
        finally:
            self._inflight.release()  # before the answer: a caller woken by it may submit again
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)

    def _serve_then_release(self, req: Request) -> list[Any]:
        try:
            return self._serve(req)
        finally:
            self._inflight.release()

    def _new_request(self, names: Sequence[str], feed: Mapping[str, Any]) -> Request:
        if self._closed:
            raise ActorError("the session is closed")
        ordered, _symbols = self.checker.check(feed)
        feeds = {}
        for name, v in zip(self.graph.inputs, ordered):
            if v is None:
                continue
            if isinstance(v, np.ndarray) and v.nbytes >= PUT_FEED_BYTES:
                v = ray.put(v)  # once per request, however many segments (and replays) read it
            feeds[name] = v
        return Request(next(self._ids), list(names), feeds)

    def _serve(self, req: Request) -> list[Any]:
        started = time.time_ns()
        try:
            compiled = self.compiled
            if compiled is not None:
                try:
                    return compiled.run(req, self)
                except CompiledGraphFailure as e:
                    self._drop_compiled(compiled, e)  # then serve it on the task path
            self._dispatch(req, 0)
            return self._serve_collect(req)
        finally:
            self._forget(req)
            if self.profiling:
                self._driver_spans.record(
                    f"request {req.id}", started, "request", {"replays": req.replays}
                )

    def _serve_collect(self, req: Request) -> list[Any]:
        """The outputs of a dispatched request, recovering and replaying after faults."""
        while True:
            try:
                return self._collect(req)
            except Exception as e:
                self._dispatch(req, self._after_failure(req, e))

    def _dispatch(self, req: Request, start: int) -> None:
        """Submit segments ``start..`` of ``req`` (atomically, so actors see requests in order)."""
        attempt: list[Any] = []
        with self._dispatch_lock:
            for k in range(start, len(self.specs)):
                spec, slot = self.specs[k], self.slot_of[k]
                args = [req.refs[n] if n in req.refs else req.feeds.get(n) for n in spec.inputs]
                n_out = len(spec.outputs)
                if self.profiling:
                    refs = slot.handle.run_fetching.options(num_returns=n_out).remote(
                        req.id, spec.segment_id, args
                    )
                else:
                    refs = slot.handle.run.options(num_returns=n_out).remote(
                        req.id, spec.segment_id, *args
                    )
                refs = [refs] if n_out == 1 else list(refs)
                req.refs.update(zip(spec.outputs, refs))
                attempt.extend(refs)
                req.incarnations[slot.index] = slot.incarnation
        req.attempt = attempt

    def _collect(self, req: Request) -> list[Any]:
        """Fetch the graph outputs (and only those) of ``req``."""
        refs = [req.refs[n] for n in req.names if n in req.refs]
        values = iter(ray.get(refs))
        return self._assemble(req, lambda _ref: next(values))

    def _assemble(self, req: Request, value_of: Any) -> list[Any]:
        """The requested outputs in order; ``value_of(ref)`` gives each produced value, in
        the order of ``req.names``."""
        out: list[Any] = []
        for name in req.names:
            if name in req.refs:
                out.append(self.seam.read(SeamKey(req.id, name), value_of(req.refs[name])))
            elif name in req.feeds:  # a graph input that is also an output
                v = req.feeds[name]
                out.append(ray.get(v) if isinstance(v, ray.ObjectRef) else v)
            else:  # an initializer that is also an output
                out.append(self.graph.initializers.get(name))
        return out

    # -- faults ----------------------------------------------------------------------

    def _after_failure(self, req: Request, error: Exception) -> int:
        """Raise the error a caller should see, or recover and return where to replay from."""
        log.debug("request %d failed: %s", req.id, type(root_cause(error)).__name__)
        self.recovery.settle(req)
        log.debug("request %d settled", req.id)
        typed = user_error(error)
        if typed is not None:
            raise typed from None
        if self._closed:  # the actors were released under this request: nothing to recover
            raise ActorError(f"request {req.id} was in flight when the session closed") from error
        if not is_fault(error):
            raise ActorError(f"request {req.id} failed: {root_cause(error)!r}") from error
        start = self.recovery.replay_start(
            req
        )  # even if this request gives up: the next ones need the actors
        req.replays += 1
        if req.replays > self.opts.max_replays:
            raise ActorError(
                f"request {req.id} failed after {self.opts.max_replays} replay(s): "
                f"{type(root_cause(error)).__name__}: {root_cause(error)}"
            ) from error
        with self._lock:
            self.replays += 1
        log.warning(
            "request %d hit %s; replaying from %s (replay %d of %d)",
            req.id,
            type(root_cause(error)).__name__,
            self.specs[start].label,
            req.replays,
            self.opts.max_replays,
        )
        return start

    def _forget(self, req: Request) -> None:
        for slot in self.slots:
            if slot.local_values and slot.handle is not None:
                slot.handle.drop.remote(req.id)  # device-local values of this request
        req.refs.clear()
        req.attempt = []

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
        """Write the Chrome trace (driver lane, then one lane per actor); returns its path.

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
            if self._closed:
                return
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        if self.compiled is not None:
            self.compiled.close()
        self.reservation.release()
