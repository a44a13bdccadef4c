"""`sim-gpu`: an emulation of the gpu provider over NumPy memory.

Same capability table as `gpu` (DeviceCapabilities), its own memory budget, and
explicit copies at seams (to_device/to_host copy and count bytes), so placement,
seams and actors are tested on machines without a GPU. By default (``strict``) device
values are `sim_array.DeviceArray` and kernels get `sim_array.SIM_CUPY` as ``xp``: CuPy's
names and boundaries over NumPy, so a kernel that would break on CuPy breaks here.
It is an emulation: kernels run on the host CPU and timings say nothing about a device.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from hetero_exec.providers import sim_array
from hetero_exec.providers.device import DeviceCapabilities, array_nbytes, map_tensors
from hetero_exec.providers.sim_array import DeviceArray

#: the emulated device size when no mem_limit is given (an 80 GiB card)
DEFAULT_SIM_MEMORY = 80 * 1024**3


class SimGpuProvider(DeviceCapabilities):
    kind = "sim-gpu"

    def __init__(self, options=None):
        super().__init__(options)
        self._lock = threading.Lock()
        self.bytes_to_device = 0
        self.bytes_to_host = 0

    @property
    def name(self) -> str:
        return f"sim-gpu:{self.options.device_id}"

    @property
    def strict(self) -> bool:
        return self.options.strict

    @property
    def xp(self) -> Any:
        return sim_array.SIM_CUPY if self.options.strict else np

    @property
    def mem_limit(self) -> int:
        return self.options.mem_limit if self.options.mem_limit is not None else DEFAULT_SIM_MEMORY

    def _count(self, attr: str, arr: Any) -> None:
        with self._lock:
            setattr(self, attr, getattr(self, attr) + array_nbytes(arr))

    def to_device(self, arr: Any) -> Any:
        return map_tensors(arr, self._to_device)

    def to_host(self, arr: Any) -> Any:
        if type(arr) is DeviceArray:  # the common case, without map_tensors' dispatch
            return self._to_host(arr)
        return map_tensors(arr, self._to_host)

    def _to_device(self, arr: Any) -> Any:
        if type(arr) is DeviceArray:
            return arr
        if isinstance(arr, np.ndarray):
            if not self.options.strict:
                self._count("bytes_to_device", arr)
                return arr.copy()
            if not sim_array.device_dtype(arr.dtype):
                return arr  # no CuPy array of this dtype: stays on the host, as on gpu
            self._count("bytes_to_device", arr)
            return sim_array.upload(arr)
        return arr

    def _to_host(self, arr: Any) -> Any:
        if type(arr) is DeviceArray:
            self._count("bytes_to_host", arr)
            return sim_array.download(arr)
        if isinstance(arr, np.ndarray):
            if not self.options.strict:
                self._count("bytes_to_host", arr)
            return arr.copy()
        return arr
