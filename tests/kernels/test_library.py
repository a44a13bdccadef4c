"""The C kernels' library as the package's build leaves it (kernels/native/library.py): a
variant picked from the CPU's features, HETERO_EXEC_ISA forcing another, the signatures
from the library's own table, and ``hetero-exec info`` printing what a run uses."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hetero_exec.kernels.native import library

ROOT = Path(__file__).resolve().parents[2]
built = library.built_variants()
needs_built = pytest.mark.skipif(not built, reason="no compiled kernels in this tree "
                                 "(python setup.py build_ext --inplace, or pip install -e .)")


def _info(**env: str) -> list[str]:
    full = {k: v for k, v in os.environ.items() if k != library.ISA_ENV}
    full.update(env)
    done = subprocess.run([sys.executable, "-m", "hetero_exec.cli", "info"], env=full,
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def _proc_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.split(":", 1)[1].split())
    return set()


@needs_built
def test_the_best_variant_the_cpu_runs_is_picked():
    flags = _proc_flags()
    want = ("avx512" if {"avx512f", "fma"} <= flags and "avx512" in built
            else "avx2" if {"avx2", "fma"} <= flags and "avx2" in built
            else "neon" if "asimd" in flags and "neon" in built else "baseline")
    lines = _info()
    assert lines[0] == f"native: {want} (the best built variant this CPU runs)"
    # the library's cpuid and /proc/cpuinfo agree on what this CPU runs
    runs = library.cpu_runs()
    assert runs["avx2"] == ({"avx2", "fma"} <= flags)
    assert runs["avx512"] == ({"avx512f", "fma", "avx2"} <= flags)


@needs_built
def test_info_prints_native_blas_and_gpu_lines():
    lines = _info()
    assert lines[0].startswith("native: ")
    assert any(re.match(r"blas: .+, \d+ threads$", line) for line in lines[1:-1]) or \
        lines[1].startswith("blas: none")
    assert re.match(r"gpu: (available|unavailable) \(.+\)$", lines[-1])


@needs_built
@pytest.mark.parametrize("isa", ["avx512", "avx2", "neon", "baseline"])
def test_forcing_a_variant(isa):
    lines = _info(HETERO_EXEC_ISA=isa)
    if isa not in built:
        assert lines[0] == f"native: off ({library.ISA_ENV}={isa!r}, not built here " \
                           f"(built: {', '.join(built)}))"
    elif not library.cpu_runs()[isa]:
        assert lines[0] == f"native: off ({library.ISA_ENV}={isa!r}, which this CPU does not run)"
    else:
        assert lines[0] == f"native: {isa} ({library.ISA_ENV}={isa})"


def test_off_and_a_wrong_name_are_reasons():
    assert _info(HETERO_EXEC_ISA="off")[0] == "native: off (HETERO_EXEC_ISA='off')"
    assert _info(HETERO_EXEC_ISA="sse9")[0].startswith(
        "native: off (HETERO_EXEC_ISA='sse9' is none of avx512, avx2, neon, baseline")


def test_a_tree_without_a_built_library_runs_on_numpy(monkeypatch, tmp_path):
    from hetero_exec.kernels.native import packed_gemm

    monkeypatch.setattr(library, "HERE", tmp_path)
    library.reset()
    try:
        assert not packed_gemm.available()
        assert library.describe().startswith(f"native: off (no compiled kernels in {tmp_path}")
        import numpy as np

        from hetero_exec.kernels.reduce import Softmax

        x = np.array([[1.0, 2.0, 3.0]], np.float32)
        e = np.exp(x - 3.0)
        np.testing.assert_allclose(Softmax(np, x)[0], e / e.sum(), rtol=1e-6)
    finally:
        monkeypatch.undo()
        library.reset()


@needs_built
def test_signatures_come_from_kernels_h():
    """Every HE_API prototype of kernels.h has its ctypes signature set from the
    library's table, with the argument count of the prototype."""
    lib = library.lib()
    header = (Path(library.__file__).parent / "kernels.h").read_text()
    protos = re.findall(r"^HE_API\s+.+?\b(he_\w+)\((.*)\);$", header, re.M)
    assert len(protos) >= 19
    for name, args in protos:
        n = 0 if args.strip() in ("", "void") else args.count(",") + 1
        assert len(getattr(lib, name).argtypes) == n, name
    assert library.constant("NR") == 32 and library.constant("ACT_RELU") == 1
