"""A msgpack wire format for tensors: dtype name, shape, raw little-endian bytes.

Used wherever tensors leave Ray's object store (clients, the Serve app's
``application/msgpack`` body, host staging, the ``wire`` seam transport). Never
pickle: a frame is a msgpack map, so any language with a msgpack library can read it.
ml_dtypes' dtypes (bfloat16, float8_*, int4...) travel by name; string tensors take a
separate path (a list of UTF-8 byte strings).

Frames come from the network, so the decoder trusts nothing: every malformed frame
(bad msgpack, trailing bytes, a duplicate map key, a missing or extra field, a field
of the wrong type, an unknown dtype, a negative or oversized shape, data whose length
does not match the shape, invalid UTF-8, a frame over ``max_bytes``) raises
`WireFormatError`, and nothing else.

>>> import numpy as np
>>> frame = encode_tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
>>> decode_tensor(frame)
array([[0., 1., 2.],
       [3., 4., 5.]], dtype=float32)
>>> decode_tensor(frame[:-1])
Traceback (most recent call last):
...
actors.transport.wire.WireFormatError: not a msgpack frame: ...
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import msgpack
import numpy as np

from actors.transport.base import SeamKey, Transport

#: the frame's format version; readers refuse frames of another version
WIRE_VERSION = 1
STRING_DTYPE = "string"
#: the largest frame a decoder accepts unless told otherwise
DEFAULT_MAX_FRAME_BYTES = 256 << 20
#: numpy's own limit on the number of dimensions
MAX_RANK = 64
#: numpy dtype kinds that travel as raw bytes (ml_dtypes' extension types are named)
NUMERIC_KINDS = "biufc"
_NUMERIC_KEYS = frozenset({"v", "dtype", "shape", "data"})
_STRING_KEYS = frozenset({"v", "dtype", "shape", "items"})


class WireFormatError(ValueError):
    """A frame that is not a tensor of this format (or of an unknown dtype)."""


def _ml_dtype(name: str) -> np.dtype | None:
    try:
        import ml_dtypes
    except ImportError:  # ml_dtypes is a dependency, but plain dtypes work without it
        return None
    ext = getattr(ml_dtypes, name, None)
    if isinstance(ext, type) and issubclass(ext, np.generic):
        return np.dtype(ext)
    return None


def dtype_from_name(name: str) -> np.dtype:
    """numpy's dtype for a canonical numeric dtype ``name``, ml_dtypes' types included.

    Only canonical names of numeric types are accepted (``float32``, not ``<f4``
    or ``object``): a frame's bytes are always little-endian numbers.

    >>> dtype_from_name("bfloat16").name
    'bfloat16'
    >>> dtype_from_name("object")
    Traceback (most recent call last):
    ...
    actors.transport.wire.WireFormatError: unknown dtype 'object' in tensor frame
    """
    if not isinstance(name, str):
        raise WireFormatError(f"tensor frame dtype must be a string, got {type(name).__name__}")
    dt = _KNOWN_DTYPES.get(name)
    if dt is not None:
        return dt
    dt = _ml_dtype(name)
    if dt is not None:
        _KNOWN_DTYPES[name] = dt
        return dt
    try:
        dt = np.dtype(name)
    except (TypeError, ValueError, SyntaxError):
        dt = None
    if dt is None or dt.name != name or dt.kind not in NUMERIC_KINDS:
        raise WireFormatError(f"unknown dtype {name!r} in tensor frame")
    _KNOWN_DTYPES[name] = dt
    return dt


#: dtypes by the names already accepted (a finite set: only valid names are kept), so a
#: decode step's few small tensors do not look each up again (numpy's and ml_dtypes'
#: lookups are most of a small frame's decode time)
_KNOWN_DTYPES: dict[str, np.dtype] = {}


def tensor_to_map(arr: Any) -> dict[str, Any]:
    """The msgpack-ready map of one tensor (numpy array or scalar)."""
    arr = np.asarray(arr)
    if arr.dtype.kind in "USO":
        items = [s.encode("utf-8") if isinstance(s, str) else bytes(s) for s in arr.reshape(-1)]
        return {"v": WIRE_VERSION, "dtype": STRING_DTYPE, "shape": list(arr.shape), "items": items}
    name, shape, data = _numeric_parts(arr)
    return {"v": WIRE_VERSION, "dtype": name, "shape": shape, "data": data}


def _numeric_parts(arr: np.ndarray) -> list[Any]:
    """[dtype name, shape, little-endian bytes] of a numeric array."""
    dtype = arr.dtype
    name = _DTYPE_NAMES.get(dtype)  # little-endian (or byte-order-free) dtypes only
    if name is None:
        if dtype.byteorder == ">":
            arr = arr.astype(dtype.newbyteorder("<"))
            dtype = arr.dtype
        name = dtype.name  # numpy computes a dtype's name on every read
        if dtype.byteorder != ">":
            _DTYPE_NAMES[dtype] = name
    return [name, list(arr.shape), arr.tobytes()]  # tobytes: C order, any strides


_DTYPE_NAMES: dict[np.dtype, str] = {}


def _shape(shape: Any) -> tuple[int, ...]:
    if not isinstance(shape, list) or len(shape) > MAX_RANK:
        raise WireFormatError(f"tensor frame shape must be a list of at most {MAX_RANK} dims, "
                              f"got {shape!r:.80}")
    for d in shape:
        if type(d) is not int or d < 0:  # bool is an int subclass: refused too
            raise WireFormatError(f"tensor frame shape {shape!r:.80}: dims must be "
                                  f"non-negative integers")
    return tuple(shape)


def _strings(frame: Mapping[str, Any], shape: tuple[int, ...]) -> np.ndarray:
    items = frame["items"]
    count = math.prod(shape)
    if not isinstance(items, list) or len(items) != count:
        got = len(items) if isinstance(items, list) else type(items).__name__
        raise WireFormatError(f"string tensor frame of shape {list(shape)} needs {count} "
                              f"items, got {got}")
    out = np.empty(count, dtype=object)
    for i, b in enumerate(items):
        if not isinstance(b, bytes):
            raise WireFormatError(f"string tensor frame item {i} is {type(b).__name__}, not bytes")
        try:
            out[i] = b.decode("utf-8")
        except UnicodeDecodeError as e:
            raise WireFormatError(f"string tensor frame item {i} is not UTF-8: {e}") from None
    return out.reshape(shape)


def tensor_from_map(frame: Any) -> np.ndarray:
    """The array a map holds; numeric data is a read-only view of the frame's bytes."""
    if not isinstance(frame, Mapping):
        raise WireFormatError(f"a tensor frame is a map, got {type(frame).__name__}")
    if frame.get("v") != WIRE_VERSION or type(frame.get("v")) is not int:
        raise WireFormatError(f"tensor frame version {frame.get('v')!r:.40}, "
                              f"expected {WIRE_VERSION}")
    strings = frame.get("dtype") == STRING_DTYPE
    want = _STRING_KEYS if strings else _NUMERIC_KEYS
    if set(frame) != want:
        raise WireFormatError(f"tensor frame fields {sorted(map(str, frame))}, "
                              f"expected {sorted(want)}")
    if strings:
        return _strings(frame, _shape(frame["shape"]))
    return _numeric(frame["dtype"], frame["shape"], frame["data"])


def _numeric(name: Any, shape: Any, data: Any) -> np.ndarray:
    """The array of a numeric tensor's dtype name, shape and bytes (a read-only view of
    the bytes); WireFormatError when they do not make one."""
    dtype = _KNOWN_DTYPES.get(name) if type(name) is str else None
    if dtype is None:
        dtype = dtype_from_name(name)
    dims = shape if type(shape) is list and len(shape) <= MAX_RANK else _shape(shape)
    for d in dims:
        if type(d) is not int or d < 0:  # bool is an int subclass: refused too
            _shape(shape)  # raises, naming the shape
    if type(data) is not bytes:
        raise WireFormatError(f"tensor frame data is {type(data).__name__}, not bytes")
    need = math.prod(dims) * dtype.itemsize
    if len(data) != need:
        raise WireFormatError(f"tensor frame of {dtype.name}{list(dims)} needs {need} bytes "
                              f"of data, got {len(data)}")
    return np.frombuffer(data, dtype=dtype).reshape(dims)


def tensor_to_list(arr: Any) -> list[Any]:
    """The compact form of a numeric tensor, for frames between this project's own
    processes (the generation ring's steps and tokens): ``[dtype, shape, data]``, no
    map (a map's keys cost a decoder more than the few bytes of a decode step's
    tensors)."""
    arr = np.asarray(arr)
    if arr.dtype.kind in "USO":
        raise WireFormatError(f"a compact tensor is numeric, got {arr.dtype}")
    return _numeric_parts(arr)


def tensor_from_list(v: Any) -> np.ndarray:
    """The array of `tensor_to_list`'s form (a read-only view of the frame's bytes);
    WireFormatError when it is not one."""
    if type(v) is not list or len(v) != 3:
        raise WireFormatError("a compact tensor is [dtype, shape, data]")
    return _numeric(*v)


def _pairs(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[Any] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise WireFormatError(f"duplicate key {dup!r:.80} in a frame's map")
    return out


#: one packer for the frames this process encodes (`pack`)
_PACKER = msgpack.Packer(use_bin_type=True, autoreset=True)
_PACK_LOCK = threading.Lock()


def pack(obj: Any) -> bytes:
    """``msgpack.packb(obj, use_bin_type=True)`` with a packer made once: packb makes
    one per call, ~0.7 us of a decode step's small frame. A packer is not thread-safe:
    a second thread packing at the same moment gets a packb of its own."""
    if _PACK_LOCK.acquire(blocking=False):
        try:
            return _PACKER.pack(obj)
        finally:
            _PACK_LOCK.release()
    return msgpack.packb(obj, use_bin_type=True)


def unpack_frame(frame: Any, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Any:
    """The msgpack object a frame holds: one object, no trailing bytes, no duplicate
    map keys, string keys only, at most ``max_bytes``.

    >>> unpack_frame(msgpack.packb({"a": 1}) + b"x")
    Traceback (most recent call last):
    ...
    actors.transport.wire.WireFormatError: not a msgpack frame: unpack(b) received extra data.
    """
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise WireFormatError(f"a frame is bytes, got {type(frame).__name__}")
    if len(frame) > max_bytes:
        raise WireFormatError(f"frame of {len(frame)} bytes exceeds the limit of {max_bytes} bytes")
    try:
        return msgpack.unpackb(frame, raw=False, strict_map_key=True, object_pairs_hook=_pairs)
    except WireFormatError:
        raise
    except Exception as e:  # msgpack's own errors, UnicodeDecodeError, recursion depth...
        raise WireFormatError(f"not a msgpack frame: {e}") from None


def encode_tensor(arr: Any) -> bytes:
    """One tensor as a msgpack frame."""
    return msgpack.packb(tensor_to_map(arr), use_bin_type=True)


def decode_tensor(frame: bytes, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> np.ndarray:
    """The tensor of a frame written by `encode_tensor`."""
    return tensor_from_map(unpack_frame(frame, max_bytes))


def encode_tensors(tensors: Mapping[str, Any]) -> bytes:
    """Named tensors as one frame (a map of name to tensor map).

    >>> import numpy as np
    >>> sorted(decode_tensors(encode_tensors({"a": np.zeros(2), "b": np.array(["x"])})))
    ['a', 'b']
    """
    return msgpack.packb({k: tensor_to_map(v) for k, v in tensors.items()}, use_bin_type=True)


def tensors_from_map(obj: Any, what: str = "tensors") -> dict[str, np.ndarray]:
    """A map of name to tensor map, decoded (names are non-empty strings)."""
    if not isinstance(obj, Mapping):
        raise WireFormatError(f"{what} must be a map of name to tensor, got {type(obj).__name__}")
    out = {}
    for name, tensor in obj.items():
        if not isinstance(name, str) or not name:
            raise WireFormatError(f"{what}: a tensor name must be a non-empty string, got {name!r:.40}")
        try:
            out[name] = tensor_from_map(tensor)
        except WireFormatError as e:
            raise WireFormatError(f"{what} {name!r}: {e}") from None
    return out


def decode_tensors(frame: bytes, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> dict[str, np.ndarray]:
    return tensors_from_map(unpack_frame(frame, max_bytes))


# -- inference requests and responses (the Serve app's application/msgpack body) ----------

_REQUEST_KEYS = frozenset({"v", "inputs", "outputs", "id"})
_RESPONSE_KEYS = frozenset({"v", "model_name", "model_version", "outputs", "id"})


@dataclass
class WireMessage:
    """An inference request (inputs, requested outputs) or response (outputs) frame."""

    tensors: dict[str, np.ndarray]
    outputs: list[str] | None = None  # a request's requested outputs (None: all)
    id: str | None = None
    model_name: str | None = None
    model_version: str | None = None


def encode_request(inputs: Mapping[str, Any], outputs: Sequence[str] | None = None,
                   id: str | None = None) -> bytes:
    """An inference request: named input tensors, optionally the outputs wanted.

    >>> msg = decode_request(encode_request({"x": np.ones(2, np.float32)}, ["y"], id="r1"))
    >>> sorted(msg.tensors), msg.outputs, msg.id
    (['x'], ['y'], 'r1')
    """
    body: dict[str, Any] = {"v": WIRE_VERSION,
                            "inputs": {k: tensor_to_map(v) for k, v in inputs.items()}}
    if outputs is not None:
        body["outputs"] = list(outputs)
    if id is not None:
        body["id"] = id
    return msgpack.packb(body, use_bin_type=True)


def _message(obj: Any, keys: frozenset[str], tensors_key: str) -> WireMessage:
    if not isinstance(obj, Mapping):
        raise WireFormatError(f"a message frame is a map, got {type(obj).__name__}")
    extra = sorted(set(obj) - keys)
    if extra:
        raise WireFormatError(f"unknown field(s) {extra} in message frame; known: {sorted(keys)}")
    if obj.get("v") != WIRE_VERSION or type(obj.get("v")) is not int:
        raise WireFormatError(f"message frame version {obj.get('v')!r:.40}, expected {WIRE_VERSION}")
    if tensors_key not in obj:
        raise WireFormatError(f"message frame has no {tensors_key!r} field")
    for key in ("id", "model_name", "model_version"):
        if obj.get(key) is not None and not isinstance(obj[key], str):
            raise WireFormatError(f"message frame {key!r} must be a string")
    return WireMessage(tensors_from_map(obj[tensors_key], tensors_key), id=obj.get("id"),
                       model_name=obj.get("model_name"), model_version=obj.get("model_version"))


def decode_request(frame: bytes, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> WireMessage:
    obj = unpack_frame(frame, max_bytes)
    msg = _message(obj, _REQUEST_KEYS, "inputs")
    outputs = obj.get("outputs")
    if outputs is not None:
        if not isinstance(outputs, list) or not all(isinstance(o, str) for o in outputs):
            raise WireFormatError("request frame 'outputs' must be a list of output names")
        if len(set(outputs)) != len(outputs):
            raise WireFormatError(f"request frame names an output twice: {outputs}")
        msg.outputs = outputs
    return msg


def encode_response(outputs: Mapping[str, Any], model_name: str, model_version: str = "1",
                    id: str | None = None) -> bytes:
    body: dict[str, Any] = {"v": WIRE_VERSION, "model_name": model_name,
                            "model_version": model_version,
                            "outputs": {k: tensor_to_map(v) for k, v in outputs.items()}}
    if id is not None:
        body["id"] = id
    return msgpack.packb(body, use_bin_type=True)


def decode_response(frame: bytes, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> WireMessage:
    """The outputs of a response frame written by `encode_response`.

    >>> decode_response(encode_response({"y": np.zeros(1)}, "m")).model_name
    'm'
    """
    return _message(unpack_frame(frame, max_bytes), _RESPONSE_KEYS, "outputs")


class WireTransport(Transport):
    """Seam values travel as msgpack frames (bytes) through the object store.

    >>> t = WireTransport()
    >>> carried = t.write(SeamKey(1, "x"), np.ones(2, np.int64))
    >>> isinstance(carried, bytes), t.read(SeamKey(1, "x"), carried).tolist()
    (True, [1, 1])
    """

    name = "wire"
    label = "wire"

    def write(self, key: SeamKey, value: Any) -> Any:
        if value is None or isinstance(value, (list, dict)):
            return value  # sequences and maps are not tensors: they travel as they are
        return encode_tensor(value)

    def read(self, key: SeamKey, carried: Any) -> Any:
        # a seam value may be any size: the frame limit guards network input, not seams
        return decode_tensor(carried, max_bytes=1 << 62) if isinstance(carried, bytes) else carried

    def carries(self, carried: Any) -> bool:
        return isinstance(carried, bytes)
