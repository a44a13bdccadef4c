"""What a run in this process will use, one item a line: `show_runtime` (as numpy's) and
``hetero-exec info``.

    native: avx512 (the best built variant this CPU runs)
    blas: openblas 0.3.29 (/path/libscipy_openblas64_.so), 2 threads
    gpu: unavailable (CuPy's reason)
"""

from __future__ import annotations

import sys
from typing import TextIO


def native_line() -> str:
    """``native: avx512|avx2|neon|baseline (why)`` or ``native: off (why)``."""
    from hetero_exec.kernels.native import library

    return library.describe()


def blas_lines() -> list[str]:
    """One ``blas:`` line per BLAS numpy loaded, with its threads now."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError as e:
        return [f"blas: unknown (threadpoolctl is not importable: {e})"]
    lines = [f"blas: {i.get('internal_api')} {i.get('version') or ''} ({i.get('filepath')}), "
             f"{i.get('num_threads')} threads"
             for i in threadpool_info() if i.get("user_api") == "blas"]
    return lines or ["blas: none found (numpy's own loops)"]


def gpu_line() -> str:
    """``gpu: available (CuPy ...)`` or ``gpu: unavailable (CuPy's reason)``."""
    from hetero_exec.providers import parse_provider

    try:
        support = parse_provider("gpu").available()
    except Exception as e:  # noqa: BLE001 - reported, not raised: this is a report
        return f"gpu: unavailable ({type(e).__name__}: {e})"
    if support.ok:
        return f"gpu: available ({support.reason or 'CuPy'})"
    return f"gpu: unavailable ({support.reason})"


def runtime_lines() -> list[str]:
    return [native_line(), *blas_lines(), gpu_line()]


def show_runtime(file: TextIO | None = None) -> None:
    """Print what a run will use: the C kernels' variant, the BLAS and its threads, the
    GPU's availability."""
    out = file or sys.stdout
    for line in runtime_lines():
        print(line, file=out)
