"""Imports go one way: no import cycle between the files of ``hetero_exec`` and
``actors``, counting function-level imports too (a lazy import that closes a loop is
still a loop), but not those under ``if TYPE_CHECKING:``.

The cycles known today are listed with where they are; the list may only shrink.
"""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("hetero_exec", "actors")

#: cycles still there (each a sorted tuple of modules); remove one once it is gone
KNOWN = {
    ("hetero_exec.kernels", "hetero_exec.kernels.registry"),
    ("hetero_exec.kernels._conv_bound", "hetero_exec.kernels.conv"),
}


def modules() -> dict[str, str]:
    """Module name -> file, for every file of the packages."""
    out = {}
    for pkg in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(folder, f)
                    name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    out[name.removesuffix(".__init__")] = path
    return out


def _type_checking_only(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        test = getattr(node, "test", None)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in (getattr(test, "id", None),
                                                            getattr(test, "attr", None)):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def imports(mods: dict[str, str]) -> dict[str, set[str]]:
    """Module -> the modules of the packages it imports (at any level of its code)."""

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {}
    for name, path in mods.items():
        with open(path) as f:
            tree = ast.parse(f.read())
        skip = _type_checking_only(tree)
        targets: set[str | None] = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                targets.update(resolve(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = name if path.endswith("__init__.py") else name.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        pkg = pkg.rpartition(".")[0]
                    base = f"{pkg}.{base}" if base else pkg
                for a in node.names:
                    full = f"{base}.{a.name}"
                    targets.add(full if full in mods else resolve(base))
        edges[name] = {t for t in targets if t and t != name}
    return edges


def cycles(edges: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[tuple[str, ...]] = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.add(tuple(sorted(component)))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_cycles_finds_a_loop_through_a_lazy_import():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == {("a", "b", "c")}


def test_no_new_import_cycle_between_files():
    found = cycles(imports(modules()))
    new = sorted(found - KNOWN)
    assert not new, "import cycles between files: " + "; ".join(" <-> ".join(c) for c in new)
