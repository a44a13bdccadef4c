"""Sequences (Python lists of arrays) and optionals (a value, or None when empty)."""

from __future__ import annotations

from hetero_exec.kernels._common import host_ints, host_scalar, norm_axis
from hetero_exec.kernels.registry import kernel

_HOST = "sequence values live on the coordinator's host"


def _pos(seq, position, insert: bool = False) -> int:
    n = len(seq)
    p = int(host_scalar(position))
    limit = n if insert else n - 1
    if p < -n or p > limit:
        raise IndexError(f"sequence position {p} out of range for length {n}")
    return p + n if p < 0 else p


@kernel("SequenceEmpty", since=11)
def SequenceEmpty(xp, *, dtype=1):
    return ([],)


@kernel("SequenceConstruct", since=11)
def SequenceConstruct(xp, *inputs):
    return (list(inputs),)


@kernel("SequenceInsert", since=11)
def SequenceInsert(xp, seq, tensor, position=None):
    out = list(seq)
    if position is None:
        out.append(tensor)
    else:
        out.insert(_pos(seq, position, insert=True), tensor)
    return (out,)


@kernel("SequenceErase", since=11)
def SequenceErase(xp, seq, position=None):
    out = list(seq)
    del out[-1 if position is None else _pos(seq, position)]
    return (out,)


@kernel("SequenceAt", since=11)
def SequenceAt(xp, seq, position):
    return (seq[_pos(seq, position)],)


@kernel("SequenceLength", since=11)
def SequenceLength(xp, seq):
    return (xp.asarray(len(seq), dtype=xp.int64),)


@kernel("SplitToSequence", since=11, host_inputs=(1,))
def SplitToSequence(xp, x, split=None, *, axis=0, keepdims=1):
    axis = norm_axis(axis, x.ndim)
    if split is None:
        parts = [xp.take(x, i, axis=axis) for i in range(x.shape[axis])]
        if keepdims:
            parts = [xp.expand_dims(p, axis) for p in parts]
        return (parts,)
    sizes = host_ints(split)
    if getattr(split, "ndim", 1) == 0:  # equal chunks of this size, last may be smaller
        step = sizes[0]
        bounds = list(range(step, x.shape[axis], step))
    else:
        bounds = []
        acc = 0
        for s in sizes[:-1]:
            acc += s
            bounds.append(acc)
    return (list(xp.split(x, bounds, axis=axis)),)


@kernel("ConcatFromSequence", since=11)
def ConcatFromSequence(xp, seq, *, axis, new_axis=0):
    if new_axis:
        return (xp.stack(seq, axis=axis if axis >= 0 else axis + seq[0].ndim + 1),)
    return (xp.concatenate(seq, axis=axis),)


@kernel("SequenceMap", since=17)
def SequenceMap(xp, input_sequence, *additional, body, scope):
    n = len(input_sequence)
    outs: list[list] = [[] for _ in range(body.output_count)]
    for i in range(n):
        args = [input_sequence[i]] + [a[i] if isinstance(a, list) else a for a in additional]
        for k, v in enumerate(body.run(scope, args)):
            outs[k].append(v)
    return tuple(outs)


@kernel("Optional", since=15)
def Optional(xp, input=None, *, type=None):
    return (input,)


@kernel("OptionalHasElement", since=15)
def OptionalHasElement(xp, input=None):
    return (xp.asarray(input is not None),)


@kernel("OptionalGetElement", since=15)
def OptionalGetElement(xp, input):
    if input is None:
        raise ValueError("OptionalGetElement on an empty optional")
    return (input,)
