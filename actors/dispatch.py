"""Dispatch: a group of requests' stage tasks, submitted in order, and their outputs read.

Every stage's task for a group is submitted at once: a seam value is the ObjectRef
one stage's task returns and the next takes, so it goes actor to actor and the driver
fetches only graph outputs. Actors run their tasks in submission order, so while stage
2 works on request k, stage 1 already works on k+1. Submission holds one lock, so no
actor sees requests out of order, and each task carries the oldest request still in
flight (the *floor*): what older requests held in the seam transport can be reused.
"""

from __future__ import annotations

import threading
from typing import Any, Mapping, Sequence

import numpy as np
import ray

from actors.request import Request, graph_outputs
from actors.reservation import ActorSlot
from actors.transport.base import SeamKey, Transport
from hetero_exec.ir.graph import Graph

#: feeds at least this large are put in the object store once per group of requests
PUT_FEED_BYTES = 64 * 1024


class Dispatcher:
    """Submits stage tasks for groups of requests; reads their graph outputs back.

    >>> dispatcher.dispatch([request], start=0)  # doctest: +SKIP
    >>> dispatcher.collect(request)  # doctest: +SKIP
    """

    def __init__(self, graph: Graph, slots: Sequence[ActorSlot], seam: Transport,
                 profiling: bool = False):
        self.graph = graph
        self.slots = slots  # one per stage, in order
        self.seam = seam  # the driver's end: large feeds out, graph outputs in
        self.profiling = profiling
        self._open: set[int] = set()  # dispatched, not yet answered (the floor)
        self._lock = threading.Lock()

    def dispatch(self, reqs: list[Request], start: int) -> None:
        """Submit stages ``start..`` for a group of requests, one task per stage, atomically."""
        attempt: list[Any] = []
        ids = [r.id for r in reqs]
        if start == 0:
            self.put_feeds(reqs)
        with self._lock:
            # under the lock, so no task can carry a floor above a request in flight
            self._open.update(ids)
            floor = min(self._open)
            for slot in self.slots[start:]:
                spec = slot.spec
                if not spec.outputs:
                    continue  # only nodes whose values nothing reads: nothing to run for
                layout, flat = self.layout(reqs, spec.inputs)
                n_out = len(spec.outputs)
                method = slot.method(n_out, self.profiling)
                meta = (ids, layout, floor)
                refs = method.remote(meta, flat) if self.profiling else method.remote(meta, *flat)
                refs = [refs] if n_out == 1 else list(refs)
                for j, req in enumerate(reqs):
                    req.refs.update((name, (ref, j)) for name, ref in zip(spec.outputs, refs))
                    req.incarnations[slot.index] = slot.incarnation
                attempt.extend(refs)
        for req in reqs:
            req.attempt = attempt

    def put_feeds(self, reqs: list[Request]) -> None:
        """Large feeds go to shared memory (one node), else to the object store once per
        input per group, however many stages and replays read them; the requests then
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

    @staticmethod
    def layout(reqs: list[Request], inputs: Sequence[str]) -> tuple[tuple, list[Any]]:
        """The flat task arguments for a group and where each request's inputs are in
        them: a group output ref (top level, so Ray resolves it) is passed once.

        >>> r1, r2 = Request(1, [], {"x": 1}), Request(2, [], {"x": 2})
        >>> r1.refs["h"] = r2.refs["h"] = ("ref", 0)
        >>> r2.refs["h"] = ("ref", 1)
        >>> Dispatcher.layout([r1, r2], ["h", "x"])
        ((((0, 0), (0, 1)), ((1, None), (2, None))), ['ref', 1, 2])
        """
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

    def output_refs(self, req: Request) -> list[Any]:
        return list(dict.fromkeys(req.refs[n][0] for n in req.names if n in req.refs))

    def collect(self, req: Request) -> list[Any]:
        """Fetch the graph outputs (and only those) of ``req``."""
        refs = self.output_refs(req)
        return self.assemble(req, dict(zip(refs, ray.get(refs))))

    def assemble(self, req: Request, values: Mapping[Any, Any]) -> list[Any]:
        """The requested outputs in order, from the fetched group values (by ref).

        Raises the request's `SegmentRunError` when its own run failed."""
        produced = {name: values[ref][index] for name, (ref, index) in req.refs.items()
                    if name in req.names}
        return graph_outputs(req.names, produced, req.feeds, self.graph.initializers,
                             lambda name, v: self.seam.take(SeamKey(req.id, name), v))

    def forget(self, req: Request) -> None:
        """``req`` is answered: it no longer holds the floor, nor its feeds' buffers."""
        with self._lock:
            self._open.discard(req.id)
        self.seam.drop(req.id)
        req.refs.clear()
        req.attempt = []
