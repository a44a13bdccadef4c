"""The Open Inference Protocol (KServe v2 REST) as data: requests in, responses out.

No HTTP and no Ray here: `actors.serve` routes requests to these functions and
`actors.client` speaks the same protocol. Three bodies are understood:

* JSON tensors (``name``, ``shape``, ``datatype`` in the protocol's names, ``data``
  row-major, flat or nested);
* the binary tensor data extension: a JSON header of ``Inference-Header-Content-Length``
  bytes, then each binary tensor's raw bytes in input order (``parameters.
  binary_data_size``); BYTES elements are a 4-byte little-endian length and the bytes;
* ``Content-Type: application/msgpack``: our tensor frames (`actors.transport.wire`).

Every malformed request raises `ProtocolError` with the HTTP status to answer and a
message naming what is wrong.

>>> req = parse_infer_request(b'{"inputs": [{"name": "x", "shape": [2], '
...                           b'"datatype": "FP32", "data": [1, 2]}]}', "application/json")
>>> req.inputs
[('x', array([1., 2.], dtype=float32))]
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from actors.transport.wire import WireFormatError, decode_request, encode_response

MSGPACK = "application/msgpack"
JSON = "application/json"
BINARY = "application/octet-stream"
HEADER_LENGTH = "inference-header-content-length"

#: the protocol's datatype names and numpy's dtypes
DATATYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8), "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32), "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8), "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32), "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16), "FP32": np.dtype(np.float32), "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(object),
}
try:
    import ml_dtypes

    DATATYPES["BF16"] = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # a dependency of hetero_exec; BF16 is simply not offered without it
    pass
_NAMES = {dt: name for name, dt in DATATYPES.items()}


class ProtocolError(ValueError):
    """A request the protocol refuses: ``status`` is the HTTP status to answer."""

    def __init__(self, message: str, status: int = 400):
        self.status = status
        super().__init__(message)


def datatype_name(dtype: Any) -> str:
    """The protocol's name of a numpy dtype (strings are BYTES).

    >>> datatype_name(np.float32), datatype_name(np.dtype("U3"))
    ('FP32', 'BYTES')
    """
    dt = np.dtype(dtype)
    if dt.kind in "USO":
        return "BYTES"
    if dt not in _NAMES:
        raise ProtocolError(f"dtype {dt.name} has no Open Inference Protocol datatype", 500)
    return _NAMES[dt]


def dtype_of(datatype: Any, where: str) -> np.dtype:
    if not isinstance(datatype, str) or datatype not in DATATYPES:
        raise ProtocolError(f"{where}: unknown datatype {datatype!r:.40}; known: {sorted(DATATYPES)}")
    return DATATYPES[datatype]


# -- requests ------------------------------------------------------------------------------


@dataclass
class RequestedOutput:
    name: str
    binary: bool | None = None  # None: the request's default


@dataclass
class InferRequest:
    """A decoded inference request; ``wire`` says how to answer (json or msgpack)."""

    inputs: list[tuple[str, np.ndarray]]
    outputs: list[RequestedOutput] | None = None  # None: every output
    id: str | None = None
    binary_output: bool = False  # the default for outputs that do not say
    wire: str = "json"
    parameters: dict[str, Any] = field(default_factory=dict)


def parse_infer_request(body: bytes, content_type: str | None,
                        header_length: str | None = None) -> InferRequest:
    """A request body as an `InferRequest`; `ProtocolError` names what is wrong."""
    if (content_type or "").split(";")[0].strip().lower() == MSGPACK:
        return _msgpack_request(body)
    head, rest = _split_binary(body, header_length)
    try:
        obj = json.loads(head)
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError(f"malformed JSON request body: {e}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("the request body must be a JSON object")
    inputs = obj.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise ProtocolError("the request needs 'inputs', a non-empty list of tensors")
    params = _parameters(obj, "the request")
    req = InferRequest(inputs=_json_tensors(inputs, rest), id=_request_id(obj),
                       binary_output=bool(params.get("binary_data_output", False)),
                       parameters=params)
    if obj.get("outputs") is not None:
        req.outputs = _requested_outputs(obj["outputs"])
    return req


def _msgpack_request(body: bytes) -> InferRequest:
    try:
        msg = decode_request(body)
    except WireFormatError as e:
        raise ProtocolError(f"malformed msgpack request: {e}") from None
    outputs = [RequestedOutput(n) for n in msg.outputs] if msg.outputs is not None else None
    return InferRequest(inputs=list(msg.tensors.items()), outputs=outputs, id=msg.id, wire="msgpack")


def _split_binary(body: bytes, header_length: str | None) -> tuple[bytes, memoryview]:
    if header_length is None:
        return body, memoryview(b"")
    try:
        n = int(header_length)
    except ValueError:
        n = -1
    if not 0 <= n <= len(body):
        raise ProtocolError(f"Inference-Header-Content-Length {header_length!r:.40} is not a "
                            f"length within the body of {len(body)} bytes")
    view = memoryview(body)
    return bytes(view[:n]), view[n:]


def _parameters(obj: Mapping[str, Any], where: str) -> dict[str, Any]:
    params = obj.get("parameters") or {}
    if not isinstance(params, dict):
        raise ProtocolError(f"{where}: 'parameters' must be an object")
    return params


def _request_id(obj: Mapping[str, Any]) -> str | None:
    rid = obj.get("id")
    if rid is not None and not isinstance(rid, str):
        raise ProtocolError("the request 'id' must be a string")
    return rid


def _shape(t: Mapping[str, Any], where: str) -> tuple[int, ...]:
    shape = t.get("shape")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise ProtocolError(f"{where}: 'shape' must be a list of non-negative integers, "
                            f"got {shape!r:.60}")
    return tuple(shape)


def _json_tensors(tensors: list[Any], binary: memoryview,
                  what: str = "input") -> list[tuple[str, np.ndarray]]:
    out, offset = [], 0
    for i, t in enumerate(tensors):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise ProtocolError(f"{what} #{i}: a tensor is an object with a string 'name'")
        where = f"{what} {t['name']!r}"
        shape, dtype = _shape(t, where), dtype_of(t.get("datatype"), where)
        size = _parameters(t, where).get("binary_data_size")
        if size is not None:
            if type(size) is not int or size < 0 or offset + size > len(binary):
                raise ProtocolError(f"{where}: binary_data_size {size!r:.20} runs past the "
                                    f"{len(binary)} bytes of binary data after the JSON header")
            if "data" in t:
                raise ProtocolError(f"{where}: both 'data' and binary_data_size given")
            arr = _from_binary(binary[offset:offset + size], dtype, shape, where)
            offset += size
        elif "data" in t:
            arr = _from_json(t["data"], dtype, shape, where)
        else:
            raise ProtocolError(f"{where}: no 'data' and no binary_data_size")
        out.append((t["name"], arr))
    if offset != len(binary):
        raise ProtocolError(f"{len(binary) - offset} bytes of binary data after the JSON "
                            f"header belong to no {what}")
    return out


def _from_binary(raw: memoryview, dtype: np.dtype, shape: tuple[int, ...], where: str) -> np.ndarray:
    count = math.prod(shape)
    if dtype.kind == "O":
        return _bytes_elements(raw, count, where).reshape(shape)
    if len(raw) != count * dtype.itemsize:
        raise ProtocolError(f"{where}: shape {list(shape)} of {_NAMES[dtype]} needs "
                            f"{count * dtype.itemsize} bytes, got {len(raw)}")
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def _bytes_elements(raw: memoryview, count: int, where: str) -> np.ndarray:
    out, pos = np.empty(count, dtype=object), 0
    for i in range(count):
        if pos + 4 > len(raw):
            raise ProtocolError(f"{where}: BYTES data ends after {i} of {count} elements")
        (n,) = struct.unpack_from("<I", raw, pos)
        if pos + 4 + n > len(raw):
            raise ProtocolError(f"{where}: BYTES element {i} of {n} bytes runs past the data")
        out[i] = _utf8(bytes(raw[pos + 4: pos + 4 + n]), where)
        pos += 4 + n
    if pos != len(raw):
        raise ProtocolError(f"{where}: {len(raw) - pos} bytes after the {count} BYTES elements")
    return out


def _utf8(b: bytes, where: str) -> str:
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ProtocolError(f"{where}: a BYTES element is not UTF-8 ({e})") from None


#: the JSON value kinds each datatype's data may hold (no silent float -> int casts)
_JSON_KINDS = {"b": "b", "i": "iu", "u": "iu", "f": "iuf", "V": "iuf"}


def _from_json(data: Any, dtype: np.dtype, shape: tuple[int, ...], where: str) -> np.ndarray:
    count = math.prod(shape)
    flat = _flatten(data, where)
    if len(flat) != count:
        raise ProtocolError(f"{where}: shape {list(shape)} holds {count} elements, "
                            f"'data' has {len(flat)}")
    if dtype.kind == "O":
        if not all(isinstance(v, str) for v in flat):
            raise ProtocolError(f"{where}: BYTES data must be strings")
        arr = np.empty(count, dtype=object)
        arr[:] = flat
        return arr.reshape(shape)
    if any(isinstance(v, (str, list, dict)) or v is None for v in flat):
        raise ProtocolError(f"{where}: {_NAMES[dtype]} data must be numbers")
    got = np.asarray(flat) if flat else np.zeros(0, dtype)
    allowed = _JSON_KINDS.get(dtype.kind, "iuf")
    if got.dtype.kind not in allowed and got.size:
        raise ProtocolError(f"{where}: {_NAMES[dtype]} data holds {_kind_word(got)} values")
    if dtype.kind in "iu" and got.size:
        info = np.iinfo(dtype)
        if got.min() < info.min or got.max() > info.max:
            raise ProtocolError(f"{where}: a value is out of range for {_NAMES[dtype]}")
    return got.astype(dtype).reshape(shape)


def _kind_word(arr: np.ndarray) -> str:
    return {"b": "boolean", "f": "non-integer", "O": "out-of-range integer"}.get(arr.dtype.kind,
                                                                                 arr.dtype.name)


def _flatten(data: Any, where: str) -> list[Any]:
    if not isinstance(data, list):
        raise ProtocolError(f"{where}: 'data' must be a list")
    flat: list[Any] = []
    stack = [iter(data)]
    while stack:
        for v in stack[-1]:
            if isinstance(v, list):
                stack.append(iter(v))
                break
            flat.append(v)
        else:
            stack.pop()
    return flat


def _requested_outputs(outputs: Any) -> list[RequestedOutput]:
    if not isinstance(outputs, list):
        raise ProtocolError("'outputs' must be a list of {\"name\": ...} objects")
    out = []
    for i, o in enumerate(outputs):
        if not isinstance(o, dict) or not isinstance(o.get("name"), str):
            raise ProtocolError(f"requested output #{i}: an object with a string 'name'")
        params = _parameters(o, f"requested output {o['name']!r}")
        if "classification" in params:
            raise ProtocolError("the classification extension is not supported")
        binary = params.get("binary_data")
        out.append(RequestedOutput(o["name"], None if binary is None else bool(binary)))
    names = [o.name for o in out]
    if len(set(names)) != len(names):
        raise ProtocolError(f"an output is requested twice: {names}")
    return out


# -- responses -----------------------------------------------------------------------------


def infer_response(model: str, version: str, req: InferRequest,
                   outputs: Sequence[tuple[str, np.ndarray]]) -> tuple[bytes, dict[str, str]]:
    """The response body and headers for ``outputs``, in the request's form."""
    if req.wire == "msgpack":
        return encode_response(dict(outputs), model, version, req.id), {"content-type": MSGPACK}
    binary_of = {o.name: o.binary for o in req.outputs or ()}
    tensors, blobs = [], []
    for name, arr in outputs:
        binary = binary_of.get(name)
        tensors.append(_tensor(name, np.asarray(arr),
                               binary if binary is not None else req.binary_output, blobs))
    head: dict[str, Any] = {"model_name": model, "model_version": version, "outputs": tensors}
    if req.id is not None:
        head["id"] = req.id
    body = json.dumps(head, separators=(",", ":")).encode()
    if not blobs:
        return body, {"content-type": JSON}
    return b"".join([body, *blobs]), {"content-type": BINARY, HEADER_LENGTH: str(len(body))}


def _tensor(name: str, arr: np.ndarray, binary: bool, blobs: list[bytes]) -> dict[str, Any]:
    """One tensor's JSON entry: its data inline, or (``binary``) its bytes appended to
    ``blobs`` with their size in the entry's parameters."""
    t: dict[str, Any] = {"name": name, "datatype": datatype_name(arr.dtype),
                         "shape": list(arr.shape)}
    if binary:
        blob = _to_binary(arr)
        t["parameters"] = {"binary_data_size": len(blob)}
        blobs.append(blob)
    else:
        t["data"] = _to_json(arr)
    return t


def _to_binary(arr: np.ndarray) -> bytes:
    if arr.dtype.kind in "USO":
        parts = []
        for v in arr.reshape(-1):
            b = v.encode("utf-8") if isinstance(v, str) else bytes(v)
            parts += [struct.pack("<I", len(b)), b]
        return b"".join(parts)
    return np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes()


def _to_json(arr: np.ndarray) -> list[Any]:
    flat = arr.reshape(-1)
    if arr.dtype.kind in "USO":
        return [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in flat]
    if arr.dtype.kind == "V" or arr.dtype == np.float16:  # bf16 and friends: as floats
        flat = flat.astype(np.float32)
    return flat.tolist()


def infer_request_body(inputs: Sequence[tuple[str, np.ndarray]], outputs: Sequence[str] | None,
                       binary: bool = True, id: str | None = None) -> tuple[bytes, dict[str, str]]:
    """A JSON request (the binary tensor extension when ``binary``) and its headers.

    >>> body, headers = infer_request_body([("x", np.ones(2, np.float32))], None)
    >>> int(headers[HEADER_LENGTH]) == len(body) - 8  # the JSON header, then 8 raw bytes
    True
    """
    blobs: list[bytes] = []
    tensors = [_tensor(name, arr, binary, blobs) for name, arr in inputs]
    head: dict[str, Any] = {"inputs": tensors}
    if outputs is not None:
        head["outputs"] = [{"name": n, "parameters": {"binary_data": binary}} for n in outputs]
    else:
        head["parameters"] = {"binary_data_output": binary}
    if id is not None:
        head["id"] = id
    body = json.dumps(head, separators=(",", ":")).encode()
    if not blobs:
        return body, {"content-type": JSON}
    return b"".join([body, *blobs]), {"content-type": BINARY, HEADER_LENGTH: str(len(body))}


def parse_infer_response(body: bytes, content_type: str | None,
                         header_length: str | None = None) -> tuple[dict[str, np.ndarray], dict]:
    """A response's outputs (name -> array) and its JSON header (empty for msgpack)."""
    if (content_type or "").split(";")[0].strip().lower() == MSGPACK:
        from actors.transport.wire import decode_response

        msg = decode_response(body)
        return msg.tensors, {"model_name": msg.model_name, "id": msg.id}
    head, rest = _split_binary(body, header_length)
    obj = json.loads(head)
    return dict(_json_tensors(obj.get("outputs") or [], rest, "output")), obj


def error_body(message: str) -> bytes:
    return json.dumps({"error": message}).encode()
