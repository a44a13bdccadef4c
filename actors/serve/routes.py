"""The Open Inference Protocol's HTTP routes (KServe v2 REST) over one served model.

``GET /v2/health/live``, ``/v2/health/ready``, ``/v2``, ``/v2/models/{name}`` (its
metadata has the placement report), ``/v2/models/{name}/ready``, ``POST
/v2/models/{name}/infer`` (``/versions/1`` may follow the name), ``GET
/v2/models/{name}/stats`` (inferences are rows, executions session runs), and, for a
decoder, Triton's ``/generate`` and ``/generate_stream`` (its server's ``generate``:
`actors.serve.generate_routes`, whose streams are responses, not a Reply). `respond`
maps every error to a status and a JSON ``{"error": ...}`` body: a bad request a 4xx
naming what is wrong, a fault in the replica a 5xx. The tensors' encoding is
`actors.oip`; the deployment (`actors.serve.deployment`) runs the inferences.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Sequence

from actors.oip import DATATYPES, JSON, ProtocolError, datatype_name, error_body
from hetero_exec.errors import ActorError, HeteroExecError, InputError, UnknownOutputError

log = logging.getLogger(__name__)

MODEL_VERSION = "1"

Reply = tuple[int, bytes, dict[str, str]]


async def respond(server: Any, request: Any) -> Any:
    """The status, body and headers answering ``request`` (a Starlette request) for
    ``server`` (a `HeteroModel` or a `GenerativeModel`), or a streaming response; never
    raises."""
    try:
        return await route(server, request)
    except ProtocolError as e:
        return e.status, error_body(str(e)), {"content-type": JSON}
    except (InputError, UnknownOutputError) as e:
        return 400, error_body(str(e)), {"content-type": JSON}
    except ActorError as e:
        return 503, error_body(f"{type(e).__name__}: {e}"), {"content-type": JSON}
    except Exception as e:  # a fault in the replica: 5xx, and it keeps serving
        if not isinstance(e, HeteroExecError):
            log.exception("request failed in the replica")
        return 500, error_body(f"{type(e).__name__}: {e}"), {"content-type": JSON}


async def route(server: Any, request: Any) -> Any:
    """Dispatch ``request`` by path and method; ProtocolError (404, 405) for the rest."""
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
        want(method, "GET", path)
        meta = health(rest)
        if not rest and hasattr(server, "generate"):
            meta["extensions"].append("generate")
        return as_json(meta)
    if rest[:1] == ["models"] and len(rest) >= 2:
        return await _model_route(server, request, method, path, rest[1], rest[2:])
    raise ProtocolError(f"no route {path!r}", 404)


def health(rest: list[str]) -> dict[str, Any]:
    """The server's metadata (``/v2``) or a health answer (``/v2/health/{live,ready}``).

    >>> health(["health", "live"])
    {'live': True}
    """
    if not rest:
        from hetero_exec import __version__

        return {"name": "hetero_exec", "version": __version__,
                "extensions": ["binary_tensor_data", "msgpack_tensor_frames"]}
    return {rest[1]: True}


async def _model_route(server: Any, request: Any, method: str, path: str, name: str,
                       tail: list[str]) -> Any:
    if name != server.name:
        raise ProtocolError(f"unknown model {name!r}; this server serves {server.name!r}", 404)
    if tail[:1] == ["versions"]:
        if len(tail) < 2 or tail[1] != MODEL_VERSION:
            got = tail[1] if len(tail) > 1 else ""
            raise ProtocolError(f"unknown version {got!r} of model {name!r}; versions: "
                                f"[{MODEL_VERSION!r}]", 404)
        tail = tail[2:]
    if not tail:
        want(method, "GET", path)
        return as_json(server.metadata)
    if tail == ["ready"]:
        want(method, "GET", path)
        return as_json({"name": server.name, "ready": True})
    if tail == ["stats"]:
        want(method, "GET", path)
        return as_json(server.counts.stats(server.name))
    if tail == ["infer"]:
        want(method, "POST", path)
        return await server.infer(request)
    if tail in (["generate"], ["generate_stream"]):
        want(method, "POST", path)
        generate = getattr(server, "generate", None)
        if generate is None:
            raise ProtocolError(f"model {name!r} is not a decoder (no key/value cache inputs "
                                "and outputs were found), so it has no generate routes; use "
                                "/infer", 400)
        return await generate(request, tail == ["generate_stream"])
    raise ProtocolError(f"no route {path!r}", 404)


def want(method: str, allowed: str, path: str) -> None:
    """ProtocolError 405 unless ``method`` is the one ``path`` takes.

    >>> want("DELETE", "GET", "/v2")
    Traceback (most recent call last):
    ...
    actors.oip.ProtocolError: DELETE /v2: use GET
    """
    if method != allowed:
        raise ProtocolError(f"{method} {path}: use {allowed}", 405)


def as_json(obj: Any) -> Reply:
    """A 200 answer with ``obj`` as its JSON body."""
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


def tensor_metadata(session: Any, name: str) -> dict[str, Any]:
    """The protocol's metadata of one input or output of ``session``'s model."""
    v = session.graph.value(name)
    if v.kind != "tensor" or v.dtype is None:
        raise ProtocolError(f"{name!r} is a {v.kind}, which the protocol cannot carry", 500)
    if v.dtype != object and v.dtype not in DATATYPES.values():
        raise ProtocolError(f"{name!r} has dtype {v.dtype}, which the protocol cannot carry", 500)
    return {"name": name, "datatype": datatype_name(v.dtype), "shape": _dims(v.shape)}


def model_metadata(server: Any) -> dict[str, Any]:
    """The protocol's model metadata, plus the placement report and the batching rule."""
    s = server.session
    plan = s.placement
    return {
        "name": server.name,
        "versions": [MODEL_VERSION],
        "platform": "hetero_exec_onnx",
        "inputs": [tensor_metadata(s, a.name) for a in s.get_inputs()],
        "outputs": [tensor_metadata(s, n) for n in s.graph.outputs],
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
