"""Runs of element-wise float steps merged into one step at compile time.

On small tensors an element-wise node costs its dispatch (a run-loop step, a kernel
call, a fresh array), not its arithmetic. A run is a chain of such steps where each
intermediate is read by the next step only (and is no output, constant or capture):
the merged step calls the same ufuncs in order, the first into a fresh array and the
others in place on it. The graph, the placement and its reports are untouched; only
the plan has fewer steps.

A step joins a run when its op is in the tables below (the float kernels of
kernels/elementwise.py, no attributes), every value it touches has the run's float
dtype, its output has the run's declared shape, and a binary op's other operand
broadcasts into that shape.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from hetero_exec.errors import HeteroExecError, KernelError
from hetero_exec.ir.graph import Graph, Node

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def _sigmoid_into(xp, t, out):
    """1 / (1 + exp(-t)), the Sigmoid kernel's steps, written into ``out``."""
    with np.errstate(over="ignore"):
        xp.negative(t, out=out)
        xp.exp(out, out=out)
    out += 1
    return xp.reciprocal(out, out=out)


def _unary(name: str, *extra):
    def apply(xp, t, out):
        return getattr(xp, name)(t, *extra, out=out)

    return apply


#: op -> fn(xp, value, out): out is None for the run's first step (a fresh array)
UNARY: dict[str, Callable] = {
    "Relu": _unary("maximum", 0), "Neg": _unary("negative"), "Abs": _unary("absolute"),
    "Exp": _unary("exp"), "Log": _unary("log"), "Sqrt": _unary("sqrt"),
    "Reciprocal": _unary("reciprocal"), "Tanh": _unary("tanh"), "Sin": _unary("sin"),
    "Cos": _unary("cos"), "Ceil": _unary("ceil"), "Floor": _unary("floor"),
    "Sigmoid": lambda xp, t, out: _sigmoid_into(xp, t, xp.empty_like(t) if out is None else out),
}
#: op -> ufunc name (float Div is true division, as the Div kernel computes it)
BINARY: dict[str, str] = {"Add": "add", "Sub": "subtract", "Mul": "multiply", "Div": "divide",
                          "Max": "maximum", "Min": "minimum"}
_MIN_RUN = 2


def merge_runs(graph: Graph, raw: list[tuple], keep: set[int], plan_xp: Any,
               slot_name: dict[int, str]) -> list[tuple]:
    """``raw`` (the compiler's step tuples, in order) with each run merged into one
    tuple at the place of its last step."""
    readers: dict[int, list[int]] = {}
    for idx, (_, _, ins, caps, *_rest) in enumerate(raw):
        for s in ins + caps:
            readers.setdefault(s, []).append(idx)
    merged: dict[int, tuple | None] = {}  # step index -> replacement (None: dropped)
    for i in range(len(raw)):
        if i in merged:
            continue
        run = _run_from(graph, raw, i, readers, keep, plan_xp, slot_name, merged)
        if run is None or len(run) < _MIN_RUN:
            continue
        for j in run[:-1]:
            merged[j] = None
        merged[run[-1]] = _merged_step(graph, raw, run, slot_name)
    if not merged:
        return raw
    return [merged.get(i, st) for i, st in enumerate(raw) if merged.get(i, st) is not None]


def _eligible(graph: Graph, st: tuple, plan_xp: Any) -> str | None:
    """The op of an element-wise float step (None when it cannot join a run)."""
    node, _fn, ins, caps, outs, kwargs, wants_scope, step_xp = st
    if wants_scope or caps or kwargs or step_xp is not plan_xp or len(outs) != 1:
        return None
    if node.attrs or node.canonical_domain != "ai.onnx" or node.subgraphs:
        return None
    op = node.op_type
    if not ((op in UNARY and len(ins) == 1) or (op in BINARY and len(ins) == 2)):
        return None
    dt = graph.value(node.outputs[0]).dtype
    if dt not in _FLOATS or any(graph.value(i).dtype != dt for i in node.inputs):
        return None
    return op


def _shape(graph: Graph, name: str):
    v = graph.value(name)
    if v.shape is None or any(d is None for d in v.shape):
        return None
    return tuple(v.shape)


def _fits(other, shape) -> bool:
    return other is not None and len(other) <= len(shape) and all(
        d == 1 or d == r for d, r in zip(other[::-1], shape[::-1]))


def _run_from(graph, raw, i, readers, keep, plan_xp, slot_name, merged) -> list[int] | None:
    if _eligible(graph, raw[i], plan_xp) is None:
        return None
    node = raw[i][0]
    shape = _shape(graph, node.outputs[0])
    if shape is None:
        return None
    run = [i]
    out = raw[i][4][0]
    while out not in keep and len(readers.get(out, ())) == 1:
        j = readers[out][0]
        nxt = raw[j]
        if j in merged or _eligible(graph, nxt, plan_xp) is None or nxt[2].count(out) != 1:
            break
        if _shape(graph, nxt[0].outputs[0]) != shape:
            break
        if len(nxt[2]) == 2:
            other = nxt[2][1 - nxt[2].index(out)]
            if not _fits(_shape(graph, slot_name[other]), shape):
                break
        run.append(j)
        out = nxt[4][0]
    return run


def _merged_step(graph: Graph, raw: list[tuple], run: list[int], slot_name: dict[int, str]) -> tuple:
    first = raw[run[0]]
    last = raw[run[-1]]
    ins = list(first[2])
    plan: list[tuple] = [(first[0], first[0].op_type, -1 if len(first[2]) == 1 else 0)]
    prev = first[4][0]
    for j in run[1:]:
        node, _fn, s_in, *_rest = raw[j]
        if len(s_in) == 1:
            plan.append((node, node.op_type, -1))
        else:
            side = s_in.index(prev)
            ins.append(s_in[1 - side])
            plan.append((node, node.op_type, side))
        prev = raw[j][4][0]
    fn = _run_fn(tuple(plan), binary_first=len(first[2]) == 2)
    return (first[0], fn, tuple(ins), (), last[4], {}, False, first[7])


def _run_fn(plan: Sequence[tuple], binary_first: bool) -> Callable:
    (node0, op0, _), rest = plan[0], plan[1:]
    steps = tuple((node, UNARY.get(op), BINARY.get(op), side) for node, op, side in rest)
    first_unary = UNARY.get(op0)
    first_binary = BINARY.get(op0)

    def elementwise_run(xp, *args):
        try:
            if binary_first:
                t = xp.asarray(getattr(xp, first_binary)(args[0], args[1]))
                k = 2
            else:
                t = xp.asarray(first_unary(xp, args[0], None))
                k = 1
        except HeteroExecError:
            raise
        except Exception as e:
            raise _error(node0, e, args[:k]) from e
        for node, unary, binary, side in steps:
            try:
                if unary is not None:
                    t = unary(xp, t, t)
                else:
                    other = args[k]
                    k += 1
                    f = getattr(xp, binary)
                    out = t if np.broadcast_shapes(t.shape, other.shape) == t.shape else None
                    t = f(t, other, out=out) if side == 0 else f(other, t, out=out)
            except Exception as e:
                raise _error(node, e, (t,)) from e
        return (t,)

    elementwise_run.__name__ = "+".join(op for _, op, _ in plan)
    return elementwise_run


def _error(node: Node, e: Exception, args) -> KernelError:
    shapes = ", ".join(f"{getattr(a, 'dtype', type(a).__name__)}{list(getattr(a, 'shape', ()))}"
                       for a in args)
    return KernelError(node.identity, node.op_class, f"{type(e).__name__}: {e}; inputs: {shapes}")
