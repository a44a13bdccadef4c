"""Checking run() feeds against the graph's declared inputs (SEMANTICS.md section 3).

Every check runs before anything is dispatched, and names what is wrong.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from hetero_exec.errors import (
    DimMismatchError,
    DtypeMismatchError,
    MissingInputError,
    RankMismatchError,
    SymbolConflictError,
    UnknownInputError,
)
from hetero_exec.ir.graph import Graph, Value


class FeedChecker:
    """Compiled once per session: the declared inputs and which of them are required."""

    def __init__(self, graph: Graph):
        self.names = list(graph.inputs)
        self.values: dict[str, Value] = {n: graph.value(n) for n in self.names}
        self.required = [n for n in self.names if n not in graph.initializers]
        self.known = set(self.names)

    def check(self, feed: Mapping[str, Any]) -> tuple[list[Any], dict[str, int]]:
        """The feeds in input order (None for omitted overrides) and the symbol bindings."""
        for name in feed:
            if name not in self.known:
                raise UnknownInputError(name, self.names)
        for name in self.required:
            if name not in feed:
                raise MissingInputError(name)
        symbols: dict[str, int] = {}
        ordered: list[Any] = []
        for name in self.names:
            v = feed.get(name)
            if v is not None:
                v = self._check_one(name, v, symbols)
            ordered.append(v)
        return ordered, symbols

    def _check_one(self, name: str, v: Any, symbols: dict[str, int]) -> Any:
        decl = self.values[name]
        if decl.kind != "tensor":
            return v  # sequences, maps, optionals pass through as given
        if not hasattr(v, "dtype") or not hasattr(v, "shape"):
            v = np.asarray(v)
        expected = decl.dtype
        if expected is not None and v.dtype != expected:
            if not (expected == np.dtype(object) and v.dtype.kind in "USO"):
                raise DtypeMismatchError(name, decl.dtype_name, str(v.dtype))
        if decl.shape is None:
            return v
        if len(decl.shape) != v.ndim:
            raise RankMismatchError(name, decl.shape, v.shape)
        for want, got in zip(decl.shape, v.shape):
            if isinstance(want, int):
                if want != got:
                    raise DimMismatchError(name, decl.shape, v.shape)
            elif isinstance(want, str):
                bound = symbols.setdefault(want, got)
                if bound != got:
                    raise SymbolConflictError(want, bound, got, f"input {name!r}")
        return v
