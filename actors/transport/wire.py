"""A msgpack wire format for tensors: dtype name, shape, raw little-endian bytes.

Used wherever tensors leave Ray's object store (clients, host staging, the ``wire``
seam transport). Never pickle: a frame is a msgpack map, so any language with a
msgpack library can read it. ml_dtypes' dtypes (bfloat16, float8_*, int4...) travel
by name; string tensors take a separate path (a list of UTF-8 byte strings).

>>> import numpy as np
>>> frame = encode_tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
>>> decode_tensor(frame)
array([[0., 1., 2.],
       [3., 4., 5.]], dtype=float32)
"""

from __future__ import annotations

from typing import Any, Mapping

import msgpack
import numpy as np

from actors.transport.base import SeamKey, Transport

#: the frame's format version; readers refuse frames of another version
WIRE_VERSION = 1
STRING_DTYPE = "string"


class WireFormatError(ValueError):
    """A frame that is not a tensor of this format (or of an unknown dtype)."""


def dtype_from_name(name: str) -> np.dtype:
    """numpy's dtype for ``name``, ml_dtypes' extension types included.

    >>> dtype_from_name("bfloat16").name
    'bfloat16'
    """
    try:
        import ml_dtypes

        ext = getattr(ml_dtypes, name, None)
        if ext is not None:
            return np.dtype(ext)
    except ImportError:  # ml_dtypes is a dependency, but plain dtypes work without it
        pass
    try:
        return np.dtype(name)
    except TypeError as e:
        raise WireFormatError(f"unknown dtype {name!r} in tensor frame") from e


def tensor_to_map(arr: Any) -> dict[str, Any]:
    """The msgpack-ready map of one tensor (numpy array or scalar)."""
    arr = np.asarray(arr)
    if arr.dtype.kind in "USO":
        items = [s.encode("utf-8") if isinstance(s, str) else bytes(s) for s in arr.reshape(-1)]
        return {"v": WIRE_VERSION, "dtype": STRING_DTYPE, "shape": list(arr.shape), "items": items}
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    data = np.ascontiguousarray(arr).tobytes()
    return {"v": WIRE_VERSION, "dtype": arr.dtype.name, "shape": list(arr.shape), "data": data}


def tensor_from_map(frame: Mapping[str, Any]) -> np.ndarray:
    """The array a map holds; numeric data is a read-only view of the frame's bytes."""
    if frame.get("v") != WIRE_VERSION:
        raise WireFormatError(f"tensor frame version {frame.get('v')!r}, expected {WIRE_VERSION}")
    shape = tuple(frame["shape"])
    if frame["dtype"] == STRING_DTYPE:
        items = [b.decode("utf-8") for b in frame["items"]]
        out = np.empty(len(items), dtype=object)
        out[:] = items
        return out.reshape(shape)
    dtype = dtype_from_name(frame["dtype"])
    return np.frombuffer(frame["data"], dtype=dtype).reshape(shape)


def encode_tensor(arr: Any) -> bytes:
    """One tensor as a msgpack frame."""
    return msgpack.packb(tensor_to_map(arr), use_bin_type=True)


def decode_tensor(frame: bytes) -> np.ndarray:
    """The tensor of a frame written by `encode_tensor`."""
    return tensor_from_map(msgpack.unpackb(frame, raw=False))


def encode_tensors(tensors: Mapping[str, Any]) -> bytes:
    """Named tensors as one frame (a map of name to tensor map).

    >>> import numpy as np
    >>> sorted(decode_tensors(encode_tensors({"a": np.zeros(2), "b": np.array(["x"])})))
    ['a', 'b']
    """
    return msgpack.packb({k: tensor_to_map(v) for k, v in tensors.items()}, use_bin_type=True)


def decode_tensors(frame: bytes) -> dict[str, np.ndarray]:
    return {k: tensor_from_map(v) for k, v in msgpack.unpackb(frame, raw=False).items()}


class WireTransport(Transport):
    """Seam values travel as msgpack frames (bytes) through the object store.

    >>> t = WireTransport()
    >>> carried = t.write(SeamKey(1, "x"), np.ones(2, np.int64))
    >>> isinstance(carried, bytes), t.read(SeamKey(1, "x"), carried).tolist()
    (True, [1, 1])
    """

    name = "wire"

    def write(self, key: SeamKey, value: Any) -> Any:
        if value is None or isinstance(value, (list, dict)):
            return value  # sequences and maps are not tensors: they travel as they are
        return encode_tensor(value)

    def read(self, key: SeamKey, carried: Any) -> Any:
        return decode_tensor(carried) if isinstance(carried, bytes) else carried
