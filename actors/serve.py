"""Ray Serve online serving over the Open Inference Protocol (KServe v2 REST).

Three ways to start it::

    serve run actors.serve:app model=model.onnx providers=sim-gpu,cpu hetero=true
    serve.run(build_app("model.onnx", providers=["gpu", "cpu"], max_batch_size=32))
    hetero-exec serve model.onnx --providers gpu,cpu --hetero --port 8000

Each replica builds one session. Requests that arrive while its runs are busy wait in
a `RunQueue` and are stacked along the batch dimension into the next run
(`actors.batching`: only requests of one shape are stacked); an idle replica runs a
lone request at once. A replica
reserves what its plan needs: a GPU per device of an in-process plan, or, for a plan
that runs on several stage actors, a placement group with the replica's bundle first
and the stages' bundles after it (``placement_group="current"``).

Routes: ``GET /v2/health/live``, ``/v2/health/ready``, ``/v2``, ``/v2/models/{name}``
(its metadata has the placement report), ``/v2/models/{name}/ready``, and ``POST
/v2/models/{name}/infer`` (``/versions/1`` may follow the name); ``GET
/v2/models/{name}/stats`` counts inferences (rows) and executions (session runs). A
bad request gets a 4xx and ``{"error": ...}`` naming what is wrong; a fault in the
replica a 5xx. The replica keeps serving after either.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
from ray import serve

from actors.batching import BatchRule, Job, RunQueue, run_jobs
from actors.oip import (
    DATATYPES,
    HEADER_LENGTH,
    JSON,
    ProtocolError,
    datatype_name,
    error_body,
    infer_response,
    parse_infer_request,
)
from hetero_exec.errors import (
    ActorError,
    HeteroExecError,
    InputError,
    UnknownInputError,
    UnknownOutputError,
)

log = logging.getLogger(__name__)

DEFAULT_MAX_BATCH_SIZE = 32  # rows per stacked run
DEFAULT_MAX_REQUEST_BYTES = 64 << 20
MODEL_VERSION = "1"
LARGE_MODEL_BYTES = 64 << 20


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


class HeteroModel:
    """The Serve deployment: one session, the protocol's routes, dynamic batching."""

    def __init__(self, spec: ServeSpec):
        from hetero_exec import InferenceSession
        from hetero_exec.exec.feeds import FeedChecker

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

    # -- HTTP ----------------------------------------------------------------------------

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import Response

        try:
            status, body, headers = await self._route(request)
        except ProtocolError as e:
            status, body, headers = e.status, error_body(str(e)), {"content-type": JSON}
        except (InputError, UnknownOutputError) as e:
            status, body, headers = 400, error_body(str(e)), {"content-type": JSON}
        except ActorError as e:
            status, body, headers = 503, error_body(f"{type(e).__name__}: {e}"), {"content-type": JSON}
        except Exception as e:  # a fault in the replica: 5xx, and it keeps serving
            if not isinstance(e, HeteroExecError):
                log.exception("request failed in the replica")
            status, body = 500, error_body(f"{type(e).__name__}: {e}")
            headers = {"content-type": JSON}
        return Response(body, status_code=status, headers=headers)

    async def _route(self, request: Any) -> tuple[int, bytes, dict[str, str]]:
        path = request.url.path
        root = request.scope.get("root_path") or ""
        if root and path.startswith(root):
            path = path[len(root):]
        parts = [p for p in path.split("/") if p]
        method = request.method
        if parts[:1] != ["v2"]:
            raise ProtocolError(f"no route {path!r}; the API is under /v2", 404)
        rest = parts[1:]
        if rest in ([], ["health", "live"], ["health", "ready"]):
            _want(method, "GET", path)
            return _json(self._health(rest))
        if rest[:1] == ["models"] and len(rest) >= 2:
            return await self._model_route(request, method, path, rest[1], rest[2:])
        raise ProtocolError(f"no route {path!r}", 404)

    def _health(self, rest: list[str]) -> dict[str, Any]:
        if not rest:
            from hetero_exec import __version__

            return {"name": "hetero_exec", "version": __version__,
                    "extensions": ["binary_tensor_data", "msgpack_tensor_frames"]}
        return {rest[1]: True}

    async def _model_route(self, request: Any, method: str, path: str, name: str,
                           tail: list[str]) -> tuple[int, bytes, dict[str, str]]:
        if name != self.name:
            raise ProtocolError(f"unknown model {name!r}; this server serves {self.name!r}", 404)
        if tail[:1] == ["versions"]:
            if len(tail) < 2 or tail[1] != MODEL_VERSION:
                got = tail[1] if len(tail) > 1 else ""
                raise ProtocolError(f"unknown version {got!r} of model {name!r}; versions: "
                                    f"[{MODEL_VERSION!r}]", 404)
            tail = tail[2:]
        if not tail:
            _want(method, "GET", path)
            return _json(self.metadata)
        if tail == ["ready"]:
            _want(method, "GET", path)
            return _json({"name": self.name, "ready": True})
        if tail == ["stats"]:
            _want(method, "GET", path)
            return _json(self.counts.stats(self.name))
        if tail == ["infer"]:
            _want(method, "POST", path)
            return await self._infer(request)
        raise ProtocolError(f"no route {path!r}", 404)

    # -- inference -------------------------------------------------------------------------

    async def _infer(self, request: Any) -> tuple[int, bytes, dict[str, str]]:
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


def _want(method: str, allowed: str, path: str) -> None:
    if method != allowed:
        raise ProtocolError(f"{method} {path}: use {allowed}", 405)


def _json(obj: Any) -> tuple[int, bytes, dict[str, str]]:
    return 200, json.dumps(obj).encode(), {"content-type": JSON}


async def read_body(request: Any, limit: int) -> bytes:
    """The request body, refused (413) past ``limit`` bytes without reading it all."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ProtocolError(f"request body of {declared} bytes exceeds the limit of "
                            f"{limit} bytes", 413)
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise ProtocolError(f"request body exceeds the limit of {limit} bytes", 413)
        chunks.append(chunk)
    return b"".join(chunks)


def _dims(shape: Sequence[Any] | None) -> list[int]:
    return [d if isinstance(d, int) else -1 for d in (shape or [])]


def _tensor_meta(session: Any, name: str) -> dict[str, Any]:
    v = session.graph.value(name)
    if v.kind != "tensor" or v.dtype is None:
        raise ProtocolError(f"{name!r} is a {v.kind}, which the protocol cannot carry", 500)
    if v.dtype != object and v.dtype not in DATATYPES.values():
        raise ProtocolError(f"{name!r} has dtype {v.dtype}, which the protocol cannot carry", 500)
    return {"name": name, "datatype": datatype_name(v.dtype), "shape": _dims(v.shape)}


def model_metadata(server: HeteroModel) -> dict[str, Any]:
    """The protocol's model metadata, plus the placement report and the batching rule."""
    s = server.session
    plan = s.placement
    return {
        "name": server.name,
        "versions": [MODEL_VERSION],
        "platform": "hetero_exec_onnx",
        "inputs": [_tensor_meta(s, a.name) for a in s.get_inputs()],
        "outputs": [_tensor_meta(s, n) for n in s.graph.outputs],
        "placement": {
            "providers": s.get_providers(),
            "heterogeneous": s.is_heterogeneous,
            "report": plan.report() if plan is not None else None,
            "plan": plan.to_dict() if plan is not None else None,
            "fallback_report": str(s.fallback_report) if s.fallback_report is not None else None,
        },
        "batching": {"batch_dim": server.rule.symbol, "max_batch_size": server.spec.max_batch_size,
                     "batch_wait_timeout_s": server.spec.batch_wait_timeout_s,
                     "max_concurrent_runs": server.queue.runners},
    }


# -- the app ---------------------------------------------------------------------------------


@dataclass
class ReplicaResources:
    """What one replica reserves, and the session options its plan needs."""

    ray_actor_options: dict[str, Any]
    placement_group_bundles: list[dict[str, float]] | None
    session_options: dict[str, Any]


def replica_resources(model: Any, providers: Sequence[Any] | None,
                      session_options: Mapping[str, Any], num_cpus: float = 1) -> ReplicaResources:
    """A replica's resources from its plan.

    A mixed plan of several pipeline stages (or any plan with ``executor="ray"``) runs on
    stage actors that the replica drives: the replica reserves a placement group, its
    own bundle first and then the stages' (`actors.stage_bundles`), which its session
    fills (``placement_group="current"``). Any other plan runs in the replica's process,
    which reserves a GPU per device the plan places nodes on.
    """
    opts = dict(session_options)
    devices, segments = _plan_devices(model, providers, opts)
    executor = opts.get("executor")
    if executor == "ray" or (executor is None and segments > 1):
        from actors import stage_bundles

        stages = stage_bundles(model, providers, **opts)
        if executor == "ray" or len(stages) > 1:
            opts.update(executor="ray", placement_group="current")
            return ReplicaResources({"num_cpus": num_cpus, "num_gpus": 0},
                                    [{"CPU": float(num_cpus)}, *stages], opts)
    # the replica runs the plan itself: its runs split over the CPUs it reserved, as Ray
    # sizes a worker's OMP_NUM_THREADS (all the node's cores per replica would have the
    # replicas, and the HTTP proxy, fight over them)
    opts.setdefault("intra_op_num_threads", max(1, int(num_cpus)))
    return ReplicaResources({"num_cpus": num_cpus, "num_gpus": len(devices)}, None, opts)


def _plan_devices(model: Any, providers: Any, opts: Mapping[str, Any]) -> tuple[set[str], int]:
    """The device providers the plan places nodes on, and its segment count; by name
    where this process cannot plan (e.g. a head node without the GPU library)."""
    from hetero_exec.ir import load
    from hetero_exec.placement.decide import build_session_plan
    from hetero_exec.session import SessionOptions

    core = {k: v for k, v in opts.items() if k in SessionOptions.KNOWN and k != "executor"}
    try:
        _, graph = load(model, core.get("base_dir"))
        build = build_session_plan(graph, providers, SessionOptions.from_kwargs(core))
        segments = build.placement.segments
        return {s.provider.name for s in segments if s.provider.is_device}, len(segments)
    except (HeteroExecError, ImportError) as e:
        log.warning("cannot plan here (%s): reserving a GPU per non-cpu provider named", e)
        names = [p if isinstance(p, str) else p[0] for p in providers or ()]
        return {n for n in names if not n.startswith("cpu")}, 1


def model_name(model: Any) -> str:
    """A protocol-safe name: the file's stem, or the graph's name."""
    if isinstance(model, (str, os.PathLike)):
        raw = os.path.splitext(os.path.basename(os.fspath(model)))[0]
    else:
        from hetero_exec.ir import load

        raw = load(model)[1].name or "model"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", raw) or "model"


def build_app(
    model: Any,
    providers: Sequence[Any] | None = None,
    *,
    name: str | None = None,
    num_replicas: int | str | None = None,
    autoscaling_config: Mapping[str, Any] | None = None,
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
    batch_wait_timeout_s: float = 0.0,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    max_ongoing_requests: int | None = None,
    access_log: bool = False,
    num_cpus: float = 1,
    max_concurrent_runs: int | None = None,
    **session_options: Any,
) -> Any:
    """A Serve application serving ``model`` over the Open Inference Protocol.

    ``model``: a path readable where the replicas run (best for large models), bytes
    or a ModelProto (they travel in the deployment's config through Ray's GCS).
    ``max_batch_size`` counts rows along the batch dim (1 turns batching off);
    ``batch_wait_timeout_s`` is how long a batch waits to fill once its first request
    came (0: it takes what has queued while the previous batch ran, so a lone request
    waits for nothing). ``max_concurrent_runs``: session runs in flight in a replica
    (default 1 for a plan the replica runs itself, so requests that come meanwhile
    wait and stack; 4 for a plan on pipelined stage actors). ``access_log``: Serve's
    log line per request (off: it costs a replica about a millisecond a request).
    ``num_cpus``: what the replica itself reserves, and (unless ``intra_op_num_threads``
    is given) the threads a run in it splits its work over. Other keywords are session
    options.

    >>> serve.run(build_app("mlp.onnx", providers=["cpu"]))  # doctest: +SKIP
    """
    if hasattr(model, "SerializeToString"):
        model = model.SerializeToString()
    elif isinstance(model, os.PathLike):
        model = os.fspath(model)
    if isinstance(model, bytes) and len(model) > LARGE_MODEL_BYTES:
        log.warning("a %d MB model given as bytes travels in the deployment's config "
                    "through Ray's GCS (512 MB a message, every app together): pass a path "
                    "readable where the replicas run", len(model) >> 20)
    if max_concurrent_runs is not None and int(max_concurrent_runs) < 1:
        raise ValueError(f"max_concurrent_runs must be at least 1, got {max_concurrent_runs!r}")
    name = name or model_name(model)
    res = replica_resources(model, providers, session_options, num_cpus)
    spec = ServeSpec(model, list(providers) if providers is not None else None, name,
                     int(max_batch_size), float(batch_wait_timeout_s), int(max_request_bytes),
                     res.session_options,
                     int(max_concurrent_runs) if max_concurrent_runs else None)
    options: dict[str, Any] = {
        "name": name, "ray_actor_options": res.ray_actor_options,
        "max_ongoing_requests": max_ongoing_requests or max(64, 2 * int(max_batch_size)),
        "logging_config": {"enable_access_log": bool(access_log)},
    }
    if autoscaling_config is not None:
        options["autoscaling_config"] = dict(autoscaling_config)
    else:
        options["num_replicas"] = num_replicas if num_replicas is not None else 1
    if res.placement_group_bundles:
        options["placement_group_bundles"] = res.placement_group_bundles
    return serve.deployment(HeteroModel).options(**options).bind(spec)


#: ``serve run actors.serve:app key=value ...``: how each argument is read
_TRUE = ("1", "true", "on", "yes")
_ARG_TYPES = {"access_log": lambda t: str(t).strip().lower() in _TRUE, "num_replicas": int,
              "num_cpus": float, "stages": lambda t: int(t) if str(t).isdigit() else t,
              "max_batch_size": int, "batch_wait_timeout_s": float, "max_request_bytes": int,
              "max_ongoing_requests": int, "max_concurrent_runs": int}


def app(args: Mapping[str, str]) -> Any:
    """The application builder of ``serve run actors.serve:app model=PATH providers=a,b``.

    ``hetero``/``require_gpu`` take true/false; ``dim.N=64`` bounds a symbolic dim; the
    keywords of `build_app` take their types; ``name`` names the model.
    """
    args = dict(args)
    if "model" not in args:
        raise ValueError("serve run actors.serve:app needs model=PATH")
    kwargs: dict[str, Any] = {}
    for key, text in args.items():
        if key == "providers":
            kwargs[key] = [p.strip() for p in text.split(",") if p.strip()]
        elif key in ("hetero", "require_gpu"):
            kwargs[key] = str(text).strip().lower() in _TRUE
        elif key.startswith("dim."):
            kwargs.setdefault("dim_bounds", {})[key[4:]] = int(text)
        elif key in _ARG_TYPES:
            kwargs[key] = _ARG_TYPES[key](text)
        else:
            kwargs[key] = text
    return build_app(kwargs.pop("model"), kwargs.pop("providers", None), **kwargs)


def _logical_gpus(model: Any, build_kwargs: Mapping[str, Any]) -> int | None:
    """The GPUs a local Ray declares when every device the plan uses is emulated
    (sim-gpu): one per device per replica, what an in-process replica or its stage
    actors reserve. None (Ray's own count) otherwise. Plans without starting a Ray."""
    providers = build_kwargs.get("providers")
    names = [p if isinstance(p, str) else p[0] for p in providers or ()]
    devices = [n for n in names if not n.startswith("cpu")]
    if not devices or not all(n.startswith("sim-gpu") for n in devices):
        return None
    known = set(_BUILD_KEYWORDS)
    opts = {k: v for k, v in build_kwargs.items() if k not in known and k != "providers"}
    used, _ = _plan_devices(model, providers, opts)
    return max(len(used), 1) * int(build_kwargs.get("num_replicas") or 1)


_BUILD_KEYWORDS = ("name", "num_replicas", "autoscaling_config", "max_batch_size",
                   "batch_wait_timeout_s", "max_request_bytes", "max_ongoing_requests",
                   "access_log", "num_cpus", "max_concurrent_runs")


def serve_forever(model: Any, *, host: str = "127.0.0.1", port: int = 8000,
                  address: str | None = None, **build_kwargs: Any) -> int:
    """Serve ``model`` until SIGINT or SIGTERM, then shut down cleanly (the CLI's
    ``hetero-exec serve``). Joins the Ray at ``address`` (or ``RAY_ADDRESS``), else
    starts a local one; on a cluster it joined it deletes only its own app."""
    import signal
    import threading

    import ray

    from actors.connect import (
        forget_haproxy_files,
        given_address,
        loopback_init_kwargs,
        loopback_node,
        loopback_runtime_env,
        serve_ingress_env,
    )

    address = given_address(address)  # "local" is a Ray of our own, as no address is
    started = not ray.is_initialized() and address is None
    node = None
    if not ray.is_initialized():
        extra: dict[str, Any] = {}
        if address is None:  # sim-gpu devices are logical GPUs on a Ray of our own,
            # which serves through HAProxy (a cluster serves as its operator set it up)
            # and listens on loopback only (the frontend on ``host``)
            extra["num_gpus"] = _logical_gpus(model, build_kwargs)
            extra["runtime_env"] = loopback_runtime_env(serve_ingress_env())
            extra.update(loopback_init_kwargs())
        else:
            extra["include_dashboard"] = False
        # "local": a Ray of our own, never one that someone's `ray start` left running
        with loopback_node() if address is None else contextlib.nullcontext():
            ray.init(address=address or "local", logging_level=logging.WARNING, **extra)
        node = ray.get_runtime_context().get_node_id() if started else None
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set())
                for sig in (signal.SIGINT, signal.SIGTERM)}
    name = None
    try:
        serve.start(http_options={"host": host, "port": port})
        application = build_app(model, **build_kwargs)
        name = application._bound_deployment.name
        serve.run(application, name=name, route_prefix="/")
        log.warning("serving %s at http://%s:%d/v2/models/%s (Ctrl-C to stop)",
                    name, host, port, name)
        print(f"serving {name} at http://{host}:{port}/v2/models/{name}", flush=True)
        stop.wait()
        print("shutting down", flush=True)
    finally:
        try:
            if started:
                serve.shutdown()
            elif name is not None:
                serve.delete(name)
        finally:
            if started:
                ray.shutdown()
                forget_haproxy_files(node)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    return 0
