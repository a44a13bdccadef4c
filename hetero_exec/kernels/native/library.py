"""The compiled C kernels' library: which variant this process runs, loaded once.

The package's build (setup.py) compiles kernels/native/*.c into one shared library per
instruction-set variant, ``_kernels_<variant>.<ext suffix>`` beside this file: avx512,
avx2 and baseline on x86-64, neon and baseline on aarch64. Nothing is compiled at run
time. At first use the best variant the CPU runs is picked, from the features the
baseline library reads by cpuid (``he_cpu_features``; /proc/cpuinfo's flags where that
library is missing), or the one ``HETERO_EXEC_ISA`` names (avx512, avx2, baseline, neon;
``off`` for none). The library exports its constants and the signature of every function
(abi.c, generated from kernels.h by setup.py), from which the ctypes signatures are set:
no hand copy of a prototype here.

Where no variant is built (a working tree that was never built, ``HETERO_EXEC_BUILD_NATIVE=0``
at install), the forced one is missing or unrunnable here, ``HETERO_EXEC_ISA=off``,
``HETERO_EXEC_PACKED_GEMM=0`` or ``HETERO_EXEC_NATIVE=0``, or the self-check fails,
`unavailable_reason` says why and every op keeps its numpy path.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import logging
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np

from hetero_exec.kernels import _threads
from hetero_exec.kernels.native import ENV as NATIVE_ENV
from hetero_exec.kernels.native import switched_off

log = logging.getLogger(__name__)

#: "0" (or "false", "off", "no"): numpy's BLAS for every product, no C kernel
ENV = "HETERO_EXEC_PACKED_GEMM"
#: a variant to run instead of the best one the CPU runs: avx512, avx2, baseline, neon, off
ISA_ENV = "HETERO_EXEC_ISA"
#: microseconds the library's workers spin after a part before they sleep (0: never spin)
SPIN_ENV = "HETERO_EXEC_WORKER_SPIN_US"
DEFAULT_SPIN_US = 400
#: the variants, best first
VARIANTS = ("avx512", "avx2", "neon", "baseline")
HERE = Path(__file__).parent

_lock = threading.Lock()
_state: dict[str, Any] = {}
_CTYPES = {"v": None, "i": ctypes.c_int, "l": ctypes.c_long, "f": ctypes.c_float,
           "d": ctypes.c_double, "p": ctypes.c_void_p}


class _Constant(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("value", ctypes.c_long)]


class _Signature(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("result", ctypes.c_char_p), ("args", ctypes.c_char_p)]


def built_variants() -> dict[str, Path]:
    """The variants built beside this file, and their libraries."""
    found = {}
    for name in VARIANTS:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = HERE / f"_kernels_{name}{suffix}"
            if path.exists():
                found[name] = path
                break
    return found


def cpu_runs() -> dict[str, bool]:
    """Which variants this CPU runs: from the baseline library's cpuid when it is built,
    else from /proc/cpuinfo's flags (Linux), else the baseline only."""
    built = built_variants()
    features = None
    if "baseline" in built:
        try:
            features = ctypes.CDLL(str(built["baseline"])).he_cpu_features()
        except (OSError, AttributeError) as e:
            log.debug("cpu features from the baseline library failed: %s", e)
    if features is None:
        features = _proc_cpuinfo_features()
    return {"avx512": features & 6 == 6 and features & 1 == 1, "avx2": features & 3 == 3,
            "neon": bool(features & 8), "baseline": True}


def _proc_cpuinfo_features() -> int:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return 0
    flags = set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(line.split(":", 1)[1].split())
            break
    return (("avx2" in flags) | ("fma" in flags) << 1 | ("avx512f" in flags) << 2
            | ("asimd" in flags) << 3)


def unavailable_reason() -> str | None:
    """Why the C kernels are not used, or None when they are (decided once per process;
    `reset` decides again)."""
    if "reason" not in _state:
        with _lock:
            if "reason" not in _state:
                _state["reason"] = _load()
                if _state["reason"]:
                    log.info("C kernels off: %s; numpy paths only", _state["reason"])
    return _state["reason"]


def available() -> bool:
    return unavailable_reason() is None


def takes(xp, *arrays: Any) -> bool:
    """Whether the C kernels may take these arrays: host (numpy) float32 arrays, and the
    library loaded."""
    return xp is np and all(a.dtype == np.float32 for a in arrays) and available()


def variant() -> str | None:
    """The variant loaded (avx512, avx2, neon, baseline), or None when off."""
    return _state.get("variant") if available() else None


def describe() -> str:
    """``native: <variant>`` or ``native: off (<reason>)``, as `hetero-exec info` prints."""
    reason = unavailable_reason()
    if reason is None:
        return f"native: {_state['variant']} ({_state['why']})"
    return f"native: off ({reason})"


def reset() -> None:
    """Decide again (after ``HETERO_EXEC_ISA`` or a switch changed). A library loaded once
    stays mapped; its workers keep running."""
    with _lock:
        _state.clear()


def _pick() -> tuple[str | None, str]:
    """(the variant to load, why), or (None, why not)."""
    built = built_variants()
    if not built:
        return None, (f"no compiled kernels in {HERE} (a working tree that was not built: "
                      "pip install -e . or python setup.py build_ext --inplace)")
    runs = cpu_runs()
    forced = os.environ.get(ISA_ENV, "").strip().lower()
    if forced:
        if forced in ("off", "0", "none", "no", "false"):
            return None, f"{ISA_ENV}={os.environ[ISA_ENV]!r}"
        if forced not in VARIANTS:
            return None, f"{ISA_ENV}={forced!r} is none of {', '.join(VARIANTS)}, off"
        if forced not in built:
            return None, f"{ISA_ENV}={forced!r}, not built here (built: {', '.join(built)})"
        if not runs[forced]:
            return None, f"{ISA_ENV}={forced!r}, which this CPU does not run"
        return forced, f"{ISA_ENV}={forced}"
    for name in VARIANTS:
        if name in built and runs[name]:
            return name, "the best built variant this CPU runs"
    return None, f"this CPU runs none of the built variants ({', '.join(built)})"


def _load() -> str | None:
    for env in (ENV, NATIVE_ENV):
        if switched_off(env):
            return f"{env}={os.environ[env]!r}"
    name, why = _pick()
    if name is None:
        return why
    path = built_variants()[name]
    try:
        lib = ctypes.CDLL(str(path))
        constants = _table(lib, "he_constants", _Constant)
        for sig in _table(lib, "he_signatures", _Signature):
            fn = getattr(lib, sig.name.decode())
            fn.restype = _CTYPES[sig.result.decode()]
            fn.argtypes = [_CTYPES[c] for c in sig.args.decode()]
        isa = (ctypes.c_char * 16).in_dll(lib, "he_isa").value.decode()
    except (OSError, AttributeError, KeyError, ValueError) as e:
        return f"{path.name} did not load ({type(e).__name__}: {e})"
    if isa != name:
        return f"{path.name} says it is the {isa!r} variant"
    _state["lib"] = lib
    _state["constants"] = {c.name.decode(): int(c.value) for c in constants}
    _state["variant"], _state["why"], _state["path"] = name, why, path
    reason = _codes_differ() or _self_check(lib)
    if reason is None:
        lib.he_pool_start(max(0, _threads.cores() - 1), _spin_ns())
    return reason


_expected: dict[str, int] = {}


def expect(**constants: int) -> None:
    """Constants a wrapper module keeps as its own (the tile in native/packed_gemm.py,
    read on every call), checked against the library's at load: a library whose
    kernels.h says otherwise is not used."""
    _expected.update(constants)


def _codes_differ() -> str | None:
    """The activation codes of native/activation.py against the library's (kernels.h):
    one meaning for a code on both sides."""
    from hetero_exec.kernels.native.activation import ACT_CODES

    names = {"": "NONE", "Relu": "RELU", "Clip": "CLIP", "HardSigmoid": "HARD_SIGMOID",
             "HardSwish": "HARD_SWISH", "Gelu": "GELU", "GeluTanh": "GELU_TANH",
             "SiLU": "SILU", "Sigmoid": "SIGMOID", "Tanh": "TANH"}
    for act, code in ACT_CODES.items():
        if _state["constants"].get("ACT_" + names[act]) != code:
            return f"activation code of {act or 'none'!r} differs from kernels.h's"
    for name, value in _expected.items():
        if _state["constants"].get(name) != value:
            return f"{name} is {value} in Python, {_state['constants'].get(name)} in kernels.h"
    return None


def _table(lib: Any, name: str, row: type) -> list:
    """The rows of a table ``name`` the library exports, up to its NULL-named end."""
    base = ctypes.addressof(row.in_dll(lib, name))
    rows = []
    while True:
        r = row.from_address(base + len(rows) * ctypes.sizeof(row))
        if not r.name:
            return rows
        rows.append(r)


def _self_check(lib: Any) -> str | None:
    """A ragged right-hand product with bias and Clip against numpy, through the raw
    entry points: a library that loads but computes wrong must not run."""
    rng = np.random.default_rng(0)
    A = rng.standard_normal((13, 300), dtype=np.float32)
    B = rng.standard_normal((300, 45), dtype=np.float32)
    bias = rng.standard_normal(45, dtype=np.float32)
    packed = np.empty(lib.he_pack_right_size(300, 45), np.float32)
    lib.he_pack_right(300, 45, B.ctypes.data, 45, 1, packed.ctypes.data)
    Y = np.empty((13, 45), np.float32)
    lib.he_gemm_right_mt(13, 45, 300, A.ctypes.data, 300, packed.ctypes.data, Y.ctypes.data, 45,
                         bias.ctypes.data, None, 45, _state["constants"]["ACT_CLIP"], -1.0, 2.0,
                         1)
    if not np.allclose(Y, np.clip(A @ B + bias, -1.0, 2.0), rtol=1e-4, atol=1e-4):
        return f"the {_state['variant']} library's product disagrees with numpy"
    return None


def _spin_ns() -> int:
    value = os.environ.get(SPIN_ENV, "")
    try:
        us = float(value) if value.strip() else DEFAULT_SPIN_US
    except ValueError:
        log.warning("%s=%r is not a number of microseconds; using %d", SPIN_ENV, value,
                    DEFAULT_SPIN_US)
        us = DEFAULT_SPIN_US
    return max(0, int(us * 1000))


def lib() -> Any:
    """The loaded library (its functions' signatures set); RuntimeError when off."""
    loaded = _state.get("lib")
    if loaded is None or "reason" not in _state or _state["reason"]:
        reason = unavailable_reason()
        loaded = _state.get("lib")
        if reason or loaded is None:
            raise RuntimeError(f"C kernels unavailable: {reason}")
    return loaded


def constant(name: str) -> int:
    """A constant the library exports (abi.c: NR, MR_LEFT, VW, ACT_RELU, ...)."""
    lib()
    return _state["constants"][name]


_CHAR = ctypes.c_char


def address(a: np.ndarray) -> int:
    """``a``'s data pointer: by the buffer protocol for a writable C-contiguous array
    (0.5 us, against 1.5-2 us for numpy's ``a.ctypes.data``, which a call of a small
    kernel paid four or five times), else by ``a.ctypes.data``."""
    try:
        return ctypes.addressof(_CHAR.from_buffer(a))
    except (TypeError, ValueError, BufferError):  # read-only, strided or empty
        return a.ctypes.data


def pointer(a: np.ndarray | None) -> int | None:
    """`address`, None for None (a NULL argument)."""
    return None if a is None else address(a)


#: a split over the library's workers from this many FLOPs (~30 us of work: a hand-off to
#: a spinning worker costs a few us, to a sleeping one 40-130 us here)
SPLIT_FLOPS = 4e6


def parts(n: int, flops: float) -> int:
    """Parts to cut ``n`` work items into over the library's workers (1: none), as
    kernels/_threads.parallel_for would for work that calls no BLAS."""
    return _threads.split_parts(n, flops, alone_flops=SPLIT_FLOPS)


def contiguous_f32(a: np.ndarray | None) -> np.ndarray | None:
    return None if a is None else np.ascontiguousarray(a, dtype=np.float32)
