"""Shape / data-movement, gather-scatter, resampling and detection kernels against
onnx.reference (and exact expectations where the reference is wrong or silent)."""

from __future__ import annotations

import functools
import types

import numpy as np
import pytest
from onnx import TensorProto

from hetero_exec.kernels._tensor_common import scatter_reduce
from tests.conftest import to_numpy
from tests.kernels._ref import check as _check
from tests.kernels._ref import ours, reference

check = functools.partial(_check, atol=1e-5)

RNG = np.random.default_rng(0)




def f32(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def i64(*v):
    return np.array(v, dtype=np.int64)


X3 = f32(3, 4, 5)


# --------------------------------------------------------------------------- shape ops

SHAPE_CASES = [
    ("Reshape", [X3, i64(5, 0, -1)], 14, {}),
    ("Reshape", [X3, i64(-1)], 14, {}),
    ("Reshape", [np.zeros((0, 3), np.float32), i64(3, 0)], 14, {"allowzero": 1}),
    ("Transpose", [X3], 13, {}),
    ("Transpose", [X3], 13, {"perm": [1, 2, 0]}),
    ("Squeeze", [f32(1, 3, 1, 2)], 13, {}),
    ("Squeeze", [f32(1, 3, 1, 2), i64(-2)], 13, {}),
    ("Squeeze", [f32(1, 3, 1, 2)], 11, {"axes": [0, 2]}),
    ("Unsqueeze", [X3, i64(1, -1, 0)], 13, {}),
    ("Unsqueeze", [X3], 11, {"axes": [-1, 0]}),
    ("Flatten", [X3], 13, {"axis": 0}),
    ("Flatten", [X3], 13, {"axis": -1}),
    ("Flatten", [X3], 13, {"axis": 3}),
    ("Shape", [X3], 15, {"start": 1}),
    ("Shape", [X3], 15, {"start": -2, "end": -1}),
    ("Size", [X3], 13, {}),
    ("Concat", [X3, f32(3, 2, 5), f32(3, 1, 5)], 13, {"axis": -2}),
    ("Expand", [np.array([[1.0], [2.0]], np.float32), i64(2, 1, 6)], 13, {}),
    ("Expand", [X3, i64(1, 1)], 13, {}),
    ("Tile", [X3, i64(2, 1, 3)], 13, {}),
    ("DepthToSpace", [f32(1, 8, 2, 3)], 13, {"blocksize": 2, "mode": "DCR"}),
    ("DepthToSpace", [f32(1, 8, 2, 3)], 13, {"blocksize": 2, "mode": "CRD"}),
    ("SpaceToDepth", [f32(2, 2, 4, 6)], 13, {"blocksize": 2}),
    ("CenterCropPad", [X3, i64(5, 2, 8)], 18, {}),
    ("CenterCropPad", [X3, i64(6, 3)], 18, {"axes": [-1, 0]}),
]


@pytest.mark.parametrize("op,inputs,opset,attrs", SHAPE_CASES,
                         ids=lambda v: v if isinstance(v, str) else "")
def test_shape_ops(xp, op, inputs, opset, attrs):
    check(xp, op, inputs, opset, **attrs)


def test_reshape_v1():
    got = ours(np, "Reshape", [X3], opset=1, shape=[5, 0, -1])[0]
    np.testing.assert_array_equal(got, X3.reshape(5, 4, 3))


def test_views_not_copies():
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    assert np.shares_memory(ours(np, "Reshape", [x, i64(6, 4)], opset=14)[0], x)
    assert np.shares_memory(ours(np, "Transpose", [x], opset=13, perm=[2, 0, 1])[0], x)
    assert np.shares_memory(ours(np, "Squeeze", [x[None], i64(0)], opset=13)[0], x)
    assert np.shares_memory(ours(np, "Unsqueeze", [x, i64(0)], opset=13)[0], x)
    assert np.shares_memory(ours(np, "Slice", [x, i64(1), i64(3), i64(2)], opset=13)[0], x)


@pytest.mark.parametrize("starts,ends,axes,steps", [
    ([0, 1], [2, 3], [0, 2], [1, 1]),
    ([-1], [-100], [1], [-1]),
    ([10], [-10], [2], [-2]),
    ([1, 0, 0], [1000, 4, 5], None, None),
    ([-2], [100], [-1], [3]),
    ([2**63 - 1], [-2**63], [2], [-1]),
])
def test_slice(xp, starts, ends, axes, steps):
    inputs = [X3, i64(*starts), i64(*ends)]
    if axes is not None:
        inputs.append(i64(*axes))
    if steps is not None:
        inputs.append(i64(*steps))
    check(xp, "Slice", inputs, 13)


def test_slice_v1(xp):
    check(xp, "Slice", [X3], 1, starts=[0, 1], ends=[2, 100], axes=[0, 2])


@pytest.mark.parametrize("opset,inputs,attrs,n", [
    (2, [X3], {"axis": 1, "split": [1, 3]}, 2),
    (11, [X3], {"axis": 0}, 3),
    (13, [X3, i64(2, 3)], {"axis": -1}, 2),
    (18, [X3], {"axis": 2, "num_outputs": 3}, 3),  # uneven: 5 -> 2, 2, 1
    (18, [X3], {"axis": 2, "num_outputs": 2}, 2),  # 5 -> 3, 2
    (18, [X3], {"axis": 1, "num_outputs": 2}, 2),
])
def test_split(xp, opset, inputs, attrs, n):
    want = reference("Split", inputs, opset=opset, n_outputs=n, **attrs)
    kw = dict(attrs)
    num = kw.pop("num_outputs", n)
    got = ours(xp, "Split", inputs, opset=opset, num_outputs=num, **kw)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(to_numpy(g), w)


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge", "wrap"])
def test_pad(xp, mode):
    check(xp, "Pad", [X3, i64(1, 0, 2, 0, 3, 1), np.array(1.5, np.float32)], 18, mode=mode)
    check(xp, "Pad", [X3, i64(1, 0, 2, 0, 3, 1), None, i64(0, 1, 2)], 18, mode=mode)
    check(xp, "Pad", [X3, i64(2, 1, 1, 3), None, i64(2, -3)], 18, mode=mode)
    check(xp, "Pad", [X3, i64(1, 0, 2, 0, 3, 1)], 11, mode=mode)
    if mode != "wrap":
        check(xp, "Pad", [X3], 2, mode=mode, pads=[1, 0, 2, 0, 3, 1], value=2.0)


def test_pad_negative_crops(xp):
    got = to_numpy(ours(xp, "Pad", [X3, i64(1, -1, 2, 0, 3, -2)], opset=18, mode="edge")[0])
    want = np.pad(X3[:, 1:, :3], [(1, 0), (0, 3), (2, 0)], mode="edge")
    np.testing.assert_array_equal(got, want)
    got = ours(xp, "Pad", [X3, i64(-1, 2), np.array(0.5, np.float32), i64(-1)], opset=18)[0]
    got = to_numpy(got)
    want = np.pad(X3[:, :, 1:], [(0, 0), (0, 0), (0, 2)], constant_values=0.5)
    np.testing.assert_array_equal(got, want)


def test_pad_int(xp):
    x = RNG.integers(0, 9, (3, 4)).astype(np.int32)
    check(xp, "Pad", [x, i64(1, 2, 0, 1), np.array(7, np.int32)], 18)


# --------------------------------------------------------------------------- generators, selection


def test_constants(xp):
    check(xp, "ConstantOfShape", [i64(2, 3)], 9)
    got = ours(xp, "ConstantOfShape", [i64(2, 3)], opset=9, value=np.array([7], np.int8))[0]
    assert to_numpy(got).dtype == np.int8 and (to_numpy(got) == 7).all()
    got = ours(xp, "Constant", [], opset=13, value_floats=[1.0, 2.0])[0]
    assert to_numpy(got).dtype == np.float32
    assert to_numpy(ours(xp, "Constant", [], opset=13, value_int=3)[0]).dtype == np.int64
    np.testing.assert_array_equal(to_numpy(ours(xp, "Constant", [], opset=13, value=X3)[0]), X3)


def test_constant_sparse():
    from onnx import helper
    sp = helper.make_sparse_tensor(helper.make_tensor("v", TensorProto.FLOAT, [2], [5.0, 6.0]),
                                   helper.make_tensor("i", TensorProto.INT64, [2], [1, 5]), [2, 3])
    got = ours(np, "Constant", [], opset=13, sparse_value=sp)[0]
    np.testing.assert_array_equal(got, [[0, 5, 0], [0, 0, 6]])


@pytest.mark.parametrize("args", [
    (np.array(10, np.int64), np.array(-3, np.int64), np.array(-3, np.int64)),
    (np.array(0.5, np.float64), np.array(3.1, np.float64), np.array(0.25, np.float64)),
    (np.array(1, np.float32), np.array(5, np.float32), np.array(2, np.float32)),
    (np.array(0, np.int32), np.array(0, np.int32), np.array(1, np.int32)),
])
def test_range(xp, args):
    check(xp, "Range", list(args), 11)


def test_onehot_eyelike_trilu(xp):
    check(xp, "OneHot", [i64(0, -1, 9, 2), np.array(4.0, np.float32), np.array([2, 5], np.int32)],
          11, axis=0)
    check(xp, "OneHot", [np.array([[0, 3], [-1, 9]], np.int64), np.array(4, np.int64),
                         np.array([0.0, 1.0], np.float32)], 11, axis=1)
    check(xp, "EyeLike", [f32(4, 5)], 22, k=-2, dtype=TensorProto.INT32)
    check(xp, "EyeLike", [f32(3, 3)], 22, k=1)
    t = f32(2, 3, 4, 5)
    for upper in (0, 1):
        for k in (None, -2, 1, 7):
            inputs = [t] + ([np.array(k, np.int64)] if k is not None else [])
            check(xp, "Trilu", inputs, 14, upper=upper)


def test_selection(xp):
    check(xp, "NonZero", [np.array([[1, 0], [0, 3]], np.float32)], 13)
    check(xp, "Compress", [X3, np.array([1, 0, 1], bool)], 11, axis=2)
    check(xp, "Compress", [X3, np.array([1, 0, 1, 1], bool)], 11)
    s = f32(4, 3, 2)
    check(xp, "ReverseSequence", [s, i64(2, 0, 4)], 10, batch_axis=1, time_axis=0)
    check(xp, "ReverseSequence", [s.transpose(1, 0, 2).copy(), i64(1, 4, 3)], 10,
          batch_axis=0, time_axis=1)


@pytest.mark.parametrize("axis", [None, 0, 1, -1])
@pytest.mark.parametrize("sorted_", [0, 1])
def test_unique(xp, axis, sorted_):
    u = np.array([[1, 3, 1], [2, 2, 0], [1, 3, 1]], np.float32)
    if axis is None and not sorted_:  # the reference indexes rows with flat indices here
        y, idx, inv, cnt = (to_numpy(v) for v in ours(xp, "Unique", [u], opset=11, sorted=0))
        np.testing.assert_array_equal(y, [1, 3, 2, 0])
        np.testing.assert_array_equal(idx, [0, 1, 3, 5])
        np.testing.assert_array_equal(inv, [0, 1, 0, 2, 2, 3, 0, 1, 0])
        np.testing.assert_array_equal(cnt, [4, 2, 2, 1])
        return
    kw = {"sorted": sorted_} if axis is None else {"sorted": sorted_, "axis": axis}
    check(xp, "Unique", [u], 11, n_outputs=4, **kw)


def test_dropout(xp):
    x = f32(3, 4, 5)
    y, mask = ours(xp, "Dropout", [x], opset=10, ratio=0.3, num_outputs=2)
    np.testing.assert_array_equal(to_numpy(y), x)
    assert to_numpy(mask).dtype == bool and to_numpy(mask).all()
    check(xp, "Dropout", [x, np.array(0.3, np.float32), np.array(True)], 13, seed=3)
    y = to_numpy(ours(xp, "Dropout", [x, np.array(0.5, np.float32), np.array(True)], opset=13)[0])
    kept = y != 0
    np.testing.assert_allclose(y[kept], 2 * x[kept], rtol=1e-6)


# --------------------------------------------------------------------------- gather / scatter

D = f32(4, 5)
G4 = f32(2, 3, 4, 5)


def test_gather(xp):
    check(xp, "Gather", [D, np.array([[0, -1], [2, 3]], np.int64)], 13, axis=1)
    check(xp, "Gather", [D, np.array(-2, np.int64)], 13, axis=0)
    check(xp, "Gather", [D, np.array([3, 0], np.int32)], 13, axis=-2)
    check(xp, "GatherElements", [D, np.array([[0, -1, 2, 1, 1], [3, 3, 0, 1, 2]], np.int64)], 13,
          axis=0)
    got = ours(xp, "GatherElements", [D, np.array([[0, -1], [2, 3]], np.int64)], opset=13,
               axis=1)[0]
    np.testing.assert_array_equal(to_numpy(got), [[D[0, 0], D[0, 4]], [D[1, 2], D[1, 3]]])
    check(xp, "GatherND", [G4, np.array([[1, 2, 3], [0, 0, -1]], np.int64)], 13)
    check(xp, "GatherND", [G4, np.array([[[1, -1], [0, 2]], [[2, 3], [1, 1]]], np.int64)], 13,
          batch_dims=1)


@pytest.mark.parametrize("reduction", ["none", "add", "mul", "max", "min"])
def test_scatter(xp, reduction):
    idx = np.array([[0, 1, 0], [3, 3, -1]], np.int64)
    upd = f32(2, 3)
    check(xp, "ScatterElements", [D, idx, upd], 18, axis=0, reduction=reduction)
    check(xp, "ScatterElements", [D, idx, upd], 18, axis=1, reduction=reduction)
    rows = np.array([[1], [0], [1], [-1]], np.int64)
    check(xp, "ScatterND", [D, rows, f32(4, 5)], 18, reduction=reduction)
    points = np.array([[1, 2], [1, 2], [0, 4]], np.int64)
    check(xp, "ScatterND", [D, points, f32(3)], 18, reduction=reduction)


def test_scatter_deprecated(xp):
    idx = np.array([[0, 1, 0], [3, 3, 1]], np.int64)
    upd = f32(2, 3)
    got = to_numpy(ours(xp, "Scatter", [D, idx, upd], opset=9, axis=1)[0])
    want = reference("ScatterElements", [D, idx, upd], opset=11, axis=1)[0]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("reduction", ["add", "mul", "max", "min"])
def test_scatter_reduce_without_ufunc_at(reduction):
    """The fallback cupy takes where a ufunc has no ``.at``: rounds of unique indices."""

    class NoAt:
        def __init__(self, f):
            self.f = f

        def __call__(self, *a, **k):
            return self.f(*a, **k)

    fake = types.SimpleNamespace(**{n: getattr(np, n) for n in dir(np) if not n.startswith("__")})
    for n in ("add", "multiply", "maximum", "minimum"):
        setattr(fake, n, NoAt(getattr(np, n)))
    out = f32(6, 3)
    idx = np.array([5, 0, 5, 2, 5, 0, 1], np.int64)
    upd = f32(7, 3)
    want = out.copy()
    name = {"add": "add", "mul": "multiply", "max": "maximum", "min": "minimum"}[reduction]
    getattr(np, name).at(want, idx, upd)
    scatter_reduce(fake, out, idx, upd, reduction)
    np.testing.assert_allclose(out, want, rtol=1e-6)


def test_tensor_scatter(xp):
    pc = f32(2, 3, 6, 4)
    up = f32(2, 3, 2, 4)
    check(xp, "TensorScatter", [pc, up, i64(1, 5)], 24, mode="circular")
    check(xp, "TensorScatter", [pc, up, i64(0, 4)], 24)
    check(xp, "TensorScatter", [pc, up], 24)
    check(xp, "TensorScatter", [f32(2, 6, 4), f32(2, 6, 2), i64(1, 2)], 24, axis=-1)


# --------------------------------------------------------------------------- resampling

XR = f32(1, 2, 5, 7)


@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
@pytest.mark.parametrize("ctm", ["half_pixel", "asymmetric", "align_corners", "pytorch_half_pixel",
                                 "tf_crop_and_resize"])
def test_resize(xp, mode, ctm):
    roi = None
    if ctm == "tf_crop_and_resize":
        roi = np.array([0, 0, 0.1, 0.2, 1, 1, 0.8, 0.95], np.float32)
    attrs = dict(mode=mode, coordinate_transformation_mode=ctm, extrapolation_value=-3.0)
    for scales in ([1, 1, 2.0, 1.5], [1, 1, 0.6, 0.45]):
        check(xp, "Resize", [XR, roi, np.array(scales, np.float32)], 19, **attrs)
        if mode != "nearest":
            check(xp, "Resize", [XR, roi, np.array(scales, np.float32)], 19, antialias=1,
                  exclude_outside=1, **attrs)
    check(xp, "Resize", [XR, roi, None, i64(1, 2, 3, 11)], 19, **attrs)


@pytest.mark.parametrize("nearest_mode",
                         ["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"])
def test_resize_nearest_modes(xp, nearest_mode):
    check(xp, "Resize", [XR, None, np.array([1, 1, 1.7, 0.7], np.float32)], 19,
          nearest_mode=nearest_mode)


@pytest.mark.parametrize("policy", ["stretch", "not_larger", "not_smaller"])
def test_resize_axes(xp, policy):
    for axes in ([2, 3], [3, 2]):
        check(xp, "Resize", [XR, None, None, i64(9, 4)], 19, mode="linear", axes=axes,
              keep_aspect_ratio_policy=policy)


def test_resize_uint8(xp):
    x = RNG.integers(0, 255, (1, 3, 6, 6)).astype(np.uint8)
    for mode in ("nearest", "linear", "cubic"):
        check(xp, "Resize", [x, None, np.array([1, 1, 1.5, 0.7], np.float32)], 19, atol=1.01,
              mode=mode)


def test_resize_v10_and_upsample(xp):
    x = np.arange(8, dtype=np.float32).reshape(1, 1, 2, 4)
    # Resize-10 / Upsample: asymmetric coordinates, nearest truncates upsampling, ceils down
    down = np.array([1, 1, 0.6, 0.6], np.float32)
    got = to_numpy(ours(xp, "Resize", [x, down], opset=10, mode="nearest")[0])
    np.testing.assert_array_equal(got, [[[[0, 2]]]])
    got = to_numpy(ours(xp, "Resize", [x, down], opset=10, mode="linear")[0])
    np.testing.assert_allclose(got, [[[[0, 5 / 3]]]], rtol=1e-6)
    check(xp, "Upsample", [x, np.array([1, 1, 2, 3], np.float32)], 9)
    got = ours(xp, "Upsample", [x], opset=7, mode="linear", scales=[1.0, 1.0, 2.0, 2.0])[0]
    got = to_numpy(got)
    assert got.shape == (1, 1, 4, 8)
    np.testing.assert_allclose(got[0, 0, 1, :3], [2, 2.5, 3])


@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
@pytest.mark.parametrize("padding_mode", ["zeros", "border", "reflection"])
def test_gridsample(xp, mode, padding_mode):
    x = f32(2, 2, 4, 5)
    grid = RNG.uniform(-1.4, 1.4, (2, 3, 4, 2)).astype(np.float32)
    for ac in (0, 1):
        check(xp, "GridSample", [x, grid], 22, mode=mode, padding_mode=padding_mode,
              align_corners=ac)
    if mode != "cubic":
        x = f32(1, 2, 3, 4, 5)
        grid = RNG.uniform(-1.2, 1.2, (1, 2, 3, 2, 3)).astype(np.float32)
        check(xp, "GridSample", [x, grid], 22, mode=mode, padding_mode=padding_mode)


def test_affine_grid(xp):
    for ac in (0, 1):
        check(xp, "AffineGrid", [f32(2, 2, 3), i64(2, 3, 4, 5)], 20, align_corners=ac)
        check(xp, "AffineGrid", [f32(2, 3, 4), i64(2, 3, 2, 4, 5)], 20, align_corners=ac)


@pytest.mark.parametrize("mode", ["avg", "max"])
@pytest.mark.parametrize("ctm", ["half_pixel", "output_half_pixel"])
def test_roialign(xp, mode, ctm):
    x = f32(2, 3, 10, 12)
    rois = np.array([[0, 0, 9, 9], [1.3, 2.2, 7.7, 5.1], [-3, -2, 15, 14], [5, 5, 5.2, 5.1]],
                    np.float32)
    bi = i64(0, 1, 1, 0)
    for sr, ss in ((0, 1.0), (2, 0.5)):
        check(xp, "RoiAlign", [x, rois, bi], 22, rtol=1e-4, atol=1e-4, mode=mode,
              coordinate_transformation_mode=ctm, sampling_ratio=sr, spatial_scale=ss,
              output_height=3, output_width=4)


@pytest.mark.parametrize("center_point_box", [0, 1])
def test_nms(xp, center_point_box):
    boxes = RNG.uniform(0, 10, (2, 30, 4)).astype(np.float32)
    if center_point_box:
        boxes[..., 2:] *= 0.5
    scores = RNG.uniform(0, 1, (2, 3, 30)).astype(np.float32)
    scores[0, 0, :5] = 0.5  # ties: lower index first
    for max_out, iou, thr in ((5, 0.3, None), (100, 0.5, 0.4), (0, 0.5, None)):
        inputs = [boxes, scores, i64(max_out), np.array([iou], np.float32)]
        if thr is not None:
            inputs.append(np.array([thr], np.float32))
        check(xp, "NonMaxSuppression", inputs, 11, center_point_box=center_point_box)
