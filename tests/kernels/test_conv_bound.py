"""A Conv node's calls bound to an input shape (kernels/_conv_bound.py): the same
results as the general route, at every shape, weight and layout fed."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from hetero_exec import InferenceSession
from hetero_exec.kernels import _conv_bound, conv
from hetero_exec.kernels import _conv_native as conv_native
from hetero_exec.kernels._conv_path import ConvPath, conv_full
from hetero_exec.kernels.fused import epilogue_activation
from hetero_exec.kernels.native import packed_gemm as pg
from hetero_exec.kernels.native import plane_kernels

pytestmark = pytest.mark.skipif(not pg.available(), reason=f"no packed kernels: "
                                f"{pg.unavailable_reason()}")


def _f(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _block(rng, C=8, E=24):
    """An inverted residual block, as MobileNetV2's: 1x1 expand + Relu6, depthwise 3x3 +
    Relu6, 1x1 project, residual Add; then a 3x3 conv with HardSwish."""
    w = {"we": (E, C, 1, 1), "wd": (E, 1, 3, 3), "wp": (C, E, 1, 1), "wc": (C, C, 3, 3)}
    inits = {k: rng.standard_normal(s, dtype=np.float32) * 0.3 for k, s in w.items()}
    inits.update({"b" + k[1]: rng.standard_normal(w[k][0], dtype=np.float32) for k in w})
    inits.update(lo=np.array(0, np.float32), hi=np.array(6, np.float32))
    nodes = [helper.make_node("Conv", ["x", "we", "be"], ["e"]),
             helper.make_node("Clip", ["e", "lo", "hi"], ["e6"]),
             helper.make_node("Conv", ["e6", "wd", "bd"], ["d"], group=E, pads=[1, 1, 1, 1]),
             helper.make_node("Clip", ["d", "lo", "hi"], ["d6"]),
             helper.make_node("Conv", ["d6", "wp", "bp"], ["p"]),
             helper.make_node("Add", ["p", "x"], ["r"]),
             helper.make_node("Conv", ["r", "wc", "bc"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("HardSwish", ["c"], ["y"])]
    graph = helper.make_graph(nodes, "block", [_f("x", ["N", C, "H", "W"])],
                              [_f("y", ["N", C, "H", "W"])],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_bound_calls_agree_at_every_shape_and_skip_the_general_route(monkeypatch):
    rng = np.random.default_rng(0)
    model = _block(rng)
    sess = InferenceSession(model.SerializeToString(), ["cpu"])
    ref = ReferenceEvaluator(model)
    general: list[int] = []
    full = conv.conv_full
    monkeypatch.setattr(conv, "conv_full", lambda *a, **k: general.append(1) or full(*a, **k))
    # (planes wide enough for the packed 3x3 conv: conv_fits)
    for shape in [(1, 8, 9, 14), (3, 8, 9, 14), (1, 8, 9, 14), (2, 8, 12, 30)]:
        x = rng.standard_normal(shape, dtype=np.float32)
        np.testing.assert_allclose(sess.run(None, {"x": x})[0], ref.run(None, {"x": x})[0],
                                   rtol=1e-4, atol=1e-4)
    assert not general, "every conv of the block took a compiled kernel, bound"


def test_a_weight_fed_each_run_rebinds():
    """A weight that is a graph input is bound anew for each array fed (never the
    first run's weight kept)."""
    rng = np.random.default_rng(1)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
         helper.make_node("Relu", ["c"], ["y"])], "g",
        [_f("x", [1, 4, 8, 8]), _f("w", [6, 4, 3, 3])], [_f("y", [1, 6, 8, 8])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    sess, ref = InferenceSession(model.SerializeToString(), ["cpu"]), ReferenceEvaluator(model)
    x = rng.standard_normal((1, 4, 8, 8), dtype=np.float32)
    w = rng.standard_normal((6, 4, 3, 3), dtype=np.float32)
    for weight in (w, w * -2, w.copy()):
        feeds = {"x": x, "w": weight}
        np.testing.assert_allclose(sess.run(None, feeds)[0], ref.run(None, feeds)[0],
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind, ws, attrs", [
    ("depthwise_native", (6, 1, 3, 3), {"group": 6, "pads": [1, 1, 1, 1], "strides": [2, 1]}),
    ("pointwise", (10, 6, 1, 1), {}),
    ("pointwise", (10, 6, 1, 1), {"strides": [2, 3]}),  # ResNet's downsampling shortcut
    ("im2col", (10, 6, 3, 3), {"pads": [1, 0, 1, 2]}),
])
@pytest.mark.parametrize("activation", ["", "Clip", "HardSigmoid"])
def test_bind_matches_the_reference(kind, ws, attrs, activation):
    """A strided view of the input and a residual, the activation in the store (Clip)
    or after it (HardSigmoid); the general route agrees too."""
    rng = np.random.default_rng(2)
    act = epilogue_activation(activation, (0.0, 6.0) if activation == "Clip" else None)
    big = rng.standard_normal((2, 9, 11, 16), dtype=np.float32)
    x = big[:, 1:7, :, 2:15]  # not contiguous
    w = rng.standard_normal(ws, dtype=np.float32)
    b = rng.standard_normal(ws[0], dtype=np.float32)
    conv_ref = ReferenceEvaluator(_conv_act_model(w, b, attrs, "", group=attrs.get("group", 1)))
    want = conv_ref.run(None, {"x": np.ascontiguousarray(x)})[0]
    z = rng.standard_normal(want.shape, dtype=np.float32)
    want = want + z
    if activation == "Clip":
        want = np.clip(want, 0.0, 6.0)
    elif activation == "HardSigmoid":
        want = np.clip(0.2 * want + 0.5, 0.0, 1.0)
    np.testing.assert_allclose(conv_full(np, x, w, b, Z=z, activation=act, path=ConvPath(kind),
                                         **attrs), want, rtol=1e-5, atol=1e-4)
    calls = _conv_bound.BoundCalls(ConvPath(kind), act)
    call = calls.get(x, w, b, z, attrs)
    assert call is not None
    for _ in range(2):  # bound, then the kept call
        np.testing.assert_allclose(calls.get(x, w, b, z, attrs)(x, z), want, rtol=1e-5,
                                   atol=1e-4)


def test_calls_the_kernels_do_not_take_keep_the_general_route():
    rng = np.random.default_rng(3)
    x64 = rng.standard_normal((1, 4, 6, 6))
    w = rng.standard_normal((5, 4, 1, 1), dtype=np.float32)
    calls = _conv_bound.BoundCalls(ConvPath("pointwise"), "")
    assert calls.get(x64, w, None, None, {}) is None  # float64
    x = x64.astype(np.float32)
    assert calls.get(x[:, :3], w, None, None, {}) is None  # channels the weight lacks
    grouped = _conv_bound.BoundCalls(ConvPath("im2col"), "")
    assert grouped.get(x, rng.standard_normal((4, 2, 3, 3), dtype=np.float32), None, None,
                       {"group": 2}) is None


def test_the_table_stays_bounded():
    rng = np.random.default_rng(4)
    w = rng.standard_normal((5, 4, 1, 1), dtype=np.float32)
    calls = _conv_bound.BoundCalls(ConvPath("pointwise"), "")
    for n in range(1, 2 * _conv_bound.LIMIT + 2):
        x = rng.standard_normal((n, 4, 3, 3), dtype=np.float32)
        np.testing.assert_allclose(calls.get(x, w, None, None, {})(x, None),
                                   np.einsum("mc,nchw->nmhw", w[:, :, 0, 0], x), rtol=1e-5,
                                   atol=1e-5)
        assert len(calls._calls) <= _conv_bound.LIMIT


@pytest.mark.parametrize("k, shape", [((2, 2), (2, 5, 12, 12)), ((4, 4), (1, 3, 17, 18)),
                                      ((2, 3), (3, 4, 9, 10)), ((16, 16), (2, 3, 32, 48))])
@pytest.mark.parametrize("activation", ["", "Relu", "HardSigmoid"])
def test_a_kernel_that_tiles_its_input_is_one_product(monkeypatch, k, shape, activation):
    """Kernel = strides, no padding (patch embeddings, ConvNeXt's downsampling): the
    input's tiles copied out once and one product by the packed weight; rows and columns
    the tiles leave over are dropped, as the conv drops them. Bound and general route."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal(shape, dtype=np.float32)
    w = rng.standard_normal((7, shape[1], *k), dtype=np.float32)
    b = rng.standard_normal(7, dtype=np.float32)
    attrs = {"strides": list(k)}
    want = ReferenceEvaluator(_conv_act_model(w, b, attrs, activation)).run(None, {"x": x})[0]
    cut: list[int] = []
    tiles = conv_native.patches
    monkeypatch.setattr(conv_native, "patches", lambda *a: cut.append(1) or tiles(*a))
    act = epilogue_activation(activation)
    got = conv_full(np, x, w, b, activation=act, path=ConvPath("im2col"), **attrs)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    call = _conv_bound.BoundCalls(ConvPath("im2col"), act).get(x, w, b, None, attrs)
    np.testing.assert_allclose(call(x, None), want, rtol=1e-5, atol=1e-4)
    assert cut == [1, 1]


def _conv_act_model(w, b, attrs, activation, group=1):
    attrs = {k: v for k, v in attrs.items() if k != "group"}
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], group=group, **attrs),
             helper.make_node(activation or "Identity", ["c"], ["y"])]
    graph = helper.make_graph(nodes, "g", [_f("x", None)], [_f("y", None)],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("xs, ws, attrs", [
    ((1, 32, 7, 7), (64, 32, 3, 3), {"pads": [1, 1, 1, 1]}),  # ResNet-18's last stage
    ((3, 16, 14, 14), (72, 16, 3, 3), {"pads": [1, 1, 1, 1], "strides": [2, 2]}),
    ((2, 8, 9, 5), (64, 8, 3, 3), {"pads": [2, 0, 1, 2], "dilations": [2, 1]}),
    ((1, 8, 6, 6), (80, 8, 5, 5), {"pads": [2, 2, 2, 2], "strides": [1, 2]}),
    ((1, 8, 9, 9), (64, 8, 3, 3), {"auto_pad": "SAME_UPPER", "strides": [2, 2]}),
])
@pytest.mark.parametrize("activation, residual", [("", False), ("Relu", True), ("Clip", False),
                                                  ("Clip", True), ("HardSigmoid", True)])
def test_narrow_planes_take_pixel_patches(monkeypatch, xs, ws, attrs, activation, residual):
    """Planes too narrow for the packed conv's lanes (conv_fits says no), by a weight of
    at least 64 channels: each output pixel's patch a row, times the weight packed
    transposed (plane_kernels.conv_patches, PackedRight), against the reference."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal(xs, dtype=np.float32)
    w = rng.standard_normal(ws, dtype=np.float32) * 0.2
    b = rng.standard_normal(ws[0], dtype=np.float32)
    want = ReferenceEvaluator(_conv_act_model(w, b, attrs, "")).run(None, {"x": x})[0]
    z = rng.standard_normal(want.shape, dtype=np.float32) if residual else None
    if residual:
        want = want + z
    params = (0.0, 1.5) if activation == "Clip" else None
    if activation == "Relu":
        want = np.maximum(want, 0)
    elif activation == "Clip":
        want = np.clip(want, 0.0, 1.5)
    elif activation == "HardSigmoid":
        want = np.clip(0.2 * want + 0.5, 0.0, 1.0)
    taken: list[int] = []
    patches = plane_kernels.conv_patches
    monkeypatch.setattr(plane_kernels, "conv_patches", lambda *a, **k: taken.append(1) or patches(*a, **k))
    act = epilogue_activation(activation, params)
    calls = _conv_bound.BoundCalls(ConvPath("im2col"), act)
    for _ in range(2):  # bound, then the kept call
        np.testing.assert_allclose(calls.get(x, w, b, z, attrs)(x, z), want, rtol=1e-4,
                                   atol=1e-4)
    assert taken == [1, 1]
