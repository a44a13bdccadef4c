"""Whether a run alone splits its BLAS products on the C library's workers (native/blas.c
through native/blas_split.py), the BLAS held at one thread, rather than on the BLAS's own
threads: one pool of threads for a whole run (kernels/_threads.py says why).

native/blas_split.py registers its split here when imported (`register_c_blas_split`):
this module imports nothing of native/, which imports it."""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

from hetero_exec.kernels import _blas

log = logging.getLogger(__name__)

#: "0" (or "false", "off", "no"): a lone run's products split on the BLAS's own threads
SPLIT_ENV = "HETERO_EXEC_BLAS_SPLIT"

#: (blas_matmul, available) of native/blas_split.py, once registered
_registered: tuple[Callable[..., Any], Callable[[], bool]] | None = None
_split_on_c_workers: bool | None = None  # decided once per process
#: native/blas_split.blas_matmul, once `blas_split_on_c_workers` says yes
blas_matmul: Callable[..., Any] | None = None


def register_c_blas_split(matmul: Callable[..., Any], available: Callable[[], bool]) -> None:
    """The C workers' BLAS split (native/blas_split.blas_matmul) and whether the library
    is loaded: what `blas_split_on_c_workers` decides from."""
    global _registered
    _registered = (matmul, available)


def blas_split_on_c_workers() -> bool:
    """Whether a run alone splits its BLAS products on gemm.c's workers (native/blas.c),
    with the BLAS at one thread, rather than on the BLAS's own threads: numpy's OpenBLAS
    and the C kernels available, and ``HETERO_EXEC_BLAS_SPLIT`` not off. Decided once per
    process."""
    global _split_on_c_workers, blas_matmul
    if _split_on_c_workers is None:
        split = _registered
        off = os.environ.get(SPLIT_ENV, "").strip().lower() in ("0", "false", "off", "no")
        _split_on_c_workers = bool(not off and _blas.blas_gemm() is not None
                                   and split is not None and split[1]())
        if _split_on_c_workers:
            blas_matmul = split[0]
        log.debug("BLAS products of a lone run split on %s",
                  "gemm.c's workers" if _split_on_c_workers else "the BLAS's own threads")
    return _split_on_c_workers
