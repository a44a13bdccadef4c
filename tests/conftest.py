"""Shared fixtures. Tiers: pure (no Ray), provider, ray (one local Ray per test session)."""

from __future__ import annotations

import os

import numpy as np
import pytest


def _array_modules():
    from hetero_exec.providers.sim_array import SIM_CUPY

    # sim-cupy: CuPy's names and boundaries over NumPy (sim-gpu's strict arrays)
    mods = [pytest.param(np, id="numpy"), pytest.param(SIM_CUPY, id="sim-cupy")]
    try:  # cupy joins only where it imports and sees a device, so CPU-only CI passes
        import cupy  # (CI installs it: its import works without a driver, its arrays do not)

        if cupy.cuda.runtime.getDeviceCount() > 0:
            mods.append(pytest.param(cupy, id="cupy"))
    except Exception:
        pass
    return mods


@pytest.fixture(params=_array_modules())
def xp(request):
    """The array module a kernel runs on: numpy, plus cupy when it imports."""
    return request.param


def to_numpy(a):
    if hasattr(a, "get") and not isinstance(a, (np.ndarray, dict)):
        return a.get()
    return np.asarray(a)


@pytest.fixture(scope="session")
def ray_session():
    """One real local Ray per test session (ray.init costs seconds)."""
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        # small, and with logical GPUs: sim-gpu segment actors reserve GPU resources
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        # address="local": a Ray of its own, even when a `ray start` cluster runs here
        ray.init(address="local", num_cpus=4, num_gpus=4, include_dashboard=False,
                 log_to_driver=False,
                 object_store_memory=1 << 30,
                 runtime_env={"env_vars": {"PYTHONPATH": root}})
    from actors.connect import forget_raylet_semaphores, raylet_pid

    raylet = raylet_pid()
    yield ray
    ray.shutdown()
    forget_raylet_semaphores(raylet)  # compiled-graph channels' semaphores (actors/connect.py)
