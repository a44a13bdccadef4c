"""ai.onnx.preview.training optimizers: Adagrad, Adam, Momentum.

Inputs are R (learning rate scalar), T (update count scalar), then n tensors to
optimise followed by their gradients and accumulators, each group of the same length
n; outputs are the new tensors followed by the new accumulators. R and T are scalars
read on the host (they select the bias-correction branch).
"""

from __future__ import annotations

import math

from hetero_exec.kernels._common import host_scalar
from hetero_exec.kernels.registry import kernel

TRAINING = "ai.onnx.preview.training"


def _groups(xs, per, op):
    if len(xs) % per:
        raise ValueError(f"{op} expects {per} equally long input groups, got {len(xs)} tensors")
    n = len(xs) // per
    return [xs[i * n : (i + 1) * n] for i in range(per)]


@kernel("Adagrad", since=1, domain=TRAINING, host_inputs=(0, 1))
def Adagrad(xp, R, T, *xs, decay_factor=0.0, epsilon=1e-6, norm_coefficient=0.0):
    r, t = float(host_scalar(R)), float(host_scalar(T))
    r_t = r / (1 + t * decay_factor)
    X, G, H = _groups(xs, 3, "Adagrad")
    new_x, new_h = [], []
    for x, g, h in zip(X, G, H):
        g_reg = x * norm_coefficient + g
        h_new = h + g_reg * g_reg
        new_x.append((x - r_t * g_reg / (xp.sqrt(h_new) + epsilon)).astype(x.dtype, copy=False))
        new_h.append(h_new.astype(h.dtype, copy=False))
    return tuple(new_x + new_h)


@kernel("Adam", since=1, domain=TRAINING, host_inputs=(0, 1))
def Adam(
    xp,
    R,
    T,
    *xs,
    alpha=0.9,
    beta=0.999,
    epsilon=1e-6,
    norm_coefficient=0.0,
    norm_coefficient_post=0.0,
):
    r, t = float(host_scalar(R)), host_scalar(T)
    if t > 0:  # bias correction of both moments
        r = r * math.sqrt(1 - beta**t) / (1 - alpha**t)
    X, G, V, H = _groups(xs, 4, "Adam")
    new_x, new_v, new_h = [], [], []
    for x, g, v, h in zip(X, G, V, H):
        g_reg = x * norm_coefficient + g
        v_new = v * alpha + g_reg * (1 - alpha)
        h_new = h * beta + (g_reg * g_reg) * (1 - beta)
        x_new = (x - r * (v_new / (xp.sqrt(h_new) + epsilon))) * (1 - norm_coefficient_post)
        new_x.append(x_new.astype(x.dtype, copy=False))
        new_v.append(v_new.astype(v.dtype, copy=False))
        new_h.append(h_new.astype(h.dtype, copy=False))
    return tuple(new_x + new_v + new_h)


@kernel("Momentum", since=1, domain=TRAINING, host_inputs=(0, 1))
def Momentum(xp, R, T, *xs, alpha=None, beta=None, mode=None, norm_coefficient=None):
    if alpha is None or beta is None or mode is None or norm_coefficient is None:
        raise ValueError("Momentum needs the alpha, beta, mode and norm_coefficient attributes")
    if mode not in ("standard", "nesterov"):
        raise ValueError(f"unknown Momentum mode {mode!r}")
    r, t = float(host_scalar(R)), host_scalar(T)
    beta_t = beta if t > 0 else 1.0  # the first update takes the whole gradient
    X, G, V = _groups(xs, 3, "Momentum")
    new_x, new_v = [], []
    for x, g, v in zip(X, G, V):
        g_reg = x * norm_coefficient + g
        v_new = v * alpha + g_reg * beta_t
        if mode == "standard":
            x_new = x - r * v_new
        else:
            x_new = x - r * (g_reg + v_new * alpha)
        new_x.append(x_new.astype(x.dtype, copy=False))
        new_v.append(v_new.astype(v.dtype, copy=False))
    return tuple(new_x + new_v)
