"""Recurrent layers: RNN, GRU, LSTM.

All directions run in one time loop: the input projection X @ W^T is one matmul over
every step up front, and each step does one batched matmul over the direction axis.
``sequence_lens`` is honoured without Python loops over the batch: the reverse
direction reads each sequence's valid prefix backwards through a per-batch gather,
and steps past a sequence's end keep the hidden state and emit zeros.
"""

from __future__ import annotations

from typing import Any, Callable

from hetero_exec.kernels.registry import kernel

# activation name -> (number of alphas, number of betas, default alpha, default beta)
_ACT_PARAMS: dict[str, tuple[int, int, float, float]] = {
    "relu": (0, 0, 0.0, 0.0),
    "tanh": (0, 0, 0.0, 0.0),
    "sigmoid": (0, 0, 0.0, 0.0),
    "affine": (1, 1, 1.0, 0.0),
    "leakyrelu": (1, 0, 0.01, 0.0),
    "thresholdedrelu": (1, 0, 1.0, 0.0),
    "scaledtanh": (1, 1, 1.0, 1.0),
    "hardsigmoid": (1, 1, 0.2, 0.5),
    "elu": (1, 0, 1.0, 0.0),
    "softsign": (0, 0, 0.0, 0.0),
    "softplus": (0, 0, 0.0, 0.0),
}


def _sigmoid(xp, x):
    # 1/(1+exp(-x)) overflows harmlessly to 0 for very negative x; tanh form avoids the warning
    return (xp.tanh(x * 0.5) + 1) * 0.5


def _make_act(xp, name: str, alpha: float, beta: float) -> Callable[[Any], Any]:
    n = name.lower()
    if n == "tanh":
        return xp.tanh
    if n == "sigmoid":
        return lambda x: _sigmoid(xp, x)
    if n == "relu":
        return lambda x: xp.maximum(x, 0)
    if n == "affine":
        return lambda x: x * alpha + beta
    if n == "leakyrelu":
        return lambda x: xp.where(x >= 0, x, x * alpha)
    if n == "thresholdedrelu":
        return lambda x: xp.where(x > alpha, x, 0).astype(x.dtype)
    if n == "scaledtanh":
        return lambda x: xp.tanh(x * beta) * alpha
    if n == "hardsigmoid":
        return lambda x: xp.clip(x * alpha + beta, 0, 1)
    if n == "elu":
        return lambda x: xp.where(x >= 0, x, (xp.exp(xp.minimum(x, 0)) - 1) * alpha)
    if n == "softsign":
        return lambda x: x / (1 + xp.abs(x))
    if n == "softplus":
        return lambda x: xp.logaddexp(x, 0).astype(x.dtype)
    raise ValueError(f"unsupported RNN activation function {name!r}")


def _activations(xp, names, alphas, betas, defaults, num_directions):
    """Per-direction activation lists; alphas/betas are consumed in order by the
    functions that take them (as onnxruntime does)."""
    per_dir = len(defaults)
    if not names:
        names = list(defaults) * num_directions
    elif len(names) == per_dir and num_directions == 2:
        names = list(names) * 2
    if len(names) != per_dir * num_directions:
        raise ValueError(f"expected {per_dir * num_directions} activations, got {len(names)}")
    alphas, betas = list(alphas or []), list(betas or [])
    ai = bi = 0
    funcs = []
    cache: dict[tuple[str, float, float], Callable[[Any], Any]] = {}
    for name in names:
        key = name.lower()
        if key not in _ACT_PARAMS:
            raise ValueError(f"unsupported RNN activation function {name!r}")
        na, nb, da, db = _ACT_PARAMS[key]
        a, b = da, db
        if na:
            if ai < len(alphas):
                a = alphas[ai]
            ai += 1
        if nb:
            if bi < len(betas):
                b = betas[bi]
            bi += 1
        spec = (key, float(a), float(b))
        if spec not in cache:  # equal specs share one function: both directions apply it at once
            cache[spec] = _make_act(xp, name, float(a), float(b))
        funcs.append(cache[spec])
    return [funcs[d * per_dir : (d + 1) * per_dir] for d in range(num_directions)]


class _Prep:
    """Inputs normalised to time-major layout, shared by the three cells."""

    def __init__(self, xp, X, W, R, sequence_lens, direction, layout, initial_states):
        self.xp = xp
        if direction not in ("forward", "reverse", "bidirectional"):
            raise ValueError(f"unknown direction {direction!r}")
        self.num_directions = 2 if direction == "bidirectional" else 1
        if W.shape[0] != self.num_directions:
            raise ValueError(
                f"direction={direction!r} needs {self.num_directions} directions in W, "
                f"got {W.shape[0]}"
            )
        self.layout = layout
        if layout == 1:
            X = xp.swapaxes(X, 0, 1)
            initial_states = [None if s is None else xp.swapaxes(s, 0, 1) for s in initial_states]
        self.X = X
        self.dtype = X.dtype
        self.seq_len, self.batch = X.shape[0], X.shape[1]
        self.hidden = R.shape[-1]
        self.reverse_dirs = [
            d
            for d in range(self.num_directions)
            if direction == "reverse" or (direction == "bidirectional" and d == 1)
        ]
        self.initial_states = [
            xp.zeros((self.num_directions, self.batch, self.hidden), dtype=self.dtype)
            if s is None
            else s.astype(self.dtype, copy=False)
            for s in initial_states
        ]
        self.mask = None
        self.rev_index = None
        if sequence_lens is not None:
            lens = sequence_lens.astype(xp.int64).reshape(1, -1)
            t = xp.arange(self.seq_len, dtype=xp.int64).reshape(-1, 1)
            self.mask = (t < lens)[:, :, None]  # (seq, batch, 1)
            # within each sequence's valid prefix, time runs backwards; padding stays put
            self.rev_index = xp.where(t < lens, lens - 1 - t, t)  # (seq, batch)

    def inputs_per_direction(self, W):
        """(seq, dirs, batch, gates*hidden) = X @ W^T, each direction in its own time order."""
        xp = self.xp
        x2 = xp.ascontiguousarray(self.X).reshape(self.seq_len * self.batch, self.X.shape[2])
        wt = xp.ascontiguousarray(xp.swapaxes(W, 1, 2).astype(self.dtype, copy=False))
        proj = xp.matmul(x2[None], wt)  # (dirs, seq*batch, G): one BLAS call per direction
        proj = proj.reshape(self.num_directions, self.seq_len, self.batch, wt.shape[-1])
        for d in self.reverse_dirs:
            if self.rev_index is None:
                proj[d] = proj[d][::-1].copy()
            else:
                proj[d] = xp.take_along_axis(proj[d], self.rev_index[:, :, None], axis=0)
        return xp.swapaxes(proj, 0, 1)

    def finish(self, ys):
        """Stack per-step outputs (dirs, batch, hidden) into Y in the requested layout."""
        xp = self.xp
        if not ys:
            Y = xp.zeros((0, self.num_directions, self.batch, self.hidden), dtype=self.dtype)
        else:
            Y = xp.stack(ys, axis=0)  # (seq, dirs, batch, hidden), freshly allocated
        for d in self.reverse_dirs:
            if self.rev_index is None:
                Y[:, d] = Y[::-1, d].copy()
            else:
                Y[:, d] = xp.take_along_axis(Y[:, d], self.rev_index[:, :, None], axis=0)
        if self.layout == 1:
            Y = xp.transpose(Y, (2, 0, 1, 3))
        return Y

    def state_out(self, s):
        return self.xp.swapaxes(s, 0, 1) if self.layout == 1 else s

    def step_mask(self, t):
        return None if self.mask is None else self.mask[t][None]  # (1, batch, 1)


def _clip(xp, x, clip):
    return x if clip is None else xp.clip(x, -clip, clip)


def _per_dir(xp, acts, idx, x):
    fs = [a[idx] for a in acts]
    if all(f is fs[0] for f in fs):
        return fs[0](x)
    return xp.stack([f(x[d]) for d, f in enumerate(fs)], axis=0)


def _bias(xp, B, num_directions, width, dtype):
    if B is None:
        z = xp.zeros((num_directions, width), dtype=dtype)
        return z, z
    B = B.astype(dtype, copy=False)
    return B[:, :width], B[:, width:]


@kernel("RNN", since=(1, 7))
def RNN(
    xp,
    X,
    W,
    R,
    B=None,
    sequence_lens=None,
    initial_h=None,
    *,
    activation_alpha=None,
    activation_beta=None,
    activations=None,
    clip=None,
    direction="forward",
    hidden_size=None,
    layout=0,
    output_sequence=0,
    num_outputs=2,
):
    p = _Prep(xp, X, W, R, sequence_lens, direction, layout, [initial_h])
    acts = _activations(
        xp, activations, activation_alpha, activation_beta, ("Tanh",), p.num_directions
    )
    wb, rb = _bias(xp, B, p.num_directions, p.hidden, p.dtype)
    xproj = p.inputs_per_direction(W) + (wb + rb)[None, :, None, :]
    Rt = xp.ascontiguousarray(xp.swapaxes(R, 1, 2).astype(p.dtype, copy=False))
    H = p.initial_states[0]
    ys = []
    for t in range(p.seq_len):
        Hn = _per_dir(xp, acts, 0, _clip(xp, xproj[t] + xp.matmul(H, Rt), clip))
        m = p.step_mask(t)
        if m is not None:
            ys.append(xp.where(m, Hn, 0).astype(p.dtype, copy=False))
            H = xp.where(m, Hn, H)
        else:
            ys.append(Hn)
            H = Hn
    Y = p.finish(ys)
    return (Y, p.state_out(H))[: max(num_outputs, 1)]


@kernel("GRU", since=(1, 3, 7))
def GRU(
    xp,
    X,
    W,
    R,
    B=None,
    sequence_lens=None,
    initial_h=None,
    *,
    activation_alpha=None,
    activation_beta=None,
    activations=None,
    clip=None,
    direction="forward",
    hidden_size=None,
    layout=0,
    linear_before_reset=0,
    output_sequence=0,
    num_outputs=2,
):
    p = _Prep(xp, X, W, R, sequence_lens, direction, layout, [initial_h])
    acts = _activations(
        xp, activations, activation_alpha, activation_beta, ("Sigmoid", "Tanh"), p.num_directions
    )
    hs = p.hidden
    wb, rb = _bias(xp, B, p.num_directions, 3 * hs, p.dtype)
    xproj = p.inputs_per_direction(W) + wb[None, :, None, :]
    Rt = xp.ascontiguousarray(
        xp.swapaxes(R, 1, 2).astype(p.dtype, copy=False)
    )  # (dirs, hidden, 3*hidden)
    Rzr, Rh = Rt[:, :, : 2 * hs], Rt[:, :, 2 * hs :]
    rb = rb[:, None, :]
    H = p.initial_states[0]
    ys = []
    for t in range(p.seq_len):
        xt = xproj[t]
        if linear_before_reset:
            hr = xp.matmul(H, Rt) + rb
            zr = xt[..., : 2 * hs] + hr[..., : 2 * hs]
        else:
            zr = xt[..., : 2 * hs] + xp.matmul(H, Rzr) + rb[..., : 2 * hs]
        zr = _per_dir(xp, acts, 0, _clip(xp, zr, clip))
        z, r = zr[..., :hs], zr[..., hs:]
        if linear_before_reset:
            hpre = xt[..., 2 * hs :] + r * hr[..., 2 * hs :]
        else:
            hpre = xt[..., 2 * hs :] + xp.matmul(r * H, Rh) + rb[..., 2 * hs :]
        h = _per_dir(xp, acts, 1, _clip(xp, hpre, clip))
        Hn = (1 - z) * h + z * H
        m = p.step_mask(t)
        if m is not None:
            ys.append(xp.where(m, Hn, 0).astype(p.dtype, copy=False))
            H = xp.where(m, Hn, H)
        else:
            ys.append(Hn)
            H = Hn
    Y = p.finish(ys)
    return (Y, p.state_out(H))[: max(num_outputs, 1)]


@kernel("LSTM", since=(1, 7))
def LSTM(
    xp,
    X,
    W,
    R,
    B=None,
    sequence_lens=None,
    initial_h=None,
    initial_c=None,
    P=None,
    *,
    activation_alpha=None,
    activation_beta=None,
    activations=None,
    clip=None,
    direction="forward",
    hidden_size=None,
    input_forget=0,
    layout=0,
    output_sequence=0,
    num_outputs=3,
):
    p = _Prep(xp, X, W, R, sequence_lens, direction, layout, [initial_h, initial_c])
    acts = _activations(
        xp,
        activations,
        activation_alpha,
        activation_beta,
        ("Sigmoid", "Tanh", "Tanh"),
        p.num_directions,
    )
    hs = p.hidden
    wb, rb = _bias(xp, B, p.num_directions, 4 * hs, p.dtype)
    xproj = p.inputs_per_direction(W) + (wb + rb)[None, :, None, :]
    Rt = xp.ascontiguousarray(xp.swapaxes(R, 1, 2).astype(p.dtype, copy=False))
    if P is not None:
        P = P.astype(p.dtype, copy=False)[:, None, :]
        p_i, p_o, p_f = P[..., :hs], P[..., hs : 2 * hs], P[..., 2 * hs :]
    H, C = p.initial_states
    ys = []
    for t in range(p.seq_len):
        g = xproj[t] + xp.matmul(H, Rt)
        c = _per_dir(xp, acts, 1, _clip(xp, g[..., 3 * hs :], clip))
        if P is None:  # the i, o, f gates in one activation call
            iof = _per_dir(xp, acts, 0, _clip(xp, g[..., : 3 * hs], clip))
            i, o, f = iof[..., :hs], iof[..., hs : 2 * hs], iof[..., 2 * hs :]
            if input_forget:
                f = 1 - i
            Cn = f * C + i * c
        else:
            i = _per_dir(xp, acts, 0, _clip(xp, g[..., :hs] + p_i * C, clip))
            f = (
                1 - i
                if input_forget
                else _per_dir(xp, acts, 0, _clip(xp, g[..., 2 * hs : 3 * hs] + p_f * C, clip))
            )
            Cn = f * C + i * c
            o = _per_dir(xp, acts, 0, _clip(xp, g[..., hs : 2 * hs] + p_o * Cn, clip))
        Hn = o * _per_dir(xp, acts, 2, Cn)
        m = p.step_mask(t)
        if m is not None:
            ys.append(xp.where(m, Hn, 0).astype(p.dtype, copy=False))
            H = xp.where(m, Hn, H)
            C = xp.where(m, Cn, C)
        else:
            ys.append(Hn)
            H, C = Hn, Cn
    Y = p.finish(ys)
    return (Y, p.state_out(H), p.state_out(C))[: max(num_outputs, 1)]
