"""What a Ray hop costs on the cluster at hand, for the stage planner's `HopModel`.

A cut between two stages costs each request one more actor task (the driver submits
it, the raylet and the worker handle it) and a copy of the seam values across it. The
planner needs both, measured where the stages will run: a probe actor answers a few
empty calls (the fixed cost per task) and takes one 4 MiB array (bytes over
bandwidth; through shared memory on a one-node cluster, as seams go there, else the
object store). Measured once per cluster per driver process (about 0.5 s), then kept,
and only when the stage planner's choice depends on it (`actors.coordinator`).
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from typing import Any

import numpy as np
import ray

from hetero_exec.placement.stages import HopModel

log = logging.getLogger(__name__)

_CACHE: dict[str, HopModel] = {}
_LOCK = threading.Lock()
PROBE_BYTES = 4 << 20


class _Probe:
    def echo(self, x: Any) -> int:
        return 0 if x is None else int(getattr(x, "nbytes", 0))


def hop_model(one_node: bool, runtime_env: dict[str, Any] | None = None) -> HopModel:
    """The cluster's HopModel, measured on first use (a probe actor, then released)."""
    try:
        key = ray.get_runtime_context().gcs_address
    except Exception:
        key = "?"
    with _LOCK:
        if key not in _CACHE:
            _CACHE[key] = _measure(one_node, runtime_env)
            m = _CACHE[key]
            log.info("hop cost on this cluster: %.2f ms per task, %.2f GB/s", m.task_s * 1e3,
                     m.bytes_per_s / 1e9)
        return _CACHE[key]


def _measure(one_node: bool, runtime_env: dict[str, Any] | None) -> HopModel:
    probe = ray.remote(_Probe).options(num_cpus=0, runtime_env=runtime_env or None).remote()
    try:
        ray.get(probe.echo.remote(None))
        calls = []
        for _ in range(8):
            t = time.perf_counter()
            ray.get(probe.echo.remote(None))
            calls.append(time.perf_counter() - t)
        task_s = statistics.median(calls)
        x = np.ones(PROBE_BYTES // 4, np.float32)
        copies = []
        for _ in range(3):
            t = time.perf_counter()
            if one_node:  # a shared-memory seam: one copy in, a zero-copy read
                np.copyto(np.empty_like(x), x)
            else:
                ray.get(probe.echo.remote(ray.put(x)))
            copies.append(time.perf_counter() - t)
        move = min(copies) - (0.0 if one_node else task_s)
        bytes_per_s = PROBE_BYTES / max(move, 1e-6)
    finally:
        ray.kill(probe)
    return HopModel(task_s=task_s, bytes_per_s=bytes_per_s)
