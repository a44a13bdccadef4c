"""Symbolic dims under declared bounds: a plain symbol (``batch``) or an exporter's
compound one (``past_sequence_length + sequence_length``, ``batch_size*sequence_length``),
evaluated from the bounds of the symbols it names. Nothing else is evaluated."""

from __future__ import annotations

import ast
import operator
from typing import Mapping

#: operators whose result grows with both sides (non-negative dims)
_OPS = {ast.Add: operator.add, ast.Mult: operator.mul}
#: a - b, a // b, a / b are at most a; a % b is below b
_LEFT = (ast.Sub, ast.FloorDiv, ast.Div)


def symbols_of(dim: str) -> list[str]:
    """The symbols a dim names (itself when it is not an expression)."""
    try:
        tree = ast.parse(dim, mode="eval")
    except SyntaxError:
        return [dim]
    names = [n.id for n in ast.walk(tree) if isinstance(n, ast.Name)]
    return names or [dim]


def bound_dim(dim: str, bounds: Mapping[str, int]) -> int | None:
    """The dim's ceiling under ``bounds`` (None when a symbol it names has no bound).
    Expressions are + - * // % of bounded symbols and integers (non-negative): the
    ceiling of ``a - b`` or ``a // b`` is ``a``'s, of ``a % b`` ``b``'s less one."""
    if dim in bounds:
        return int(bounds[dim])
    try:
        tree = ast.parse(dim, mode="eval")
    except SyntaxError:
        return None
    try:
        return int(_eval(tree.body, bounds))
    except (KeyError, ValueError, ZeroDivisionError):
        return None


def _eval(node: ast.AST, bounds: Mapping[str, int]) -> int:
    if isinstance(node, ast.Name):
        return int(bounds[node.id])
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp):
        if isinstance(node.op, _LEFT):
            return _eval(node.left, bounds)
        if isinstance(node.op, ast.Mod):
            return max(_eval(node.right, bounds) - 1, 0)
        if type(node.op) in _OPS:
            return _OPS[type(node.op)](_eval(node.left, bounds), _eval(node.right, bounds))
    raise ValueError(f"not a dim expression: {ast.dump(node)}")
