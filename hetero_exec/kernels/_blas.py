"""The BLAS under numpy: found once per process (threadpoolctl), its thread count set
process-wide, OpenBLAS's idle spin shortened, and its CBLAS products' addresses for
native/blas.c's split on the C workers. kernels/_threads.py decides what count a run
gets; this module only finds and drives the library.

OpenBLAS's workers spin 2**28 cycles (~0.1 s of a core) after each call before they
sleep. When the BLAS is found that is shortened to 2**20 (~0.4 ms: `_shorten_spin`), long
enough to stay awake between one run's products, short enough to give the core back when
the run ends: to the next stage actor on the node, to onnxruntime in a benchmark.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import threading
from typing import Any, Callable, NamedTuple

log = logging.getLogger(__name__)

#: OpenBLAS's idle workers spin 2**n cycles before they sleep (`_shorten_spin`)
SPIN_ENV = "HETERO_EXEC_BLAS_THREAD_TIMEOUT"
DEFAULT_SPIN_EXPONENT = 20

_LOCK = threading.Lock()  # the discovery runs once (it restarts OpenBLAS's workers)
_libs: list[Any] | None = None  # BlasThreads


class BlasThreads:
    """get/set of one BLAS library's thread count (process-wide)."""

    def __init__(self, get: Callable[[], int], set_: Callable[[int], Any]):
        self.get_num_threads = get
        self.set_num_threads = set_


def _openblas(path: str) -> BlasThreads | None:
    """OpenBLAS's own process-wide setters, by ctypes. (threadpoolctl's, from 3.6 on, act
    only in the first thread that calls them; a run on a run_async thread would not.)"""
    dll = ctypes.CDLL(path)
    for pre, suf in itertools.product(("", "scipy_"), ("", "64_", "_64")):
        get = getattr(dll, f"{pre}openblas_get_num_threads{suf}", None)
        set_ = getattr(dll, f"{pre}openblas_set_num_threads{suf}", None)
        if get is not None and set_ is not None:
            set_.argtypes, set_.restype, get.restype = [ctypes.c_int], None, ctypes.c_int
            _shorten_spin(dll)
            _find_gemm(dll, pre, suf)
            return BlasThreads(get, set_)
    return None


class BlasGemm(NamedTuple):
    """Addresses of numpy's OpenBLAS's CBLAS products, for native/blas.c's split of a
    product over gemm.c's workers."""

    sgemm: int
    dgemm: int
    sgemv: int
    dgemv: int
    ilp64: bool  # 64-bit integers


_gemm: BlasGemm | None = None


def _find_gemm(dll: Any, pre: str, suf: str) -> None:
    """Record the library's CBLAS products (numpy's scipy-openblas names them
    ``scipy_cblas_sgemm64_``...: 64-bit integers, as a ``64_`` suffix or USE64BITINT in
    the build's configuration says)."""
    global _gemm
    fns = [getattr(dll, f"{pre}cblas_{name}{suf}", None)
           for name in ("sgemm", "dgemm", "sgemv", "dgemv")]
    if None in fns:
        return
    ilp64 = bool(suf)
    config = getattr(dll, f"{pre}openblas_get_config{suf}", None) or getattr(
        dll, "openblas_get_config", None)
    if config is not None and not ilp64:
        config.restype = ctypes.c_char_p
        ilp64 = b"USE64BITINT" in (config() or b"")
    _gemm = BlasGemm(*(ctypes.cast(f, ctypes.c_void_p).value for f in fns), ilp64)


def blas_gemm() -> BlasGemm | None:
    """numpy's OpenBLAS's CBLAS products, or None (another BLAS, or none found)."""
    blas_libs()
    return _gemm


def _spin_exponent() -> int | None:
    """The OpenBLAS thread timeout to apply (2**n cycles), or None to leave it alone: the
    user's own OPENBLAS_THREAD_TIMEOUT always wins, and HETERO_EXEC_BLAS_THREAD_TIMEOUT
    (4-30, or 0/off) replaces our default."""
    if os.environ.get("OPENBLAS_THREAD_TIMEOUT", "").strip():
        return None
    raw = os.environ.get(SPIN_ENV, "").strip().lower()
    if not raw:
        return DEFAULT_SPIN_EXPONENT
    if raw in ("0", "off", "no", "false"):
        return None
    try:
        return min(30, max(4, int(raw)))
    except ValueError:
        log.warning("%s=%r is not a number (4-30) or off: OpenBLAS's spin left alone",
                    SPIN_ENV, raw)
        return None


def _shorten_spin(dll: Any) -> None:
    """OpenBLAS's idle workers spin for 2**28 cycles (~0.1 s, a whole core) after every
    threaded call before they sleep; OPENBLAS_THREAD_TIMEOUT, read when the library loads,
    is the only knob. Numpy has loaded it long before us, so: set the variable, have the
    library read its environment again, and stop its workers, which the next threaded
    call starts again with the short timeout. Done once, when the BLAS is first found."""
    n = _spin_exponent()
    read_env = getattr(dll, "openblas_read_env", None)
    shutdown = getattr(dll, "blas_thread_shutdown_", None)
    if n is None or read_env is None or shutdown is None:
        return
    os.environ["OPENBLAS_THREAD_TIMEOUT"] = str(n)  # child processes (Ray workers) inherit it
    read_env()
    shutdown()
    log.debug("OpenBLAS workers now sleep after 2**%d idle cycles", n)


def blas_libs() -> list[BlasThreads]:
    """The BLAS libraries numpy loaded, found by threadpoolctl (none without it); found
    once, under the lock, so that OpenBLAS's workers are restarted once (`_shorten_spin`).
    (That restart is what OpenBLAS's own fork handler does; like it, it assumes no other
    thread is inside a threaded BLAS call at that moment: the first run of a session.)"""
    if _libs is None:
        with _LOCK:
            if _libs is None:
                _discover_blas()
    return _libs


def _discover_blas() -> None:
    global _libs
    found: list[BlasThreads] = []
    try:
        from threadpoolctl import ThreadpoolController

        for ctl in ThreadpoolController().select(user_api="blas").lib_controllers:
            own = None
            if ctl.internal_api == "openblas" and ctl.threading_layer != "openmp":
                own = _openblas(ctl.filepath)
            found.append(own or BlasThreads(ctl.get_num_threads, ctl.set_num_threads))
    except Exception as e:  # threadpoolctl missing or unable: leave the BLAS alone
        log.debug("no BLAS thread control: %s", e)
    _libs = found


def blas_threads() -> int | None:
    """The BLAS's thread count now (None when it cannot be controlled)."""
    libs = blas_libs()
    return libs[0].get_num_threads() if libs else None
