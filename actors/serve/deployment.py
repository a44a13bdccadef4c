"""The Serve deployment: one session per replica, its requests batched.

Requests that arrive while a replica's runs are busy wait in a `RunQueue` and are
stacked along the batch dimension into the next run (`actors.batching`: only requests
of one shape are stacked); an idle replica runs a lone request at once. The HTTP
routes are `actors.serve.routes`; what a replica reserves is
`actors.serve.replicas`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from actors.batching import BatchRule, Job, RunQueue, run_jobs
from actors.oip import (
    HEADER_LENGTH,
    ProtocolError,
    datatype_name,
    infer_response,
    parse_infer_request,
)
from actors.serve.one_write import answer_in_one_write
from actors.serve.routes import MODEL_VERSION, Reply, model_metadata, read_body, respond
from hetero_exec.errors import UnknownInputError, UnknownOutputError

log = logging.getLogger(__name__)

DEFAULT_MAX_BATCH_SIZE = 32  # rows per stacked run
DEFAULT_MAX_REQUEST_BYTES = 64 << 20


@dataclass
class ServeSpec:
    """What a replica is built from (pickled into the deployment, never a session)."""

    model: Any = field(repr=False)  # a path readable where the replicas run, or its bytes
    providers: Sequence[Any] | None
    name: str
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    batch_wait_timeout_s: float = 0.0
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    session_options: dict[str, Any] = field(default_factory=dict)
    #: session runs in flight at once (None: 1 for a plan the replica runs itself, 4
    #: for one on pipelined stage actors); requests beyond wait and are batched
    max_concurrent_runs: int | None = None
    #: generation on stage actors: rows a running group shares (0: a Generator a
    #: request), and the longest prompt + max_tokens a group holds
    batch_slots: int = 4
    batch_max_length: int = 1024


class HeteroModel:
    """The Serve deployment: one session, the protocol's routes, dynamic batching."""

    def __init__(self, spec: ServeSpec):
        from hetero_exec import InferenceSession
        from hetero_exec.exec.feeds import FeedChecker

        answer_in_one_write()  # this replica's answers reach HAProxy whole or not at all
        self.spec, self.name = spec, spec.name
        self.session = InferenceSession(spec.model, spec.providers, **spec.session_options)
        self.checker = FeedChecker(self.session.graph)
        self.dtypes = {n: self.session.graph.value(n).dtype for n in self.checker.names}
        self.outputs = list(self.session.graph.outputs)
        self.rule = BatchRule(self.session)
        self.batching = self.rule.symbol is not None and spec.max_batch_size > 1
        runners = spec.max_concurrent_runs or (
            4 if self.session.options.executor == "ray" else 1)
        self.queue = RunQueue(self._run, spec.max_batch_size, runners,
                              spec.batch_wait_timeout_s)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            runners, thread_name_prefix="hetero-serve")
        self.counts = Counts(self.session)
        self.metadata = model_metadata(self)
        log.info("serving %s on %s (batch dim %s)", self.name,
                 ", ".join(self.session.get_providers()), self.rule.symbol)

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import Response

        status, body, headers = await respond(self, request)
        return Response(body, status_code=status, headers=headers)

    # -- inference -------------------------------------------------------------------------

    async def infer(self, request: Any) -> Reply:
        """``POST .../infer``: the request's tensors run (batched with others when their
        shapes allow), answered in the encoding it came in."""
        body = await read_body(request, self.spec.max_request_bytes)
        req = parse_infer_request(body, request.headers.get("content-type"),
                                  request.headers.get(HEADER_LENGTH))
        feed = self.feed(req.inputs)
        outputs = self.requested(req)
        job = self.rule.job(feed, outputs)
        if not self.batching or job.rows is None or job.rows > self.spec.max_batch_size:
            job.rows = None  # runs on its own (still one of the replica's runs in flight)
        result = await self.queue.submit(job)
        if isinstance(result, BaseException):
            raise result
        body, headers = infer_response(self.name, MODEL_VERSION, req, list(zip(outputs, result)))
        return 200, body, headers

    async def _run(self, jobs: list[Job]) -> list[Any]:
        """``jobs`` on a pool thread, so the loop keeps taking (and batching) requests."""
        loop = asyncio.get_running_loop()
        results = await loop.run_in_executor(self._pool, run_jobs, self.counts, jobs)
        self.counts.answered(jobs, results)
        return results

    def feed(self, inputs: Sequence[tuple[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """A request's tensors as a feed: no duplicate or unknown name, the model's
        datatypes, shapes its inputs accept (SEMANTICS.md section 3's errors)."""
        feed: dict[str, np.ndarray] = {}
        for name, arr in inputs:
            if name in feed:
                raise ProtocolError(f"duplicate input {name!r}")
            if name not in self.dtypes:
                raise UnknownInputError(name, self.checker.required)
            want = self.dtypes[name]
            if want is not None and arr.dtype != want:
                raise ProtocolError(f"input {name!r}: datatype {datatype_name(arr.dtype)}, the "
                                    f"model takes {datatype_name(want)} {list(arr.shape)}")
            feed[name] = arr
        self.checker.check(feed)
        return feed

    def requested(self, req: Any) -> list[str]:
        """The outputs a request asks for (all of them when it names none)."""
        if req.outputs is None:
            return list(self.outputs)
        for o in req.outputs:
            if o.name not in self.outputs:
                raise UnknownOutputError(o.name, self.outputs)
        return [o.name for o in req.outputs]

    def __del__(self) -> None:
        session = getattr(self, "session", None)
        if session is not None:
            session.close()


class Counts:
    """The session, counting its runs (executions) and the rows answered (inferences),
    as the protocol's statistics extension reports them."""

    def __init__(self, session: Any):
        self.session = session
        self.executions = self.inferences = self.requests = 0
        self._lock = threading.Lock()

    def run(self, names: Sequence[str], feed: Mapping[str, Any]) -> list[Any]:
        outs = self.session.run(names, feed)
        with self._lock:
            self.executions += 1
        return outs

    def answered(self, jobs: Sequence[Job], results: Sequence[Any]) -> None:
        for job, result in zip(jobs, results):
            if not isinstance(result, BaseException):
                self.requests += 1
                self.inferences += job.rows or 1

    def stats(self, name: str) -> dict[str, Any]:
        return {"model_stats": [{"name": name, "version": MODEL_VERSION,
                                 "inference_count": self.inferences,
                                 "execution_count": self.executions,
                                 "request_count": self.requests}]}
