"""Real CuPy, import level: CI installs ``cupy-cuda12x`` and has no CUDA driver.

* the `gpu` provider is unavailable with CuPy's own reason, and a session falls back (or
  fails under require_gpu) as SEMANTICS.md section 1 says;
* sim-gpu's CuPy surface (`providers/_cupy_surface_data.py`) matches the installed CuPy;
* every CuPy function, ufunc method and ndarray method the kernels reach on strict sim-gpu
  over the node suite exists in real CuPy, and each call shape binds to its signature where
  CuPy declares one; every ``xp.<name>`` written in the kernels' source exists too.
"""

from __future__ import annotations

import ast
import functools
import glob
import inspect
import logging
import os

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from hetero_exec import InferenceSession  # noqa: E402
from hetero_exec.errors import HeterogeneousPlacementRequired  # noqa: E402
from hetero_exec.providers import _cupy_surface_data as SURFACE  # noqa: E402
from hetero_exec.providers import cupy_surface, parse_provider, sim_array  # noqa: E402
from tests.placement._models import assert_outputs, chain, ort  # noqa: E402

HINT = "Set HETERO_EXEC_REQUIRE_GPU=1 to reject this fallback"


def _cupy_device_error() -> str | None:
    """CuPy's own words for why no device is usable (None when one is)."""
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - whatever CuPy raises is the reason
        return f"{type(e).__name__}: {e}"
    return None if n > 0 else "0 devices"


no_device = pytest.mark.skipif(_cupy_device_error() is None, reason="a CUDA device is usable here")


def _model():
    return chain(["Relu", "Neg", "Sigmoid"], names=["relu", "neg", "sig"])


def _feed():
    return {"x": np.array([-1.5, 0.25, 2.0, -0.5], np.float32)}


# --- the provider without a driver ----------------------------------------------------------


@no_device
def test_gpu_provider_reports_cupys_reason():
    sup = parse_provider("gpu").available()
    assert not sup
    assert _cupy_device_error() in sup.reason
    assert f"CuPy {cupy.__version__}" in sup.reason  # which CuPy, which package


@no_device
def test_session_falls_back_with_cupys_reason(caplog):
    with caplog.at_level(logging.WARNING, logger="hetero_exec.placement.decide"):
        sess = InferenceSession(_model(), providers=["gpu"])
    assert sess.get_providers() == ["cpu"]
    rep = sess.fallback_report
    assert rep.requested_provider == "gpu:0" and _cupy_device_error() in rep.unavailable
    assert rep.assigned_node_count == 3
    assert any(HINT in r.getMessage() and _cupy_device_error() in r.getMessage()
               for r in caplog.records)
    assert_outputs(sess.run(None, _feed()), ort(_model(), _feed()))


@no_device
def test_session_requiring_the_gpu_fails_with_cupys_reason():
    with pytest.raises(HeterogeneousPlacementRequired) as ei:
        InferenceSession(_model(), providers=["gpu"], require_gpu=True)
    assert _cupy_device_error() in ei.value.report.unavailable
    assert _cupy_device_error() in str(ei.value)


@no_device
def test_hetero_session_with_unusable_gpu_reports_and_runs_on_cpu():
    sess = InferenceSession(_model(), providers=["gpu", "cpu"], hetero=True)
    assert sess.get_providers() == ["cpu"]
    assert _cupy_device_error() in sess.fallback_report.unavailable
    assert_outputs(sess.run(None, _feed()), ort(_model(), _feed()))


# --- sim-gpu's surface is CuPy's ------------------------------------------------------------


def test_surface_data_matches_installed_cupy():
    real = cupy_surface.collect(cupy)
    if real["VERSION"] == SURFACE.VERSION:
        assert real["NAMES"] == SURFACE.NAMES, "regenerate: python -m hetero_exec.providers.cupy_surface"
        assert real["SIGNATURES"] == SURFACE.SIGNATURES
        assert real["UFUNC_METHODS"] == SURFACE.UFUNC_METHODS
    else:  # another CuPy (13.x lacks ~40 of 14.2's names): what the kernels call is
        # checked against the installed CuPy by the tests below
        missing = sorted(n for n in SURFACE.NAMES if n not in real["NAMES"])
        pytest.skip(f"surface data from CuPy {SURFACE.VERSION}; the installed {real['VERSION']} "
                    f"lacks {len(missing)} of its names: {missing[:10]}")


def _resolve(name: str):
    obj = cupy
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _real_signature(name: str, obj) -> inspect.Signature | None:
    try:
        return inspect.signature(obj)
    except (TypeError, ValueError):
        params = cupy_surface._doc_params(obj)
        return cupy_surface.signature(params) if params is not None else None


def _check_call(name: str, nargs: int, kwargs: tuple) -> str | None:
    """Why a recorded call would fail on real CuPy, or None."""
    head, _, method = name.rpartition(".")
    if head and SURFACE.NAMES.get(head) == "ufunc":  # add.at, maximum.reduce...
        if head not in SURFACE.UFUNC_METHODS.get(method, (head,)):
            return f"{method} is not implemented for cupy.{head}"
        return None if callable(getattr(_resolve(head), method, None)) else f"no {name}"
    try:
        obj = _resolve(name)
    except AttributeError:
        return f"cupy.{name} does not exist"
    if type(obj).__name__ == "ufunc":
        bad = set(kwargs) - set(SURFACE.UFUNC_KWARGS)
        if bad or nargs > obj.nargs:
            return f"cupy.{name} takes {obj.nin} inputs and {sorted(SURFACE.UFUNC_KWARGS)}"
        return None
    sig = _real_signature(name, obj)
    if sig is None:
        return None  # CuPy declares none (Cython without an embedded signature)
    params = list(sig.parameters.values())
    if name.startswith(("ndarray.", "random.RandomState.")) and params and params[0].name == "self":
        sig = sig.replace(parameters=params[1:])
    try:
        sig.bind(*([None] * nargs), **dict.fromkeys(kwargs))
    except TypeError as e:
        return f"cupy.{name}{sig}: {e}"
    return None


@functools.lru_cache(maxsize=1)
def node_suite_calls() -> dict:
    """Every call into CuPy's surface made by the kernels over the claimed node-suite cases
    on strict sim-gpu: (name, op, positional count, keyword names) -> count."""
    from tests.backend_cases import node_cases, run_case

    logging.disable(logging.WARNING)
    try:
        with sim_array.recording() as calls:
            for case in node_cases().values():
                try:
                    run_case(case, providers=["sim-gpu"], require_gpu=True)
                except Exception:  # noqa: BLE001 - declines and known failures: not ours here
                    pass
    finally:
        logging.disable(logging.NOTSET)
    return calls


def test_every_call_the_kernels_make_resolves_in_real_cupy(capsys):
    calls = node_suite_calls()
    names = {c[0] for c in calls}
    ops = {c[1] for c in calls if c[1]}
    assert len(names) > 80 and len(ops) > 100  # the recording saw the kernels at work
    problems = {}
    for name, op, nargs, kwargs in calls:
        why = _check_call(name, nargs, kwargs)
        if why:
            problems.setdefault(why, set()).add(op or "<outside kernels>")
    assert not problems, problems
    with capsys.disabled():
        print(f"\nkernels of {len(ops)} ops reach {len(names)} CuPy names "
              f"({len(calls)} call shapes) on strict sim-gpu; all resolve in CuPy {cupy.__version__}")


def _xp_attributes(path: str) -> set[str]:
    """Dotted ``xp.a.b`` chains written in a source file."""
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Attribute):
            parts = []
            cur = node
            while isinstance(cur, ast.Attribute):
                parts.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name) and cur.id == "xp":
                out.add(".".join(reversed(parts)))
    return out


def test_every_xp_name_in_the_kernels_source_exists_in_cupy():
    import hetero_exec.kernels as pkg

    written = set()
    for path in glob.glob(os.path.join(os.path.dirname(pkg.__file__), "*.py")):
        written |= _xp_attributes(path)
    missing = []
    for chain_ in sorted(written):
        obj = cupy
        for part in chain_.split("."):
            if part.startswith("__"):
                break
            if not hasattr(obj, part):
                missing.append(chain_)
                break
            obj = getattr(obj, part)
    assert len(written) > 80
    assert not missing, missing


def test_the_call_check_refuses_what_cupy_would():
    assert _check_call("sum", 1, ("axis", "keepdims")) is None
    assert _check_call("ndarray.astype", 1, ("copy",)) is None
    for bad in (("sum", 1, ("where",)), ("insert", 3, ()), ("maximum.reduce", 1, ()),
                ("ndarray.astype", 1, ("device",)), ("add", 2, ("where",))):
        assert _check_call(*bad), bad
