"""Conv's paths (kernels/conv.py) against onnx.reference: each path forced on the shapes
it serves, odd geometry included (stride and dilation > 1, asymmetric pads, auto_pad,
groups between 1 and the channel count, 1-D/2-D/3-D, batch 1 and > 1), the choice of
path, and the choice made at compile time through a session."""

from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import wait

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from hetero_exec.kernels import native, registry
from hetero_exec.kernels._conv_numpy import band_tile
from hetero_exec.kernels._conv_path import ConvPath, choose_path, conv_full
from hetero_exec.kernels.native import library
from tests.conftest import to_numpy
from tests.kernels._ref import activation_reference, check, reference

RTOL, ATOL = 1e-4, 1e-4


def f32(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def forced(xp, kind, x, w, b=None, **attrs):
    """Our Conv through the path ``kind``, against the reference evaluator."""
    want = reference("Conv", [x, w] + ([b] if b is not None else []), **attrs)[0]
    got = conv_full(xp, xp.asarray(x), xp.asarray(w), None if b is None else xp.asarray(b),
                    path=ConvPath(kind), **attrs)
    got = to_numpy(got)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


# --------------------------------------------------------------------------- depthwise

DEPTHWISE = [
    # x shape, kernel, attrs
    ((1, 8, 12, 12), (3, 3), {"pads": [1, 1, 1, 1]}),
    ((3, 8, 12, 12), (3, 3), {"pads": [1, 1, 1, 1]}),
    ((2, 6, 13, 11), (3, 3), {"pads": [1, 1, 1, 1], "strides": [2, 2]}),
    ((2, 5, 16, 16), (7, 7), {"pads": [3, 3, 3, 3]}),
    ((1, 5, 16, 16), (7, 7), {"pads": [3, 3, 3, 3], "strides": [2, 2]}),
    ((2, 4, 15, 17), (3, 5), {"pads": [0, 2, 1, 0], "strides": [1, 3]}),  # asymmetric
    ((2, 4, 14, 14), (3, 3), {"dilations": [2, 2], "pads": [2, 2, 2, 2]}),
    ((1, 4, 14, 14), (3, 3), {"dilations": [2, 1], "strides": [2, 1]}),
    ((2, 3, 10, 10), (3, 3), {"auto_pad": "SAME_UPPER", "strides": [2, 2]}),
    ((2, 3, 10, 10), (4, 4), {"auto_pad": "SAME_LOWER"}),
    ((2, 3, 10, 10), (3, 3), {"auto_pad": "VALID", "strides": [3, 3]}),
    ((1, 3, 5, 40), (3, 3), {"pads": [1, 1, 1, 1]}),  # 40 columns: tiles of 10 (no padding tile)
    ((2, 3, 5, 37), (3, 3), {"pads": [1, 1, 1, 1]}),  # 37 columns: a partial last tile
    ((1, 3, 4, 4), (5, 5), {"pads": [2, 2, 2, 2]}),  # kernel wider than the input
    ((2, 6, 20), (5,), {"pads": [2, 1], "strides": [2]}),  # 1-D
    ((1, 6, 33), (3,), {"dilations": [3], "auto_pad": "SAME_UPPER"}),  # 1-D, dilated
]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("xs, k, attrs", DEPTHWISE)
def test_depthwise_band(xp, xs, k, attrs, bias):
    c = xs[1]
    w = f32(c, 1, *k, seed=1)
    forced(xp, "depthwise", f32(*xs), w, f32(c, seed=2) if bias else None, group=c, **attrs)


needs_native = pytest.mark.skipif(not library.available(),
                                  reason=f"C kernels off: {library.unavailable_reason()}")


@needs_native
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("xs, k, attrs", DEPTHWISE)
def test_depthwise_native(xs, k, attrs, bias, dtype):
    c = xs[1]
    x, w = f32(*xs).astype(dtype), f32(c, 1, *k, seed=1).astype(dtype)
    forced(np, "depthwise_native", x, w, f32(c, seed=2).astype(dtype) if bias else None,
           group=c, **attrs)


@needs_native
def test_depthwise_native_reads_strided_inputs():
    """A non-contiguous input (a channel slice) and a float16 one (computed in float32)."""
    x = f32(2, 12, 9, 9)[:, ::2]
    forced(np, "depthwise_native", x, f32(6, 1, 3, 3, seed=1), f32(6, seed=2), group=6,
           pads=[1, 1, 1, 1], strides=[2, 2])
    x16, w16 = f32(2, 4, 9, 9).astype(np.float16), f32(4, 1, 3, 3, seed=1).astype(np.float16)
    want = reference("Conv", [x16, w16], group=4, pads=[1, 1, 1, 1])[0]
    got = conv_full(np, x16, w16, None, group=4, pads=[1, 1, 1, 1],
                    path=ConvPath("depthwise_native"))
    assert got.dtype == np.float16
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)


def test_native_off_by_environment(monkeypatch):
    from hetero_exec.kernels._conv_path import path_for

    monkeypatch.setenv(native.ENV, "0")
    library.reset()
    try:
        assert not library.available() and native.ENV in library.unavailable_reason()
        assert path_for(np, (8, 1, 3, 3), 8, False).kind == "depthwise"
    finally:
        monkeypatch.delenv(native.ENV)
        library.reset()
    want = "depthwise_native" if library.available() else "depthwise"
    assert path_for(np, (8, 1, 3, 3), 8, False).kind == want


@pytest.mark.parametrize("xs, k, attrs", [
    ((2, 4, 9, 9), (3, 3), {"pads": [1, 1, 1, 1], "strides": [2, 2]}),
    ((1, 3, 5, 6, 7), (3, 3, 3), {"pads": [1, 0, 1, 1, 0, 1], "strides": [1, 2, 1]}),  # 3-D
    ((2, 4, 20), (3,), {"pads": [1, 1]}),
])
@pytest.mark.parametrize("mult", [1, 2])  # channel multiplier
def test_depthwise_taps(xp, xs, k, attrs, mult):
    c = xs[1]
    forced(xp, "depthwise_taps", f32(*xs), f32(c * mult, 1, *k, seed=1), f32(c * mult, seed=2),
           group=c, **attrs)


def test_band_tiles():
    assert [band_tile(w) for w in (4, 16, 32, 56, 28, 40, 37, 17)] == \
        [4, 16, 16, 14, 14, 10, 16, 16]


def test_band_cache_follows_the_weights(xp):
    """One path object, two weight arrays: the band is rebuilt for the second (by
    identity), and reused for the first again."""
    path = ConvPath("depthwise")
    x = xp.asarray(f32(2, 4, 9, 9))
    for seed in (1, 2, 1):
        w = f32(4, 1, 3, 3, seed=seed)
        want = reference("Conv", [to_numpy(x), w], group=4, pads=[1, 1, 1, 1])[0]
        got = conv_full(xp, x, xp.asarray(w), None, group=4, pads=[1, 1, 1, 1], path=path)
        np.testing.assert_allclose(to_numpy(got), want, rtol=RTOL, atol=ATOL)
    W = xp.asarray(f32(4, 1, 3, 3, seed=3))
    conv_full(xp, x, W, None, group=4, pads=[1, 1, 1, 1], path=path)
    band = path._band[3]
    conv_full(xp, x, W, None, group=4, pads=[1, 1, 1, 1], path=path)
    assert path._band[3] is band  # same weights, same geometry: built once


def test_depthwise_float16(xp):
    x, w = f32(2, 4, 9, 9).astype(np.float16), f32(4, 1, 3, 3, seed=1).astype(np.float16)
    check(xp, "Conv", [x, w], group=4, pads=[1, 1, 1, 1], rtol=1e-2, atol=1e-2)


# --------------------------------------------------------------------------- pointwise


@pytest.mark.parametrize("xs, ws, attrs", [
    ((1, 6, 8, 8), (4, 6, 1, 1), {}),
    ((3, 6, 8, 8), (4, 6, 1, 1), {}),  # small planes
    ((2, 6, 40, 40), (4, 6, 1, 1), {}),  # large planes (a GEMM split by columns in a run)
    ((2, 6, 9, 9), (4, 6, 1, 1), {"strides": [2, 2]}),
    ((1, 6, 9, 8), (4, 6, 1, 1), {"strides": [3, 2]}),
    ((2, 6, 8, 8), (4, 3, 1, 1), {"group": 2}),  # grouped 1x1
    ((2, 6, 40, 40), (6, 2, 1, 1), {"group": 3, "strides": [2, 2]}),
    ((2, 6, 8, 8), (4, 6, 1, 1), {"auto_pad": "SAME_UPPER", "strides": [2, 2]}),
    ((2, 6, 17), (4, 6, 1), {"strides": [2]}),  # 1-D
    ((1, 4, 3, 5, 6), (5, 4, 1, 1, 1), {}),  # 3-D
])
@pytest.mark.parametrize("bias", [False, True])
def test_pointwise(xp, xs, ws, attrs, bias):
    forced(xp, "pointwise", f32(*xs), f32(*ws, seed=1), f32(ws[0], seed=2) if bias else None,
           **attrs)


# --------------------------------------------------------------------------- im2col


@pytest.mark.parametrize("xs, ws, attrs", [
    ((2, 6, 9, 9), (4, 6, 3, 3), {"pads": [1, 1, 1, 1]}),
    ((1, 6, 11, 11), (6, 3, 3, 3), {"group": 2, "dilations": [2, 2], "pads": [2, 2, 2, 2]}),
    ((2, 6, 10, 9), (9, 2, 3, 2), {"group": 3, "pads": [1, 0, 2, 1], "strides": [2, 1]}),
    ((3, 8, 8, 8), (8, 2, 3, 3), {"group": 4, "auto_pad": "SAME_LOWER"}),
    ((2, 6, 12), (4, 3, 3), {"group": 2, "pads": [1, 2], "strides": [2]}),  # 1-D
    ((1, 4, 5, 6, 7), (6, 2, 3, 2, 3), {"group": 2, "pads": [1, 0, 1, 1, 0, 1]}),  # 3-D
    ((2, 5, 7, 7), (3, 5, 1, 1), {"pads": [1, 1, 0, 0]}),  # a padded 1x1
    ((2, 3, 40, 40), (4, 3, 3, 3), {"dilations": [2, 2], "auto_pad": "VALID"}),  # per-image GEMMs
    ((2, 3, 40, 40), (4, 3, 3, 3), {"dilations": [1, 2]}),  # the same, unpadded (no copy of x)
])
@pytest.mark.parametrize("bias", [False, True])
def test_im2col(xp, xs, ws, attrs, bias):
    forced(xp, "im2col", f32(*xs), f32(*ws, seed=1), f32(ws[0], seed=2) if bias else None,
           **attrs)


SHIFT = [  # x, w, attrs: output planes of at least 784 pixels, stride and dilation 1
    ((2, 6, 30, 30), (4, 6, 3, 3), {"pads": [1, 1, 1, 1]}),
    ((1, 3, 29, 31), (5, 3, 3, 3), {"pads": [0, 2, 1, 0]}),  # asymmetric
    ((1, 4, 28, 28), (6, 4, 5, 5), {"pads": [2, 2, 2, 2]}),
    ((2, 3, 32, 32), (4, 3, 3, 3), {"auto_pad": "VALID"}),
    ((1, 2, 30, 30), (3, 2, 2, 4), {"auto_pad": "SAME_LOWER"}),  # even, uneven kernel
    ((1, 5, 40, 24), (7, 5, 1, 3), {"pads": [0, 1, 0, 1]}),
]
SHIFT_FALLBACK = [  # asked for shift, computed by im2col
    ((1, 4, 40, 40), (6, 4, 3, 3), {"pads": [1, 1, 1, 1], "strides": [2, 2]}),
    ((1, 4, 40, 40), (6, 2, 3, 3), {"pads": [1, 1, 1, 1], "group": 2}),
    ((1, 4, 40, 40), (6, 4, 3, 3), {"pads": [2, 2, 2, 2], "dilations": [2, 2]}),
    ((2, 4, 12, 12), (6, 4, 3, 3), {"pads": [1, 1, 1, 1]}),  # 144 pixels: too few
    ((2, 4, 900), (6, 4, 3), {"pads": [1, 1]}),  # 1-D
]


@pytest.fixture
def shift_calls(monkeypatch):
    """How many times the shift path ran (the real function, counted)."""
    from hetero_exec.kernels import _conv_numpy as conv_numpy
    from hetero_exec.kernels.native import packed_gemm

    calls, real = [], conv_numpy.shift

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(conv_numpy, "shift", counted)
    # the path a CPU without AVX-512 takes: with it, packed_gemm's conv computes these
    # float32 convs (tests/kernels/test_packed_gemm.py)
    monkeypatch.setattr(packed_gemm, "conv_fits", lambda *args: False)
    return calls


@pytest.mark.parametrize("xs, ws, attrs", SHIFT + SHIFT_FALLBACK)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kind", ["shift", "im2col"])  # im2col nodes take it where it fits
def test_shift(shift_calls, kind, xs, ws, attrs, bias):
    forced(np, kind, f32(*xs), f32(*ws, seed=1), f32(ws[0], seed=2) if bias else None, **attrs)
    assert len(shift_calls) == ((xs, ws, attrs) in SHIFT)


@pytest.mark.parametrize("xs, ws, attrs", SHIFT[:3])
@pytest.mark.parametrize("name, params", [("Relu", None), ("Clip", (0.0, 6.0)), ("SiLU", None)])
def test_shift_epilogue(shift_calls, xs, ws, attrs, name, params):
    """The shift path's product, then the bias, residual and activation (compiled or not)."""
    from hetero_exec.kernels.fused import epilogue_activation

    x, w, b = f32(*xs), f32(*ws, seed=1), f32(ws[0], seed=2)
    conv = reference("Conv", [x, w, b], **attrs)[0].astype(np.float64)
    z = f32(*conv.shape, seed=3)
    act = name if name == "Relu" else epilogue_activation(name, params)
    got = conv_full(np, x, w, b, Z=z, activation=act, path=ConvPath("im2col"), **attrs)
    np.testing.assert_allclose(got, activation_reference(name, params, conv + z), rtol=RTOL, atol=ATOL)
    assert len(shift_calls) == 1


def test_shift_weights_cache_follows_the_weights(shift_calls):
    path = ConvPath("im2col")
    x = f32(1, 3, 30, 30)
    for seed in (1, 2, 2):
        w = f32(4, 3, 3, 3, seed=seed)
        got = conv_full(np, x, w, None, pads=[1, 1, 1, 1], path=path)
        np.testing.assert_allclose(got, reference("Conv", [x, w], pads=[1, 1, 1, 1])[0],
                                   rtol=RTOL, atol=ATOL)
    assert len(shift_calls) == 3


@pytest.fixture
def numpy_paths(monkeypatch):
    """The C kernels off (as in a tree that was not built): the numpy paths run."""
    monkeypatch.setenv(native.ENV, "0")
    library.reset()
    yield
    monkeypatch.delenv(native.ENV)
    library.reset()


@pytest.mark.parametrize("kind, xs, ws, attrs", [
    ("im2col", (2, 6, 9, 9), (4, 6, 3, 3), {"pads": [1, 1, 1, 1]}),
    ("im2col", (2, 6, 10, 9), (9, 2, 3, 2), {"group": 3, "pads": [1, 0, 2, 1], "strides": [2, 1]}),
    ("im2col", (2, 3, 40, 40), (4, 3, 3, 3), {"auto_pad": "VALID", "dilations": [2, 1]}),
    ("shift", (2, 3, 40, 40), (4, 3, 3, 3), {"auto_pad": "VALID"}),
    ("pointwise", (2, 6, 8, 8), (4, 6, 1, 1), {}),
])
def test_numpy_columns_and_epilogues(numpy_paths, kind, xs, ws, attrs):
    """Without the compiled kernels: numpy's im2col and its bias / residual / activation."""
    from hetero_exec.kernels.fused import epilogue_activation

    assert not library.available()
    x, w, b = f32(*xs), f32(*ws, seed=1), f32(ws[0], seed=2)
    forced(np, kind, x, w, b, **attrs)
    conv = reference("Conv", [x, w, b], **attrs)[0]
    z = f32(*conv.shape, seed=3)
    got = conv_full(np, x, w, b, Z=z, activation=epilogue_activation("Clip", (0.0, 6.0)),
                    path=ConvPath(kind), **attrs)
    np.testing.assert_allclose(got, np.clip(conv + z, 0, 6), rtol=RTOL, atol=ATOL)


# --------------------------------------------------------------------------- threads


@pytest.mark.parametrize("kind, xs, ws, attrs", [
    ("depthwise", (3, 24, 12, 12), (24, 1, 3, 3), {"group": 24, "pads": [1, 1, 1, 1]}),
    ("depthwise", (1, 24, 9, 9), (24, 1, 7, 7), {"group": 24, "pads": [3, 3, 3, 3]}),
    pytest.param("depthwise_native", (3, 24, 12, 12), (24, 1, 3, 3),
                 {"group": 24, "pads": [1, 1, 1, 1], "strides": [2, 2]}, marks=needs_native),
    pytest.param("depthwise_native", (2, 40, 6, 6), (40, 1, 3, 3),  # channels-last
                 {"group": 40, "pads": [1, 1, 1, 1]}, marks=needs_native),
    ("pointwise", (3, 8, 40, 40), (16, 8, 1, 1), {}),
    ("im2col", (5, 6, 9, 9), (8, 6, 3, 3), {"pads": [1, 1, 1, 1]}),  # wide GEMMs
    ("im2col", (3, 4, 36, 36), (6, 2, 3, 3), {"group": 2, "strides": [1, 2]}),  # per image
    ("shift", (3, 4, 30, 30), (6, 4, 3, 3), {"pads": [1, 1, 1, 1]}),
])
def test_paths_split_over_threads(monkeypatch, kind, xs, ws, attrs):
    """Every split a run can make (images, channels, GEMM rows or columns), forced."""
    from hetero_exec.kernels import _threads

    monkeypatch.setattr(_threads, "PARALLEL_FLOPS", 0)
    monkeypatch.setattr(_threads, "_MIN_PART", 4)
    with _threads.single_blas_thread():
        forced(np, kind, f32(*xs), f32(*ws, seed=1), f32(ws[0], seed=2), **attrs)


# --------------------------------------------------------------------------- the choice


def test_choose_path():
    assert choose_path(True, (8, 1, 3, 3), 8, False) == "depthwise"
    assert choose_path(True, (8, 1, 3, 3), 8, False, compiled=True) == "depthwise_native"
    assert choose_path(True, (16, 1, 3, 3), 8, False, compiled=True) == "depthwise_taps"
    assert choose_path(False, (8, 1, 3, 3), 8, False, compiled=True) == "depthwise_taps"
    assert choose_path(True, (8, 1, 7), 8, False) == "depthwise"  # 1-D
    assert choose_path(True, (8, 1, 3, 3, 3), 8, False) == "depthwise_taps"  # 3-D
    assert choose_path(True, (16, 1, 3, 3), 8, False) == "depthwise_taps"  # multiplier 2
    assert choose_path(False, (8, 1, 3, 3), 8, False) == "depthwise_taps"  # not numpy
    assert choose_path(True, (8, 4, 1, 1), 1, True) == "pointwise"
    assert choose_path(True, (8, 2, 1, 1), 2, True) == "pointwise"
    assert choose_path(True, (8, 4, 1, 1), 1, False) == "im2col"  # padded
    assert choose_path(True, (8, 2, 3, 3), 2, False) == "im2col"
    with pytest.raises(ValueError, match="unknown Conv path"):
        ConvPath("winograd")


def test_unspecialized_kernel_picks_its_path_per_call(xp):
    # the registered kernel, called directly (no compile-time hook), on every kind
    check(xp, "Conv", [f32(2, 6, 9, 9), f32(6, 1, 3, 3), f32(6)], group=6, pads=[1, 1, 1, 1])
    check(xp, "Conv", [f32(2, 6, 9, 9), f32(4, 6, 1, 1)], strides=[2, 2])
    check(xp, "Conv", [f32(2, 6, 9, 9), f32(6, 3, 3, 3)], group=2, pads=[0, 1, 1, 0])


def _conv_model(weight_input: bool = False):
    """Depthwise 3x3, pointwise, grouped 3x3 and a padded 3x3, chained, on [N, 8, 12, 12]."""
    rng = np.random.default_rng(0)
    ws = {"w_dw": rng.standard_normal((8, 1, 3, 3)).astype(np.float32),
          "w_pw": rng.standard_normal((12, 8, 1, 1)).astype(np.float32),
          "w_g": rng.standard_normal((12, 3, 3, 3)).astype(np.float32),
          "w_full": rng.standard_normal((4, 12, 3, 3)).astype(np.float32),
          "b": rng.standard_normal((8,)).astype(np.float32)}
    nodes = [
        helper.make_node("Conv", ["x", "w_dw", "b"], ["a"], group=8, pads=[1, 1, 1, 1],
                         strides=[2, 2]),
        helper.make_node("Conv", ["a", "w_pw"], ["p"]),
        helper.make_node("Conv", ["p", "w_g"], ["g"], group=4, pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["g", "w_full"], ["y"], pads=[0, 1, 2, 1]),
    ]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8, 12, 12])]
    inits = []
    for name, arr in ws.items():
        if weight_input and name == "w_dw":
            inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, list(arr.shape)))
        else:
            inits.append(numpy_helper.from_array(arr, name))
    graph = helper.make_graph(nodes, "convs", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 6, 6])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), ws


def chain_close(got, want):
    """Four float32 convs chained: outputs near 1e3, so a near-zero one carries ~1e-4 of
    rounding either way (the float32 reference is off the float64 one by as much)."""
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=1e-6 * np.abs(want).max())


def _session(model):
    from hetero_exec.session import InferenceSession

    return InferenceSession(model.SerializeToString(), providers=["cpu"])


def _paths(sess):
    return [getattr(s.fn, "path", None) for seg in sess._executor.segments
            for s in seg.plan.steps if s.node.op_type in ("Conv", "FusedConv")]


def test_session_chooses_paths_at_compile_time():
    from onnx.reference import ReferenceEvaluator

    model, _ = _conv_model()
    sess = _session(model)
    dw = "depthwise_native" if library.available() else "depthwise"
    assert [p.kind for p in _paths(sess)] == [dw, "pointwise", "im2col", "im2col"]
    ref = ReferenceEvaluator(model)
    for n in (1, 3):
        x = f32(n, 8, 12, 12, seed=n)
        chain_close(sess.run(None, {"x": x})[0], ref.run(None, {"x": x})[0])


def test_weights_fed_at_run_time_rebuild_the_band():
    from onnx.reference import ReferenceEvaluator

    model, ws = _conv_model(weight_input=True)
    sess, ref = _session(model), ReferenceEvaluator(model)
    x = f32(2, 8, 12, 12)
    for seed in (1, 2):
        w = f32(8, 1, 3, 3, seed=seed)
        chain_close(sess.run(None, {"x": x, "w_dw": w})[0], ref.run(None, {"x": x, "w_dw": w})[0])


def test_concurrent_runs_keep_their_own_buffers():
    """run_async callers on several threads: the scratch buffers are per thread."""
    from onnx.reference import ReferenceEvaluator

    model, _ = _conv_model()
    sess, ref = _session(model), ReferenceEvaluator(model)
    xs = [f32(2, 8, 12, 12, seed=s) for s in range(8)]
    futures = [sess.run_async(None, {"x": x}) for x in xs]
    wait(futures)
    for x, f in zip(xs, futures):
        chain_close(f.result()[0], ref.run(None, {"x": x})[0])


def test_a_failing_specialize_hook_falls_back(monkeypatch, caplog):
    from onnx.reference import ReferenceEvaluator

    def broken(xp, kwargs, inputs):
        raise RuntimeError("no path today")

    versions = registry._TABLE[("", "Conv")]
    for since, kdef in list(versions.items()):
        monkeypatch.setitem(versions, since, dataclasses.replace(kdef, specialize=broken))
    model, _ = _conv_model()
    with caplog.at_level(logging.WARNING, logger="hetero_exec.exec.plan"):
        sess = _session(model)
    assert "no path today" in caplog.text and "generic kernel" in caplog.text
    assert _paths(sess) == [None] * 4
    x = f32(1, 8, 12, 12)
    np.testing.assert_allclose(sess.run(None, {"x": x})[0],
                               ReferenceEvaluator(model).run(None, {"x": x})[0],
                               rtol=RTOL, atol=ATOL)


# --------------------------------------------------------------------------- FusedConv


@pytest.mark.parametrize("kind, ws, attrs", [
    ("depthwise", (6, 1, 3, 3), {"group": 6, "pads": [1, 1, 1, 1]}),
    ("pointwise", (6, 6, 1, 1), {}),
    ("im2col", (6, 3, 3, 3), {"group": 2, "pads": [1, 1, 1, 1]}),
])
def test_fused_conv_residual_and_activation(xp, kind, ws, attrs):
    """FusedConv's epilogue on every path: + Z, then Relu or a callable activation."""
    from hetero_exec.kernels.conv import FusedConv

    x, w, b, z = f32(2, 6, 7, 7), f32(*ws, seed=1), f32(6, seed=2), f32(2, 6, 7, 7, seed=3)
    conv = reference("Conv", [x, w, b], **attrs)[0] + z

    def relu6(xp_, y):
        xp_.clip(y, 0, 6, out=y)

    for activation, want in (("Relu", np.maximum(conv, 0)), (relu6, np.clip(conv, 0, 6))):
        got = conv_full(xp, xp.asarray(x), xp.asarray(w), xp.asarray(b), Z=xp.asarray(z),
                        activation=activation, path=ConvPath(kind), **attrs)
        np.testing.assert_allclose(to_numpy(got), want, rtol=RTOL, atol=ATOL)
    got = FusedConv(xp, xp.asarray(x), xp.asarray(w), xp.asarray(b), xp.asarray(z), "Relu",
                    **attrs)[0]
    np.testing.assert_allclose(to_numpy(got), np.maximum(conv, 0), rtol=RTOL, atol=ATOL)
    with pytest.raises(ValueError, match="unsupported activation"):
        FusedConv(xp, xp.asarray(x), xp.asarray(w), None, None, "Mish", **attrs)


@needs_native
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("name, params", [
    ("Relu", None), ("Clip", (0.0, 6.0)), ("Clip", (-1.0, np.inf)), ("HardSigmoid", (0.3, 0.4)),
    ("HardSwish", None), ("SiLU", None), ("Sigmoid", None), ("Tanh", None),
])
def test_depthwise_native_epilogue(name, params, residual):
    """The compiled epilogue (bias, activation) and a residual added before it, against
    the reference Conv and numpy's formula; NaN stays NaN through Relu and Clip."""
    from hetero_exec.kernels.fused import epilogue_activation

    x, w, b = f32(2, 6, 9, 9), f32(6, 1, 3, 3, seed=1), f32(6, seed=2)
    x[0, 0, 4, 4] = np.nan
    z = f32(2, 6, 5, 5, seed=3) if residual else None
    attrs = {"group": 6, "pads": [1, 1, 1, 1], "strides": [2, 2]}
    conv = reference("Conv", [x, w, b], **attrs)[0] + (0 if z is None else z)
    act = name if name == "Relu" else epilogue_activation(name, params)
    got = conv_full(np, x, w, b, Z=z, activation=act, path=ConvPath("depthwise_native"),
                    **attrs)
    with np.errstate(over="ignore", invalid="ignore"):
        want = activation_reference(name, params, conv)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    assert np.isnan(got).sum() == np.isnan(want).sum() > 0
