"""Epilogues, compiled: a fresh product's bias, residual and activation in one pass.

numpy spends a pass over memory per step (bias add, then each step of the activation:
two for Clip, ~25 for float32 erf GELU); here each value is read and written once.
One loop per activation, each over an inlined scalar function, so that the loops
vectorize: a branch on the activation inside the loop, or Python's division semantics
(a zero-divisor check per division; hence ``error_model="numpy"``), stop LLVM's
vectorizer (7x on the GELU here). The activation codes are kernels/native.ACT_CODES.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba.extending import overload

# float32 erf as kernels/elementwise._erf_f32_into computes it (Eigen's rational,
# clamp then clip); highest degree first
_P = (2.2905065861350646e-4, 3.4082910107109506e-3, 5.0955695062380861e-2,
      1.8520832239976145e-1, 1.128379143519084)
_Q = (-1.1791602954361697e-7, 2.3547966471313185e-5, 1.0179625278914885e-3,
      1.4070470171167667e-2, 1.1098505178285362e-1, 4.9746925110067538e-1, 1.0)
_F = np.float32
P0, P1, P2, P3, P4 = (_F(c) for c in _P)
Q0, Q1, Q2, Q3, Q4, Q5, Q6 = (_F(c) for c in _Q)
_CLAMP, _ONE, _HALF, _RSQRT2 = _F(4.5), _F(1), _F(0.5), _F(1 / math.sqrt(2))


@numba.njit(inline="always", error_model="numpy")
def _relu(v):
    return 0 if v < 0 else v  # v < 0 is False for NaN: NaN stays, as np.maximum's


@numba.njit(inline="always", error_model="numpy")
def _clip(v, lo, hi):  # max then min, as Clip (lo > hi gives hi)
    v = lo if v < lo else v
    return hi if v > hi else v


@numba.njit(inline="always", error_model="numpy")
def _hard_sigmoid(v, alpha, beta):
    t = v * alpha + beta
    t = 0 if t < 0 else t
    return 1 if t > 1 else t


@numba.njit(inline="always", error_model="numpy")
def _gelu_erf_f32(x):
    """0.5 x (1 + erf(x / sqrt 2)) in float32, erf by the rational above."""
    t = x * _RSQRT2
    t = -_CLAMP if t < -_CLAMP else (_CLAMP if t > _CLAMP else t)
    z = t * t
    p = (((P0 * z + P1) * z + P2) * z + P3) * z + P4
    q = (((((Q0 * z + Q1) * z + Q2) * z + Q3) * z + Q4) * z + Q5) * z + Q6
    e = t * p / q
    e = -_ONE if e < -_ONE else (_ONE if e > _ONE else e)
    return _HALF * x * (_ONE + e)


# float32 tanh: Eigen's rational (odd degree 13 over even degree 6, clamped at
# +-7.9053; within 3.5e-7 of tanh everywhere): only multiplies, adds and one divide,
# where numpy's path takes seven passes around its SIMD exp
_TA = tuple(_F(c) for c in (-2.76076847742355e-16, 2.00018790482477e-13, -8.60467152213735e-11,
                            5.12229709037114e-08, 1.48572235717979e-05, 6.37261928875436e-04,
                            4.89352455891786e-03))
_TB = tuple(_F(c) for c in (1.19825839466702e-06, 1.18534705686654e-04, 2.26843463243900e-03,
                            4.89352518554385e-03))
A13, A11, A9, A7, A5, A3, A1 = _TA
B6, B4, B2, B0 = _TB
_TCLAMP = _F(7.90531110763549805)
_K_TANH, _C_CUBE = _F(math.sqrt(2 / math.pi)), _F(0.044715)


@numba.njit(inline="always", error_model="numpy")
def _tanh_f32(u):
    """tanh in float32 by the rational (NaN stays NaN: the clamps compare false)."""
    t = -_TCLAMP if u < -_TCLAMP else (_TCLAMP if u > _TCLAMP else u)
    z = t * t
    p = ((((((A13 * z + A11) * z + A9) * z + A7) * z + A5) * z + A3) * z + A1) * t
    q = ((B6 * z + B4) * z + B2) * z + B0
    return p / q


@numba.njit(inline="always", error_model="numpy")
def _gelu_tanh_f32(x):
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) in float32, tanh by the rational."""
    return _HALF * x * (_ONE + _tanh_f32(_K_TANH * (x + _C_CUBE * x * x * x)))


@numba.njit(inline="always", error_model="numpy")
def _gelu_tanh_f64(x):
    return 0.5 * x * (1.0 + math.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


# the logistic as 0.5 + 0.5 tanh(x / 2): within 2e-7 of it, absolutely; below x = -16
# it is 0 (so float32 SiLU there is 0, not x e^x >= -1.7e-6), as onnxruntime's rational
# logistic trades accuracy in the far tail for one vectorized pass
@numba.njit(inline="always", error_model="numpy")
def _sigmoid_f32(x):
    return _HALF + _HALF * _tanh_f32(_HALF * x)


@numba.njit(inline="always", error_model="numpy")
def _sigmoid_f64(x):
    return 0.5 + 0.5 * math.tanh(0.5 * x)


def _by_dtype(f32, f64):
    """A scalar function compiled as ``f32`` for float32 and ``f64`` for float64."""
    def fn(x):
        raise NotImplementedError  # only called compiled, through the overload below

    def call32(x):
        return f32(x)

    def call64(x):
        return f64(x)

    overload(fn)(lambda x: call32 if x == numba.types.float32 else call64)
    return fn


_gelu_tanh = _by_dtype(_gelu_tanh_f32, _gelu_tanh_f64)
_sigmoid = _by_dtype(_sigmoid_f32, _sigmoid_f64)
_tanh = _by_dtype(_tanh_f32, math.tanh)


@numba.njit(inline="always", error_model="numpy")
def _gelu_erf_f64(x):
    return 0.5 * x * (1.0 + math.erf(x * 0.7071067811865476))


# GELU (erf): the float32 rational in float32, libm's erf in float64
_gelu_erf = _by_dtype(_gelu_erf_f32, _gelu_erf_f64)


def _zero(a):
    """A zero of array ``a``'s dtype (compiled only)."""
    raise NotImplementedError


@overload(_zero, inline="always")
def _zero_typed(a):
    dtype = a.dtype
    return lambda a: dtype(0)


# inlined into its callers: a call per row costs ~40 ns here (array arguments, refcounts)
@numba.njit(inline="always", boundscheck=False, error_model="numpy")
def act_row(row, bias, o, code, p0, p1):
    """o[k] = act(row[k] + bias) (row and o may be the same array)."""
    n = o.shape[0]
    if code == 0:
        for k in range(n):
            o[k] = row[k] + bias
    elif code == 1:
        for k in range(n):
            o[k] = _relu(row[k] + bias)
    elif code == 2:
        for k in range(n):
            o[k] = _clip(row[k] + bias, p0, p1)
    elif code == 3:
        for k in range(n):
            o[k] = _hard_sigmoid(row[k] + bias, p0, p1)
    elif code == 4:
        for k in range(n):
            v = row[k] + bias
            o[k] = v * _hard_sigmoid(v, p0, p1)
    elif code == 8:
        for k in range(n):
            o[k] = _gelu_erf(row[k] + bias)
    elif code == 9:
        for k in range(n):
            o[k] = _gelu_tanh(row[k] + bias)
    elif code == 10:
        for k in range(n):
            v = row[k] + bias
            o[k] = v * _sigmoid(v)
    elif code == 11:
        for k in range(n):
            o[k] = _sigmoid(row[k] + bias)
    else:  # 12
        for k in range(n):
            o[k] = _tanh(row[k] + bias)


@numba.njit(nogil=True, cache=True, boundscheck=False, error_model="numpy")
def channels(y, b, z, code, p0, p1, r0, r1):
    """y[n, m, :] = act(y[n, m, :] + b[m] + z[n, m, :]) for rows n*M + m in [r0, r1):
    an NCHW product (N, M, L) in place; b of size M or 0 (no bias), z of y's shape or
    empty (no residual)."""
    N, M, L = y.shape
    has_b, has_z = b.shape[0] > 0, z.size > 0
    for r in range(r0, r1):
        n, m = r // M, r % M
        row = y[n, m]
        if has_z:
            zr = z[n, m]
            for k in range(L):
                row[k] += zr[k]
        act_row(row, b[m] if has_b else _zero(b), row, code, p0, p1)


@numba.njit(nogil=True, cache=True, boundscheck=False, error_model="numpy")
def last_axis(y, b, code, p0, p1, r0, r1):
    """y[r, :] = act(y[r, :] + b) for rows [r0, r1) of a (R, K) product in place; b of
    size K or 0 (no bias)."""
    K = y.shape[1]
    if b.shape[0] == 0:
        for r in range(r0, r1):
            act_row(y[r], _zero(y), y[r], code, p0, p1)
        return
    for r in range(r0, r1):
        row = y[r]
        for k in range(K):
            row[k] += b[k]
        act_row(row, _zero(y), row, code, p0, p1)


@numba.njit(nogil=True, cache=True, boundscheck=False, error_model="numpy")
def unary(x, o, code, p0, p1, i0, i1):
    """o[i] = act(x[i]) for i in [i0, i1) of two 1-D arrays."""
    act_row(x[i0:i1], _zero(x), o[i0:i1], code, p0, p1)
