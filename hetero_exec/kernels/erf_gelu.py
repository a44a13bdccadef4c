"""Erf and Gelu: rational approximations evaluated in place, in float32 for narrow
floats (a third of a float64 evaluation's cost) and in float64 by Cody's rationals.
On the host, float32 Gelu is the C library's one pass (native/act.c, the same
rationals); these are the definitions it is tested against, and what other array
modules run.
"""

from __future__ import annotations

import math

import numpy as np

from hetero_exec.kernels.elementwise import _BLOCK, _blockwise, _keep
from hetero_exec.kernels.native import library, row_kernels
from hetero_exec.kernels.native.activation import activation_args
from hetero_exec.kernels.registry import kernel

# float64 inputs: W. J. Cody's rational approximations (CALERF, netlib specfun), relative
# error ~1e-16: |x| <= 0.46875: erf = x A(x^2)/B(x^2); up to 4: erfc = exp(-x^2) C(|x|)/D(|x|);
# beyond: erfc = exp(-x^2)/|x| (1/sqrt(pi) - P(1/x^2)/(x^2 Q(1/x^2))).
# Narrower floats are evaluated in float32 (see _erf_f32).
_ERF_A = (3.16112374387056560e00, 1.13864154151050156e02, 3.77485237685302021e02,
          3.20937758913846947e03, 1.85777706184603153e-1)
_ERF_B = (2.36012909523441209e01, 2.44024637934444173e02, 1.28261652607737228e03,
          2.84423683343917062e03)
_ERF_C = (5.64188496988670089e-1, 8.88314979438837594e00, 6.61191906371416295e01,
          2.98635138197400131e02, 8.81952221241769090e02, 1.71204761263407058e03,
          2.05107837782607147e03, 1.23033935479799725e03, 2.15311535474403846e-8)
_ERF_D = (1.57449261107098347e01, 1.17693950891312499e02, 5.37181101862009858e02,
          1.62138957456669019e03, 3.29079923573345963e03, 4.36261909014324716e03,
          3.43936767414372164e03, 1.23033935480374942e03)
_ERF_P = (3.05326634961232344e-1, 3.60344899949804439e-1, 1.25781726111229246e-1,
          1.60837851487422766e-2, 6.58749161529837803e-4, 1.63153871373020978e-2)
_ERF_Q = (2.56852019228982242e00, 1.87295284992346725e00, 5.27905102951428412e-1,
          6.05183413124413191e-2, 2.33520497626869185e-3)
_SQRPI = 5.6418958354775628695e-1

# float32: erf = x p(x^2) / q(x^2) on x clamped to [-4.5, 4.5], the result clipped to
# [-1, 1] (Eigen's fast float erf: p odd, q even, positive coefficients but the last, so
# Horner's rule loses little; the rational passes 1 just above erfinv(1 - ulp/2) = 3.8325
# and keeps growing, hence clamp-then-clip). Its own error is below 1 float32 ulp; evaluated
# in float32 without FMA, the measured error is at most 3.2e-7 (absolute and relative, ~5
# ulp) over the whole range, at a third of the cost of a float64 evaluation.
# Highest degree first.
_ERF32_P = tuple(np.float32(c) for c in (
    2.2905065861350646e-4, 3.4082910107109506e-3, 5.0955695062380861e-2,
    1.8520832239976145e-1, 1.128379143519084))
_ERF32_Q = tuple(np.float32(c) for c in (
    -1.1791602954361697e-7, 2.3547966471313185e-5, 1.0179625278914885e-3,
    1.4070470171167667e-2, 1.1098505178285362e-1, 4.9746925110067538e-1, 1.0))
_ERF32_CLAMP = np.float32(4.5)
_ONE32 = np.float32(1.0)


def _horner(xp, z, coeffs, out=None):
    """coeffs[0] z^n + ... + coeffs[n], evaluated in place in one array (``out`` if given)."""
    acc = xp.multiply(z, coeffs[0], out=out)
    acc += coeffs[1]
    for c in coeffs[2:]:
        acc *= z
        acc += c
    return acc


def _horner_monic(xp, z, coeffs):
    """z^n + coeffs[0] z^(n-1) + ... + coeffs[n-1]."""
    acc = z + coeffs[0]
    for c in coeffs[1:]:
        acc *= z
        acc += c
    return acc


def _erf_f32_into(xp, x, out, t, z):
    """erf of float32 ``x`` written into ``out``; ``t`` and ``z`` are float32 work arrays
    of x's shape (no other allocation)."""
    xp.clip(x, -_ERF32_CLAMP, _ERF32_CLAMP, out=t)
    xp.multiply(t, t, out=z)
    _horner(xp, z, _ERF32_P, out=out)
    out *= t
    out /= _horner(xp, z, _ERF32_Q, out=t)
    xp.clip(out, -_ONE32, _ONE32, out=out)
    return out


def _blockwise_f32(xp, fn_into, x):
    """``fn_into(xp, xb, outb, t, z)`` over a float32 array: on numpy blockwise (so that
    the many passes run in cache) with the two work buffers ``t``, ``z`` allocated once;
    cupy gets the whole array."""
    flat = x.reshape(-1)
    out = xp.empty(flat.shape, np.float32)
    if xp is not np or flat.size <= 2 * _BLOCK:
        fn_into(xp, flat, out, xp.empty_like(out), xp.empty_like(out))
        return out.reshape(x.shape)
    t = np.empty(_BLOCK, np.float32)
    z = np.empty(_BLOCK, np.float32)
    for i in range(0, flat.size, _BLOCK):
        j = min(flat.size, i + _BLOCK)
        fn_into(xp, flat[i:j], out[i:j], t[:j - i], z[:j - i])
    return out.reshape(x.shape)


def _erf_f32(xp, x):
    """erf of a float32 array, in float32 (~25 passes, in cache on numpy)."""
    return _blockwise_f32(xp, _erf_f32_into, x)


def _erf_cody(xp, x):
    y = xp.abs(x)
    # |x| <= 0.46875 (x clipped so the unused lanes stay finite)
    xs = xp.clip(x, -0.5, 0.5)
    z = xs * xs
    small = _horner(xp, z, (_ERF_A[4],) + _ERF_A[:4])
    small *= xs
    small /= _horner_monic(xp, z, _ERF_B)
    # erfc for |x| > 0.46875, y clipped so that inf gives erfc = 0 without nan
    yc = xp.clip(y, 0.46875, 30.0)
    mid = _horner(xp, yc, (_ERF_C[8],) + _ERF_C[:8])
    mid /= _horner_monic(xp, yc, _ERF_D)
    yt = xp.maximum(yc, 4.0)
    isq = 1.0 / (yt * yt)
    tail = _horner(xp, isq, (_ERF_P[5],) + _ERF_P[:5])
    tail *= isq
    tail /= _horner_monic(xp, isq, _ERF_Q)
    xp.subtract(_SQRPI, tail, out=tail)
    tail /= yt
    r = xp.where(yc <= 4.0, mid, tail)
    e = yc * yc  # exp(-y^2) in one go: its error, y^2 ulp(1), stays far below erf's
    xp.negative(e, out=e)
    xp.exp(e, out=e)
    e *= r
    xp.subtract(1.0, e, out=e)
    xp.copysign(e, x, out=e)
    return xp.where(y <= 0.46875, small, e)


def erf(xp, x):
    """erf of a float array, in x's dtype (see above for the approximations)."""
    if x.ndim == 0:  # numpy makes scalars of 0-d results, which the in-place steps need as arrays
        return erf(xp, x.reshape(1)).reshape(())
    if x.dtype == np.float64:
        return _erf_cody(xp, x)
    return _keep(_erf_f32(xp, x.astype(np.float32, copy=False)), x)


@kernel("Erf", 9)
def Erf(xp, x):
    if x.dtype.kind in "iu":
        return (xp.asarray(erf(xp, x.astype(np.float64)).astype(x.dtype)),)
    if x.dtype == np.float64:
        return (_blockwise(xp, lambda v: erf(xp, v), x, x.dtype),)
    return (erf(xp, x),)



def _gelu_erf(xp, x):
    y = erf(xp, x * (1 / math.sqrt(2)))
    y += 1
    y *= x
    y *= 0.5
    return y


_GELU_K = math.sqrt(2 / math.pi)


def _gelu_tanh(xp, x):
    """0.5 x (1 + tanh(u)) = x / (1 + exp(-2u)), u = sqrt(2/pi) (x + 0.044715 x^3): one
    exp instead of a tanh, and no cancellation in 1 + tanh(u) for negative u."""
    y = x * x
    y *= -2 * _GELU_K * 0.044715
    y += -2 * _GELU_K
    y *= x
    with np.errstate(over="ignore", invalid="ignore"):  # exp(-2u) = inf for very negative
        xp.exp(y, out=y)                                # x: x / inf = -0 (-inf: nan, as
        y += 1                                          # 0.5 x (1 + tanh) gives)
        return xp.divide(x, y, out=y)


_F32 = np.float32
_GELU32 = (_F32(1 / math.sqrt(2)), _F32(-2 * _GELU_K * 0.044715), _F32(-2 * _GELU_K), _F32(1),
           _F32(0.5))


def _gelu_erf_f32_into(xp, x, out, t, z):
    """float32 Gelu (erf) of x into out, no allocation: erf is evaluated on out itself."""
    xp.multiply(x, _GELU32[0], out=out)
    _erf_f32_into(xp, out, out, t, z)
    out += _GELU32[3]
    out *= x
    out *= _GELU32[4]


def _gelu_tanh_f32_into(xp, x, out, t, z):
    """float32 Gelu (tanh) of x into out, as _gelu_tanh computes it."""
    xp.multiply(x, x, out=out)
    out *= _GELU32[1]
    out += _GELU32[2]
    out *= x
    with np.errstate(over="ignore", invalid="ignore"):
        xp.exp(out, out=out)
        out += _GELU32[3]
        xp.divide(x, out, out=out)


@kernel("Gelu", 20)
def Gelu(xp, x, approximate="none"):
    if x.ndim == 0:  # numpy makes scalars of 0-d results; the in-place steps need arrays
        return (Gelu(xp, x.reshape(1), approximate)[0].reshape(()),)
    if x.size and library.takes(xp, x):  # native/act.c: one pass, 16 lanes a step
        act = activation_args("GeluTanh" if approximate == "tanh" else "Gelu")
        return (row_kernels.unary(x, *act),)
    if x.dtype == np.float64:
        fn = _gelu_tanh if approximate == "tanh" else _gelu_erf
        return (_blockwise(xp, lambda v: fn(xp, v), x, x.dtype),)
    fn_into = _gelu_tanh_f32_into if approximate == "tanh" else _gelu_erf_f32_into
    y = _blockwise_f32(xp, fn_into, x.astype(np.float32, copy=False))
    return (_keep(y, x),)
