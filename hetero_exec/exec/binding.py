"""ORT-style IO binding for a single-provider session: inputs and outputs stay on the
provider's device between runs (no host round trip). Heterogeneous sessions refuse it
(SEMANTICS.md section 2). A bound run returns tensors only (section 3): a sequence or
map output is an error naming ``run()``, which returns them.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from hetero_exec.errors import OrtValueError, SequenceOutputError, UnknownInputError
from hetero_exec.ortvalue import DEVICE_NAMES, OrtValue, device_provider


class IOBinding:
    """>>> b = sess.io_binding(); b.bind_cpu_input("x", x); b.bind_output("y")  # doctest: +SKIP
    >>> sess.run_with_iobinding(b); y = b.copy_outputs_to_cpu()[0]  # doctest: +SKIP
    """

    def __init__(self, session: Any):
        self._session = session
        self._provider = session._build.providers[0]
        self._inputs: dict[str, Any] = {}
        self._outputs: list[str] = []
        self._on_host: set[str] = set()  # outputs bound to cpu on a device session
        self._preallocated: dict[str, OrtValue] = {}
        self._results: list[OrtValue] = []

    # -- inputs -------------------------------------------------------------------------

    def bind_input(self, name: str, device_type: Any, device_id: int = 0, element_type: Any = None,
                   shape: Any = None, buffer_ptr: int | None = None) -> None:
        """onnxruntime's raw form (device_type, device_id, element_type, shape, buffer_ptr),
        or ``bind_input(name, array)``: host arrays are copied to the device once, here."""
        if isinstance(device_type, str):
            value = _from_pointer(device_type, device_id, element_type, shape, buffer_ptr)
            return self.bind_ortvalue_input(name, value)
        self._check_input(name)
        value = device_type
        if isinstance(value, OrtValue):
            return self.bind_ortvalue_input(name, value)
        if isinstance(value, np.ndarray):
            value = self._provider.to_device(value)
        self._inputs[name] = value

    def bind_cpu_input(self, name: str, arr_on_cpu: np.ndarray) -> None:
        self.bind_input(name, np.asarray(arr_on_cpu))

    def bind_ortvalue_input(self, name: str, ortvalue: OrtValue) -> None:
        self._check_input(name)
        if not isinstance(ortvalue, OrtValue):
            raise OrtValueError(f"bind_ortvalue_input({name!r}): expected an OrtValue, "
                                f"got {type(ortvalue).__name__}")
        if ortvalue.provider is None:
            self._inputs[name] = self._provider.to_device(ortvalue.value)
            return
        self._same_device(name, ortvalue)
        self._inputs[name] = ortvalue.value

    def _check_input(self, name: str) -> None:
        if name not in self._session.graph.inputs:
            raise UnknownInputError(name, self._session.graph.inputs)

    def _same_device(self, name: str, value: OrtValue) -> None:
        p, mine = value.provider, self._provider
        if not mine.is_device or (p.kind, p.options.device_id) != (mine.kind, mine.options.device_id):
            raise OrtValueError(f"{name!r} is bound on {value.device_name()}:{p.options.device_id}, "
                                f"but the session runs on {mine.name}")

    # -- outputs ------------------------------------------------------------------------

    def bind_output(self, name: str, device_type: str | None = None, device_id: int = 0,
                    element_type: Any = None, shape: Any = None, buffer_ptr: int | None = None) -> None:
        """``device_type`` "cpu" copies the output to the host after each run; the
        session's own device (or None) keeps it there. With ``buffer_ptr`` the output is
        written into that buffer."""
        self._session._output_names([name])
        if buffer_ptr is not None:
            return self.bind_ortvalue_output(
                name, _from_pointer(device_type or "cpu", device_id, element_type, shape, buffer_ptr))
        self._add_output(name)
        if device_type is not None and str(device_type).lower() == "cpu" and self._provider.is_device:
            self._on_host.add(name)
        elif device_type is not None:
            device_provider(device_type, device_id)  # an unknown or absent device is an error

    def bind_ortvalue_output(self, name: str, ortvalue: OrtValue) -> None:
        """The run writes this output into ``ortvalue`` (same shape and dtype)."""
        self._session._output_names([name])
        if not isinstance(ortvalue, OrtValue) or not ortvalue.is_tensor():
            raise OrtValueError(f"bind_ortvalue_output({name!r}): expected a tensor OrtValue")
        if ortvalue.provider is not None:
            self._same_device(name, ortvalue)
        self._add_output(name)
        self._preallocated[name] = ortvalue

    def _add_output(self, name: str) -> None:
        if name not in self._outputs:
            self._outputs.append(name)

    def clear_binding_inputs(self) -> None:
        self._inputs.clear()

    def clear_binding_outputs(self) -> None:
        self._outputs.clear()
        self._on_host.clear()
        self._preallocated.clear()

    # -- running ------------------------------------------------------------------------

    def _run(self, run_options: Any = None) -> None:
        session = self._session
        names = self._outputs or list(session.graph.outputs)
        for n in names:
            kind = session.graph.value(n).kind
            if kind in ("sequence", "map"):
                raise SequenceOutputError(n, kind)
        outs = session._run(names, self._inputs, run_options, on_device=True)
        for n, o in zip(names, outs):
            if isinstance(o, (list, dict)):
                raise SequenceOutputError(n, "sequence" if isinstance(o, list) else "map")
        self._results = [self._deliver(n, o) for n, o in zip(names, outs)]

    def _deliver(self, name: str, value: Any) -> OrtValue:
        device = self._provider if self._provider.is_device else None
        if name in self._on_host:
            return OrtValue(self._provider.to_host(value))
        target = self._preallocated.get(name)
        if target is None:
            return OrtValue(value, device)
        if tuple(target.shape()) != tuple(value.shape) or target.value.dtype != value.dtype:
            raise OrtValueError(f"output {name!r} is {value.dtype}{list(value.shape)}, the bound "
                                f"OrtValue is {target.value.dtype}{target.shape()}")
        if target.provider is None and device is not None:
            value = device.to_host(value)  # bound to a host buffer: asked for
        target._assign(value)
        return target

    def get_outputs(self) -> list[OrtValue]:
        """The outputs as OrtValues, where they were bound (the device by default)."""
        return list(self._results)

    get_outputs_as_ortvaluevector = get_outputs

    def copy_outputs_to_cpu(self) -> list[np.ndarray]:
        return [v.numpy() for v in self._results]

    def synchronize_inputs(self) -> None:
        self._synchronize()

    def synchronize_outputs(self) -> None:
        self._synchronize()

    def _synchronize(self) -> None:
        if self._provider.kind == "gpu":
            self._provider.device().synchronize()


def _from_pointer(device_type: str, device_id: int, element_type: Any, shape: Any,
                  buffer_ptr: int | None) -> OrtValue:
    """onnxruntime's raw-pointer binding: a view of memory the caller owns."""
    if buffer_ptr is None or element_type is None or shape is None:
        raise OrtValueError("a raw binding needs device_type, device_id, element_type, shape "
                            "and buffer_ptr")
    dtype, shape = np.dtype(element_type), tuple(int(d) for d in shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    provider = device_provider(device_type, device_id)
    if provider is None:
        buf = (ctypes.c_char * nbytes).from_address(int(buffer_ptr))
        return OrtValue(np.frombuffer(buf, dtype=dtype).reshape(shape))
    if provider.kind != "gpu":
        raise OrtValueError(f"raw pointers are for cpu and cuda memory, not "
                            f"{DEVICE_NAMES[provider.kind]}")
    import cupy as cp

    mem = cp.cuda.UnownedMemory(int(buffer_ptr), nbytes, owner=None, device_id=int(device_id))
    return OrtValue(cp.ndarray(shape, dtype, cp.cuda.MemoryPointer(mem, 0)), provider)
