"""RunOptions: per-run settings, as onnxruntime's.

``terminate`` set before a run (or from another thread while it runs) makes the run
raise `RunTerminatedError`: it is checked before dispatch and again when the run
returns, so a terminated run never hands back outputs. ``logid`` tags the run's log
lines. Every assignment is checked, and run config entries are a known table.

>>> ro = RunOptions()
>>> ro.logid = "request-7"
>>> ro.terminate
False
"""

from __future__ import annotations

from typing import Any

from hetero_exec.errors import OptionError, OptionTypeError, RunTerminatedError, UnknownOptionError
from hetero_exec.options import CHECKS as SESSION_CHECKS


def _bool(name: str, v: Any) -> bool:
    return SESSION_CHECKS["enable_profiling"](name, v)


CHECKS = {
    "log_severity_level": SESSION_CHECKS["log_severity_level"],
    "log_verbosity_level": SESSION_CHECKS["log_verbosity_level"],
    "logid": SESSION_CHECKS["logid"],
    "terminate": _bool,
    "only_execute_path_to_fetches": _bool,  # we always run only what the fetches need
}


def _flag01(key: str, v: str) -> str:
    if v not in ("0", "1"):
        raise OptionError(f"run config entry {key!r} takes '0' or '1', got {v!r}")
    return v


def _devices(key: str, v: str) -> str:
    return v  # e.g. "cpu:0;gpu:0": arenas to shrink; NumPy and CuPy's pools need no call


#: onnxruntime's run config keys we accept; none changes what a run computes
RUN_ENTRIES = {
    "memory.enable_memory_arena_shrinkage": _devices,
    "disable_synchronize_execution_providers": _flag01,
}


class RunOptions:
    def __init__(self) -> None:
        object.__setattr__(self, "_config", {})
        self.log_severity_level = -1
        self.log_verbosity_level = 0
        self.logid = ""
        self.terminate = False
        self.only_execute_path_to_fetches = False

    def __setattr__(self, name: str, value: Any) -> None:
        check = CHECKS.get(name)
        if check is None:
            raise UnknownOptionError(f"RunOptions has no option {name!r}; known: {sorted(CHECKS)}")
        object.__setattr__(self, name, check(name, value))

    def add_run_config_entry(self, key: str, value: str) -> None:
        if not isinstance(key, str) or not isinstance(value, str):
            raise OptionTypeError(f"a run config entry is a (str, str) pair, got ({key!r}, {value!r})")
        parse = RUN_ENTRIES.get(key)
        if parse is None:
            raise OptionError(f"unknown run config entry {key!r}; known: {sorted(RUN_ENTRIES)}")
        self._config[key] = parse(key, value)

    def get_run_config_entry(self, key: str) -> str:
        if key not in self._config:
            raise OptionError(f"RunOptions does not have configuration with key: {key}")
        return self._config[key]

    def __repr__(self) -> str:
        return (f"RunOptions(logid={self.logid!r}, terminate={self.terminate}, "
                f"log_severity_level={self.log_severity_level})")


def check_run_options(run_options: Any) -> RunOptions | None:
    if run_options is None or isinstance(run_options, RunOptions):
        return run_options
    raise OptionTypeError(f"run_options must be a hetero_exec.RunOptions, got "
                          f"{type(run_options).__name__}")


def raise_if_terminated(run_options: RunOptions | None) -> None:
    if run_options is not None and run_options.terminate:
        raise RunTerminatedError(run_options.logid)
