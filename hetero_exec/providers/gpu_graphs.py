"""CUDA graphs for static gpu plans, and GPU-to-GPU copies (experimental).

Neither has run on a GPU yet: no machine with one has been lent to this work. Both sit
behind capability checks and say why they are not used; nothing else depends on them.

* `CapturedPlan`: a static RunPlan (fixed input shapes, no host reads of device data)
  captured once on a non-default stream (``Stream.begin_capture``/``end_capture``) and
  replayed with ``Graph.launch``. Its allocations come from a memory pool of its own that
  nothing else uses, so blocks freed during the capture are never handed to another
  array while the graph may still write them. A plan that synchronises (``int(x)``, a host
  step reading device data) cannot be captured; the error says so.
* `peer_copy`: a CuPy array moved to another device directly (CUDA peer copy, or
  CuPy's staged copy where peer access is unavailable), instead of through the host.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np

from hetero_exec.providers.base import SUPPORTED, Support

log = logging.getLogger(__name__)


def graph_support() -> Support:
    """Whether CuPy here can capture and replay CUDA graphs."""
    try:
        import cupy as cp
    except Exception as e:  # noqa: BLE001
        return Support(False, f"CuPy is not importable ({type(e).__name__}: {e})")
    try:
        if cp.cuda.runtime.getDeviceCount() < 1:
            return Support(False, "no CUDA device")
    except Exception as e:  # noqa: BLE001
        return Support(False, f"no usable CUDA device ({type(e).__name__}: {e})")
    if not hasattr(cp.cuda.Stream, "begin_capture") or not hasattr(cp.cuda, "graph"):
        return Support(False, f"CuPy {cp.__version__} has no stream capture")
    if cp.cuda.runtime.is_hip:
        return Support(False, "stream capture is not used on ROCm")
    return SUPPORTED


class CapturedPlan:
    """A RunPlan captured as a CUDA graph for fixed inputs (shapes and dtypes)."""

    def __init__(self, plan: Any, example_inputs: Sequence[Any], device_id: int = 0):
        import cupy as cp

        from hetero_exec.exec.executor import execute

        self._cp = cp
        self.device = cp.cuda.Device(device_id)
        with self.device:
            self.pool = cp.cuda.MemoryPool()  # this graph's own: never shared
            self.stream = cp.cuda.Stream(non_blocking=True)
            with cp.cuda.using_allocator(self.pool.malloc), self.stream:
                self.inputs = [cp.array(x) if x is not None else None for x in example_inputs]
                execute(plan, self.inputs)  # warm-up: kernels compiled, blocks cached
                self.stream.synchronize()
                self.stream.begin_capture()
                try:
                    self.outputs = execute(plan, self.inputs)
                finally:
                    self.graph = self.stream.end_capture()
        self.plan = plan

    def run(self, inputs: Sequence[Any]) -> list[Any]:
        """Copy ``inputs`` into the captured buffers, replay, return device copies."""
        cp = self._cp
        with self.device, self.stream:
            for buf, x in zip(self.inputs, inputs):
                if buf is None or x is None:
                    continue
                if isinstance(x, np.ndarray):
                    buf.set(x, stream=self.stream)
                else:
                    buf[...] = x
            self.graph.launch(self.stream)
            outs = [cp.array(o) if isinstance(o, cp.ndarray) else o for o in self.outputs]
            self.stream.synchronize()
        return outs


# --- GPU-to-GPU copies -----------------------------------------------------------------------

def peer_access(src_id: int, dst_id: int) -> Support:
    """Whether device ``dst_id`` can read ``src_id``'s memory directly."""
    try:
        import cupy as cp

        if cp.cuda.runtime.deviceCanAccessPeer(dst_id, src_id):
            return SUPPORTED
        return Support(False, f"no peer access from device {dst_id} to {src_id}")
    except Exception as e:  # noqa: BLE001
        return Support(False, f"{type(e).__name__}: {e}")


def peer_copy(arr: Any, dst_id: int) -> Any:
    """A copy of the CuPy array ``arr`` on device ``dst_id``, without host staging
    (``cudaMemcpyPeer`` semantics through CuPy's memory pointers)."""
    import cupy as cp

    src_id = arr.device.id
    if src_id == dst_id:
        return arr
    src = cp.ascontiguousarray(arr)
    with cp.cuda.Device(dst_id):
        out = cp.empty(src.shape, dtype=src.dtype)
        out.data.copy_from_device(src.data, src.nbytes)
    return out
