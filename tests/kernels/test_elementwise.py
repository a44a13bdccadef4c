"""Element-wise and cast kernels against onnx.reference (and exact expectations where
the reference lacks an opset's semantics)."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto

from tests.conftest import to_numpy
from tests.kernels._ref import check, ours, reference

RNG = np.random.default_rng(0)




def f32(*shape, lo=-3.0, hi=3.0):
    return RNG.uniform(lo, hi, shape).astype(np.float32)


# op -> input domain
UNARY = {
    "Abs": (-3, 3), "Neg": (-3, 3), "Ceil": (-3, 3), "Floor": (-3, 3), "Exp": (-3, 3),
    "Log": (0.1, 3), "Sqrt": (0, 3), "Reciprocal": (0.5, 3), "Tanh": (-3, 3), "Relu": (-3, 3),
    "Sign": (-3, 3), "Cos": (-3, 3), "Sin": (-3, 3), "Tan": (-1.5, 1.5), "Acos": (-1, 1),
    "Asin": (-1, 1), "Atan": (-3, 3), "Cosh": (-3, 3), "Sinh": (-3, 3), "Acosh": (1, 3),
    "Asinh": (-3, 3), "Atanh": (-0.99, 0.99), "Sigmoid": (-30, 30), "Softplus": (-30, 30),
    "Softsign": (-3, 3), "Mish": (-10, 10), "HardSwish": (-5, 5), "Erf": (-5, 5),
    "Elu": (-3, 3), "Celu": (-3, 3), "Selu": (-3, 3), "LeakyRelu": (-3, 3),
    "ThresholdedRelu": (-3, 3), "HardSigmoid": (-5, 5), "Shrink": (-2, 2), "Round": (-3, 3),
}


@pytest.mark.parametrize("op", sorted(UNARY))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_unary(xp, op, dtype):
    lo, hi = UNARY[op]
    x = RNG.uniform(lo, hi, (3, 4, 5)).astype(dtype)
    check(xp, op, [x], rtol=1e-5 if dtype == np.float32 else 1e-12)


@pytest.mark.parametrize("op", ["Relu", "Sigmoid", "Exp", "Erf", "Celu", "Elu", "Gelu", "LeakyRelu",
                                "Tanh", "Softplus", "Mish", "Selu"])
def test_unary_float16_and_scalar(xp, op):
    x = f32(6).astype(np.float16)
    opset = 20 if op == "Gelu" else 21
    check(xp, op, [x], opset=opset, rtol=2e-3, atol=1e-3)
    check(xp, op, [np.array(0.5, dtype=np.float32)], opset=opset)  # 0-d stays an array


def test_bfloat16_keeps_dtype(xp):
    if xp is not np:
        pytest.skip("ml_dtypes are host-only")
    x = f32(5).astype(ml_dtypes.bfloat16)
    for op, attrs in [("Celu", {"alpha": 2.0}), ("Elu", {}), ("LeakyRelu", {}), ("HardSigmoid", {}),
                      ("Selu", {}), ("Erf", {}), ("Softplus", {}), ("Mish", {}), ("Sigmoid", {}),
                      ("Gelu", {}), ("Gelu", {"approximate": "tanh"}), ("Swish", {}),
                      ("HardSwish", {})]:
        y = ours(xp, op, [x], opset=24, **attrs)[0]
        assert y.dtype == x.dtype, op


@pytest.mark.parametrize("attrs", [{"alpha": 0.5}, {"alpha": 2.0}])
@pytest.mark.parametrize("op", ["Elu", "Celu", "LeakyRelu", "ThresholdedRelu"])
def test_unary_alpha(xp, op, attrs):
    check(xp, op, [f32(4, 5)], **attrs)


def test_misc_activation_attrs(xp):
    x = f32(4, 5)
    check(xp, "Selu", [x], alpha=2.0, gamma=3.0)
    check(xp, "HardSigmoid", [x], alpha=0.5, beta=0.6)
    check(xp, "Shrink", [x], bias=1.5, lambd=1.0)
    check(xp, "Shrink", [np.arange(-5, 5, dtype=np.int32)], bias=1.0, lambd=1.5)
    check(xp, "Swish", [x], opset=24, alpha=1.5)
    check(xp, "Gelu", [x], opset=20, approximate="tanh")
    check(xp, "Gelu", [x], opset=20)
    check(xp, "PRelu", [f32(2, 3, 4), f32(3, 1)])
    check(xp, "PRelu", [np.arange(-6, 6, dtype=np.int32).reshape(3, 4), np.array([2], np.int32)])


def test_erf_accuracy(xp):
    edges = [0.0, 1e-30, -1e-9, 0.46875, 4.0, 30.0, np.inf, -np.inf]
    x = np.concatenate([np.linspace(-8, 8, 4001), edges])
    want = np.array([math.erf(v) for v in x])
    got = to_numpy(ours(xp, "Erf", [x])[0])
    np.testing.assert_allclose(got, want, rtol=1e-14, atol=0)
    got32 = to_numpy(ours(xp, "Erf", [x.astype(np.float32)])[0])
    assert got32.dtype == np.float32
    # float32 is evaluated in float32: within ~5 ulp (3.2e-7 measured) everywhere
    np.testing.assert_allclose(got32, want.astype(np.float32), rtol=4e-7, atol=1e-37)
    assert np.isnan(to_numpy(ours(xp, "Erf", [np.array([np.nan], np.float32)])[0])).all()


@pytest.mark.parametrize("op,attrs", [("Erf", {}), ("Gelu", {}), ("Gelu", {"approximate": "tanh"})])
def test_large_and_strided(xp, op, attrs):
    # past the blockwise threshold, on a transposed (non-contiguous) input
    x = RNG.uniform(-4, 4, (600, 300)).astype(np.float32).T
    check(xp, op, [x], opset=20, **attrs)
    check(xp, op, [x[:7, :5].astype(np.float16)], opset=20, rtol=2e-3, atol=1e-3, **attrs)


def test_round_half_to_even(xp):
    x = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 2.4, 2.6], np.float32)
    np.testing.assert_array_equal(to_numpy(ours(xp, "Round", [x])[0]), [0, 2, 2, -0, -2, -2, 2, 3])


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64, np.uint8, np.uint32, np.float16,
                                   np.float32])
@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div"])
def test_arith(xp, op, dtype):
    if np.dtype(dtype).kind == "f":
        a = f32(3, 4).astype(dtype)
        b = (f32(4, lo=0.5, hi=3) * RNG.choice([-1, 1], 4)).astype(dtype)
    else:
        info = np.iinfo(dtype)
        lo = max(info.min, -100)
        a = RNG.integers(lo, min(info.max, 100), (3, 4)).astype(dtype)
        b = RNG.integers(lo, min(info.max, 10), (4,)).astype(dtype)
        b[b == 0] = 3
    check(xp, op, [a, b], rtol=1e-3 if dtype == np.float16 else 1e-6)


def test_div_truncates(xp):
    a = np.array([7, -7, 7, -7, 6, -6, 0], np.int32)
    b = np.array([2, 2, -2, -2, 3, 3, 5], np.int32)
    np.testing.assert_array_equal(to_numpy(ours(xp, "Div", [a, b])[0]), [3, -3, -3, 3, 2, -2, 0])


def test_legacy_broadcast(xp):
    a, b = f32(2, 3, 4, 5), f32(3, 4)
    got = to_numpy(ours(xp, "Add", [a, b], opset=6, broadcast=1, axis=1)[0])
    np.testing.assert_allclose(got, a + b[:, :, None])
    got = to_numpy(ours(xp, "Mul", [a, f32(5)], opset=1, broadcast=1, consumed_inputs=[0])[0])
    assert got.shape == a.shape
    assert ours(xp, "Relu", [a], opset=1, consumed_inputs=[0])[0].shape == a.shape


@pytest.mark.parametrize("fmod", [0, 1])
@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64, np.uint16, np.float32, np.float64])
def test_mod(xp, fmod, dtype):
    if np.dtype(dtype).kind == "f":
        a = RNG.uniform(-10, 10, (3, 5)).astype(dtype)
        b = RNG.uniform(1, 4, (5,)).astype(dtype) * RNG.choice([-1, 1], 5).astype(dtype)
    elif np.dtype(dtype).kind == "u":
        a, b = RNG.integers(0, 100, (3, 5)).astype(dtype), RNG.integers(1, 9, (5,)).astype(dtype)
    else:
        a = RNG.integers(-100, 100, (3, 5)).astype(dtype)
        b = RNG.integers(1, 9, (5,)).astype(dtype) * RNG.choice([-1, 1], 5).astype(dtype)
    check(xp, "Mod", [a, b], opset=13, fmod=fmod)


@pytest.mark.parametrize("ta,tb", [(np.float32, np.float32), (np.float32, np.int64),
                                   (np.int64, np.float32), (np.int32, np.int32),
                                   (np.int64, np.int64), (np.float32, np.uint32)])
def test_pow(xp, ta, tb):
    a = np.array([[1, 2, 3], [4, 1, 2]], ta)
    b = np.array([2, 3, 1], tb)
    y = check(xp, "Pow", [a, b], opset=15)
    assert y[0].dtype == np.dtype(ta)


@pytest.mark.parametrize("op", ["Equal", "Greater", "Less", "GreaterOrEqual", "LessOrEqual"])
@pytest.mark.parametrize("dtype", [np.float32, np.int16, np.uint64])
def test_compare(xp, op, dtype):
    a = RNG.integers(0, 4, (3, 4)).astype(dtype)
    b = RNG.integers(0, 4, (4,)).astype(dtype)
    got = check(xp, op, [a, b])
    assert to_numpy(got[0]).dtype == np.bool_


def test_equal_string(xp):
    if xp is not np:
        pytest.skip("strings are host-only")
    a = np.array(["a", "b", "c"], dtype=object)
    check(xp, "Equal", [a, np.array(["a", "x", "c"], dtype=object)], opset=19)


@pytest.mark.parametrize("op", ["And", "Or", "Xor"])
def test_logic(xp, op):
    a = RNG.integers(0, 2, (2, 3, 4)).astype(bool)
    b = RNG.integers(0, 2, (3, 1)).astype(bool)
    check(xp, op, [a, b])
    check(xp, "Not", [a])


@pytest.mark.parametrize("op", ["BitwiseAnd", "BitwiseOr", "BitwiseXor"])
@pytest.mark.parametrize("dtype", [np.int16, np.uint8, np.uint64])
def test_bitwise(xp, op, dtype):
    a = RNG.integers(0, 200, (3, 4)).astype(dtype)
    b = RNG.integers(0, 200, (4,)).astype(dtype)
    check(xp, op, [a, b], opset=18)
    check(xp, "BitwiseNot", [a], opset=18)


@pytest.mark.parametrize("direction", ["LEFT", "RIGHT"])
@pytest.mark.parametrize("dtype", [np.uint8, np.uint32, np.uint64, np.int8, np.int32, np.int64])
def test_bitshift(xp, direction, dtype):
    bits = np.dtype(dtype).itemsize * 8
    x = np.array([1, 5, 100, 127, 3, 64], dtype)
    if np.dtype(dtype).kind == "i":
        x = np.concatenate([x, -x])
        y = np.array([0, 1, 3, bits - 1, bits, bits + 5, -1, 2, 7, 1, 0, -3], dtype)
    else:
        y = np.array([0, 1, 3, bits - 1, bits, bits + 5], dtype)
    check(xp, "BitShift", [x, y], opset=28, direction=direction)


def test_variadic(xp):
    a, b, c = f32(3, 2, 4), f32(2, 1), f32(4)  # reference Mean needs the full shape first
    for op in ["Sum", "Max", "Min", "Mean"]:
        check(xp, op, [a, b, c])
        check(xp, op, [a])
    i8 = [np.array([1, -3, 5], np.int8), np.array([2, -4, 0], np.int8)]
    check(xp, "Max", i8)
    check(xp, "Min", i8)
    check(xp, "Sum", i8)


def test_clip(xp):
    x = f32(3, 4, lo=-5, hi=5)
    check(xp, "Clip", [x], opset=6, min=-1.0, max=2.0)
    check(xp, "Clip", [x, np.array(-1, np.float32), np.array(2, np.float32)], opset=13)
    check(xp, "Clip", [x, None, np.array(2, np.float32)], opset=13)
    check(xp, "Clip", [x, np.array(-1, np.float32)], opset=13)
    check(xp, "Clip", [x, np.array(3, np.float32), np.array(1, np.float32)], opset=13)  # min > max
    xi = np.arange(-6, 6, dtype=np.int8)
    check(xp, "Clip", [xi, np.array(-2, np.int8), np.array(3, np.int8)], opset=13)
    check(xp, "Clip", [xi], opset=13)


def test_where_isinf_isnan(xp):
    c = RNG.integers(0, 2, (3, 4)).astype(bool)
    check(xp, "Where", [c, f32(3, 4), f32(4)])
    check(xp, "Where", [c, np.arange(4, dtype=np.int64), np.array(7, np.int64)])
    x = np.array([1.0, np.inf, -np.inf, np.nan, 0.0], np.float32)
    check(xp, "IsNaN", [x])
    for dn in (0, 1):
        for dp in (0, 1):
            check(xp, "IsInf", [x], detect_negative=dn, detect_positive=dp)


def test_identity(xp):
    x = f32(2, 3)
    assert ours(xp, "Identity", [x])[0].shape == (2, 3)


# ---------------------------------------------------------------- Cast / CastLike / BitCast
FLOATS = np.array([0.47892547, -0.48033667, 0.81910545, 1000000, 1e-7, -1e-7, -1000000, 448, 500,
                   57344, 1e5, np.nan, np.inf, -np.inf, 0.0, -2.5], np.float32)

CAST_TARGETS = ["FLOAT16", "DOUBLE", "INT32", "INT8", "UINT8", "BOOL", "BFLOAT16",
                "FLOAT8E4M3FN", "FLOAT8E4M3FNUZ", "FLOAT8E5M2", "FLOAT8E5M2FNUZ"]


def _same(got, want):
    got = to_numpy(got)
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype.kind in "fV":
        np.testing.assert_array_equal(got.astype(np.float64), want.astype(np.float64))
    else:
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("saturate", [0, 1])
@pytest.mark.parametrize("to", CAST_TARGETS)
def test_cast(xp, to, saturate):
    if xp is not np and to.startswith(("BFLOAT", "FLOAT8")):
        pytest.skip("ml_dtypes are host-only")
    x = FLOATS
    if to in ("INT8", "UINT8", "INT32"):
        x = np.array([0, 1.5, -2.7, 100, 7], np.float32)
    attrs = {"to": getattr(TensorProto, to), "saturate": saturate}
    for src in (x, x.astype(np.float16)):
        want = reference("Cast", [src], opset=21, **attrs)[0]
        _same(ours(xp, "Cast", [src], opset=21, **attrs)[0], want)
        like = np.zeros(1, want.dtype)
        want = reference("CastLike", [src, like], opset=21, saturate=saturate)[0]
        _same(ours(xp, "CastLike", [src, like], opset=21, saturate=saturate)[0], want)


@pytest.mark.parametrize("to", ["INT4", "UINT4", "FLOAT4E2M1", "INT2", "UINT2", "FLOAT8E8M0"])
def test_cast_small_types(xp, to):
    if xp is not np:
        pytest.skip("ml_dtypes are host-only")
    x = np.array([0.48, 0.25, 1.05, -3.5, 2, 1, 0.01, 6, 7.2], np.float32)
    for rm in (["up", "down", "nearest"] if to == "FLOAT8E8M0" else ["up"]):
        kw = {"round_mode": rm} if to == "FLOAT8E8M0" else {}
        want = reference("Cast", [np.abs(x)], opset=25, to=getattr(TensorProto, to), **kw)[0]
        _same(ours(xp, "Cast", [np.abs(x)], opset=25, to=getattr(TensorProto, to), **kw)[0], want)
    back = ours(xp, "Cast", [ours(xp, "Cast", [x], opset=25, to=getattr(TensorProto, to))[0]],
                opset=25, to=TensorProto.FLOAT)[0]
    assert back.dtype == np.float32


def test_cast_strings(xp):
    if xp is not np:
        pytest.skip("strings are host-only")
    x = np.array([0.47892547, 1e-7, 1e6, np.nan, -np.inf, 3.0], np.float32)
    s = ours(xp, "Cast", [x], to=TensorProto.STRING)[0]
    assert s.dtype == object and list(s) == list(x.astype(np.str_))
    back = ours(xp, "Cast", [np.array(["0.5", "NaN", "INF", "+INF", "-INF", "1e-3"], dtype=object)],
                to=TensorProto.FLOAT)[0]
    want = np.array([0.5, np.nan, np.inf, np.inf, -np.inf, 1e-3], np.float32)
    np.testing.assert_array_equal(back, want)
    ints = ours(xp, "Cast", [np.array(["12", "-7"], dtype=object)], to=TensorProto.INT64)[0]
    np.testing.assert_array_equal(ints, [12, -7])
    s = ours(xp, "Cast", [np.array([1, -2], np.int32)], to=TensorProto.STRING)[0]
    assert list(s) == ["1", "-2"]
    b16 = ours(xp, "Cast", [np.array(["1.5"], dtype=object)], to=TensorProto.BFLOAT16)[0]
    assert b16.dtype == ml_dtypes.bfloat16 and float(b16[0]) == 1.5
    # Cast-1 names the target type with a string
    assert ours(xp, "Cast", [x], opset=1, to="DOUBLE")[0].dtype == np.float64


def test_bitcast(xp):
    x = np.array([1.0, -2.5, 3.75], np.float32)
    check(xp, "BitCast", [x], opset=26, to=TensorProto.INT32)
    check(xp, "BitCast", [np.array([True, False])], opset=26, to=TensorProto.UINT8)
    check(xp, "BitCast", [np.array(1.5, np.float64)], opset=26, to=TensorProto.INT64)
