"""Execution providers, named as in ONNX Runtime's `providers` list."""

from __future__ import annotations

from typing import Any

from hetero_exec.errors import ProviderError
from hetero_exec.providers.base import Provider, ProviderOptions, Support

ALIASES = {
    "cpu": "cpu", "cpuexecutionprovider": "cpu",
    "gpu": "gpu", "cuda": "gpu", "cudaexecutionprovider": "gpu",
    "sim-gpu": "sim-gpu", "simgpu": "sim-gpu", "sim_gpu": "sim-gpu",
}


def parse_provider(spec: Any) -> Provider:
    """``"cpu"``, ``"gpu:1"``, ``"CUDAExecutionProvider"`` or ``(name, {options})``."""
    options: dict[str, Any] = {}
    if isinstance(spec, (tuple, list)):
        if len(spec) != 2 or not isinstance(spec[1], dict):
            raise ProviderError(f"a provider is a name or (name, options_dict), got {spec!r}")
        spec, options = spec[0], dict(spec[1])
    if isinstance(spec, Provider):
        return spec
    if not isinstance(spec, str):
        raise ProviderError(f"a provider is a name or (name, options_dict), got {spec!r}")
    name, _, dev = spec.strip().partition(":")
    kind = ALIASES.get(name.lower())
    if kind is None:
        raise ProviderError(f"unknown provider {spec!r}; known: cpu, gpu[:N], sim-gpu[:N] "
                            f"(aliases CPUExecutionProvider, CUDAExecutionProvider)")
    if dev:
        if kind == "cpu" or not dev.isdigit():
            raise ProviderError(f"bad device suffix in provider {spec!r}")
        options.setdefault("device_id", int(dev))
    opts = ProviderOptions.parse(options)
    if kind == "cpu":
        from hetero_exec.providers.cpu import CpuProvider

        return CpuProvider(opts)
    if kind == "gpu":
        from hetero_exec.providers.gpu import GpuProvider

        return GpuProvider(opts)
    from hetero_exec.providers.sim_gpu import SimGpuProvider

    return SimGpuProvider(opts)


__all__ = ["Provider", "ProviderOptions", "Support", "parse_provider"]
