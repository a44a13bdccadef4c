"""The C kernels' activations and row norms (kernels/native: act.c, norm.c), the switch
that turns the library off, and the epilogues and GELU against numpy formulas (the
depthwise kernel is in test_conv_paths.py). float64 runs the numpy definitions."""

from __future__ import annotations

import numpy as np
import pytest

from hetero_exec.kernels import native
from hetero_exec.kernels.erf_gelu import Gelu
from hetero_exec.kernels.fused import FusedMatMul, epilogue_activation
from hetero_exec.kernels.native import library, row_kernels
from hetero_exec.kernels.native.activation import activation_args
from tests.kernels._ref import activation_reference

needs_native = pytest.mark.skipif(not library.available(),
                                  reason=f"C kernels off: {library.unavailable_reason()}")


def test_off_by_environment(monkeypatch):
    monkeypatch.setenv(native.ENV, "off")
    library.reset()
    try:
        assert not library.available() and "off" in library.unavailable_reason()
        assert not library.takes(np, np.zeros(3, np.float32))
        x = np.linspace(-3, 3, 50, dtype=np.float32)
        np.testing.assert_allclose(Gelu(np, x)[0], _gelu_ref(x), rtol=1e-6, atol=1e-6)
    finally:
        monkeypatch.delenv(native.ENV)
        library.reset()


def _gelu_ref(x):
    return activation_reference("Gelu", None, x)


@needs_native
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype, tol", [(np.float32, 1e-6), (np.float64, 1e-12)])
def test_gelu(dtype, tol, approximate):
    x = np.concatenate([np.linspace(-12, 12, 4000),
                        [0.0, -0.0, 1e-30, -1e-30, 1e30, -1e30, np.inf, -np.inf, np.nan, 0.5]])
    x = x.astype(dtype).reshape(-1, 1, 10)[::-1]  # odd shape, a reversed (strided) view
    got = Gelu(np, x, approximate)[0]
    assert got.dtype == dtype and got.shape == x.shape
    want = activation_reference("GeluTanh" if approximate == "tanh" else "Gelu", None, x)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=tol, atol=tol)
    assert got[x == np.inf].tolist() == [np.inf]


ACTS = [("", None), ("Relu", None), ("Clip", (0.0, 6.0)), ("HardSigmoid", (0.3, 0.4)),
        ("HardSwish", None), ("Gelu", None), ("GeluTanh", None), ("SiLU", None),
        ("Sigmoid", None), ("Tanh", None)]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("name, params", ACTS)
def test_fused_matmul_epilogue(name, params, bias):
    """activation(A @ B + bias) along the last axis, compiled (the dtype's) or numpy's."""
    rng = np.random.default_rng(1)
    a = rng.standard_normal((3, 7, 16)).astype(np.float32)
    b = (rng.standard_normal((16, 24)) * 0.5).astype(np.float32)
    c = rng.standard_normal(24).astype(np.float32) if bias else None
    product = a.astype(np.float64) @ b + (0 if c is None else c)
    want = activation_reference(name, params, product)
    got = FusedMatMul(np, a, b, c, name, params)[0]
    assert got.dtype == np.float32 and got.shape == (3, 7, 24)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind, ws, attrs", [
    ("pointwise", (6, 4, 1, 1), {}),
    ("im2col", (6, 2, 3, 3), {"group": 2, "pads": [1, 1, 1, 1]}),
])
@pytest.mark.parametrize("name, params", ACTS)
def test_conv_epilogue(kind, ws, attrs, name, params):
    """FusedConv's bias + residual + activation after the products, compiled or not."""
    from hetero_exec.kernels._conv_path import ConvPath, conv_full
    from tests.kernels._ref import reference

    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 4, 7, 7)).astype(np.float32)
    w = (rng.standard_normal(ws) * 0.5).astype(np.float32)
    b = rng.standard_normal(6).astype(np.float32)
    z = rng.standard_normal((2, 6, 7, 7)).astype(np.float32)
    conv = reference("Conv", [x, w, b], **attrs)[0].astype(np.float64)
    want = activation_reference(name, params, conv + z)
    act = name if name in ("", "Relu") else epilogue_activation(name, params)
    got = conv_full(np, x, w, b, Z=z, activation=act, path=ConvPath(kind), **attrs)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@needs_native
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape, axis, with_scale, with_bias", [
    ((4, 7, 33), -1, True, True), ((4, 7, 33), 1, True, False), ((1, 5), -1, False, False),
    ((3, 2, 8), -1, False, True)])
def test_layer_norm(shape, axis, with_scale, with_bias, dtype):
    """LayerNormalization (and its mean / inverse deviation outputs) by the row kernel."""
    from tests.kernels._ref import check

    rng = np.random.default_rng(3)
    x = (rng.standard_normal(shape) * 3 + 1).astype(dtype)
    tail = shape[axis:]
    scale = rng.standard_normal(tail).astype(dtype) if with_scale else np.ones(tail, dtype)
    bias = rng.standard_normal(tail).astype(dtype) if with_bias else None
    if dtype == np.float32:
        check(np, "LayerNormalization", [x, scale, bias], opset=17, rtol=1e-5, atol=1e-5,
              n_outputs=3, axis=axis, epsilon=1e-3)
        return
    # float64 stash (11): beyond onnx.reference, so against the formula
    from hetero_exec.kernels.norm import LayerNormalization

    axes = tuple(range(axis % x.ndim, x.ndim))
    mean = x.mean(axis=axes, keepdims=True)
    inv = 1 / np.sqrt(((x - mean) ** 2).mean(axis=axes, keepdims=True) + 1e-3)
    want = (x - mean) * inv * scale + (0 if bias is None else bias)
    got = LayerNormalization(np, x, scale, bias, axis=axis, epsilon=1e-3, stash_type=11,
                             num_outputs=3)
    for g, w in zip(got, (want, mean, inv)):
        assert g.dtype == dtype and g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-10)


@needs_native
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_rms_norm(dtype):
    from hetero_exec.kernels.norm import RMSNormalization

    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 5, 24)).astype(dtype)
    scale = rng.standard_normal(24).astype(dtype)
    want = x / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True) + 1e-6) * scale
    for s in (scale, None):
        got = RMSNormalization(np, x, s, epsilon=1e-6, stash_type=0)[0]
        assert got.dtype == dtype
        np.testing.assert_allclose(got, want if s is not None else want / scale, rtol=1e-5,
                                   atol=1e-5)


def test_conv_epilogue_broadcast_residual():
    """A residual that only broadcasts to the output (not what the fusion makes, but a
    FusedConv node may say so) takes numpy's add."""
    from hetero_exec.kernels._conv_path import ConvPath, conv_full
    from tests.kernels._ref import reference

    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 4, 5, 5)).astype(np.float32)
    w = rng.standard_normal((6, 4, 1, 1)).astype(np.float32)
    b = rng.standard_normal(6).astype(np.float32)
    z = rng.standard_normal((1, 6, 1, 5)).astype(np.float32)
    got = conv_full(np, x, w, b, Z=z, activation="Relu", path=ConvPath("pointwise"))
    want = np.maximum(reference("Conv", [x, w, b])[0] + z, 0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@needs_native
@pytest.mark.parametrize("name", ["GeluTanh", "SiLU", "Sigmoid", "Tanh"])
def test_compiled_tanh_family_special_values(name):
    """The rational tanh behind tanh GELU, SiLU, Sigmoid and Tanh: within 1e-6 (absolute,
    and relative for large values) of numpy's formulas, infinities and NaN as they give.
    float32 SiLU is the exception, within 2.2e-6: below x = -16 its logistic rounds to 0,
    where x * e^x is still up to -1.7e-6 (onnxruntime's rational logistic trades alike)."""
    x = np.concatenate([np.linspace(-30, 30, 6001), [0.0, -0.0, 1e-30, 1e30, -1e30, 88.0, -88.0,
                                                     np.inf, -np.inf, np.nan]]).astype(np.float32)
    out = row_kernels.unary(x, *activation_args(name))
    with np.errstate(over="ignore", invalid="ignore"):
        want = activation_reference(name, None, x.astype(np.float64))
    np.testing.assert_array_equal(np.isnan(out), np.isnan(want))
    finite = np.isfinite(want)
    atol = 2.2e-6 if name == "SiLU" else 1e-6
    np.testing.assert_allclose(out[finite], want[finite], rtol=1e-6, atol=atol)
    np.testing.assert_array_equal(out[~finite & ~np.isnan(want)], want[~finite & ~np.isnan(want)])


@needs_native
@pytest.mark.parametrize("name, params", ACTS)
@pytest.mark.parametrize("size", [1, 15, 4096, 4096 * 3 + 17])
def test_unary_matches_the_numpy_definition(name, params, size):
    """row_kernels.unary (act.c, runs of 4096 split over the workers, a ragged tail)
    against the numpy formulas, in place too."""
    rng = np.random.default_rng(7)
    x = (rng.standard_normal(size) * 4).astype(np.float32)
    want = activation_reference(name, params, x.astype(np.float64))
    got = row_kernels.unary(x, *activation_args(name, params))
    assert got.dtype == np.float32 and got.shape == x.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2.2e-6)


@needs_native
@pytest.mark.parametrize("with_bias, with_z", [(False, False), (True, False), (True, True),
                                               (False, True)])
@pytest.mark.parametrize("name, params", ACTS)
def test_channels_epilogue_matches_the_numpy_definition(name, params, with_bias, with_z):
    """row_kernels.channels: act(Y + bias[channel] + z) over (N, M, L) rows, L ragged."""
    rng = np.random.default_rng(8)
    y = rng.standard_normal((2, 5, 3, 7)).astype(np.float32)
    b = rng.standard_normal(5).astype(np.float32) if with_bias else None
    z = rng.standard_normal(y.shape).astype(np.float32) if with_z else None
    pre = y.astype(np.float64) + (0 if z is None else z) + (0 if b is None else b[:, None, None])
    want = activation_reference(name, params, pre)
    row_kernels.channels(y, b, z, *activation_args(name, params))
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=2.2e-6)
