"""SessionOptions: our options and onnxruntime's, on one object.

The rest of the code reads our names (``fold_constants``, ``optimize``,
``executor_options``, ``stages``...). onnxruntime's fields map onto them:
``graph_optimization_level`` switches folding and fusions, ``intra_op_num_threads`` is
the threads this session's runs split their work over (`kernels._threads`), ``log_severity_level`` our logger's
level (`hetero_exec.logs`), and session config entries (`hetero_exec.config_entries`)
reach every option. Every assignment is checked: an unknown name or a bad value is an
`OptionError`, never ignored.

>>> so = SessionOptions()
>>> so.graph_optimization_level = GraphOptimizationLevel.ORT_DISABLE_ALL
>>> (so.fold_constants, so.optimize)
(False, False)
>>> so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
>>> so.require_gpu
True
"""

from __future__ import annotations

import copy
import enum
import os
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping

import numpy as np

from hetero_exec.errors import OptionError, OptionTypeError, UnknownOptionError

TRUE_VALUES = ("1", "true", "on")


def env_flag(name: str) -> bool:
    """Trimmed, case-insensitive 1/true/on; anything else (unset, empty, 0, off...) is off."""
    return os.environ.get(name, "").strip().lower() in TRUE_VALUES


class GraphOptimizationLevel(enum.IntEnum):
    """onnxruntime's levels. ORT_DISABLE_ALL turns off constant folding and fusions;
    every other level turns both on (we have one optimisation tier)."""

    ORT_DISABLE_ALL = 0
    ORT_ENABLE_BASIC = 1
    ORT_ENABLE_EXTENDED = 2
    ORT_ENABLE_LAYOUT = 3
    ORT_ENABLE_ALL = 99


class ExecutionMode(enum.IntEnum):
    """Accepted as in onnxruntime; nodes run in order in either mode."""

    ORT_SEQUENTIAL = 0
    ORT_PARALLEL = 1


# --- value checks -------------------------------------------------------------------


def _enum(cls: type[enum.IntEnum]) -> Callable[[str, Any], Any]:
    def check(name: str, v: Any) -> Any:
        member = getattr(v, "name", None)  # ours, or onnxruntime's own enum of that name
        if isinstance(member, str) and member in cls.__members__:
            return cls[member]
        if isinstance(v, int) and not isinstance(v, bool) and v in cls._value2member_map_:
            return cls(v)
        raise OptionTypeError(f"{name} must be a {cls.__name__} ({', '.join(cls.__members__)}), "
                              f"got {v!r}")
    return check


def _bool(name: str, v: Any) -> bool:
    if isinstance(v, (bool, np.bool_)) or (isinstance(v, int) and v in (0, 1)):
        return bool(v)
    raise OptionTypeError(f"{name} must be a bool, got {v!r}")


def _opt_bool(name: str, v: Any) -> bool | None:
    return None if v is None else _bool(name, v)


def _int_range(lo: int, hi: int | None = None) -> Callable[[str, Any], int]:
    def check(name: str, v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise OptionTypeError(f"{name} must be an int, got {v!r}")
        if v < lo or (hi is not None and v > hi):
            span = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
            raise OptionError(f"{name} must be {span}, got {v}")
        return int(v)
    return check


def _str(name: str, v: Any) -> str:
    if isinstance(v, os.PathLike):
        v = os.fspath(v)
    if not isinstance(v, str):
        raise OptionTypeError(f"{name} must be a str, got {v!r}")
    return v


def _opt_path(name: str, v: Any) -> str | None:
    return None if v is None else _str(name, v)


def _choice(*allowed: str) -> Callable[[str, Any], str]:
    def check(name: str, v: Any) -> str:
        if v not in allowed:
            raise OptionError(f"{name} must be one of {list(allowed)}, got {v!r}")
        return v
    return check


def _dim_bounds(name: str, v: Any) -> dict[str, int]:
    if not isinstance(v, Mapping):
        raise OptionTypeError(f"{name} must be a dict of symbol -> int, got {v!r}")
    for k, n in v.items():
        if not isinstance(k, str) or isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise OptionError(f"{name}: {k!r}: {n!r} is not a symbol -> non-negative int bound")
    return dict(v)


def _stages(name: str, v: Any) -> Any:
    if v == "auto":
        return v
    if isinstance(v, int) and not isinstance(v, bool):
        return _int_range(1)(name, v)
    if isinstance(v, (list, tuple)) and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0
                                            for c in v):
        return list(v)
    raise OptionError(f"{name} must be 'auto', a stage count K >= 1, or a list of segment indices "
                      f"where a stage starts; got {v!r}")


def _dict(name: str, v: Any) -> dict[str, Any]:
    if not isinstance(v, Mapping):
        raise OptionTypeError(f"{name} must be a dict, got {v!r}")
    return dict(v)


def _any(name: str, v: Any) -> Any:
    return v


#: every settable field and its check (our options first, then onnxruntime's)
CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "require_gpu": _opt_bool, "hetero": _opt_bool, "executor": _choice("local", "ray"),
    "dim_bounds": _dim_bounds, "affinity": _any, "placement": _any,  # checked by the planner
    "strategy": _str, "base_dir": _opt_path, "enable_profiling": _bool,
    "profile_file_prefix": _str, "fold_constants": _bool, "optimize": _bool,
    "cost_model": _any, "stages": _stages, "executor_options": _dict,
    "intra_op_num_threads": _int_range(0), "inter_op_num_threads": _int_range(0),
    "execution_mode": _enum(ExecutionMode), "log_severity_level": _int_range(-1, 4),
    "log_verbosity_level": _int_range(0), "logid": _str, "optimized_model_filepath": _str,
    "enable_cpu_mem_arena": _bool, "enable_mem_pattern": _bool, "enable_mem_reuse": _bool,
    "use_deterministic_compute": _bool, "use_per_session_threads": _bool,
}


@dataclass
class SessionOptions:
    """Our options (also InferenceSession keywords) and onnxruntime's fields."""

    # -- ours --------------------------------------------------------------------------
    require_gpu: bool | None = None  # None: from HETERO_EXEC_REQUIRE_GPU
    hetero: bool | None = None  # None: from HETERO_EXEC_HETERO
    executor: str = "local"  # local | ray
    dim_bounds: dict[str, int] = field(default_factory=dict)
    affinity: list[tuple[str, str]] = field(default_factory=list)
    placement: Any = None  # a saved plan (path or dict)
    strategy: str = "greedy"  # multi-GPU split: greedy | balanced | memory
    base_dir: str | None = None  # for external data of a model given as bytes
    enable_profiling: bool = False
    profile_file_prefix: str = "hetero_exec_profile"
    fold_constants: bool = True
    optimize: bool = True  # run the provider's graph passes (fusions) on the single-provider path
    cost_model: Any = None  # placement.partition.CostModel for multi-GPU splits (e.g. calibrate())
    #: pipeline stages of a mixed plan: "auto" (the cost model's cuts), an int K, or
    #: explicit cuts (segment indices where a new stage starts); see placement.stages
    stages: Any = "auto"
    executor_options: dict[str, Any] = field(default_factory=dict)
    # -- onnxruntime's -------------------------------------------------------------------
    intra_op_num_threads: int = 0  # threads one run splits its work over; 0: the cores
    inter_op_num_threads: int = 0  # accepted (nodes run in order)
    execution_mode: ExecutionMode = ExecutionMode.ORT_SEQUENTIAL  # accepted
    log_severity_level: int = -1  # -1: leave the hetero_exec logger's level alone
    log_verbosity_level: int = 0
    logid: str = ""
    optimized_model_filepath: str = ""  # write the model as optimised (folded, fused) here
    # accepted for onnxruntime code; our allocator and kernels have no such switches
    enable_cpu_mem_arena: bool = True
    enable_mem_pattern: bool = True
    enable_mem_reuse: bool = True
    use_deterministic_compute: bool = False
    use_per_session_threads: bool = True

    #: our option names: InferenceSession keywords, and ``hetero_exec.<name>`` config keys
    KNOWN = ("require_gpu", "hetero", "executor", "dim_bounds", "affinity", "placement",
             "strategy", "base_dir", "enable_profiling", "profile_file_prefix",
             "fold_constants", "optimize", "cost_model", "stages")

    def __post_init__(self) -> None:
        object.__setattr__(self, "_level", GraphOptimizationLevel.ORT_ENABLE_ALL)
        object.__setattr__(self, "_config", {})
        object.__setattr__(self, "_free_dims", {"name": {}, "denotation": {}})
        object.__setattr__(self, "_initializers", {})

    def __setattr__(self, name: str, value: Any) -> None:
        check = CHECKS.get(name)
        if check is None and not hasattr(type(self), name):
            raise UnknownOptionError(f"SessionOptions has no option {name!r}")
        if isinstance(getattr(type(self), name, None), property):
            object.__setattr__(self, name, value)  # the property's setter checks
            return
        object.__setattr__(self, name, check(name, value) if check else value)

    # -- onnxruntime's graph_optimization_level over fold_constants and optimize ---------

    @property
    def graph_optimization_level(self) -> GraphOptimizationLevel:
        if not (self.fold_constants or self.optimize):
            return GraphOptimizationLevel.ORT_DISABLE_ALL
        return self._level

    @graph_optimization_level.setter
    def graph_optimization_level(self, value: Any) -> None:
        level = _enum(GraphOptimizationLevel)("graph_optimization_level", value)
        on = level != GraphOptimizationLevel.ORT_DISABLE_ALL
        object.__setattr__(self, "_level", level)
        self.fold_constants = on
        self.optimize = on

    # -- switches read by the session ---------------------------------------------------

    @property
    def require_gpu_on(self) -> bool:
        return self.require_gpu if self.require_gpu is not None else env_flag("HETERO_EXEC_REQUIRE_GPU")

    @property
    def hetero_on(self) -> bool:
        return self.hetero if self.hetero is not None else env_flag("HETERO_EXEC_HETERO")

    # -- config entries (hetero_exec.config_entries holds the table) ----------------------

    def add_session_config_entry(self, key: str, value: str) -> None:
        """onnxruntime's ``session.*`` keys we know, and ``hetero_exec.<option>``."""
        from hetero_exec.config_entries import apply_session_entry

        apply_session_entry(self, key, value)
        self._config[key] = value

    def get_session_config_entry(self, key: str) -> str:
        if key not in self._config:
            raise OptionError(f"SessionOptions does not have configuration with key: {key}")
        return self._config[key]

    def add_free_dimension_override_by_name(self, dim_name: str, dim_value: int) -> None:
        """Fix a symbolic dim of the model's inputs to a size, as onnxruntime does."""
        self._free_dims["name"][_str("dim_name", dim_name)] = _int_range(1)("dim_value", dim_value)

    def add_free_dimension_override_by_denotation(self, dim_denotation: str, dim_value: int) -> None:
        key = _str("dim_denotation", dim_denotation)
        self._free_dims["denotation"][key] = _int_range(1)("dim_value", dim_value)

    def add_initializer(self, name: str, ortvalue: Any) -> None:
        """Replace an initializer's value with a host OrtValue (or array)."""
        from hetero_exec.ortvalue import host_array

        self._initializers[_str("name", name)] = host_array(ortvalue, "add_initializer")

    def register_custom_ops_library(self, library_path: str) -> None:
        raise OptionError(f"custom operator libraries are onnxruntime binaries and cannot run "
                          f"here ({library_path!r}); register kernels with "
                          f"hetero_exec.kernels.registry.kernel instead")

    # -- building -----------------------------------------------------------------------

    def copy(self) -> "SessionOptions":
        return copy.deepcopy(self)

    def update(self, kwargs: Mapping[str, Any]) -> "SessionOptions":
        """Keywords of InferenceSession: our fields, onnxruntime's, or executor options."""
        settable = set(CHECKS) | {"graph_optimization_level"}
        for k, v in kwargs.items():
            if k in settable and k != "executor_options":
                setattr(self, k, v)
            elif k == "executor_options":
                self.executor_options = {**self.executor_options, **_dict(k, v)}
            else:
                self.executor_options = {**self.executor_options, k: v}
        return self

    def check_executor_options(self) -> None:
        if self.executor_options and self.executor == "local":
            raise OptionError(f"unknown session option(s) {sorted(self.executor_options)} "
                              f"(executor='local' takes none beyond SessionOptions' fields)")

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> "SessionOptions":
        opts = cls().update(kwargs)
        opts.check_executor_options()
        return opts

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
