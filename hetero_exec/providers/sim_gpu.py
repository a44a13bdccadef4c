"""`sim-gpu`: an emulation of the gpu provider over NumPy arrays.

Same capability table as `gpu` (DeviceCapabilities), its own memory budget, and
explicit copies at seams (to_device/to_host copy and count bytes), so placement,
seams and actors are tested on machines without a GPU. It is an emulation: kernels
run on the host CPU and timings say nothing about a real device.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from hetero_exec.providers.device import DeviceCapabilities, array_nbytes

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
    def mem_limit(self) -> int:
        return self.options.mem_limit if self.options.mem_limit is not None else DEFAULT_SIM_MEMORY

    def to_device(self, arr: Any) -> Any:
        if isinstance(arr, np.ndarray):
            with self._lock:
                self.bytes_to_device += array_nbytes(arr)
            return arr.copy()
        return arr

    def to_host(self, arr: Any) -> Any:
        if isinstance(arr, np.ndarray):
            with self._lock:
                self.bytes_to_host += array_nbytes(arr)
            return arr.copy()
        return arr
