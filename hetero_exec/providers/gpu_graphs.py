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
import time
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


def _time(fn, runs: int) -> float:
    fn()
    ts = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts) * 1e3)


def compare_replay(models: Sequence[str], runs: int = 10, batch: int = 1) -> dict:
    """Eager per-op launches against graph replay for the benchmark models on gpu:0
    (each a single static segment), outputs compared. Used by bench/gpu_check.py."""
    sup = graph_support()
    if not sup:
        return {"unavailable": sup.reason}
    import cupy as cp

    from bench.models import MODELS, inputs
    from hetero_exec import InferenceSession
    from hetero_exec.exec.executor import execute

    rows = []
    for name in models:
        row: dict[str, Any] = {"model": name, "batch": batch}
        try:
            sess = InferenceSession(MODELS[name](), providers=["gpu"], require_gpu=True)
            segs = sess._executor.segments  # one segment: the whole model on gpu:0
            plan = segs[0].plan
            feed = inputs(name, batch, seq=32) if name in ("bert", "gpt2") else inputs(name, batch)
            dev = [cp.asarray(feed[n]) if n in feed else None for n, _ in plan.input_slots]
            stream = cp.cuda.Stream(non_blocking=True)

            def eager():
                with stream:
                    out = execute(plan, dev)
                    stream.synchronize()
                return out

            row["eager_ms"] = _time(eager, runs)
            try:
                cap = CapturedPlan(plan, dev)
            except Exception as e:  # noqa: BLE001 - not capturable: say why
                row["captured"] = False
                row["reason"] = f"{type(e).__name__}: {str(e)[:300]}"
                rows.append(row)
                continue
            row["captured"] = True
            row["replay_ms"] = _time(lambda: cap.run(dev), runs)
            ref = [o.get() for o in eager()]
            got = [o.get() for o in cap.run(dev)]
            row["match"] = all(np.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(ref, got))
            row["speedup"] = row["eager_ms"] / row["replay_ms"]
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
    return {"rows": rows}


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
