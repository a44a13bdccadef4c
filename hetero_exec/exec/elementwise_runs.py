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

from typing import Any, Callable

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


#: op -> (ufunc name, constant second operand or None); Sigmoid has its own steps
UNARY: dict[str, tuple[str, Any]] = {
    "Relu": ("maximum", 0), "Neg": ("negative", None), "Abs": ("absolute", None),
    "Exp": ("exp", None), "Log": ("log", None), "Sqrt": ("sqrt", None),
    "Reciprocal": ("reciprocal", None), "Tanh": ("tanh", None), "Sin": ("sin", None),
    "Cos": ("cos", None), "Ceil": ("ceil", None), "Floor": ("floor", None),
    "Sigmoid": ("sigmoid", None),
}
#: op -> ufunc name (float Div is true division, as the Div kernel computes it)
BINARY: dict[str, str] = {"Add": "add", "Sub": "subtract", "Mul": "multiply", "Div": "divide",
                          "Max": "maximum", "Min": "minimum"}
#: how a step of a run applies: unary, unary with a constant, binary with the running
#: value first or second, Sigmoid
UNARY_STEP, UNARY_ARG_STEP, VALUE_FIRST, VALUE_SECOND, SIGMOID_STEP = range(5)
_UNARY, _UNARY_ARG, _VALUE_FIRST, _VALUE_SECOND, _SIGMOID = range(5)
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
        merged[run[-1]] = _merged_step(graph, raw, run, slot_name, plan_xp)
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


def _merged_step(graph: Graph, raw: list[tuple], run: list[int], slot_name: dict[int, str],
                 xp: Any) -> tuple:
    first = raw[run[0]]
    last = raw[run[-1]]
    ins = list(first[2])
    prev = first[4][0]
    steps = []
    for j in run[1:]:
        node, _fn, s_in, *_rest = raw[j]
        op = node.op_type
        if op in UNARY:
            name, arg = UNARY[op]
            kind = _SIGMOID if op == "Sigmoid" else _UNARY if arg is None else _UNARY_ARG
            steps.append((kind, None if kind == _SIGMOID else getattr(xp, name), arg))
        else:
            side = s_in.index(prev)
            ins.append(s_in[1 - side])
            steps.append((_VALUE_FIRST if side == 0 else _VALUE_SECOND, getattr(xp, BINARY[op]), None))
        prev = raw[j][4][0]
    nodes = tuple(raw[j][0] for j in run)
    fn = _run_fn(first[0], len(first[2]) == 2, tuple(steps), nodes, xp)
    return (first[0], fn, tuple(ins), (), last[4], {}, False, first[7])


def _run_fn(node0: Node, binary_first: bool, steps: tuple, nodes: tuple, xp: Any) -> Callable:
    """The merged step. Its ufuncs are bound here (a cpu plan's array module is numpy);
    the operands' shapes were checked against the run's at compile time, so every step
    after the first writes into the first one's fresh array."""
    op0 = node0.op_type
    if binary_first:
        first = getattr(xp, BINARY[op0])
    elif op0 == "Sigmoid":
        first = None
    else:
        name, arg0 = UNARY[op0]
        first = getattr(xp, name)

    def elementwise_run(xp_, *args):
        i = 0
        try:
            if binary_first:
                t = xp.asarray(first(args[0], args[1]))
                k = 2
            elif first is None:
                t = _sigmoid_into(xp, args[0], xp.empty_like(args[0]))
                k = 1
            else:
                t = xp.asarray(first(args[0]) if arg0 is None else first(args[0], arg0))
                k = 1
            for i, (kind, f, arg) in enumerate(steps, 1):
                if kind == _UNARY:
                    f(t, out=t)
                elif kind == _UNARY_ARG:
                    f(t, arg, out=t)
                elif kind == _VALUE_FIRST:
                    f(t, args[k], out=t)
                    k += 1
                elif kind == _VALUE_SECOND:
                    f(args[k], t, out=t)
                    k += 1
                else:
                    _sigmoid_into(xp, t, t)
        except HeteroExecError:
            raise
        except Exception as e:
            raise _error(nodes[i], e, args) from e
        return (t,)

    elementwise_run.__name__ = "+".join(n.op_type for n in nodes)
    # what the run computes, for a bound program to lower (exec/program): the first op,
    # then each later op with how the running value enters it
    elementwise_run.merged = (op0, tuple((n.op_type, kind) for n, (kind, _f, _a)
                                         in zip(nodes[1:], steps)))
    return elementwise_run


def _error(node: Node, e: Exception, args) -> KernelError:
    shapes = ", ".join(f"{getattr(a, 'dtype', type(a).__name__)}{list(getattr(a, 'shape', ()))}"
                       for a in args)
    return KernelError(node.identity, node.op_class, f"{type(e).__name__}: {e}; inputs: {shapes}")
