"""The Serve application: `build_app` (from Python) and `app` (the builder that ``serve
run actors.serve:app key=value ...`` calls with its arguments as text).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping, Sequence

from ray import serve

from actors.serve.deployment import (
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MAX_REQUEST_BYTES,
    HeteroModel,
    ServeSpec,
)
from actors.serve.replicas import model_name, replica_resources

log = logging.getLogger(__name__)

LARGE_MODEL_BYTES = 64 << 20
#: `build_app`'s own keywords; the others it takes are session options
BUILD_KEYWORDS = ("name", "num_replicas", "autoscaling_config", "max_batch_size",
                  "batch_wait_timeout_s", "max_request_bytes", "max_ongoing_requests",
                  "access_log", "num_cpus", "max_concurrent_runs")


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
    options. Building plans the model here; deploying it needs Ray Serve:

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


def app_arguments(args: Mapping[str, str]) -> dict[str, Any]:
    """``serve run`` arguments (text) as `build_app`'s keywords: ``providers`` a comma
    list, ``hetero``/``require_gpu`` true or false, ``dim.N=64`` a symbolic dim's bound,
    `build_app`'s own keywords their types, the rest as given.

    >>> app_arguments({"model": "m.onnx", "providers": "sim-gpu, cpu", "hetero": "true",
    ...                "dim.batch": "8", "max_batch_size": "16"})
    {'model': 'm.onnx', 'providers': ['sim-gpu', 'cpu'], 'hetero': True, 'dim_bounds': {'batch': 8}, 'max_batch_size': 16}
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
