"""If, Loop and Scan: kernels that run compiled bodies (`exec.plan.Subgraph`).

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
    carried = list(v_initial)
    scans: list[list[Any]] = [[] for _ in range(n_scan)]
    it = 0
    iter_dtype = M.dtype if M is not None else xp.int64
    while keep_going and (trip is None or it < trip):
        outs = body.run(scope, [xp.asarray(it, dtype=iter_dtype), xp.asarray(keep_going)] + carried)
        keep_going = bool(host_scalar(outs[0]))
        carried = list(outs[1:1 + n_carried])
        for k in range(n_scan):
            scans[k].append(outs[1 + n_carried + k])
        it += 1
    stacked = []
    for k in range(n_scan):
        if scans[k]:
            stacked.append(xp.stack([xp.asarray(s) for s in scans[k]]))
        else:  # zero-trip: an empty scan output of the body's declared dtype
            stacked.append(xp.empty((0,), dtype=body.output_dtype(1 + n_carried + k)))
    return tuple(carried + stacked)


def _scan_once(xp, states, scans, body, scope, num_scan_inputs, in_axes, in_dirs, out_axes, out_dirs):
    n_state = len(states)
    n_out_scan = body.output_count - n_state
    rank_axes = [a + x.ndim if a < 0 else a for a, x in zip(in_axes, scans)]
    length = scans[0].shape[rank_axes[0]] if scans else 0
    results: list[list[Any]] = [[] for _ in range(n_out_scan)]
    for t in range(length):
        slices = []
        for x, axis, d in zip(scans, rank_axes, in_dirs):
            idx = length - 1 - t if d == 1 else t
            slices.append(xp.take(x, idx, axis=axis))
        outs = body.run(scope, list(states) + slices)
        states = list(outs[:n_state])
        for k in range(n_out_scan):
            results[k].append(outs[n_state + k])
    finals = list(states)
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
