"""A small client for the Open Inference Protocol, as `actors.serve` speaks it.

Tensors travel as msgpack frames (``protocol="msgpack"``, the default), as JSON with
the binary tensor data extension (``"binary"``, what tritonclient sends), or as plain
JSON (``"json"``). Input names, dtypes and order come from the server's model metadata.

    client = InferenceClient("http://127.0.0.1:8000", "mlp")
    y = client.infer(x)["y"]          # one input: the array alone
    outs = client.infer({"x": x}, outputs=["y"])

Each thread keeps its own keep-alive connection, so one client may be shared by
threads. `AsyncInferenceClient` offers the same calls as coroutines.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
from typing import Any, Mapping, Sequence
from urllib.parse import urlsplit

import numpy as np

from actors.oip import (
    DATATYPES,
    HEADER_LENGTH,
    MSGPACK,
    infer_request_body,
    parse_infer_response,
)
from actors.transport.wire import encode_request
from hetero_exec.errors import HeteroExecError

PROTOCOLS = ("msgpack", "binary", "json")


class InferenceServerError(HeteroExecError):
    """The server answered with an error: ``status`` (HTTP) and its message."""

    def __init__(self, status: int, message: str):
        self.status, self.message = status, message
        super().__init__(f"HTTP {status}: {message}")


class InferenceClient:
    """A synchronous client of one model on one server."""

    def __init__(self, url: str, model: str, *, protocol: str = "msgpack",
                 timeout: float = 60.0):
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"an http://host:port[/prefix] URL is needed, got {url!r}")
        self.host, self.port = parts.hostname, parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self.model, self.protocol, self.timeout = model, protocol, timeout
        self._local = threading.local()
        self._metadata: dict[str, Any] | None = None

    # -- the protocol's calls ------------------------------------------------------------

    def live(self) -> bool:
        return self._request("GET", "/v2/health/live", check=False)[0] == 200

    def ready(self) -> bool:
        return self._request("GET", "/v2/health/ready", check=False)[0] == 200

    def model_ready(self) -> bool:
        return self._request("GET", f"/v2/models/{self.model}/ready", check=False)[0] == 200

    def server_metadata(self) -> dict[str, Any]:
        return json.loads(self._request("GET", "/v2")[2])

    def model_metadata(self, refresh: bool = False) -> dict[str, Any]:
        """The model's metadata (fetched once): inputs, outputs, placement report."""
        if self._metadata is None or refresh:
            self._metadata = json.loads(self._request("GET", f"/v2/models/{self.model}")[2])
        return self._metadata

    def model_stats(self) -> dict[str, Any]:
        """Inferences (rows) and executions (runs) so far: fewer executions than
        inferences means requests were batched."""
        stats = json.loads(self._request("GET", f"/v2/models/{self.model}/stats")[2])
        return stats["model_stats"][0]

    def infer(self, inputs: Any, outputs: Sequence[str] | None = None,
              id: str | None = None) -> dict[str, np.ndarray]:
        """The outputs (all, or those named) for ``inputs``: a mapping of name to array,
        a sequence of arrays in the model's input order, or, for a one-input model, its
        one array (or nested lists). Lists and scalars take the input's declared dtype; arrays are
        sent as they are (the server refuses a wrong dtype, nothing is cast)."""
        named = self._named(inputs)
        if self.protocol == "msgpack":
            body = encode_request(dict(named), outputs, id)
            headers = {"content-type": MSGPACK}
        else:
            body, headers = infer_request_body(named, outputs, self.protocol == "binary", id)
        _, resp_headers, data = self._request("POST", f"/v2/models/{self.model}/infer",
                                              body, headers)
        tensors, _ = parse_infer_response(data, resp_headers.get("content-type"),
                                          resp_headers.get(HEADER_LENGTH))
        return tensors

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    def __enter__(self) -> "InferenceClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- helpers ---------------------------------------------------------------------------

    def _named(self, inputs: Any) -> list[tuple[str, np.ndarray]]:
        declared = self.model_metadata()["inputs"]
        if isinstance(inputs, Mapping):
            pairs = list(inputs.items())
        elif len(declared) == 1:  # the one input's array (or nested lists)
            pairs = [(declared[0]["name"], inputs)]
        elif isinstance(inputs, np.ndarray) or not isinstance(inputs, (list, tuple)):
            raise ValueError(f"the model takes {len(declared)} inputs "
                             f"{[d['name'] for d in declared]}: pass a mapping or a sequence")
        else:
            if len(inputs) != len(declared):
                raise ValueError(f"{len(inputs)} inputs given, the model takes "
                                 f"{[d['name'] for d in declared]}")
            pairs = [(d["name"], v) for d, v in zip(declared, inputs)]
        dtypes = {d["name"]: DATATYPES.get(d["datatype"]) for d in declared}
        return [(n, v if isinstance(v, np.ndarray) else np.asarray(v, dtype=dtypes.get(n)))
                for n, v in pairs]

    def _conn(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = http.client.HTTPConnection(self.host, self.port,
                                                                 timeout=self.timeout)
        return conn

    def _request(self, method: str, path: str, body: bytes | None = None,
                 headers: Mapping[str, str] | None = None,
                 check: bool = True) -> tuple[int, dict[str, str], bytes]:
        for attempt in (0, 1):  # a keep-alive connection the server closed: reconnect once
            conn = self._conn()
            try:
                conn.request(method, self.prefix + path, body=body, headers=dict(headers or {}))
                resp = conn.getresponse()
                data = resp.read()
                break
            except (http.client.RemoteDisconnected, http.client.CannotSendRequest,
                    BrokenPipeError, ConnectionResetError):
                self.close()
                if attempt:
                    raise
            except BaseException:  # a timeout, say: this connection's state is unknown
                self.close()
                raise
        got = {k.lower(): v for k, v in resp.getheaders()}
        if check and resp.status != 200:
            try:
                message = json.loads(data)["error"]
            except (ValueError, KeyError, TypeError):
                message = data[:500].decode("utf-8", "replace")
            raise InferenceServerError(resp.status, message)
        return resp.status, got, data


class AsyncInferenceClient:
    """`InferenceClient`'s calls as coroutines (each runs on a worker thread with its
    own connection, so many may be in flight at once)."""

    def __init__(self, url: str, model: str, **kwargs: Any):
        self._sync = InferenceClient(url, model, **kwargs)

    async def infer(self, inputs: Any, outputs: Sequence[str] | None = None,
                    id: str | None = None) -> dict[str, np.ndarray]:
        return await asyncio.to_thread(self._sync.infer, inputs, outputs, id)

    async def model_metadata(self) -> dict[str, Any]:
        return await asyncio.to_thread(self._sync.model_metadata)

    async def ready(self) -> bool:
        return await asyncio.to_thread(self._sync.ready)

    async def live(self) -> bool:
        return await asyncio.to_thread(self._sync.live)
