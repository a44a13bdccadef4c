"""Fast paths: Pow by small constant exponents, the float32 Erf, and the internal fused
kernels (FusedConv, FusedMatMul, FusedGelu) against the unfused ops."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.conftest import to_numpy
from tests.kernels._ref import check, ours, reference

RNG = np.random.default_rng(11)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("e", [0.0, 0.5, 1.0, 2.0, 3.0, -1.0, 1.5])
def test_pow_small_exponents(xp, dtype, e):
    a = np.concatenate([RNG.uniform(-3, 3, 40), [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-3]])
    a = a.astype(dtype)
    if e in (0.5, 1.5):
        a = np.abs(a) * np.where(np.arange(a.size) % 7 == 0, -1, 1).astype(dtype)  # a few < 0
    b = np.array(e, dtype=np.float32)
    tol = 2e-3 if dtype == np.float16 else 1e-6
    with np.errstate(all="ignore"):
        want = reference("Pow", [a, b], opset=15)[0]
        got = to_numpy(ours(xp, "Pow", [a, b], opset=15)[0])
    assert got.dtype == want.dtype and got.shape == want.shape
    if xp is not np:
        # device power is C's pow (CuPy, and sim-cupy's float16): pow(-inf, .5) = +inf and
        # pow(-0, .5) = +0, where numpy's sqrt path (and onnxruntime) give nan and -0
        keep = ~(np.isneginf(a) | ((a == 0) & np.signbit(a)))
        got, want = got[keep], want[keep]
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=0)
    # signs of zeros as the reference (numpy's power) gives them
    np.testing.assert_array_equal(np.signbit(got[np.isfinite(want) & (want == 0)]),
                                  np.signbit(want[np.isfinite(want) & (want == 0)]))


def test_pow_fast_path_keeps_broadcast_shape(xp):
    a = RNG.standard_normal((3,)).astype(np.float32)
    b = np.array([[2.0]], np.float32)  # a (1, 1) exponent broadcasts a to (1, 3)
    check(xp, "Pow", [a, b], opset=15)


def test_erf_float32_accuracy_and_specials(xp):
    x = np.concatenate([np.linspace(-6, 6, 20001), [0.0, -0.0, np.inf, -np.inf, 3.83, 3.84, 1e-30]])
    x32 = x.astype(np.float32)
    want = np.array([math.erf(float(v)) for v in x32])
    got = to_numpy(ours(xp, "Erf", [x32])[0])
    assert got.dtype == np.float32
    assert np.abs(got - want).max() <= 3.5e-7
    assert np.all(np.abs(got) <= 1)
    assert np.signbit(got[np.nonzero(x32 == 0)[0][1]])  # erf(-0) = -0
    # float64 stays exact; a large input goes blockwise
    big = RNG.uniform(-5, 5, 300_000).astype(np.float32)
    want_big = np.array([math.erf(float(v)) for v in big[:2000]])
    np.testing.assert_allclose(to_numpy(ours(xp, "Erf", [big])[0])[:2000], want_big, atol=3.5e-7, rtol=0)


def _conv_ref(X, W, B, Z, act, **attrs):
    args = [X, W] + ([B] if B is not None else [])
    y = reference("Conv", args, opset=11, **attrs)[0]
    if Z is not None:
        y = y + Z
    if act == "Relu":
        y = np.maximum(y, 0)
    return y


@pytest.mark.parametrize("shape,w_shape,attrs", [
    ((1, 4, 40, 40), (6, 4, 3, 3), {"pads": [1, 1, 1, 1]}),  # one image, wide plane
    ((3, 4, 9, 9), (6, 4, 3, 3), {"pads": [1, 1, 1, 1], "strides": [2, 2]}),  # small planes
    ((2, 6, 8, 8), (6, 1, 3, 3), {"pads": [1, 1, 1, 1], "group": 6}),  # depthwise
    ((2, 4, 8, 8), (6, 2, 3, 3), {"group": 2}),  # grouped
    ((2, 4, 33, 33), (6, 4, 1, 1), {}),  # stride-1 1x1: no column copy
])
@pytest.mark.parametrize("with_z", [False, True])
@pytest.mark.parametrize("act", ["", "Relu"])
def test_fused_conv(xp, shape, w_shape, attrs, with_z, act):
    X = RNG.standard_normal(shape).astype(np.float32)
    W = RNG.standard_normal(w_shape).astype(np.float32)
    B = RNG.standard_normal(w_shape[0]).astype(np.float32)
    plain = reference("Conv", [X, W, B], opset=11, **attrs)[0]
    Z = RNG.standard_normal(plain.shape).astype(np.float32) if with_z else None
    want = _conv_ref(X, W, B, Z, act, **attrs)
    got = to_numpy(ours(xp, "FusedConv", [X, W, B, Z], opset=1, domain="hetero_exec",
                        activation=act, **attrs)[0])
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("a_shape", [(5, 8), (2, 3, 8), (8,)])
@pytest.mark.parametrize("act", ["", "Relu"])
def test_fused_matmul(xp, a_shape, act):
    A = RNG.standard_normal(a_shape).astype(np.float32)
    Bm = RNG.standard_normal((8, 6)).astype(np.float32)
    bias = RNG.standard_normal(6).astype(np.float32)
    want = A @ Bm + bias
    if act:
        want = np.maximum(want, 0)
    got = to_numpy(ours(xp, "FusedMatMul", [A, Bm, bias], opset=1, domain="hetero_exec",
                        activation=act)[0])
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_fused_gelu(xp, approximate):
    x = RNG.uniform(-6, 6, (4, 300)).astype(np.float32)
    want = reference("Gelu", [x], opset=20, approximate=approximate)[0]
    got = to_numpy(ours(xp, "FusedGelu", [x], opset=1, domain="hetero_exec",
                        approximate=approximate)[0])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
