"""Ray Compiled Graphs (``ray.dag`` ``experimental_compile``): a second way to run a
static stage chain, beside the task path (`actors.dispatch`).

The task path submits one actor task per stage per request; a compiled graph
instead sets up shared-memory channels between the actors once, and each execution
writes the feed into the first channel. `CompiledChain` builds that graph over the
session's stage actors: each stage node takes the feed dict and/or the output
dicts of the stages it reads from, and the driver merges the output dicts of the
stages that produce graph outputs.

It is opt-in (``ray_compiled=True``) and evaluated against the task path in
``bench/bench_ray.py``: on a 2-core machine its readers poll and compete for the
cores. What it gives up: no shared-memory seams, no per-seam profile spans, and no
replay inside the graph: when an execution fails for any reason other than a
stage's own typed error (an actor fault, a channel timeout), the coordinator
tears the compiled graph down and serves that request, and every later one, on the
task path, with its replays.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
from typing import Any, Sequence

import numpy as np
import ray

from actors.remote_errors import root_cause, user_error
from actors.request import Request, graph_outputs
from hetero_exec.errors import ActorError

log = logging.getLogger(__name__)


class CompiledGraphFailure(ActorError):
    """The compiled graph itself failed (channel timeout, torn down, actor lost)."""


class CompiledChain:
    """A compiled Ray DAG over stage actors: ``run_feeds(feeds) -> {name: value}``.

    Needs a cluster and started stage actors, so its example does not run here:

    >>> chain = CompiledChain([s.handle for s in slots], specs, graph)  # doctest: +SKIP
    >>> chain.run(request)  # doctest: +SKIP
    [array([...], dtype=float32)]
    >>> chain.close()  # doctest: +SKIP
    """

    def __init__(
        self,
        handles: Sequence[Any],
        specs: Sequence[Any],
        graph: Any,
        max_inflight: int = 8,
        buffer_size_bytes: int | None = None,
    ):
        """A chain over ``handles`` (stage actors, in order) running ``specs``, for the
        outputs of ``graph``, with at most ``max_inflight`` executions in flight."""
        from ray.dag import InputNode, MultiOutputNode

        self.specs = list(specs)
        self.initializers = graph.initializers
        producer: dict[str, int] = {}
        nodes: list[Any] = []
        with InputNode() as feed:
            for k, (handle, spec) in enumerate(zip(handles, specs)):
                sources = sorted({producer[n] for n in spec.inputs if n in producer})
                args = [feed] + [nodes[j] for j in sources]
                nodes.append(handle.run_dict.bind(*args))
                producer.update({o: k for o in spec.outputs})
            # the producers of graph outputs come back to the driver, and so must every
            # leaf (a compiled graph has no dangling nodes)
            read = {producer[n] for s in specs for n in s.inputs if n in producer}
            leaves = {k for k in range(len(specs)) if k not in read}
            self.returned = sorted(leaves | {producer[o] for o in graph.outputs if o in producer})
            dag = MultiOutputNode([nodes[k] for k in self.returned])
        self.producer = producer
        self.dag = dag.experimental_compile(
            _max_inflight_executions=max_inflight, _buffer_size_bytes=buffer_size_bytes
        )
        self._lock = threading.Lock()
        self._closed = False
        self._pending: queue.Queue = queue.Queue()
        self._fetcher = threading.Thread(target=self._fetch_loop, name="hetero-exec-compiled-fetch",
                                         daemon=True)
        self._fetcher.start()
        log.info("compiled a Ray graph over %d stage actor(s)", len(handles))

    def run_feeds(self, feeds: dict[str, Any]) -> dict[str, Any]:
        """One execution: the feed dict in, every returned segment's outputs merged.

        Executions pipeline: each is submitted in order under a lock, and one fetcher
        thread reads the results in submission order (concurrent gets of compiled refs
        from several threads stalled the channels on Ray 2.60), so while the last actor
        works on execution k the first already works on k+1.
        """
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise CompiledGraphFailure("compiled graph is closed")
            try:
                ref = self.dag.execute(feeds)
            except Exception as e:  # noqa: BLE001 - re-raised typed
                raise CompiledGraphFailure(f"compiled graph submit failed: {root_cause(e)!r}") from e
            self._pending.put((ref, fut))
        return fut.result()

    def _fetch_loop(self) -> None:
        """Results in submission order, each copied out of its channel buffer."""
        while True:
            item = self._pending.get()
            if item is None:
                return
            ref, fut = item
            try:
                dicts = ray.get(ref)
            except Exception as e:  # noqa: BLE001 - handed to the waiting caller, typed
                typed = user_error(e)
                fut.set_exception(typed if typed is not None else CompiledGraphFailure(
                    f"compiled graph execution failed: {root_cause(e)!r}"))
                continue
            merged: dict[str, Any] = {}
            for d in dicts:
                # copy out of the channel's shared-memory buffer: an array the caller keeps
                # would pin the buffer, and the graph stalls once every buffer is pinned
                merged.update({k: np.array(v, copy=True) if isinstance(v, np.ndarray) else v
                               for k, v in d.items()})
            fut.set_result(merged)

    def run(self, req: Request) -> list[Any]:
        """A coordinator request's outputs, run on the compiled graph."""
        feeds = {
            k: (ray.get(v) if isinstance(v, ray.ObjectRef) else v) for k, v in req.feeds.items()
        }
        return graph_outputs(req.names, self.run_feeds(feeds), feeds, self.initializers)

    def close(self) -> None:
        """Stop taking executions and tear the graph down (a second call does nothing)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._pending.put(None)
        self._fetcher.join(timeout=30)
        try:
            self.dag.teardown()
        except Exception as e:  # noqa: BLE001 - teardown of a broken graph
            log.warning("compiled graph teardown: %s", e)
