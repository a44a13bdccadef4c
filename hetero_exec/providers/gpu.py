"""`gpu`: CuPy arrays on CUDA device N, imported lazily.

Any CuPy package works (``cupy-cuda12x``, ``cupy-cuda13x``, a source build; CuPy 13 or
14): the provider uses only what they share. When CuPy or a usable device is missing
the provider is unavailable, with CuPy's own reason; a session that asked for it falls
back (or fails when the GPU is required, SEMANTICS.md section 1).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from hetero_exec.providers.base import SUPPORTED, Support
from hetero_exec.providers.device import DeviceCapabilities, map_tensors

log = logging.getLogger(__name__)

#: array kinds CuPy has (bool, ints, floats, complex); other dtypes stay on the host
DEVICE_KINDS = frozenset("biufc")


def _cupy():
    import cupy  # noqa: PLC0415 - optional dependency, imported on first use

    return cupy


def cupy_packages() -> list[str]:
    """The installed distributions that provide the ``cupy`` module (normally one)."""
    from importlib import metadata

    names = set()
    for dist in metadata.distributions():
        name = (dist.metadata.get("Name") or "").lower()
        if name == "cupy" or name.startswith("cupy-cuda") or name.startswith("cupy-rocm"):
            names.add(name)
    return sorted(names)


def cupy_info(cp: Any) -> str:
    """``CuPy 14.2.0 (cupy-cuda12x), CUDA runtime 12.9, driver 13.0`` (what is readable)."""
    parts = [f"CuPy {cp.__version__}"]
    pkgs = cupy_packages()
    if pkgs:
        parts[0] += f" ({', '.join(pkgs)})"
    try:
        v = cp.cuda.runtime.runtimeGetVersion()
        parts.append(f"CUDA runtime {v // 1000}.{v % 1000 // 10}")
    except Exception:  # noqa: BLE001 - informative only
        pass
    try:
        v = cp.cuda.runtime.driverGetVersion()
        parts.append(f"driver {v // 1000}.{v % 1000 // 10}" if v else "no CUDA driver")
    except Exception:  # noqa: BLE001
        pass
    return ", ".join(parts)


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
                                  f"install the 'gpu' extra (or 'gpu-cuda13')")
        pkgs = cupy_packages()
        if len(pkgs) > 1:
            log.warning("several CuPy packages are installed (%s); CuPy may not work", pkgs)
        try:
            count = cp.cuda.runtime.getDeviceCount()
        except Exception as e:
            return Support(False, f"no usable CUDA device ({type(e).__name__}: {e}) [{cupy_info(cp)}]")
        if count == 0:
            return Support(False, f"no CUDA device (0 devices) [{cupy_info(cp)}]")
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
        return map_tensors(arr, self._to_device)

    def to_host(self, arr: Any) -> Any:
        return map_tensors(arr, self._to_host)

    def receive_from(self, value: Any, src: Any) -> Any:
        """``value`` from another gpu provider's device copied straight to this one (a
        CUDA peer copy, gpu_graphs.peer_copy), or None: then the caller stages it through
        the host. Experimental: not yet run on a machine with two GPUs."""
        if getattr(src, "kind", None) != "gpu" or src.options.device_id == self.options.device_id:
            return None
        from hetero_exec.providers.gpu_graphs import peer_access, peer_copy

        try:
            cp = _cupy()
        except Exception:  # noqa: BLE001
            return None
        if not isinstance(value, cp.ndarray) or not peer_access(src.options.device_id,
                                                                self.options.device_id):
            return None
        return peer_copy(value, self.options.device_id)

    def _to_device(self, arr: Any) -> Any:
        if isinstance(arr, np.ndarray) and arr.dtype.kind in DEVICE_KINDS:
            with self.device():
                return _cupy().asarray(arr)
        return arr

    def _to_host(self, arr: Any) -> Any:
        if hasattr(arr, "get") and not isinstance(arr, np.ndarray):
            return arr.get()
        return arr
