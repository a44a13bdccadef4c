"""What CuPy exposes: its names, what each is, and the signatures it declares.

sim-gpu's strict array module (`sim_array`) exposes exactly this surface, so a kernel
that reaches a name CuPy lacks, or calls one with a keyword CuPy does not take, fails
on sim-gpu as it would on a GPU. The data lives in `_cupy_surface_data` (generated
from a real CuPy, whose import works without a CUDA driver)::

    python -m hetero_exec.providers.cupy_surface          # rewrites _cupy_surface_data.py

Each entry of ``NAMES`` maps a dotted name (``"sum"``, ``"linalg.inv"``,
``"ndarray.astype"``, ``"random.RandomState.uniform"``) to its kind:

* ``numpy``: the very object NumPy has (CuPy re-exports dtypes, ``finfo``, ``pi``...);
* ``ufunc``, ``gufunc``, ``function``, ``class``, ``module``, ``constant``;
* ``method`` / ``attribute``: members of ``ndarray`` and ``random.RandomState``.

``SIGNATURES`` holds ``(name, kind, has_default)`` per parameter where CuPy declares
one (``inspect.signature`` for Python functions, the embedded signature line of
Cython methods' docstrings otherwise).
"""

from __future__ import annotations

import inspect
import os
import pprint
import re
import sys
import types
from typing import Any

import numpy as np

#: the submodules the strict namespace mirrors (the others are CUDA-specific)
SUBMODULES = ("linalg", "fft", "random", "lib", "lib.stride_tricks")
#: classes whose members are listed too
CLASSES = ("ndarray", "random.RandomState")

#: ufunc methods CuPy implements only for some ufuncs (cupy/_core/_kernel.pyx, v14:
#: ``reduce``/``accumulate`` dispatch to sum/prod and cumsum/cumprod, ``reduceat`` to
#: an add-only routine, and raise NotImplementedError for every other ufunc); ``at`` is
#: read from the ufuncs' ``_scatter_op``; ``outer`` works for all
UFUNC_METHODS_FIXED = {"reduce": ("add", "multiply"), "accumulate": ("add", "multiply"),
                       "reduceat": ("add",)}
#: keywords a CuPy ufunc call accepts (``ufunc.__call__`` pops these, refuses others)
UFUNC_KWARGS = ("out", "dtype", "casting")

_KIND_CODES = {
    inspect.Parameter.POSITIONAL_ONLY: "PO",
    inspect.Parameter.POSITIONAL_OR_KEYWORD: "P",
    inspect.Parameter.VAR_POSITIONAL: "V",
    inspect.Parameter.KEYWORD_ONLY: "K",
    inspect.Parameter.VAR_KEYWORD: "VK",
}
_CODE_KINDS = {v: k for k, v in _KIND_CODES.items()}


def kind_of(obj: Any, np_obj: Any) -> str:
    if np_obj is not None and obj is np_obj:
        return "numpy"
    if isinstance(obj, types.ModuleType):
        return "module"
    tname = type(obj).__name__
    if tname == "ufunc":
        return "ufunc"
    if tname == "_GUFunc":
        return "gufunc"
    if isinstance(obj, type):
        return "class"
    if callable(obj):
        return "function"
    return "constant"


def _python_params(obj: Any) -> tuple | None:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    return tuple((p.name, _KIND_CODES[p.kind], p.default is not p.empty)
                 for p in sig.parameters.values())


_DOC_SIG = re.compile(r"^[\w.]+\((.*)\)(\s*->.*)?$")


def _doc_params(obj: Any) -> tuple | None:
    """Parameters from a Cython docstring's first line, ``self`` dropped."""
    doc = (getattr(obj, "__doc__", None) or "").strip().splitlines()
    m = _DOC_SIG.match(doc[0].strip()) if doc else None
    if m is None:
        return None
    out = []
    kw_only = False
    for raw in _split_top(m.group(1)):
        raw = raw.strip()
        if not raw or raw == "/":
            continue
        if raw == "*":
            kw_only = True
            continue
        if raw.startswith("**"):
            out.append((raw[2:], "VK", False))
            continue
        if raw.startswith("*"):
            out.append((raw[1:], "V", False))
            kw_only = True
            continue
        head, eq, _default = raw.partition("=")
        name = head.split()[-1].lstrip("*")  # drop Cython types: "int axis=-1"
        if name == "self":
            continue
        out.append((name, "K" if kw_only else "P", bool(eq)))
    return tuple(out)


def _split_top(s: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in s:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return parts


def collect(cupy: Any) -> dict[str, Any]:
    """The surface of an imported ``cupy`` module (no CUDA driver needed)."""
    names: dict[str, str] = {}
    sigs: dict[str, tuple] = {}

    def walk(prefix: str, mod: Any, np_mod: Any) -> None:
        for n in sorted(dir(mod)):
            if n.startswith("_") or n == "annotations":
                continue
            obj = getattr(mod, n)
            full = prefix + n
            kind = kind_of(obj, getattr(np_mod, n, None) if np_mod is not None else None)
            if kind == "module" and full not in SUBMODULES:
                continue
            names[full] = kind
            if kind in ("function", "class"):
                params = _python_params(obj) or _doc_params(obj)
                if params is not None:
                    sigs[full] = params

    walk("", cupy, np)
    for sub in SUBMODULES:
        mod, np_mod = cupy, np
        for part in sub.split("."):
            mod = getattr(mod, part)
            np_mod = getattr(np_mod, part, None)
        walk(sub + ".", mod, np_mod)
    for cls_name in CLASSES:
        cls = cupy
        for part in cls_name.split("."):
            cls = getattr(cls, part)
        for n in sorted(dir(cls)):
            if n.startswith("_"):
                continue
            member = getattr(cls, n)
            full = f"{cls_name}.{n}"
            is_method = callable(member) and not isinstance(member, (property, type))
            names[full] = "method" if is_method else "attribute"
            if is_method:
                params = _python_params(member) if not _is_cython(member) else None
                params = params if params is not None else _doc_params(member)
                if params is not None:
                    sigs[full] = tuple(p for p in params if p[0] != "self")
    ufuncs = [n for n, k in names.items() if k == "ufunc" and "." not in n]
    methods = dict(UFUNC_METHODS_FIXED)
    methods["at"] = tuple(n for n in ufuncs if getattr(getattr(cupy, n), "_scatter_op", None) is not None)
    return {"VERSION": cupy.__version__, "NAMES": names, "SIGNATURES": sigs,
            "UFUNC_METHODS": methods, "UFUNC_KWARGS": UFUNC_KWARGS}


def _is_cython(obj: Any) -> bool:
    return type(obj).__name__ in ("method_descriptor", "cython_function_or_method", "getset_descriptor")


def signature(params: tuple) -> inspect.Signature:
    """An inspect.Signature from ``(name, kind, has_default)`` triples (defaults None)."""
    out, seen_default = [], False
    for name, code, has_default in params:
        kind = _CODE_KINDS[code]
        if kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            # a Cython line may list a default-less parameter after a defaulted one
            has_default = has_default or seen_default
            seen_default = seen_default or has_default
        default = None if has_default and kind not in (
            inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD) else inspect.Parameter.empty
        out.append(inspect.Parameter(name, kind, default=default))
    return inspect.Signature(out)


DATA_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_cupy_surface_data.py")


def write(data: dict[str, Any], path: str = DATA_FILE) -> None:
    with open(path, "w") as f:
        f.write('"""Generated by `python -m hetero_exec.providers.cupy_surface` from '
                f'CuPy {data["VERSION"]}; do not edit."""\n\n')
        f.write("# fmt: off\n")
        for key in ("VERSION", "UFUNC_KWARGS", "UFUNC_METHODS", "NAMES", "SIGNATURES"):
            f.write(f"{key} = {pprint.pformat(data[key], width=100, compact=True)}\n")


def main() -> int:
    import cupy  # noqa: PLC0415 - only the generator needs the real module

    data = collect(cupy)
    write(data)
    print(f"CuPy {data['VERSION']}: {len(data['NAMES'])} names, "
          f"{len(data['SIGNATURES'])} signatures -> {DATA_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
