"""The experimental GPU paths (providers/gpu_graphs.py) behind their capability checks:
without a usable device they say why and change nothing. What they do on a GPU is
measured by bench/gpu_check.py --cuda-graph, on a lent machine."""

from __future__ import annotations

import numpy as np

from bench.cuda_graph_replay import compare_replay
from hetero_exec.exec.chain import move_value
from hetero_exec.providers import parse_provider
from hetero_exec.providers.gpu_graphs import graph_support


def _device_usable() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001
        return False


def test_graph_capture_reports_why_it_is_unavailable():
    if _device_usable():
        assert graph_support()
        return
    sup = graph_support()
    assert not sup and ("CuPy" in sup.reason or "device" in sup.reason)
    assert compare_replay(["mlp"]) == {"unavailable": sup.reason}


def test_peer_copy_only_between_gpu_providers_on_different_devices():
    g0, g1, cpu, sim = (parse_provider(p) for p in ("gpu:0", "gpu:1", "cpu", "sim-gpu"))
    x = np.ones(3, np.float32)
    assert g1.receive_from(x, cpu) is None and g0.receive_from(x, g0) is None
    assert g1.receive_from(x, g0) is None  # a host array is not a device array: staged
    # moves without a peer path are unchanged: through the host
    d = move_value(x, None, sim)
    back = move_value(d, sim, None)
    assert type(back) is np.ndarray and back.tolist() == [1.0, 1.0, 1.0]
