"""If, Loop and Scan: kernels that run compiled bodies (`exec.subgraph.Subgraph`).

``scope`` is the enclosing run's slot list; bodies read their outer-scope captures
from it, so concurrent runs never share state.
"""

from __future__ import annotations

from typing import Any

from hetero_exec.kernels._common import host_scalar
from hetero_exec.kernels.registry import kernel


@kernel("If", since=1)
def If(xp, cond, *, then_branch, else_branch, scope):
    branch = then_branch if bool(host_scalar(cond)) else else_branch
    return tuple(branch.run(scope, ()))


@kernel("Loop", since=1)
def Loop(xp, M=None, cond=None, *v_initial, body, scope):
    n_carried = len(v_initial)
    n_scan = body.output_count - 1 - n_carried
    trip = None if M is None else int(host_scalar(M))
    keep_going = True if cond is None else bool(host_scalar(cond))
    scans: list[list[Any]] = [[] for _ in range(n_scan)]
    iter_dtype = M.dtype if M is not None else xp.int64
    run = body.start(scope)  # one slot list for every iteration
    count = body.reads_input(0)  # the iteration number, made only for a body that reads it
    # the body's inputs, updated in place: (iteration, condition, carried...)
    args = [None, xp.asarray(True)] + list(v_initial)
    it = 0
    while keep_going and (trip is None or it < trip):
        if count:
            args[0] = xp.asarray(it, dtype=iter_dtype)
        outs = run(args)
        keep_going = bool(host_scalar(outs[0]))
        for j in range(n_carried):
            args[2 + j] = outs[1 + j]
        for k in range(n_scan):
            scans[k].append(outs[1 + n_carried + k])
        it += 1
    stacked = []
    for k in range(n_scan):
        if scans[k]:
            stacked.append(xp.stack([xp.asarray(s) for s in scans[k]]))
        else:  # zero-trip: an empty scan output of the body's declared dtype (and shape)
            i = 1 + n_carried + k
            stacked.append(xp.empty((0,) + (body.output_shape(i) or ()), dtype=body.output_dtype(i)))
    return tuple(args[2:] + stacked)


def _scan_once(xp, states, scans, body, scope, num_scan_inputs, in_axes, in_dirs, out_axes, out_dirs):
    n_state = len(states)
    n_out_scan = body.output_count - n_state
    rank_axes = [a + x.ndim if a < 0 else a for a, x in zip(in_axes, scans)]
    length = scans[0].shape[rank_axes[0]] if scans else 0
    results: list[list[Any]] = [[] for _ in range(n_out_scan)]
    run = body.start(scope)
    lead = [(slice(None),) * axis for axis in rank_axes]
    args = list(states) + [None] * len(scans)
    for t in range(length):
        for j, (x, d) in enumerate(zip(scans, in_dirs)):
            args[n_state + j] = x[lead[j] + (length - 1 - t if d == 1 else t,)]  # a view
        outs = run(args)
        for j in range(n_state):
            args[j] = outs[j]
        for k in range(n_out_scan):
            results[k].append(outs[n_state + k])
    # a state passed through unchanged would be a view of a scan input: hand out a copy
    finals = [_own(s, scans) for s in args[:n_state]]
    for k in range(n_out_scan):
        if not results[k]:
            raise ValueError("Scan with zero-length scan inputs cannot infer its scan outputs' shapes")
        parts = results[k][::-1] if out_dirs[k] == 1 else results[k]
        y = xp.stack(parts, axis=0)
        axis = out_axes[k]
        axis = axis + y.ndim if axis < 0 else axis
        if axis != 0:
            y = xp.moveaxis(y, 0, axis)
        finals.append(y)
    return finals


def _own(v, scans):
    """``v``, copied when it is a view into one of ``scans``."""
    base = getattr(v, "base", None)
    if base is not None and any(base is x or base is getattr(x, "base", None) for x in scans):
        return v.copy()
    return v


@kernel("Scan", since=9)
def Scan(xp, *args, body, num_scan_inputs, scan_input_axes=None, scan_input_directions=None,
         scan_output_axes=None, scan_output_directions=None, scope):
    n_state = len(args) - num_scan_inputs
    n_out_scan = body.output_count - n_state
    states, scans = list(args[:n_state]), list(args[n_state:])
    in_axes = scan_input_axes or [0] * num_scan_inputs
    in_dirs = scan_input_directions or [0] * num_scan_inputs
    out_axes = scan_output_axes or [0] * n_out_scan
    out_dirs = scan_output_directions or [0] * n_out_scan
    return tuple(_scan_once(xp, states, scans, body, scope, num_scan_inputs, in_axes, in_dirs,
                            out_axes, out_dirs))


@kernel("Scan", since=8)
def Scan8(xp, sequence_lens, *args, body, num_scan_inputs, directions=None, scope):
    """Opset 8: a batch axis 0 on every input, the scan axis is 1."""
    n_state = len(args) - num_scan_inputs
    n_out_scan = body.output_count - n_state
    dirs = directions or [0] * num_scan_inputs
    batch = args[0].shape[0]
    per_batch = []
    for b in range(batch):
        states = [a[b] for a in args[:n_state]]
        scans = [a[b] for a in args[n_state:]]
        if sequence_lens is not None:
            n = int(host_scalar(sequence_lens[b:b + 1]))
            scans = [s[:n] for s in scans]
        per_batch.append(_scan_once(xp, states, scans, body, scope, num_scan_inputs,
                                    [0] * num_scan_inputs, dirs, [0] * n_out_scan, [0] * n_out_scan))
    return tuple(xp.stack([r[i] for r in per_batch]) for i in range(n_state + n_out_scan))
