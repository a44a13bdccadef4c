"""Symbolic sizes for memory admission: integer polynomials in the input symbols, and
numeric ranges where an operation is not exact.

A dim the exporter left unnamed (a ``Range``'s length, a ``Reshape`` whose target is
computed from ``Shape``s) is worked out by `placement/shape_bounds.py` as an expression
of the graph inputs' symbols: ``past_sequence_length + sequence_length``, ``4*batch``.
Admission needs only its ceiling under ``dim_bounds``; keeping the expression exact as
long as possible is what lets a ``Reshape``'s ``-1`` divide out (``batch*seq*64`` over
``batch*seq*4`` is ``16``, where ceilings alone would give ``batch*seq*16``).

* `Poly`: a polynomial with integer coefficients over symbol names, exact;
* `Span`: a range ``[lo, hi]`` of integers (``hi`` None: unbounded, ``missing`` names the
  symbol without a bound), for what is not exact: ``min``/``max``, a ``Where`` on a value
  not known before running, a division that leaves a remainder.

Symbols count from 0 up to their bound: the ceiling of ``a - b`` is ``a``'s.

>>> b = {"batch": 4, "seq": 16}
>>> d = (Poly.symbol("batch") * Poly.symbol("seq") * 64).exact_div(Poly.symbol("batch") * 4)
>>> str(d), upper(d, b)
('16*seq', 256)
>>> upper(parse_dim("past + seq", {"past": 100, "seq": 16}), {"past": 100, "seq": 16})
116
"""

from __future__ import annotations

import ast
from collections import Counter
from dataclasses import dataclass
from typing import Mapping, Union

Monomial = tuple[str, ...]  # sorted symbol names, a power as a repeat


@dataclass(frozen=True)
class Poly:
    """Integer polynomial over symbols: ``((monomial, coefficient), ...)``, sorted, no zero
    coefficient; the empty monomial is the constant term."""

    terms: tuple[tuple[Monomial, int], ...] = ()

    @staticmethod
    def of(terms: Mapping[Monomial, int]) -> "Poly":
        return Poly(tuple(sorted((m, c) for m, c in terms.items() if c)))

    @staticmethod
    def const(n: int) -> "Poly":
        return Poly.of({(): int(n)})

    @staticmethod
    def symbol(name: str) -> "Poly":
        return Poly.of({(name,): 1})

    @property
    def constant(self) -> int | None:
        """The value when no symbol is left, else None."""
        if not self.terms:
            return 0
        if len(self.terms) == 1 and self.terms[0][0] == ():
            return self.terms[0][1]
        return None

    def symbols(self) -> set[str]:
        return {s for m, _ in self.terms for s in m}

    def __add__(self, other: "Poly | int") -> "Poly":
        out = dict(self.terms)
        for m, c in _poly(other).terms:
            out[m] = out.get(m, 0) + c
        return Poly.of(out)

    __radd__ = __add__

    def __neg__(self) -> "Poly":
        return Poly(tuple((m, -c) for m, c in self.terms))

    def __sub__(self, other: "Poly | int") -> "Poly":
        return self + (-_poly(other))

    def __rsub__(self, other: "Poly | int") -> "Poly":
        return _poly(other) - self

    def __mul__(self, other: "Poly | int") -> "Poly":
        out: dict[Monomial, int] = {}
        for m1, c1 in self.terms:
            for m2, c2 in _poly(other).terms:
                m = tuple(sorted(m1 + m2))
                out[m] = out.get(m, 0) + c1 * c2
        return Poly.of(out)

    __rmul__ = __mul__

    def exact_div(self, other: "Poly | int") -> "Poly | None":
        """``self / other`` when it is a polynomial (every term divisible by a one-term
        divisor, or a one-term quotient times ``other`` giving ``self`` back), else None."""
        d = _poly(other)
        if not d.terms:
            return None
        if len(d.terms) == 1:
            (dm, dc), = d.terms
            out = {}
            for m, c in self.terms:
                q = _monomial_div(m, dm)
                if q is None or c % dc:
                    return None
                out[q] = c // dc
            return Poly.of(out)
        if not self.terms:
            return Poly()
        (nm, nc), (dm, dc) = self.terms[-1], d.terms[-1]  # highest monomials
        q = _monomial_div(nm, dm)
        if q is None or nc % dc:
            return None
        quotient = Poly.of({q: nc // dc})
        return quotient if quotient * d == self else None

    def __str__(self) -> str:
        if not self.terms:
            return "0"
        parts = []
        for m, c in reversed(self.terms):
            body = "*".join(m)
            text = str(abs(c)) if not m else (body if abs(c) == 1 else f"{abs(c)}*{body}")
            parts.append(("- " if c < 0 else "+ ") + text)
        s = " ".join(parts)
        return s[2:] if s.startswith("+ ") else "-" + s[2:]


@dataclass(frozen=True)
class Span:
    """Integers from ``lo`` to ``hi`` (None: no bound, for want of the symbol ``missing``,
    or of anything known when ``missing`` is None too)."""

    lo: int
    hi: int | None
    missing: str | None = None


Dim = Union[Poly, Span]
UNKNOWN = Span(0, None)
#: the floor of a range with no lower bound
NO_FLOOR = -(2**62)
BOOL = Span(0, 1)


def _poly(x: "Poly | int") -> Poly:
    return x if isinstance(x, Poly) else Poly.const(int(x))


def _monomial_div(m: Monomial, d: Monomial) -> Monomial | None:
    left = Counter(m)
    left.subtract(Counter(d))
    if any(v < 0 for v in left.values()):
        return None
    return tuple(sorted(left.elements()))


def span(d: Dim, bounds: Mapping[str, int]) -> Span:
    """The range of ``d`` with every symbol between 0 and its bound."""
    if isinstance(d, Span):
        return d
    lo = hi = 0
    missing = None
    for m, c in d.terms:
        if not m:
            lo, hi = lo + c, hi + c
            continue
        absent = [s for s in m if s not in bounds]
        if absent:
            if c > 0:
                missing = missing or absent[0]
            else:
                lo = NO_FLOOR
            continue
        top = c
        for s in m:
            top *= int(bounds[s])
        lo, hi = (lo + top, hi) if c < 0 else (lo, hi + top)
    return Span(max(lo, NO_FLOOR), None if missing else hi, missing)


def upper(d: Dim | None, bounds: Mapping[str, int]) -> int | None:
    """The ceiling of ``d`` (None when it has none)."""
    return None if d is None else span(d, bounds).hi


def exact(d: Dim | None) -> Poly | None:
    """``d`` when it is a polynomial, a range of one value as a constant, else None."""
    if isinstance(d, Poly):
        return d
    if isinstance(d, Span) and d.hi is not None and d.lo == d.hi:
        return Poly.const(d.lo)
    return None


def constant(d: Dim | None) -> int | None:
    p = exact(d)
    return None if p is None else p.constant


def join(a: Dim | None, b: Dim | None, bounds: Mapping[str, int]) -> Dim | None:
    """A value that is ``a`` or ``b``."""
    if a is None or b is None:
        return None
    if isinstance(a, Poly) and a == b:
        return a
    sa, sb = span(a, bounds), span(b, bounds)
    hi = None if sa.hi is None or sb.hi is None else max(sa.hi, sb.hi)
    return Span(min(sa.lo, sb.lo), hi, sa.missing or sb.missing)


def arith(op: str, a: Dim | None, b: Dim | None, bounds: Mapping[str, int]) -> Dim | None:
    """``a op b`` for op in + - * // / % min max: exact where it can be."""
    if a is None or b is None:
        return None
    pa, pb = exact(a), exact(b)
    if pa is not None and pb is not None:
        if op == "+":
            return pa + pb
        if op == "-":
            return pa - pb
        if op == "*":
            return pa * pb
        if op in ("//", "/"):
            q = pa.exact_div(pb)
            if q is not None:
                return q
        if pa.constant is not None and pb.constant is not None:
            x, y = pa.constant, pb.constant
            if op in ("//", "/") and y:
                return Poly.const(_trunc_div(x, y) if op == "/" else x // y)
            if op == "%" and y:
                return Poly.const(x % y)
            if op == "min":
                return Poly.const(min(x, y))
            if op == "max":
                return Poly.const(max(x, y))
    return _range_arith(op, span(a, bounds), span(b, bounds))


def _trunc_div(x: int, y: int) -> int:
    q = abs(x) // abs(y)
    return q if (x >= 0) == (y >= 0) else -q


def _range_arith(op: str, a: Span, b: Span) -> Span:
    missing = a.missing or b.missing
    if a.hi is None or b.hi is None:
        return Span(min(a.lo, b.lo, 0), None, missing)
    if op in ("+", "-", "*", "min", "max"):
        fn = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y,
              "min": min, "max": max}[op]
        corners = [fn(x, y) for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
        return Span(min(corners), max(corners))
    if op in ("//", "/") and b.lo > 0:
        corners = [x // y for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
        return Span(min(corners), max(corners))
    if op == "%" and b.lo > 0:
        return Span(0, b.hi - 1)
    return Span(min(a.lo, 0), None)


def parse_dim(dim: str, bounds: Mapping[str, int]) -> Dim:
    """A declared symbolic dim: a symbol, or an exporter's expression of symbols and
    integers (``+ - * // %``); anything else is a symbol named by the whole text."""
    if dim in bounds:
        return Poly.symbol(dim)
    try:
        return _parse(ast.parse(dim, mode="eval").body, bounds)
    except (SyntaxError, ValueError):
        return Poly.symbol(dim)


def _parse(node: ast.AST, bounds: Mapping[str, int]) -> Dim:
    if isinstance(node, ast.Name):
        return Poly.symbol(node.id)
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return Poly.const(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return arith("-", Poly(), _parse(node.operand, bounds), bounds)
    ops = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.FloorDiv: "//", ast.Div: "//",
           ast.Mod: "%"}
    if isinstance(node, ast.BinOp) and type(node.op) in ops:
        return arith(ops[type(node.op)], _parse(node.left, bounds), _parse(node.right, bounds),
                     bounds)
    raise ValueError(f"not a dim expression: {ast.dump(node)}")
