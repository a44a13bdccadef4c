"""Random generators: RandomUniform(Like), RandomNormal(Like), Bernoulli, Multinomial.

A ``seed`` attribute gives a fresh generator seeded with it on every call, so a seeded
node is reproducible run to run (on one array module; numpy and cupy streams differ).
Without a seed each array module keeps one process-wide generator.
"""

from __future__ import annotations

import threading

import numpy as np

from hetero_exec.kernels._common import np_dtype
from hetero_exec.kernels.registry import kernel

_states: dict[str, object] = {}
_lock = threading.Lock()


def _state(xp, seed):
    if seed is not None and not np.isnan(seed):
        return xp.random.RandomState(int(seed))
    key = xp.__name__
    with _lock:
        st = _states.get(key)
        if st is None:
            st = _states[key] = xp.random.RandomState()
    return st


def _uniform(xp, shape, dtype, low, high, seed):
    u = _state(xp, seed).random_sample(size=tuple(shape))
    out = (u * (high - low) + low).astype(dtype)
    if high > low and xp.dtype(dtype).kind == "f":
        # a float64 draw in [low, high) within half a step of high rounds up to it in a
        # narrower dtype (rare for a wide range, one in 8 for one 4 float32 steps wide)
        top = xp.nextafter(xp.asarray(high, dtype), xp.asarray(low, dtype))
        xp.minimum(out, top, out=out)
    return out


def _normal(xp, shape, dtype, mean, scale, seed):
    z = _state(xp, seed).standard_normal(size=tuple(shape))
    return (z * scale + mean).astype(dtype)


def _like_dtype(x, dtype):
    return x.dtype if dtype is None else np_dtype(dtype)


@kernel("RandomUniform", since=1)
def RandomUniform(xp, *, dtype=1, high=1.0, low=0.0, seed=None, shape=None):
    if shape is None:
        raise ValueError("RandomUniform needs the shape attribute")
    return (_uniform(xp, shape, np_dtype(dtype), low, high, seed),)


@kernel("RandomUniformLike", since=1)
def RandomUniformLike(xp, input, *, dtype=None, high=1.0, low=0.0, seed=None):
    return (_uniform(xp, input.shape, _like_dtype(input, dtype), low, high, seed),)


@kernel("RandomNormal", since=1)
def RandomNormal(xp, *, dtype=1, mean=0.0, scale=1.0, seed=None, shape=None):
    if shape is None:
        raise ValueError("RandomNormal needs the shape attribute")
    return (_normal(xp, shape, np_dtype(dtype), mean, scale, seed),)


@kernel("RandomNormalLike", since=1)
def RandomNormalLike(xp, input, *, dtype=None, mean=0.0, scale=1.0, seed=None):
    return (_normal(xp, input.shape, _like_dtype(input, dtype), mean, scale, seed),)


@kernel("Bernoulli", since=15)
def Bernoulli(xp, input, *, dtype=None, seed=None):
    u = _state(xp, seed).random_sample(size=input.shape)
    return ((u < input).astype(_like_dtype(input, dtype)),)


@kernel("Multinomial", since=7)
def Multinomial(xp, input, *, dtype=6, sample_size=1, seed=None):
    """input: (batch, classes) unnormalised log-probabilities -> (batch, sample_size) class ids."""
    if input.ndim != 2:
        raise ValueError(
            f"Multinomial input must be [batch, classes], got shape {list(input.shape)}"
        )
    batch, classes = input.shape
    x = input.astype(np.float64)
    p = xp.exp(x - xp.max(x, axis=1, keepdims=True))
    cdf = xp.cumsum(p, axis=1)
    cdf = cdf / cdf[:, -1:]
    u = _state(xp, seed).random_sample(size=(batch, sample_size))
    # one searchsorted for every row: row r's cdf lives in [r, r+1]
    rows = xp.arange(batch, dtype=np.float64)[:, None]
    flat = (cdf + rows).reshape(-1)
    idx = xp.searchsorted(flat, (u + rows).reshape(-1), side="right").reshape(batch, sample_size)
    idx = idx - (rows * classes).astype(idx.dtype)
    return (xp.clip(idx, 0, classes - 1).astype(np_dtype(dtype)),)
