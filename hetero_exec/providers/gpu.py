"""`gpu`: CuPy arrays on CUDA device N, imported lazily.

When CuPy or a device is missing the provider is unavailable, with the reason; a
session that asked for it falls back (or fails when the GPU is required).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from hetero_exec.providers.base import SUPPORTED, Support
from hetero_exec.providers.device import DeviceCapabilities

log = logging.getLogger(__name__)


def _cupy():
    import cupy  # noqa: PLC0415 - optional dependency, imported on first use

    return cupy


class GpuProvider(DeviceCapabilities):
    kind = "gpu"

    @property
    def name(self) -> str:
        return f"gpu:{self.options.device_id}"

    def available(self) -> Support:
        try:
            cp = _cupy()
        except Exception as e:  # ImportError, or a CUDA library that fails to load
            return Support(False, f"CuPy is not importable ({type(e).__name__}: {e}); "
                                  f"install the 'gpu' extra")
        try:
            count = cp.cuda.runtime.getDeviceCount()
        except Exception as e:
            return Support(False, f"no CUDA device ({type(e).__name__}: {e})")
        if self.options.device_id >= count:
            return Support(False, f"CUDA device {self.options.device_id} does not exist "
                                  f"({count} device(s))")
        return SUPPORTED

    @property
    def xp(self) -> Any:
        return _cupy()

    @property
    def mem_limit(self) -> int | None:
        if self.options.mem_limit is not None:
            return self.options.mem_limit
        try:
            cp = _cupy()
            with cp.cuda.Device(self.options.device_id):
                free, _total = cp.cuda.runtime.memGetInfo()
            return int(free)
        except Exception:
            return None

    def device(self):
        return _cupy().cuda.Device(self.options.device_id)

    def to_device(self, arr: Any) -> Any:
        if isinstance(arr, np.ndarray) and arr.dtype != object:
            with self.device():
                return _cupy().asarray(arr)
        return arr

    def to_host(self, arr: Any) -> Any:
        if hasattr(arr, "get") and not isinstance(arr, np.ndarray):
            return arr.get()
        return arr
