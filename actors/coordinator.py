"""RayExecutor: a PlacementPlan run by segment actors, pipelined and fault tolerant.

The coordinator holds no weights and no activations. For each request it checks the
feeds (typed errors, before anything is dispatched), then submits every segment's
task at once: seam values are the ObjectRefs one task returns and the next takes,
so they go actor to actor and the driver fetches only graph outputs. Actors run
their tasks in submission order, so while stage 2 works on request k stage 1 already
works on k+1; at most ``max_inflight`` requests are in flight (callers block beyond).

Ray's fixed cost per task and per object (a few ms of CPU on a small host) is what
limits a pipeline, so two things cut how often it is paid: `run_many` sends requests
in groups (one task per segment and one object per output for up to ``coalesce``
requests, each request still run on its own), and on a one-node cluster seams travel
through shared memory (`actors.transport.shared_memory`), with only a small
descriptor going through Ray.

When an actor dies, the requests that were in flight through it are replayed from
the first segment it hosts, with the seam refs and feeds the request kept: Ray
restarts the actor (or the coordinator re-creates it), it reloads its weights, and
each request still gets exactly one answer. Bounded replays end in ActorError.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import logging
import threading
import time
import uuid
from typing import Any, Mapping, Sequence

import numpy as np
import ray

from actors.connect import ensure_ray
from actors.options import RayOptions
from actors.profile import SpanRecorder, write_trace
from actors.recovery import Recovery
from actors.remote_errors import FailedValue, SegmentRunError, is_fault, root_cause, user_error
from actors.request import InflightLimit, Request
from actors.reservation import ActorSlot, Reservation, plan_slots
from actors.segment_model import SegmentSpec, segment_spec
from actors.transport import make_transport
from actors.transport.base import SeamKey, Transport
from actors.transport.compiled import CompiledGraphFailure
from actors.transport.shared_memory import SeamUnreachable
from hetero_exec.errors import ActorError, BuildError
from hetero_exec.exec.feeds import FeedChecker
from hetero_exec.ir.graph import Graph

log = logging.getLogger(__name__)

#: feeds at least this large are put in the object store once per group of requests
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
        self.shm_prefix = f"hetero_exec-{uuid.uuid4().hex[:12]}"
        if self.opts.seam_transport == "auto":
            self.opts.seam_transport = auto_transport()
        self.slot_of: list[ActorSlot] = [
            next(sl for sl in self.slots if any(spec is x for x in sl.specs)) for spec in self.specs
        ]
        self.seam = self._driver_transport()
        self._open: set[int] = set()  # dispatched, not yet answered (the floor in _dispatch)
        self._waiting: dict[int, tuple[Request, concurrent.futures.Future]] = {}  # run_async
        self._queue: collections.deque = collections.deque()  # run_async, not yet dispatched
        self._drain_lock = threading.Lock()  # held by the thread dispatching the queue
        self._closed = False
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._ids = itertools.count(1)
        self._inflight = InflightLimit(int(self.opts.max_inflight))
        self._dispatch_lock = threading.Lock()
        self._lock = threading.Lock()
        self._driver_spans = SpanRecorder()
        self.replays = 0  # requests replayed after faults, over the session's life
        self.reservation = Reservation(
            self.slots, bundles, self.opts, self.profiling, shm_prefix=self.shm_prefix
        )
        try:
            self.reservation.start()  # on failure: everything released, then the error
        except BaseException:
            self.seam.close()  # the driver's buffers (the actors' go with their processes)
            raise
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
                    self.seam.close()
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
        """Per segment: requests run, Ray tasks that ran them, mean run milliseconds per
        request (measured inside its actor), compile seconds.

        >>> sess._executor.segment_stats()  # doctest: +SKIP
        {'segment#0 (sim-gpu:0)': {'runs': 3, 'tasks': 3, 'mean_ms': 0.41, 'compile_s': 0.02}}
        """
        stats = ray.get([slot.handle.stats.remote() for slot in self.slots])
        out: dict[str, dict[str, float]] = {}
        for k, spec in enumerate(self.specs):
            s = stats[self.slot_of[k].index][spec.segment_id]
            out[spec.label] = {
                "runs": s["runs"],
                "tasks": s["tasks"],
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
        self._inflight.acquire(1)
        try:
            return self._serve(req)
        finally:
            self._inflight.release(1)

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
        self._inflight.acquire(1)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.append((req, fut))
        self._drain()
        return fut

    def _drain(self) -> None:
        """Dispatch what run_async queued, up to ``coalesce`` requests per task.

        Whoever finds the dispatcher free dispatches everything queued, its own request
        first if it is alone (so a lone request waits for nothing); requests that other
        threads queue meanwhile go out together in the next group. A caller that finds
        the dispatcher busy leaves its request to it: the dispatcher looks at the queue
        again after letting go, so nothing is stranded.
        """
        limit = self._group_limit()
        while self._queue:
            if not self._drain_lock.acquire(blocking=False):
                return
            try:
                while self._queue:
                    group = []
                    while self._queue and len(group) < limit:
                        group.append(self._queue.popleft())
                    self._start(group)
            finally:
                self._drain_lock.release()

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
        return max(1, min(self._group_limit(), requests // 16))

    def _group_limit(self) -> int:
        """The most requests one task may carry: ``coalesce``, within ``max_inflight``."""
        return max(1, min(int(self.opts.coalesce), int(self.opts.max_inflight)))

    def _executor_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._closed:
                raise ActorError("the session is closed")
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=int(self.opts.max_inflight), thread_name_prefix="hetero-exec-ray"
                )
            return self._pool

    def _submit(self, reqs: list[Request]) -> list[concurrent.futures.Future]:
        """Take ``len(reqs)`` in-flight places (blocking), dispatch as one group, return
        the Futures."""
        self._inflight.acquire(len(reqs))
        if self.compiled is not None:
            try:
                pool = self._executor_pool()
                return [pool.submit(self._serve_then_release, r) for r in reqs]
            except BaseException:
                self._inflight.release(len(reqs))
                raise
        group = [(r, concurrent.futures.Future()) for r in reqs]
        self._start(group)
        return [fut for _, fut in group]

    def _start(self, group: list[tuple[Request, concurrent.futures.Future]]) -> None:
        """Dispatch a group whose places are taken; its Futures answer, no thread waits.

        Ray calls back when each output lands; the last one hands the group to the
        pool, which answers it (or, after a failure, recovers and replays each request
        there). A thread per waiting request costs the driver a core's worth of
        wake-ups on a small host; this costs one pool task per group. A dispatch that
        fails answers the group's Futures with the error.
        """
        reqs = [req for req, _ in group]
        futures = [fut for _, fut in group]
        with self._lock:
            for req, fut in group:
                fut.set_running_or_notify_cancel()
                self._waiting[req.id] = (req, fut)
        started = time.time_ns()
        for req in reqs:
            req.started_ns = started
        try:
            if self._closed:
                raise ActorError("the session is closed")
            self._dispatch(reqs, 0)
        except BaseException as e:
            for req, fut in group:
                self._settle_future(req, fut, error=e)
            return
        needed = list(dict.fromkeys(r.refs[n][0] for r in reqs for n in r.names if n in r.refs))
        landed = {ref: ref.future() for ref in needed}
        remaining = [len(landed)]
        count_lock = threading.Lock()

        def on_landed(_: concurrent.futures.Future | None) -> None:
            with count_lock:
                remaining[0] -= 1
                if remaining[0] > 0:
                    return
            try:
                self._executor_pool().submit(self._finish, reqs, futures, landed)
            except Exception as e:  # the session closed under these requests
                for req, fut in zip(reqs, futures):
                    self._settle_future(req, fut, error=e)

        if not landed:
            remaining[0] = 1
            on_landed(None)
        for f in landed.values():
            f.add_done_callback(on_landed)

    def _finish(
        self,
        reqs: list[Request],
        futures: list[concurrent.futures.Future],
        landed: dict[Any, concurrent.futures.Future],
    ) -> None:
        """Answer a group whose outputs all landed; after a fault, recover each request."""
        failure = next((f.exception() for f in landed.values() if f.exception()), None)
        if failure is not None:
            log.debug("a group of %d request(s) failed: %s", len(reqs), type(failure).__name__)
            for req, fut in zip(reqs, futures):
                self._recover_later(req, fut, failure)
            return
        values = {ref: f.result() for ref, f in landed.items()}
        for req, fut in zip(reqs, futures):
            try:
                out = self._assemble(req, values)
            except SegmentRunError as e:  # this request's own run failed; not the others'
                self._settle_future(req, fut, error=user_error(e) or e)
            except SeamUnreachable as e:  # its writer died after answering: a fault
                self._recover_later(req, fut, e)
            except BaseException as e:
                self._settle_future(req, fut, error=e)
            else:
                self._settle_future(req, fut, result=out)

    def _recover_later(
        self, req: Request, fut: concurrent.futures.Future, failure: BaseException
    ) -> None:
        """Recover and replay ``req`` on the pool (it blocks on Ray), each request apart."""
        try:
            self._executor_pool().submit(self._recover, req, fut, failure)
        except Exception as e:  # the session closed: nothing left to replay on
            self._settle_future(req, fut, error=e)

    def _recover(self, req: Request, fut: concurrent.futures.Future, failure: Exception) -> None:
        try:
            self._dispatch([req], self._after_failure(req, failure))
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
        with self._lock:
            if self._waiting.pop(req.id, None) is None:
                return  # close() already answered it
        try:
            self._forget(req)
        finally:
            self._inflight.release(1)  # before the answer: a caller woken by it may submit again
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)

    def _serve_then_release(self, req: Request) -> list[Any]:
        try:
            return self._serve(req)
        finally:
            self._inflight.release(1)

    def _new_request(self, names: Sequence[str], feed: Mapping[str, Any]) -> Request:
        if self._closed:
            raise ActorError("the session is closed")
        ordered, _symbols = self.checker.check(feed)
        feeds = {name: v for name, v in zip(self.graph.inputs, ordered) if v is not None}
        return Request(next(self._ids), list(names), feeds)

    def _put_feeds(self, reqs: list[Request]) -> None:
        """Large feeds go to shared memory (one node), else to the object store once per
        input per group, however many segments and replays read them; the requests then
        carry them like seam values."""
        def large(v: Any) -> bool:
            return isinstance(v, np.ndarray) and v.nbytes >= PUT_FEED_BYTES

        for name in list(reqs[0].feeds):
            for r in reqs:
                if large(r.feeds.get(name)):
                    r.feeds[name] = self.seam.write(SeamKey(r.id, name), r.feeds[name])
            if not all(large(r.feeds.get(name)) for r in reqs):
                continue
            ref = ray.put([r.feeds.pop(name) for r in reqs])
            for j, req in enumerate(reqs):
                req.refs[name] = (ref, j)

    def _serve(self, req: Request) -> list[Any]:
        req.started_ns = time.time_ns()
        try:
            compiled = self.compiled
            if compiled is not None:
                try:
                    return compiled.run(req, self)
                except CompiledGraphFailure as e:
                    self._drop_compiled(compiled, e)  # then serve it on the task path
            self._dispatch([req], 0)
            return self._serve_collect(req)
        finally:
            self._forget(req)

    def _serve_collect(self, req: Request) -> list[Any]:
        """The outputs of a dispatched request, recovering and replaying after faults."""
        while True:
            try:
                return self._collect(req)
            except Exception as e:
                self._dispatch([req], self._after_failure(req, e))

    def _dispatch(self, reqs: list[Request], start: int) -> None:
        """Submit segments ``start..`` for a group of requests, one task per segment
        (atomically, so actors see requests in order)."""
        attempt: list[Any] = []
        ids = [r.id for r in reqs]
        if start == 0:
            self._put_feeds(reqs)
        with self._dispatch_lock:
            # under the lock, so no task can carry a floor above a request in flight
            self._open.update(ids)
            floor = min(self._open)
            for k in range(start, len(self.specs)):
                spec, slot = self.specs[k], self.slot_of[k]
                layout, flat = self._layout(reqs, spec.inputs)
                n_out = len(spec.outputs)
                method = slot.method(n_out, self.profiling)
                meta = (ids, spec.segment_id, layout, floor)
                refs = method.remote(meta, flat) if self.profiling else method.remote(meta, *flat)
                refs = [refs] if n_out == 1 else list(refs)
                for j, req in enumerate(reqs):
                    req.refs.update((name, (ref, j)) for name, ref in zip(spec.outputs, refs))
                    req.incarnations[slot.index] = slot.incarnation
                attempt.extend(refs)
        for req in reqs:
            req.attempt = attempt

    @staticmethod
    def _layout(reqs: list[Request], inputs: Sequence[str]) -> tuple[tuple, list[Any]]:
        """The flat task arguments for a group and where each request's inputs are in
        them: a group output ref (top level, so Ray resolves it) is passed once."""
        flat: list[Any] = []
        position: dict[Any, int] = {}
        layout = []
        for name in inputs:
            entries = []
            for req in reqs:
                carried = req.refs.get(name)
                if carried is not None:
                    ref, index = carried
                    pos = position.get(ref)
                    if pos is None:
                        pos = position[ref] = len(flat)
                        flat.append(ref)
                    entries.append((pos, index))
                else:  # a feed (array, its ObjectRef, or None when optional and absent)
                    entries.append((len(flat), None))
                    flat.append(req.feeds.get(name))
            layout.append(tuple(entries))
        return tuple(layout), flat

    def _collect(self, req: Request) -> list[Any]:
        """Fetch the graph outputs (and only those) of ``req``."""
        refs = list(dict.fromkeys(req.refs[n][0] for n in req.names if n in req.refs))
        return self._assemble(req, dict(zip(refs, ray.get(refs))))

    def _assemble(self, req: Request, values: Mapping[Any, Any]) -> list[Any]:
        """The requested outputs in order, from the fetched group values (by ref).

        Raises the request's `SegmentRunError` when its own run failed."""
        out: list[Any] = []
        for name in req.names:
            if name in req.refs:
                ref, index = req.refs[name]
                v = values[ref][index]
                if isinstance(v, FailedValue):
                    raise v.error
                out.append(self.seam.take(SeamKey(req.id, name), v))
            elif name in req.feeds:  # a graph input that is also an output
                out.append(self.seam.take(SeamKey(req.id, name), req.feeds[name]))
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
        with self._dispatch_lock:
            self._open.discard(req.id)
        self.seam.drop(req.id)  # the driver's shared-memory feeds of this request
        req.refs.clear()
        req.attempt = []
        if self.profiling:
            self._driver_spans.record(
                f"request {req.id}", req.started_ns, "request", {"replays": req.replays}
            )

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
        with self._lock:  # requests whose answer the pool will now never give
            waiting, self._waiting = list(self._waiting.values()), {}
        while True:  # and those queued but not dispatched
            try:
                waiting.append(self._queue.popleft())
            except IndexError:
                break
        for req, fut in waiting:
            self._inflight.release(1)
            if not fut.done():
                fut.set_exception(
                    ActorError(f"request {req.id} was in flight when the session closed")
                )
        if self.compiled is not None:
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
