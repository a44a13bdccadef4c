"""OrtValue: a value on a device, as onnxruntime code handles it.

A tensor lives where its provider keeps arrays: NumPy on ``cpu``, CuPy on ``cuda``
(our ``gpu``), the provider's own device array on ``sim-gpu``. Values move only
through the provider's ``to_device`` / ``to_host`` and only when asked (``numpy()``,
``ortvalue_from_numpy(..., "cuda")``): a device value never goes to the host silently.
Sequences (lists), maps (dicts) and empty optionals (None) are OrtValues too, as
``run_with_ort_values`` returns them.

>>> import numpy as np
>>> v = OrtValue.ortvalue_from_numpy(np.ones((2, 3), np.float32))
>>> (v.shape(), v.data_type(), v.device_name(), v.is_tensor())
([2, 3], 'tensor(float)', 'cpu', True)
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import numpy as np
import onnx

from hetero_exec.errors import InputError, OrtValueError, ProviderError

#: onnxruntime's device_type -> our provider kind (None: host memory)
DEVICE_KINDS = {"cpu": None, "cuda": "gpu", "gpu": "gpu", "sim-gpu": "sim-gpu"}
DEVICE_NAMES = {None: "cpu", "gpu": "cuda", "sim-gpu": "sim-gpu"}


@functools.lru_cache(maxsize=None)
def device_provider(device_type: str, device_id: int = 0) -> Any:
    """The provider holding arrays of ``device_type`` (None for cpu); raises when that
    device does not work here."""
    key = str(device_type).lower()
    if key not in DEVICE_KINDS:
        raise ProviderError(f"unknown device_type {device_type!r}; use one of {sorted(DEVICE_KINDS)}")
    kind = DEVICE_KINDS[key]
    if kind is None:
        return None
    from hetero_exec.providers import parse_provider

    provider = parse_provider((kind, {"device_id": int(device_id)}))
    sup = provider.available()
    if not sup:
        raise ProviderError(f"cannot place a value on {device_type}:{device_id}: {sup.reason}")
    return provider


def _type_name(dtype: np.dtype) -> str:
    if dtype == np.dtype(object) or dtype.kind in "US":
        return "string"
    elem = onnx.helper.np_dtype_to_tensor_dtype(dtype)
    return onnx.TensorProto.DataType.Name(elem).lower()


def _elem_dtype(element_type: Any) -> np.dtype:
    if isinstance(element_type, int) and not isinstance(element_type, bool):
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(element_type))
    try:
        return np.dtype(element_type)
    except TypeError:
        raise OrtValueError(f"element_type must be a numpy type or an onnx TensorProto type, "
                            f"got {element_type!r}") from None


class OrtValue:
    """A tensor, sequence, map or optional, on the host or a provider's device."""

    def __init__(self, value: Any, provider: Any = None):
        self._value = value
        self._provider = provider  # None: host memory

    # -- making ----------------------------------------------------------------------

    @staticmethod
    def ortvalue_from_numpy(numpy_obj: np.ndarray, device_type: str = "cpu", device_id: int = 0,
                            vendor_id: int = -1) -> "OrtValue":
        """On cpu the array itself (no copy, as onnxruntime); on a device, one copy there."""
        if not isinstance(numpy_obj, np.ndarray):
            raise OrtValueError(f"ortvalue_from_numpy takes a numpy array, got {type(numpy_obj).__name__}")
        provider = device_provider(device_type, device_id)
        if provider is None:
            return OrtValue(numpy_obj if numpy_obj.flags.c_contiguous else np.ascontiguousarray(numpy_obj))
        return OrtValue(provider.to_device(np.ascontiguousarray(numpy_obj)), provider)

    @staticmethod
    def ortvalue_from_numpy_with_onnx_type(data: np.ndarray, onnx_element_type: int) -> "OrtValue":
        """Bytes of another dtype reinterpreted as the onnx type (e.g. uint16 as bfloat16)."""
        return OrtValue(np.ascontiguousarray(data).view(_elem_dtype(onnx_element_type)))

    @staticmethod
    def ortvalue_from_shape_and_type(shape: Sequence[int], element_type: Any, device_type: str = "cpu",
                                     device_id: int = 0, vendor_id: int = -1) -> "OrtValue":
        """A zero-filled tensor (onnxruntime leaves it uninitialised)."""
        host = np.zeros(tuple(int(d) for d in shape), _elem_dtype(element_type))
        provider = device_provider(device_type, device_id)
        return OrtValue(host if provider is None else provider.to_device(host), provider)

    # -- what it is --------------------------------------------------------------------

    def is_tensor(self) -> bool:
        v = self._value
        return v is not None and not isinstance(v, (list, tuple, dict)) and hasattr(v, "dtype")

    def is_tensor_sequence(self) -> bool:
        return isinstance(self._value, (list, tuple))

    def is_sparse_tensor(self) -> bool:
        return False

    def has_value(self) -> bool:
        return self._value is not None

    def device_name(self) -> str:
        return DEVICE_NAMES[self._provider.kind if self._provider is not None else None]

    def _tensor(self, what: str) -> Any:
        if not self.is_tensor():
            raise OrtValueError(f"{what}: this OrtValue is a {self._kind()}, not a tensor")
        return self._value

    def _kind(self) -> str:
        if self._value is None:
            return "empty optional"
        return {list: "sequence", tuple: "sequence", dict: "map"}.get(type(self._value), "tensor")

    def shape(self) -> list[int]:
        return [int(d) for d in self._tensor("shape()").shape]

    def data_type(self) -> str:
        v = self._value
        if self.is_tensor():
            return f"tensor({_type_name(np.dtype(v.dtype))})"
        if self.is_tensor_sequence():
            inner = OrtValue(v[0]).data_type() if v and hasattr(v[0], "dtype") else "tensor(undefined)"
            return f"seq({inner})"
        if isinstance(v, dict):
            key = _type_name(np.asarray(next(iter(v))).dtype) if v else "undefined"
            val = OrtValue(next(iter(v.values()))).data_type() if v else "undefined"
            return f"map({key},{val})"
        return "optional(undefined)"

    def element_type(self) -> int:
        """The onnx TensorProto element type (what onnxruntime 1.2x+ returns)."""
        dtype = np.dtype(self._tensor("element_type()").dtype)
        if dtype == np.dtype(object) or dtype.kind in "US":
            return onnx.TensorProto.STRING
        return int(onnx.helper.np_dtype_to_tensor_dtype(dtype))

    def tensor_size_in_bytes(self) -> int:
        return int(self._tensor("tensor_size_in_bytes()").nbytes)

    def data_ptr(self) -> int:
        v = self._tensor("data_ptr()")
        if isinstance(v, np.ndarray):
            return int(v.ctypes.data)
        ptr = getattr(getattr(v, "data", None), "ptr", None)  # CuPy
        if ptr is None:
            raise OrtValueError(f"data_ptr(): a {self.device_name()} value has no raw pointer")
        return int(ptr)

    # -- moving -----------------------------------------------------------------------

    def numpy(self) -> np.ndarray:
        """A host copy of a device tensor (explicit), or the host tensor itself."""
        v = self._tensor("numpy()")
        return v if self._provider is None else self._provider.to_host(v)

    def update_inplace(self, np_arr: np.ndarray) -> None:
        """Copy a host array of the same shape and dtype into this tensor's buffer."""
        v = self._tensor("update_inplace()")
        arr = np.asarray(np_arr)
        if tuple(arr.shape) != tuple(v.shape) or arr.dtype != v.dtype:
            raise OrtValueError(f"update_inplace: got {arr.dtype}{list(arr.shape)}, "
                                f"the value is {v.dtype}{list(v.shape)}")
        self._assign(arr if self._provider is None else self._provider.to_device(arr))

    def _assign(self, new: Any) -> None:
        """Write ``new`` (same device) into this value's buffer, or adopt it."""
        try:
            self._value[...] = new
        except (TypeError, ValueError, AttributeError):
            self._value = new

    @property
    def value(self) -> Any:
        """The value itself (array, list, dict or None), where it lives."""
        return self._value

    @property
    def provider(self) -> Any:
        return self._provider

    def __repr__(self) -> str:
        what = self.data_type()
        shape = f" {self.shape()}" if self.is_tensor() else ""
        return f"<OrtValue {what}{shape} on {self.device_name()}>"


def host_array(value: Any, what: str) -> Any:
    """A host value from an OrtValue or array; a device OrtValue is an error (no silent copy)."""
    if isinstance(value, OrtValue):
        if value.provider is not None:
            raise OrtValueError(f"{what}: the OrtValue is on {value.device_name()}; pass "
                                f"value.numpy() to copy it to the host")
        return value.value
    return value


def unwrap_feed(feed: Any, what: str = "run()") -> dict[str, Any]:
    """A run() feed with host OrtValues unwrapped (onnxruntime's run takes them too)."""
    if not hasattr(feed, "items"):
        raise InputError(f"{what}: the input feed must be a dict of name -> value, "
                            f"got {type(feed).__name__}")
    if not any(isinstance(v, OrtValue) for v in feed.values()):
        return feed
    return {k: host_array(v, f"{what}: input {k!r}") for k, v in feed.items()}


def on_device(name: str, value: Any, provider: Any) -> Any:
    """A run_with_ort_values feed on ``provider``'s device: host values are copied there
    (the call asks for it); a value on another device is an error."""
    if not isinstance(value, OrtValue):
        return provider.to_device(value) if isinstance(value, np.ndarray) else value
    if value.provider is None:
        return provider.to_device(value.value)
    p = value.provider
    if (p.kind, p.options.device_id) != (provider.kind, provider.options.device_id):
        raise OrtValueError(f"input {name!r} is on {value.device_name()}:{p.options.device_id}, "
                            f"the session runs on {provider.name}")
    return value.value
