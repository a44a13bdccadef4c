"""Dynamic batching along the batch dimension, for the Serve replica (no Ray here).

A model is batchable when every input's first dim is one shared symbol (``N``) and every
output's first dim is that symbol too: requests can then be stacked along dim 0 and
the outputs cut back into per-request rows. Requests are only stacked with requests
of the same `Job.key` (input names, dtypes and trailing shapes, requested outputs), so
requests of different shapes are never mixed in one run.

>>> import numpy as np, onnx.helper as h
>>> from hetero_exec import InferenceSession
>>> g = h.make_graph([h.make_node("Relu", ["x"], ["y"])], "g",
...     [h.make_tensor_value_info("x", 1, ["N", 2])], [h.make_tensor_value_info("y", 1, ["N", 2])])
>>> sess = InferenceSession(h.make_model(g))
>>> rule = BatchRule(sess)
>>> jobs = [rule.job({"x": np.full((n, 2), -n, np.float32)}, ["y"]) for n in (1, 2)]
>>> [r[0].shape for r in run_jobs(sess, jobs)], rule.symbol
([(1, 2), (2, 2)], 'N')
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping, Sequence

import numpy as np

log = logging.getLogger(__name__)


@dataclass
class Job:
    """One request's run: its feed, the outputs it wants, its rows (None: not batchable)."""

    feed: dict[str, np.ndarray]
    outputs: list[str]
    rows: int | None
    key: tuple[Any, ...]


class BatchRule:
    """Which dim is the batch dim of a session's model (``symbol``), if any."""

    def __init__(self, session: Any):
        graph = session.graph
        inputs = [a.name for a in session.get_inputs()]
        firsts = {_first_dim(graph.value(n)) for n in inputs}
        firsts |= {_first_dim(graph.value(n)) for n in graph.outputs}
        symbol = firsts.pop() if len(firsts) == 1 else None
        self.symbol: str | None = symbol if isinstance(symbol, str) else None

    def job(self, feed: Mapping[str, np.ndarray], outputs: Sequence[str]) -> Job:
        rows = None
        if self.symbol is not None:
            firsts = {a.shape[0] for a in feed.values() if a.ndim}
            if len(firsts) == 1 and all(a.ndim for a in feed.values()):
                rows = firsts.pop()
        key = (tuple(sorted((n, a.dtype.str, a.shape[1:]) for n, a in feed.items())),
               tuple(outputs))
        return Job(dict(feed), list(outputs), rows, key)


def _first_dim(value: Any) -> Any:
    if value.kind != "tensor" or not value.shape:
        return None
    return value.shape[0]


def run_jobs(session: Any, jobs: Sequence[Job]) -> list[list[np.ndarray] | BaseException]:
    """Each job's outputs (or its error), running jobs of one key as one stacked run.

    A stacked run that fails is retried job by job, so an error is answered only to the
    request that caused it.
    """
    results: list[list[np.ndarray] | BaseException | None] = [None] * len(jobs)
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, job in enumerate(jobs):
        groups.setdefault(job.key if job.rows is not None else ("single", i), []).append(i)
    for members in groups.values():
        group = [jobs[i] for i in members]
        outs = _run_stacked(session, group) if len(group) > 1 else None
        if outs is None:
            outs = [_run_one(session, job) for job in group]
        for i, out in zip(members, outs):
            results[i] = out
    return results  # type: ignore[return-value]


def _run_one(session: Any, job: Job) -> list[np.ndarray] | BaseException:
    try:
        return session.run(job.outputs, job.feed)
    except Exception as e:  # answered to this request alone
        return e


def _run_stacked(session: Any, group: Sequence[Job]) -> list[list[np.ndarray]] | None:
    names = list(group[0].feed)
    feed = {n: np.concatenate([j.feed[n] for j in group]) for n in names}
    try:
        outs = session.run(group[0].outputs, feed)
    except Exception as e:
        log.info("a stacked run of %d requests failed (%s); running them one by one",
                 len(group), e)
        return None
    total = sum(j.rows for j in group)  # type: ignore[misc]
    if any(np.ndim(o) == 0 or np.shape(o)[0] != total for o in outs):
        return None  # an output without one row per input row: run each on its own
    cuts = np.cumsum([j.rows for j in group])[:-1]
    per_output = [np.split(o, cuts) for o in outs]
    return [[parts[k] for parts in per_output] for k in range(len(group))]


class RunQueue:
    """Requests wait here while the replica's runs are busy; a runner that comes free
    takes every waiting request it can stack (one key, up to ``max_rows`` rows) as one run.

    An idle replica runs a lone request at once; under load a batch grows to what arrived
    while the run before it ran, which is what dynamic batching is for. ``runners``
    bounds the runs in flight: one for a replica that runs its plan itself on the CPU it
    reserved (two runs there would take the core the HTTP proxy delivers requests on,
    so batches would stay small); more when the runs go to pipelined stage actors.
    ``wait_s`` > 0: a batch waits that long to fill once its first request came.

    >>> import asyncio, numpy as np
    >>> async def run(jobs):  # stands for the session: one result per job
    ...     return [[j.feed["x"] * 2] for j in jobs]
    >>> q = RunQueue(run, max_rows=4)
    >>> jobs = [Job({"x": np.ones((1, 2))}, ["y"], 1, ("k",)) for _ in range(3)]
    >>> async def main():
    ...     return await asyncio.gather(*(q.submit(j) for j in jobs))
    >>> [r[0].tolist() for r in asyncio.run(main())], q.runs
    ([[[2.0, 2.0]], [[2.0, 2.0]], [[2.0, 2.0]]], 2)
    """

    def __init__(self, run: Callable[[list[Job]], Awaitable[list[Any]]], max_rows: int,
                 runners: int = 1, wait_s: float = 0.0):
        self._run = run
        self.max_rows = max(1, int(max_rows))
        self.runners = max(1, int(runners))
        self.wait_s = float(wait_s)
        self._pending: list[tuple[Job, asyncio.Future]] = []
        self._busy = 0
        self.runs = 0  # session runs started (a stacked run counts once)

    @property
    def busy(self) -> int:
        return self._busy

    async def submit(self, job: Job) -> Any:
        """This job's result (its outputs, or the exception its run raised)."""
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((job, fut))
        self._start()
        return await fut

    def _start(self) -> None:
        while self._busy < self.runners and self._pending:
            batch = self._take([])
            self._busy += 1
            asyncio.get_running_loop().create_task(self._runner(batch))

    def _take(self, batch: list[tuple[Job, asyncio.Future]]) -> list[tuple[Job, asyncio.Future]]:
        """``batch`` topped up from the queue, in arrival order: the jobs of its first
        job's key, up to the first that would not fit (a job that cannot be stacked runs
        alone; jobs of other keys keep their places)."""
        if not batch:
            batch.append(self._pending.pop(0))
        first = batch[0][0]
        if first.rows is None:
            return batch
        rows = sum(j.rows or 0 for j, _ in batch)
        keep = []
        for k, item in enumerate(self._pending):
            job = item[0]
            if job.rows is None or job.key != first.key:
                keep.append(item)
            elif rows + job.rows > self.max_rows:
                keep.extend(self._pending[k:])
                break
            else:
                batch.append(item)
                rows += job.rows
        self._pending = keep
        return batch

    async def _runner(self, batch: list[tuple[Job, asyncio.Future]]) -> None:
        try:
            if self.wait_s > 0 and batch[0][0].rows is not None:
                await asyncio.sleep(self.wait_s)
                batch = self._take(batch)
            self.runs += 1
            try:
                results = await self._run([j for j, _ in batch])
            except Exception as e:  # the run itself broke: each of its requests is told
                results = [e] * len(batch)
            for (_, fut), result in zip(batch, results):
                if not fut.done():
                    fut.set_result(result)
        finally:
            self._busy -= 1
            self._start()
