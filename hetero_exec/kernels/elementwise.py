"""Element-wise ONNX ops: math, activations, comparisons, logic and bit ops (Erf and
Gelu, with their rational approximations: erf_gelu.py).

Each kernel is registered once at its first opset; later versions only widen the
accepted types. Kernels of ops whose opset 1 (or 6) carried ``consumed_inputs`` or the
legacy ``broadcast``/``axis`` attributes accept those too, so one function serves every
version. Outputs are always arrays (numpy turns 0-d results into scalars, hence the
``xp.asarray`` wrappers) of the dtype the spec requires.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from hetero_exec.kernels.registry import kernel


def _keep(y, x):
    """y in x's dtype: ml_dtypes (bfloat16...) promote to float32 with Python floats."""
    return y if y.dtype == x.dtype else y.astype(x.dtype)


_BLOCK = 1 << 16


def _blockwise(xp, fn, x, out_dtype):
    """``fn(x)`` for an element-wise ``fn`` with many temporaries. On numpy it runs over
    cache-sized blocks (about 3x faster for erf); cupy gets the whole array."""
    if xp is not np or x.size <= 2 * _BLOCK:
        return fn(x)
    flat = x.reshape(-1)
    out = np.empty(flat.shape, out_dtype)
    for i in range(0, flat.size, _BLOCK):
        out[i:i + _BLOCK] = fn(flat[i:i + _BLOCK])
    return out.reshape(x.shape)


def _unary(op_type: str, fn: Callable[[Any, Any], Any], since: int = 1, legacy: bool = False,
           keep: bool = True) -> None:
    """Register ``y = fn(xp, x)`` (in x's dtype when ``keep``); ``legacy`` adds opset-1's
    ignored ``consumed_inputs``, and a lean kernel from opset 6 on (the hot path)."""
    if keep:
        def f(xp, x):
            y = fn(xp, x)
            if y.__class__ is not x.__class__ or y.dtype != x.dtype:  # 0-d scalars, promotions
                y = _keep(xp.asarray(y), x)
            return y
    else:
        def f(xp, x):
            return xp.asarray(fn(xp, x))

    def k(xp, x):
        return (f(xp, x),)

    k.__name__ = k.__qualname__ = op_type
    if legacy:
        def k_legacy(xp, x, consumed_inputs=None):
            return (f(xp, x),)

        k_legacy.__name__ = k_legacy.__qualname__ = op_type
        kernel(op_type, since)(k_legacy)
        kernel(op_type, 6)(k)
    else:
        kernel(op_type, since)(k)


def _legacy_b(a, b, axis, broadcast):
    """Opset<7 broadcasting: B aligned with A from ``axis`` (suffix-aligned by default)."""
    if broadcast and axis is not None and b.ndim and b.ndim < a.ndim:
        ax = axis + a.ndim if axis < 0 else axis
        trailing = a.ndim - ax - b.ndim
        if trailing > 0:
            b = b.reshape(b.shape + (1,) * trailing)
    return b


def _binary(op_type: str, fn: Callable[[Any, Any, Any], Any], since: int = 1, legacy: bool = False) -> None:
    """Register a broadcasting ``z = fn(xp, a, b)``; ``legacy`` adds opset<7's
    axis/broadcast/consumed_inputs, and a lean kernel from opset 7 on (the hot path)."""
    def k(xp, a, b):
        z = fn(xp, a, b)
        return (z if z.__class__ is a.__class__ else xp.asarray(z),)

    k.__name__ = k.__qualname__ = op_type
    if legacy:
        def k_legacy(xp, a, b, axis=None, broadcast=0, consumed_inputs=None):
            return (xp.asarray(fn(xp, a, _legacy_b(a, b, axis, broadcast))),)

        k_legacy.__name__ = k_legacy.__qualname__ = op_type
        kernel(op_type, since)(k_legacy)
        kernel(op_type, 7)(k)
    else:
        kernel(op_type, since)(k)


def _fold(xp, ufunc, xs):
    """ufunc folded over broadcasting inputs, accumulating in place once the shape is final."""
    out = xp.asarray(ufunc(xs[0], xs[1]))
    for x in xs[2:]:
        if np.broadcast_shapes(out.shape, x.shape) == out.shape:
            ufunc(out, x, out=out)
        else:
            out = xp.asarray(ufunc(out, x))
    return out


def _variadic(op_type: str, ufunc_name: str, since: int = 1) -> None:
    def k(xp, *xs, consumed_inputs=None):
        if len(xs) == 1:
            return (xs[0],)
        return (_fold(xp, getattr(xp, ufunc_name), xs),)

    k.__name__ = k.__qualname__ = op_type
    kernel(op_type, since)(k)


# ---------------------------------------------------------------- plain math
_unary("Abs", lambda xp, x: xp.abs(x), legacy=True)
_unary("Neg", lambda xp, x: xp.negative(x), legacy=True)
_unary("Ceil", lambda xp, x: xp.ceil(x), legacy=True)
_unary("Floor", lambda xp, x: xp.floor(x), legacy=True)
_unary("Exp", lambda xp, x: xp.exp(x), legacy=True)
_unary("Log", lambda xp, x: xp.log(x), legacy=True)
_unary("Sqrt", lambda xp, x: xp.sqrt(x), legacy=True)
_unary("Reciprocal", lambda xp, x: xp.reciprocal(x), legacy=True)
_unary("Tanh", lambda xp, x: xp.tanh(x), legacy=True)
_unary("Relu", lambda xp, x: xp.maximum(x, 0), legacy=True)
_unary("Round", lambda xp, x: xp.round(x), 11)  # numpy/cupy round half to even
_unary("Sign", lambda xp, x: xp.sign(x), 9)
_unary("Cos", lambda xp, x: xp.cos(x), 7)
_unary("Sin", lambda xp, x: xp.sin(x), 7)
_unary("Tan", lambda xp, x: xp.tan(x), 7)
_unary("Acos", lambda xp, x: xp.arccos(x), 7)
_unary("Asin", lambda xp, x: xp.arcsin(x), 7)
_unary("Atan", lambda xp, x: xp.arctan(x), 7)
_unary("Cosh", lambda xp, x: xp.cosh(x), 9)
_unary("Sinh", lambda xp, x: xp.sinh(x), 9)
_unary("Acosh", lambda xp, x: xp.arccosh(x), 9)
_unary("Asinh", lambda xp, x: xp.arcsinh(x), 9)
_unary("Atanh", lambda xp, x: xp.arctanh(x), 9)
_unary("Not", lambda xp, x: xp.logical_not(x), keep=False)
_unary("BitwiseNot", lambda xp, x: xp.invert(x), 18)
_unary("IsNaN", lambda xp, x: xp.isnan(x), 9, keep=False)


def _sigmoid(xp, x):
    """1 / (1 + exp(-x)) in one buffer; exp overflowing to inf still gives the right 0."""
    t = xp.empty_like(x)
    with np.errstate(over="ignore"):
        xp.negative(x, out=t)
        xp.exp(t, out=t)
    t += 1
    return xp.reciprocal(t, out=t)


def _f32_if_narrow(x):
    """float16/bfloat16 lose too much in exp(.) +- 1: compute those in float32 (callers
    cast the result back with _keep)."""
    if x.dtype in (np.float32, np.float64):
        return x
    return x.astype(np.float32)


def _softplus(xp, x):
    """log(1 + exp(x)) = max(x, 0) + log(1 + exp(-|x|)), never overflowing. Below float64
    plain log is used (log1p is unvectorised in numpy, 4x slower): its error, at most an
    ulp of 1, is what float32 can hold anyway for the result's absolute value."""
    x = _f32_if_narrow(x)
    t = xp.abs(x, out=xp.empty_like(x))  # out=: a 0-d result stays an array
    xp.negative(t, out=t)
    xp.exp(t, out=t)
    if x.dtype == np.float64:
        xp.log1p(t, out=t)
    else:
        t += 1
        xp.log(t, out=t)
    t += xp.maximum(x, 0)
    return t


def _expm1_neg(xp, x):
    """expm1(min(x, 0)): exact expm1 for float64; exp - 1 (absolute error below an ulp of 1,
    as onnxruntime computes it, and far faster in numpy) in float32 for narrower floats."""
    x = _f32_if_narrow(x)
    m = xp.minimum(x, 0, out=xp.empty_like(x))
    if x.dtype == np.float64:
        return xp.expm1(m, out=m)
    xp.exp(m, out=m)
    m -= 1
    return m


_unary("Sigmoid", _sigmoid, legacy=True)
_unary("Softplus", _softplus)
_unary("Softsign", lambda xp, x: x / (1 + xp.abs(x)))
_unary("Mish", lambda xp, x: x * xp.tanh(_softplus(xp, x)), 18)
_unary("HardSwish", lambda xp, x: x * xp.clip(x * (1 / 6) + 0.5, 0, 1), 14)


@kernel("Identity")
def Identity(xp, x):
    return (x,)


# ---------------------------------------------------------------- activations with attributes
@kernel("Elu")
def Elu(xp, x, alpha=1.0, consumed_inputs=None):
    return (_keep(xp.asarray(xp.where(x > 0, x, alpha * _expm1_neg(xp, x))), x),)


@kernel("Celu", 12)
def Celu(xp, x, alpha=1.0):
    return (_keep(xp.asarray(xp.maximum(x, 0) + alpha * _expm1_neg(xp, x / alpha)), x),)


@kernel("Selu")
def Selu(xp, x, alpha=1.67326319217681884765625, gamma=1.05070102214813232421875,
         consumed_inputs=None):
    y = xp.where(x > 0, gamma * x, (gamma * alpha) * _expm1_neg(xp, x))
    return (_keep(xp.asarray(y), x),)


@kernel("LeakyRelu")
def LeakyRelu(xp, x, alpha=0.01, consumed_inputs=None):
    return (_keep(xp.asarray(xp.where(x > 0, x, x * alpha)), x),)


@kernel("ThresholdedRelu", 10)
def ThresholdedRelu(xp, x, alpha=1.0):
    return (_keep(xp.asarray(xp.where(x > alpha, x, 0)), x),)


@kernel("HardSigmoid")
def HardSigmoid(xp, x, alpha=0.2, beta=0.5, consumed_inputs=None):
    return (_keep(xp.asarray(xp.clip(x * alpha + beta, 0, 1)), x),)


@kernel("Shrink", 9)
def Shrink(xp, x, bias=0.0, lambd=0.5):
    y = xp.where(x < -lambd, x + bias, xp.where(x > lambd, x - bias, 0))
    return (_keep(xp.asarray(y), x),)


@kernel("Swish", 24)
def Swish(xp, x, alpha=1.0):
    return (_keep(xp.asarray(x * _sigmoid(xp, x * alpha)), x),)


@kernel("PRelu", 7)
def PRelu(xp, x, slope):
    return (_keep(xp.asarray(xp.where(x < 0, x * slope, x)), x),)


@kernel("PRelu", 1)
def PRelu_legacy(xp, x, slope, consumed_inputs=None):
    """Before opset 7 a 1-D slope of length C applies per channel (axis 1), as exporters
    of that era (and onnxruntime) read it, not with numpy's trailing alignment."""
    if slope.ndim == 1 and slope.shape[0] > 1 and x.ndim >= 2 and x.shape[1] == slope.shape[0]:
        slope = slope.reshape((-1,) + (1,) * (x.ndim - 2))
    return PRelu(xp, x, slope)


@kernel("IsInf", 10)
def IsInf(xp, x, detect_negative=1, detect_positive=1):
    if detect_negative and detect_positive:
        y = xp.isinf(x)
    elif detect_positive:
        y = x == np.inf
    elif detect_negative:
        y = x == -np.inf
    else:
        y = xp.zeros(x.shape, dtype=bool)
    return (xp.asarray(y),)


@kernel("Clip")
def Clip(xp, x, min=None, max=None, consumed_inputs=None):  # noqa: A002
    # opset<11: min/max are float attributes; later optional 0-d inputs of x's dtype.
    # max(x, min) then min(., max) also gives the spec's "all max" when min > max
    # (cupy.clip would give min there).
    if min is None and max is None:
        return (x,)
    if min is not None:
        y = xp.asarray(xp.maximum(x, min))
        if max is not None:
            xp.minimum(y, max, out=y)
    else:
        y = xp.asarray(xp.minimum(x, max))
    return (_keep(y, x),)


# ---------------------------------------------------------------- arithmetic
def _div(xp, a, b):
    if a.dtype.kind in "iu":
        with np.errstate(divide="ignore", invalid="ignore"):
            q = xp.floor_divide(a, b)
            if a.dtype.kind == "i":
                # floor -> trunc: add one where the exact quotient was negative and inexact
                r = a - q * b
                q = q + ((r != 0) & ((a < 0) != (b < 0))).astype(q.dtype)
        return q
    return a / b


#: float dtypes whose x**k for small k is cheaper by multiplication (numpy's power is a
#: generic pow call per element: ~40x slower than x*x*x)
_POW_FAST_DTYPES = (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16))


def _pow_scalar(xp, a, e):
    """a ** e for a host scalar exponent in {0, 0.5, 1, 2, 3, -1}, in a's dtype; None
    for other exponents. Results agree with pow to an ulp or so (x*x*x rounds twice)."""
    if e == 2.0:
        return xp.multiply(a, a)
    if e == 3.0:
        y = xp.multiply(a, a)
        y *= a
        return y
    if e == 1.0:
        return a.copy()
    if e == 0.0:
        return xp.ones(a.shape, a.dtype)  # pow(x, 0) is 1 even for nan
    if e == -1.0:
        return xp.divide(a.dtype.type(1), a)
    if e == 0.5:
        return xp.sqrt(a)  # as numpy's power gives it: sqrt(-0) = -0, sqrt(-inf) = nan
    return None


def _pow(xp, a, b):
    if (a.dtype in _POW_FAST_DTYPES and b.size == 1 and b.ndim <= a.ndim
            and isinstance(b, np.ndarray) and a.ndim):
        y = _pow_scalar(xp, a, float(b.reshape(-1)[0]))
        if y is not None:
            return y
    if a.dtype.kind == "f" and b.dtype != a.dtype:
        b = b.astype(a.dtype)
    r = xp.power(a, b)
    return r.astype(a.dtype, copy=False)


_binary("Add", lambda xp, a, b: a + b, legacy=True)
_binary("Sub", lambda xp, a, b: a - b, legacy=True)
_binary("Mul", lambda xp, a, b: a * b, legacy=True)
_binary("Div", _div, legacy=True)
_binary("Pow", _pow, legacy=True)


@kernel("Mod", 10)
def Mod(xp, a, b, fmod=0):
    if fmod and a.dtype.kind in "iu":
        # exact C remainder (cupy's integer fmod goes through double)
        y = a - _div(xp, a, b) * b
    else:
        with np.errstate(divide="ignore", invalid="ignore"):
            y = xp.fmod(a, b) if fmod else xp.mod(a, b)
    return (xp.asarray(y),)


_variadic("Sum", "add")
_variadic("Max", "maximum")
_variadic("Min", "minimum")


@kernel("Mean")
def Mean(xp, *xs, consumed_inputs=None):
    if len(xs) == 1:
        return (xs[0],)
    s = _fold(xp, xp.add, xs)
    return (_keep(xp.asarray(s / len(xs)), xs[0]),)


# ---------------------------------------------------------------- comparisons and logic
_binary("Equal", lambda xp, a, b: a == b, legacy=True)
_binary("Greater", lambda xp, a, b: a > b, legacy=True)
_binary("Less", lambda xp, a, b: a < b, legacy=True)
_binary("GreaterOrEqual", lambda xp, a, b: a >= b, 12)
_binary("LessOrEqual", lambda xp, a, b: a <= b, 12)
_binary("And", lambda xp, a, b: xp.logical_and(a, b), legacy=True)
_binary("Or", lambda xp, a, b: xp.logical_or(a, b), legacy=True)
_binary("Xor", lambda xp, a, b: xp.logical_xor(a, b), legacy=True)
_binary("BitwiseAnd", lambda xp, a, b: xp.bitwise_and(a, b), 18)
_binary("BitwiseOr", lambda xp, a, b: xp.bitwise_or(a, b), 18)
_binary("BitwiseXor", lambda xp, a, b: xp.bitwise_xor(a, b), 18)


@kernel("Where", 9)
def Where(xp, condition, x, y):
    return (xp.asarray(xp.where(condition, x, y)),)


@kernel("BitShift", 11)
def BitShift(xp, x, y, direction="LEFT"):
    # Shift counts outside [0, bits) are undefined in C (and cupy): opset 28 defines
    # them as the sign fill, which for in-range unsigned shifts changes nothing.
    bits = x.dtype.itemsize * 8
    signed = x.dtype.kind == "i"
    valid = (y < bits) & (y >= 0) if signed else y < bits
    if direction == "RIGHT":
        if signed:
            # shifting by bits-1 yields exactly the sign fill (-1 or 0)
            z = xp.right_shift(x, xp.where(valid, y, bits - 1).astype(x.dtype, copy=False))
        else:
            z = xp.where(valid, xp.right_shift(x, xp.minimum(y, bits - 1)), 0)
    elif direction == "LEFT":
        ys = xp.clip(y, 0, bits - 1) if signed else xp.minimum(y, bits - 1)
        if signed:
            udt = np.dtype(f"u{x.dtype.itemsize}")
            z = xp.left_shift(x.view(udt), ys.astype(udt)).view(x.dtype)
        else:
            z = xp.left_shift(x, ys)
        z = xp.where(valid, z, 0)
    else:
        raise ValueError(f"BitShift: direction must be LEFT or RIGHT, not {direction!r}")
    return (xp.asarray(z).astype(x.dtype, copy=False),)
