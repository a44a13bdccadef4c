"""The Serve application: `build_app`, a deployment of the model with what its
replicas reserve (``serve run``'s builder over it is `actors.serve.cli.app`).
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
from actors.serve.generation import GenerativeModel, decoder_file
from actors.serve.replicas import model_name, replica_resources

log = logging.getLogger(__name__)

LARGE_MODEL_BYTES = 64 << 20
#: `build_app`'s own keywords; the others it takes are session options
BUILD_KEYWORDS = ("name", "num_replicas", "autoscaling_config", "max_batch_size",
                  "batch_wait_timeout_s", "max_request_bytes", "max_ongoing_requests",
                  "access_log", "num_cpus", "max_concurrent_runs", "generate", "batch_slots",
                  "batch_max_length")


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
    generate: bool | None = None,
    batch_slots: int = 4,
    batch_max_length: int = 1024,
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
    options. ``generate``: serve the model as a decoder, through Triton's generate
    extension (`actors.serve.generation`); None (the default) does so when ``model`` is
    a path to a decoder (`decoder_file`: a genai folder, or an ``.onnx`` with a
    key/value cache), True insists (ValueError otherwise), False serves ``/infer``.
    ``batch_slots``, ``batch_max_length``: a decoder on stage actors (``executor="ray"``)
    serves its requests by continuous batching, groups of ``batch_slots`` rows of
    up to ``batch_max_length`` tokens (0 slots: a Generator a request).
    Building plans the model here; deploying it needs Ray Serve:

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
    if isinstance(batch_slots, bool) or not isinstance(batch_slots, int) or batch_slots < 0:
        raise ValueError(f"batch_slots must be an int >= 0, got {batch_slots!r}")
    if isinstance(batch_max_length, bool) or not isinstance(batch_max_length, int) \
            or batch_max_length < 2:
        raise ValueError(f"batch_max_length must be an int >= 2, got {batch_max_length!r}")
    if max_concurrent_runs is not None and int(max_concurrent_runs) < 1:
        raise ValueError(f"max_concurrent_runs must be at least 1, got {max_concurrent_runs!r}")
    decoder = decoder_file(model) if generate is not False else None
    if generate and decoder is None:
        raise ValueError(f"generate=True, but {model!r:.80} is not a path to a decoder (a "
                         "genai folder, or an .onnx with key/value cache inputs and outputs)")
    name = name or model_name(model)
    res = replica_resources(decoder or model, providers, session_options, num_cpus,
                            generation=decoder is not None)
    spec = ServeSpec(model, list(providers) if providers is not None else None, name,
                     int(max_batch_size), float(batch_wait_timeout_s), int(max_request_bytes),
                     res.session_options,
                     int(max_concurrent_runs) if max_concurrent_runs else None,
                     batch_slots=batch_slots, batch_max_length=batch_max_length)
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
    return serve.deployment(GenerativeModel if decoder else HeteroModel
                            ).options(**options).bind(spec)
