"""The command lines that serve: ``serve run actors.serve:app key=value ...`` (`app`,
its arguments read by `app_arguments`), and ``hetero-exec serve`` (`serve_forever`,
after `hetero_exec.cli` read its flags): it starts (or joins) a Ray, deploys the
model's application, serves until SIGINT or SIGTERM, then shuts down what it started.
A decoder (a genai folder, or an ``.onnx`` with a key/value cache: `decoder_file`) is
served through Triton's generate extension (`actors.serve.generation`).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from typing import Any, Mapping

import ray
from ray import serve

from actors.connect import (
    forget_haproxy_files,
    given_address,
    loopback_init_kwargs,
    loopback_node,
    loopback_runtime_env,
    serve_ingress_env,
    token_auth_told,
)
from actors.serve.application import BUILD_KEYWORDS, build_app
from actors.serve.generation import decoder_file
from actors.serve.replicas import plan_devices
from hetero_exec.genai.config import parse_layer_counts

log = logging.getLogger(__name__)


def _layer_counts(text: str) -> list[int]:
    try:
        return parse_layer_counts(text)
    except ValueError as e:
        raise ValueError(f"stage_layers {e}") from None


#: ``serve run actors.serve:app key=value ...``: how each argument is read
_TRUE = ("1", "true", "on", "yes")
_ARG_TYPES = {"access_log": lambda t: str(t).strip().lower() in _TRUE, "num_replicas": int,
              "num_cpus": float, "stages": lambda t: int(t) if str(t).isdigit() else t,
              "max_batch_size": int, "batch_wait_timeout_s": float, "max_request_bytes": int,
              "max_ongoing_requests": int, "max_concurrent_runs": int,
              "stage_layers": _layer_counts, "stage_spin_ms": float}


def app_arguments(args: Mapping[str, str]) -> dict[str, Any]:
    """``serve run`` arguments (text) as `build_app`'s keywords: ``providers`` a comma
    list, ``hetero``/``require_gpu`` true or false, ``dim.N=64`` a symbolic dim's bound,
    `build_app`'s own keywords their types, the rest as given.

    >>> app_arguments({"model": "m.onnx", "providers": "sim-gpu, cpu", "hetero": "true",
    ...                "dim.batch": "8", "max_batch_size": "16"})
    {'model': 'm.onnx', 'providers': ['sim-gpu', 'cpu'], 'hetero': True, 'dim_bounds': {'batch': 8}, 'max_batch_size': 16}
    >>> app_arguments({"executor": "ray", "stage_layers": "3,1"})["stage_layers"]
    [3, 1]
    >>> app_arguments({"stage_layers": "3;1"})
    Traceback (most recent call last):
    ...
    ValueError: stage_layers expects layer counts such as 3,1, got '3;1'
    """
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
    return kwargs


def app(args: Mapping[str, str]) -> Any:
    """The application builder of ``serve run actors.serve:app model=PATH providers=a,b``
    (`app_arguments` reads the rest; ``name`` names the model)."""
    if "model" not in args:
        raise ValueError("serve run actors.serve:app needs model=PATH")
    kwargs = app_arguments(args)
    return build_app(kwargs.pop("model"), kwargs.pop("providers", None), **kwargs)


def logical_gpus(model: Any, build_kwargs: Mapping[str, Any]) -> int | None:
    """The GPUs a local Ray declares when every device the plan uses is emulated
    (sim-gpu): one per device per replica, what an in-process replica or its stage
    actors reserve. None (Ray's own count) otherwise. Plans without starting a Ray."""
    providers = build_kwargs.get("providers")
    names = [p if isinstance(p, str) else p[0] for p in providers or ()]
    devices = [n for n in names if not n.startswith("cpu")]
    if not devices or not all(n.startswith("sim-gpu") for n in devices):
        return None
    replicas = int(build_kwargs.get("num_replicas") or 1)
    decoder = decoder_file(model)
    if decoder and build_kwargs.get("executor") == "ray":  # a generation stage per device
        return max(len(set(devices)), 1) * replicas
    known = set(BUILD_KEYWORDS)
    opts = {k: v for k, v in build_kwargs.items() if k not in known and k != "providers"}
    used, _ = plan_devices(decoder or model, providers, opts)
    return max(len(used), 1) * replicas


def serve_forever(model: Any, *, host: str = "127.0.0.1", port: int = 8000,
                  address: str | None = None, **build_kwargs: Any) -> int:
    """Serve ``model`` until SIGINT or SIGTERM, then shut down cleanly (the CLI's
    ``hetero-exec serve``). Joins the Ray at ``address`` (or ``RAY_ADDRESS``), else
    starts a local one; on a cluster it joined it deletes only its own app."""
    address = given_address(address)  # "local" is a Ray of our own, as no address is
    started = not ray.is_initialized() and address is None
    node = None
    if not ray.is_initialized():
        extra: dict[str, Any] = {}
        if address is None:  # sim-gpu devices are logical GPUs on a Ray of our own,
            # which serves through HAProxy (a cluster serves as its operator set it up)
            # and listens on loopback only (the frontend on ``host``)
            extra["num_gpus"] = logical_gpus(model, build_kwargs)
            extra["runtime_env"] = loopback_runtime_env(serve_ingress_env())
            extra.update(loopback_init_kwargs())
        else:
            extra["include_dashboard"] = False
        # "local": a Ray of our own, never one that someone's `ray start` left running
        with loopback_node() if address is None else contextlib.nullcontext(), token_auth_told():
            ray.init(address=address or "local", logging_level=logging.WARNING, **extra)
        node = ray.get_runtime_context().get_node_id() if started else None
    # the handler only appends (atomic, no lock): an Event.set in a handler deadlocks
    # when a second signal lands while the first one's set holds the Event's lock (seen
    # with `timeout` forwarding the SIGINT it got beside the one sent to the process)
    stop: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: stop.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    name = None
    try:
        serve.start(http_options={"host": host, "port": port})
        application = build_app(model, **build_kwargs)
        name = application._bound_deployment.name
        serve.run(application, name=name, route_prefix="/")
        log.warning("serving %s at http://%s:%d/v2/models/%s (Ctrl-C to stop)",
                    name, host, port, name)
        routes = "/generate, /generate_stream" if decoder_file(model) else "/infer"
        print(f"serving {name} at http://{host}:{port}/v2/models/{name} ({routes})", flush=True)
        while not stop:
            time.sleep(0.2)
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
