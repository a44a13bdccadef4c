"""Providers as onnxruntime code names them.

``CPUExecutionProvider`` / ``CUDAExecutionProvider`` are our ``cpu`` / ``gpu``; a
session reports its providers in the spelling the caller used. ``provider_options``
beside a providers list, and onnxruntime's CUDA option names, are translated to our
provider options here. `get_available_providers` is honest: CUDA is listed only when a
device computes through CuPy on this machine.

>>> specs = ProviderSpecs.parse(["CUDAExecutionProvider"], [{"device_id": "1"}])
>>> specs.specs
[('CUDAExecutionProvider', {'device_id': 1})]
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

from hetero_exec.errors import ProviderError

log = logging.getLogger(__name__)

ORT_NAMES = {"cpu": "CPUExecutionProvider", "gpu": "CUDAExecutionProvider"}
_ORT_SPELLED = {n.lower(): n for n in ORT_NAMES.values()}


def ort_name(name: Any) -> str | None:
    """onnxruntime's canonical name when ``name`` is one (any case), else None."""
    return _ORT_SPELLED.get(name.strip().lower()) if isinstance(name, str) else None
#: onnxruntime's provider options accepted without effect (allocation and search
#: heuristics our CuPy/NumPy kernels do not have), with the values onnxruntime takes
NO_EFFECT_OPTIONS = {
    "arena_extend_strategy": {"kNextPowerOfTwo", "kSameAsRequested", "0", "1"},
    "cudnn_conv_algo_search": {"EXHAUSTIVE", "HEURISTIC", "DEFAULT"},
    "do_copy_in_default_stream": {"0", "1", "True", "False"},
    "cudnn_conv_use_max_workspace": {"0", "1"},
    "enable_cuda_graph": {"0", "False"},
}


def _int_value(provider: str, key: str, v: Any) -> int:
    try:
        n = int(v)
    except (TypeError, ValueError):
        raise ProviderError(f"provider {provider!r}: option {key!r} must be an int, got {v!r}") from None
    if isinstance(v, bool) or n < 0:
        raise ProviderError(f"provider {provider!r}: option {key!r} must be a non-negative int, got {v!r}")
    return n


def translate_options(provider: str, given: dict[str, Any]) -> dict[str, Any]:
    """onnxruntime's option names and string values -> ours; unknown keys stay for
    ProviderOptions.parse to refuse."""
    ours: dict[str, Any] = {}
    for key, v in given.items():
        if key == "device_id":
            ours["device_id"] = _int_value(provider, key, v)
        elif key == "gpu_mem_limit":
            ours["mem_limit"] = _int_value(provider, key, v)
        elif key in NO_EFFECT_OPTIONS:
            if str(v) not in NO_EFFECT_OPTIONS[key]:
                raise ProviderError(f"provider {provider!r}: option {key!r} takes one of "
                                    f"{sorted(NO_EFFECT_OPTIONS[key])}, got {v!r}")
            log.debug("provider option %s=%r has no effect here", key, v)
        else:
            ours[key] = v
    return ours


@dataclass
class ProviderSpecs:
    """A providers list with its options, parsed once: what the planner gets, and how
    to spell each provider back."""

    specs: list[Any]
    spelling: dict[str, str] = field(default_factory=dict)  # provider name -> caller's
    given: dict[str, dict[str, str]] = field(default_factory=dict)  # caller's options
    ort_style: bool = False

    @classmethod
    def parse(cls, providers: Any, provider_options: Sequence[Any] | None = None) -> "ProviderSpecs":
        from hetero_exec.providers import Provider, parse_provider

        if providers is None:
            providers, ort_style = ["CPUExecutionProvider"], True
        else:
            if isinstance(providers, (str, Provider)) or _is_pair(providers):
                providers = [providers]
            providers = list(providers)
            ort_style = any(ort_name(_name(p)) for p in providers)
        options = _options_list(providers, provider_options)
        out = cls([], ort_style=ort_style)
        for spec, extra in zip(providers, options):
            if isinstance(spec, Provider):
                out.specs.append(spec)
                out.spelling[spec.name] = spec.name
                continue
            name, opts = _split(spec)
            if extra is not None:
                if opts:
                    raise ProviderError(f"provider {name!r} has options both in its tuple and in "
                                        f"provider_options; give them once")
                opts = dict(extra)
            ours = (name, translate_options(name, opts))
            parsed = parse_provider(ours)
            out.specs.append(ours)
            out.spelling[parsed.name] = ort_name(name) or parsed.name
            out.given[parsed.name] = {str(k): str(v) for k, v in opts.items()}
        return out

    def spell(self, provider: Any) -> str:
        """The caller's name of a provider in use (cpu added by us: in their style)."""
        if provider.name in self.spelling:
            return self.spelling[provider.name]
        return ORT_NAMES.get(provider.kind, provider.name) if self.ort_style else provider.name

    def options_of(self, provider: Any) -> dict[str, str]:
        opts = dict(self.given.get(provider.name, {}))
        if provider.is_device:
            opts.setdefault("device_id", str(provider.options.device_id))
        return opts


def _is_pair(p: Any) -> bool:
    return isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], dict)


def _name(p: Any) -> Any:
    return p[0] if isinstance(p, (tuple, list)) and p else p


def _split(spec: Any) -> tuple[str, dict[str, Any]]:
    if isinstance(spec, str):
        return spec, {}
    if isinstance(spec, (tuple, list)) and len(spec) == 2 and isinstance(spec[0], str) \
            and isinstance(spec[1], dict):
        return spec[0], dict(spec[1])
    raise ProviderError(f"a provider is a name or (name, options_dict), got {spec!r}")


def _options_list(providers: list[Any], provider_options: Sequence[Any] | None) -> list[Any]:
    if provider_options is None:
        return [None] * len(providers)
    if not isinstance(provider_options, (list, tuple)) or \
            not all(isinstance(o, dict) for o in provider_options):
        raise ProviderError(f"provider_options must be a list of dicts, one per provider, "
                            f"got {provider_options!r}")
    if len(provider_options) != len(providers):
        raise ProviderError(f"'providers' and 'provider_options' should be the same length: "
                            f"{len(providers)} providers, {len(provider_options)} option dicts")
    return list(provider_options)


# --- what this machine has ---------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def cuda_status() -> tuple[bool, str]:
    """(works, reason): CuPy imports, a device exists, and a kernel computes on it."""
    from hetero_exec.providers.gpu import GpuProvider

    sup = GpuProvider().available()
    if not sup:
        return False, sup.reason
    try:
        import cupy as cp

        got = float((cp.arange(4, dtype=cp.float32) * 2).sum().get())
    except Exception as e:  # a driver, NVRTC or library failure: not a working GPU
        return False, f"a CuPy kernel failed ({type(e).__name__}: {e})"
    if got != 12.0:
        return False, f"a CuPy kernel computed {got}, not 12.0"
    return True, "ok"


def get_available_providers() -> list[str]:
    """onnxruntime's names of the providers that work here, in priority order."""
    names = ["CUDAExecutionProvider"] if cuda_status()[0] else []
    return names + ["CPUExecutionProvider"]


def get_all_providers() -> list[str]:
    """Every provider this build knows, in onnxruntime's names (sim-gpu is ours only)."""
    return ["CUDAExecutionProvider", "CPUExecutionProvider"]


def get_device() -> str:
    return "GPU" if cuda_status()[0] else "CPU"
