"""Ray Serve online serving over the Open Inference Protocol (KServe v2 REST).

Three ways to start it::

    serve run actors.serve:app model=model.onnx providers=sim-gpu,cpu hetero=true
    serve.run(build_app("model.onnx", providers=["gpu", "cpu"], max_batch_size=32))
    hetero-exec serve model.onnx --providers gpu,cpu --hetero --port 8000

A file per concern:

* ``deployment``: the deployment (`HeteroModel`: one session per replica, requests
  batched into its runs) and its counters;
* ``routes``: the protocol's HTTP routes, and every error as a status and a JSON body;
* ``generation``: the deployment of a decoder (`GenerativeModel`: one genai Model a
  replica, a Generator a request) and `decoder_file`, which says what is one;
  ``generate_routes`` its ``/generate`` and ``/generate_stream`` (Triton's generate
  extension, server-sent events), ``generate_request`` their JSON and events;
* ``replicas``: what a replica reserves, planned from its model;
* ``application``: `build_app`, the model's deployment and what its replicas reserve;
* ``cli``: the command lines: `app` (what ``serve run`` calls, with its arguments)
  and `serve_forever` (what ``hetero-exec serve`` runs).

A bad request gets a 4xx and ``{"error": ...}`` naming what is wrong; a fault in the
replica a 5xx. The replica keeps serving after either.
"""

from __future__ import annotations

from actors.serve.application import BUILD_KEYWORDS, LARGE_MODEL_BYTES, build_app
from actors.serve.cli import app, serve_forever
from actors.serve.deployment import (
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MAX_REQUEST_BYTES,
    Counts,
    HeteroModel,
    ServeSpec,
)
from actors.serve.generation import GenerativeModel, decoder_file
from actors.serve.replicas import ReplicaResources, model_name, replica_resources
from actors.serve.routes import MODEL_VERSION, model_metadata

__all__ = [
    "BUILD_KEYWORDS",
    "Counts",
    "DEFAULT_MAX_BATCH_SIZE",
    "DEFAULT_MAX_REQUEST_BYTES",
    "GenerativeModel",
    "HeteroModel",
    "LARGE_MODEL_BYTES",
    "MODEL_VERSION",
    "ReplicaResources",
    "ServeSpec",
    "app",
    "build_app",
    "decoder_file",
    "model_metadata",
    "model_name",
    "replica_resources",
    "serve_forever",
]
