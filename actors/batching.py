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

import logging
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

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
