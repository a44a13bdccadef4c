"""Compiled CPU kernels (numba), for the few ops numpy cannot do at memory speed.

Two mechanisms live under this package: the C library, built by the package's build
(library.py loads it: every float32 product, conv, depthwise conv, MaxPool, softmax, row
and channel norms, and the FusedMatMul epilogue), and numba, here, for what the C
library does not cover: the float64 paths (depthwise conv, row norms, epilogues), the
element-wise float32 activations (Gelu, ...) and the channels epilogue of a conv the
store cannot finish. numba compiles on first use (cached on disk); a process with no
cache paid 2-4 s for it, so the float32 row norms moved to C, and the compile check
below runs when a numba kernel is first used rather than at `available`. Porting the
rest is open work, not a measured choice.

numpy runs one pass over memory per operation and has no fused multiply-add, so an op
that is a chain of small element-wise steps (a depthwise convolution is a sum of K*K
scaled shifted copies) runs at a fraction of the machine's speed however it is written
(bench/bench_conv.py measures the numpy forms). The kernels here are the cpu provider's
own fast paths, like cuDNN's are CuPy's: the array-module kernels stay the definition,
run everywhere else, and are what these are tested against.

Without numba, or with ``HETERO_EXEC_NATIVE=0``, `available` is False with the reason,
and every op keeps its numpy path. Kernels are compiled on first use and cached on disk
(numba's ``cache=True``), so a process after the first loads them in milliseconds; they
release the GIL and run single-threaded, split over threads by the caller
(kernels/_threads.parallel_for).

numba keys a cached function on its own file only, so a kernel that inlines code from
another file of this package would keep running the old code after that file changed
(it did, here: a stale depthwise kernel ran at half speed). `module` therefore drops the
package's cache whenever the hash of its sources differs from the one recorded beside it.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import threading
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import numpy as np

log = logging.getLogger(__name__)

#: set to "0" (or "false", "off", "no") to run the numpy paths only
ENV = "HETERO_EXEC_NATIVE"

#: the compiled epilogues' activation codes (native/epilogue.py), one per activation of
#: kernels/fused.py. None calls libm's scalar exp or tanh (4-30 ns a value here, where
#: numpy has SIMD loops at 0.5 ns): in float32, erf GELU runs on a rational erf, and tanh
#: GELU, SiLU, Sigmoid and Tanh on a rational tanh.
ACT_CODES = {"": 0, "Relu": 1, "Clip": 2, "HardSigmoid": 3, "HardSwish": 4, "Gelu": 8,
             "GeluTanh": 9, "SiLU": 10, "Sigmoid": 11, "Tanh": 12}
#: (min, max) / (alpha, beta) when an activation comes without its parameters
ACT_DEFAULTS = {"Clip": (float("-inf"), float("inf")), "HardSigmoid": (0.2, 0.5),
                "HardSwish": (1.0 / 6.0, 0.5)}

#: the dtypes the kernels are compiled for
DTYPES = (np.dtype(np.float32), np.dtype(np.float64))

_lock = threading.RLock()  # the availability check imports a kernel module
_state: dict[str, object] = {}
_modules: dict[str, ModuleType] = {}


def unavailable_reason() -> str | None:
    """Why the compiled kernels are not used, or None when they are (decided once per
    process, `reset` decides again)."""
    try:
        return _state["reason"]  # type: ignore[return-value]
    except KeyError:
        pass
    with _lock:
        if "reason" not in _state:
            _state["reason"] = _find_reason()
            if _state["reason"]:
                log.info("compiled cpu kernels off: %s; numpy paths only", _state["reason"])
    return _state["reason"]  # type: ignore[return-value]


def switched_off(env: str) -> bool:
    """Whether the environment variable ``env`` turns a fast path off ("0", "false",
    "off" or "no")."""
    return os.environ.get(env, "").strip().lower() in ("0", "false", "off", "no")


def _find_reason() -> str | None:
    if switched_off(ENV):
        return f"{ENV}={os.environ[ENV]!r}"
    try:
        importlib.import_module("numba")
    except Exception as e:  # ImportError, or a numba that fails on this numpy
        return f"numba is not importable ({type(e).__name__}: {e})"
    return None


def _compile_check() -> str | None:
    """A numba that imports but cannot compile here (LLVM, CPU) must not fail a run: one
    small kernel compiled and run before the first kernel module is used (not at
    `available`, which every float32 gate asks: compiling it cost a process's first run
    2-3 s, where the float32 paths are the C library's and need no numba)."""
    try:
        x = np.array([-1.0, 2.0], np.float32)
        y = np.empty_like(x)
        importlib.import_module(f"{__name__}.epilogue").unary(x, y, ACT_CODES["Relu"], 0.0, 0.0,
                                                              0, 2)
        if y.tolist() != [0.0, 2.0]:
            return f"numba's compiled Relu gave {y.tolist()} for [-1, 2]"
    except Exception as e:
        return f"numba cannot compile here ({type(e).__name__}: {e})"
    return None


def reset() -> None:
    """Decide `available` again (after ``HETERO_EXEC_NATIVE`` changed)."""
    with _lock:
        _state.pop("reason", None)


def available() -> bool:
    """True when the compiled kernels can be used in this process."""
    return unavailable_reason() is None


def takes(xp, *arrays: Any) -> bool:
    """Whether the compiled kernels may take these arrays: host (numpy) arrays of the
    dtypes in `DTYPES`, and the kernels available."""
    return xp is np and all(a.dtype in DTYPES for a in arrays) and available()


def split(kernel: Callable[..., None], n: int, *args: Any, cost: float, least: int = 1) -> None:
    """``kernel(*args, i0, i1)`` over [0, n), cut over our threads as a kernel's
    independent blocks are (kernels/_threads.parallel_for; ``cost`` in its FLOPs), in a
    run alone too: the compiled kernels call no BLAS."""
    from hetero_exec.kernels import _threads

    _threads.parallel_for(np, n, lambda i0, i1: kernel(*args, i0, i1), cost, least, alone=True)


def epilogue_code(activation: str, params=None) -> tuple[int, float, float] | None:
    """``activation`` (with its parameters) as the compiled epilogues' (code, p0, p1), or
    None when they lack it or are unavailable."""
    code = ACT_CODES.get(activation)
    if code is None or not available():
        return None
    p0, p1 = params if params else ACT_DEFAULTS.get(activation, (0.0, 0.0))
    return code, float(p0), float(p1)


def module(name: str) -> ModuleType:
    """The kernel module ``hetero_exec.kernels.native.<name>``, imported (and its
    functions compiled lazily by numba) on first use. Only call when `available`."""
    mod = _modules.get(name)
    if mod is None:
        with _lock:
            if "checked" not in _state:
                _drop_stale_cache(Path(__file__).parent)
                _state["checked"] = True
                reason = _compile_check()
                if reason:  # numba off from now on; this call's caller fails once
                    _state["reason"] = reason
                    log.warning("compiled cpu kernels off: %s; numpy paths only", reason)
            if _state.get("reason"):
                raise RuntimeError(f"numba kernels unavailable: {_state['reason']}")
        mod = _modules[name] = importlib.import_module(f"{__name__}.{name}")
    return mod


def _drop_stale_cache(here: Path) -> None:
    """Delete numba's cache files of this package when its sources changed since they
    were written (see the module docstring). Best effort: a cache that cannot be read
    or removed only costs a compile."""
    digest = hashlib.sha256()
    for src in sorted(here.glob("*.py")):
        digest.update(src.name.encode() + b"\0" + src.read_bytes())
    want = digest.hexdigest()
    cache = here / "__pycache__"
    stamp = cache / "native-sources.sha256"
    try:
        if stamp.read_text().strip() == want:
            return
    except OSError:
        pass
    try:
        cache.mkdir(exist_ok=True)
        for f in list(cache.glob("*.nbi")) + list(cache.glob("*.nbc")):
            f.unlink(missing_ok=True)
        tmp = cache / f"native-sources.{os.getpid()}.tmp"
        tmp.write_text(want + "\n")
        tmp.replace(stamp)  # atomic: a concurrent process sees the old stamp or this one
        log.debug("compiled cpu kernels: sources changed, cache dropped")
    except OSError as e:  # a read-only install: numba falls back to its user cache dir
        log.debug("compiled cpu kernels: cache not checked (%s)", e)
