"""Session config entries: onnxruntime's ``session.*`` keys we know, and
``hetero_exec.<option>`` for every one of our options.

Values are strings, as in onnxruntime. Each key has a parser; an unknown key, or a
value its parser refuses, is an `OptionError` naming the key and what it accepts
(onnxruntime stores unknown keys silently; we refuse them, so a typo is never ignored).

>>> from hetero_exec.options import SessionOptions
>>> so = SessionOptions()
>>> so.add_session_config_entry("hetero_exec.dim_bounds", "N=8,M=4")
>>> so.dim_bounds
{'N': 8, 'M': 4}
"""

from __future__ import annotations

import json
from typing import Any, Callable

from hetero_exec.errors import OptionError, OptionTypeError

PREFIX = "hetero_exec."


def _flag01(key: str, v: str) -> bool:
    if v not in ("0", "1"):
        raise OptionError(f"config entry {key!r} takes '0' or '1', got {v!r}")
    return v == "1"


def _only(*allowed: str) -> Callable[[str, str], str]:
    def parse(key: str, v: str) -> str:
        if v not in allowed:
            raise OptionError(f"config entry {key!r}: only {list(allowed)} is supported here, "
                              f"got {v!r}")
        return v
    return parse


def _no_effect(_opts: Any, _v: Any) -> None:
    """Accepted for onnxruntime code: our runtime has no such switch (see the table)."""


def _set(name: str) -> Callable[[Any, Any], None]:
    return lambda opts, v: setattr(opts, name, v)


#: key -> (parser, apply); the comment says why a key has no effect
ORT_ENTRIES: dict[str, tuple[Callable[[str, str], Any], Callable[[Any, Any], None]]] = {
    # "1": the GPU is required, no whole-session cpu fallback (SEMANTICS.md 1.6)
    "session.disable_cpu_ep_fallback": (_flag01, _set("require_gpu")),
    # our kernels never spin-wait, so either value holds
    "session.intra_op.allow_spinning": (_flag01, _no_effect),
    "session.inter_op.allow_spinning": (_flag01, _no_effect),
    # allocators: arrays come from NumPy / CuPy
    "session.use_env_allocators": (_flag01, _no_effect),
    "session.use_device_allocator_for_initializers": (_flag01, _no_effect),
    # weights are used as given, never pre-packed
    "session.disable_prepacking": (_flag01, _no_effect),
    # denormals are never flushed: only "0" is true of us
    "session.set_denormal_as_zero": (_only("0"), _no_effect),
    "session.load_model_format": (_only("ONNX"), _no_effect),
    "session.save_model_format": (_only("ONNX"), _no_effect),
}


# --- hetero_exec.<option> ------------------------------------------------------------


def _bool(key: str, v: str) -> bool:
    low = v.strip().lower()
    if low in ("1", "true", "on"):
        return True
    if low in ("0", "false", "off"):
        return False
    raise OptionError(f"config entry {key!r} takes 1/true/on or 0/false/off, got {v!r}")


def _text(key: str, v: str) -> str:
    return v


def _json(key: str, v: str) -> Any:
    try:
        return json.loads(v)
    except ValueError as e:
        raise OptionError(f"config entry {key!r}: not valid JSON ({e}): {v!r}") from None


def _dim_bounds(key: str, v: str) -> dict[str, int]:
    """``N=8,M=4`` or a JSON object."""
    if v.strip().startswith("{"):
        return _json(key, v)
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in v.split(","))):
        sym, eq, n = part.partition("=")
        if not eq or not n.strip().isdigit():
            raise OptionError(f"config entry {key!r} takes 'SYMBOL=N,...' or a JSON object, "
                              f"got {v!r}")
        out[sym.strip()] = int(n)
    return out


def _stages(key: str, v: str) -> Any:
    """``auto``, a count ``K``, or cuts: ``0,3`` / JSON ``[3]``."""
    s = v.strip()
    if s == "auto":
        return s
    if "," in s and not s.startswith("["):
        s = f"[{s}]"
    return _json(key, s)


def _cost_model(key: str, v: str) -> Any:
    from hetero_exec.placement.partition import CostModel

    fields = _json(key, v)
    try:
        return CostModel(**fields)
    except TypeError as e:
        raise OptionError(f"config entry {key!r}: {e}") from None


OWN_PARSERS: dict[str, Callable[[str, str], Any]] = {
    "require_gpu": _bool, "hetero": _bool, "enable_profiling": _bool,
    "fold_constants": _bool, "optimize": _bool,
    "executor": _text, "strategy": _text, "profile_file_prefix": _text,
    "placement": _text, "base_dir": _text,
    "dim_bounds": _dim_bounds, "affinity": _json, "stages": _stages, "cost_model": _cost_model,
}


def executor_option_names() -> set[str]:
    """The Ray executor's option names (its dataclass, read without starting Ray)."""
    from dataclasses import fields

    from actors.options import RayOptions  # a dataclass module: no Ray import

    return {f.name for f in fields(RayOptions)}


def _executor_value(v: str) -> Any:
    """A JSON literal (``8``, ``true``, ``{...}``) when it is one, else the string."""
    try:
        return json.loads(v)
    except ValueError:
        return v


def apply_session_entry(opts: Any, key: str, value: Any) -> None:
    if not isinstance(key, str) or not isinstance(value, str):
        raise OptionTypeError(f"a session config entry is a (str, str) pair, got ({key!r}, {value!r})")
    if key in ORT_ENTRIES:
        parse, apply = ORT_ENTRIES[key]
        apply(opts, parse(key, value))
        return
    if key.startswith(PREFIX):
        name = key[len(PREFIX):]
        if name in OWN_PARSERS:
            setattr(opts, name, OWN_PARSERS[name](key, value))
            return
        if name in executor_option_names():
            opts.executor_options = {**opts.executor_options, name: _executor_value(value)}
            return
        raise OptionError(f"unknown config entry {key!r}; hetero_exec.* keys are "
                          f"{sorted(OWN_PARSERS)} and the Ray executor's options "
                          f"{sorted(executor_option_names())}")
    raise OptionError(f"unknown session config entry {key!r}; known: {sorted(ORT_ENTRIES)} "
                      f"and hetero_exec.<option>")
