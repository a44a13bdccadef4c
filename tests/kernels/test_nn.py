"""Conv / pool / norm / linalg / quant kernels against onnx.reference (and hand-written
expectations where the reference lacks an op or a case)."""

from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto

from tests.conftest import to_numpy
from tests.kernels._ref import ours, reference

RNG = np.random.default_rng(0)


def f32(*shape, lo=-2.0, hi=2.0):
    return RNG.uniform(lo, hi, shape).astype(np.float32)


def compare(got, want, rtol, atol):
    assert isinstance(got, tuple)
    assert len(got) >= len(want)
    for w, g in zip(want, got):
        g = to_numpy(g)
        assert isinstance(g, np.ndarray)
        assert g.dtype == w.dtype, (g.dtype, w.dtype)
        assert g.shape == w.shape, (g.shape, w.shape)
        if w.dtype.kind in "fV":
            np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64),
                                       rtol=rtol, atol=atol)
        else:
            np.testing.assert_array_equal(g, w)


def check(xp, op, inputs, opset=22, rtol=1e-4, atol=1e-5, n_outputs=1, **attrs):
    want = reference(op, inputs, opset=opset, n_outputs=n_outputs, **attrs)
    extra = {"num_outputs": n_outputs} if op in _WANTS_N else {}
    got = ours(xp, op, inputs, opset=opset, **attrs, **extra)
    compare(got, want, rtol, atol)
    return got


_WANTS_N = {"MaxPool", "BatchNormalization", "LayerNormalization"}


# --------------------------------------------------------------------------- Conv


CONV_CASES = [
    # x shape, w shape, attrs
    ((2, 3, 9, 9), (4, 3, 3, 3), {}),
    ((2, 3, 9, 9), (4, 3, 3, 3), {"pads": [1, 1, 1, 1]}),
    ((2, 3, 9, 10), (4, 3, 3, 2), {"pads": [1, 0, 2, 1], "strides": [2, 1]}),
    ((1, 4, 11, 11), (6, 2, 3, 3), {"group": 2, "dilations": [2, 2], "pads": [2, 2, 2, 2]}),
    ((1, 6, 8, 8), (6, 1, 3, 3), {"group": 6, "pads": [1, 1, 1, 1]}),  # depthwise
    # depthwise with channel multiplier 2
    ((2, 4, 8, 8), (8, 1, 3, 3), {"group": 4, "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ((2, 5, 7, 7), (3, 5, 1, 1), {}),  # 1x1
    ((2, 5, 7, 7), (3, 5, 1, 1), {"strides": [2, 2]}),  # strided 1x1
    ((1, 3, 10, 10), (4, 3, 3, 3), {"auto_pad": "SAME_UPPER", "strides": [2, 2]}),
    ((1, 3, 10, 10), (4, 3, 4, 4), {"auto_pad": "SAME_LOWER"}),
    ((1, 3, 10, 10), (4, 3, 3, 3), {"auto_pad": "VALID", "strides": [3, 3]}),
    ((2, 3, 12), (4, 3, 3), {"pads": [1, 2], "strides": [2]}),  # 1D
    ((1, 2, 5, 6, 7), (3, 2, 3, 2, 3), {"pads": [1, 0, 1, 1, 0, 1], "strides": [1, 2, 1]}),  # 3D
    ((1, 3, 9, 9), (4, 3, 3, 3), {"dilations": [2, 1], "strides": [1, 2]}),
]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("xs, ws, attrs", CONV_CASES)
def test_conv(xp, xs, ws, attrs, bias):
    inputs = [f32(*xs), f32(*ws)] + ([f32(ws[0])] if bias else [])
    check(xp, "Conv", inputs, **attrs)


def test_conv_gemm_paths(xp):
    # per-image GEMMs (large planes), the zero-copy 1x1 path with groups, chunked batches
    check(xp, "Conv", [f32(3, 4, 36, 36), f32(6, 4, 3, 3), f32(6)], pads=[1, 1, 1, 1])
    check(xp, "Conv", [f32(1, 4, 6, 6), f32(6, 2, 1, 1), f32(6)], group=2)
    check(xp, "Conv", [f32(3, 4, 36, 36), f32(6, 2, 1, 1)], group=2)
    check(xp, "Conv", [f32(5, 4, 12, 12), f32(6, 2, 3, 3)], group=2, strides=[2, 2])


def test_conv_chunked(xp, monkeypatch):
    # batches whose columns outgrow the scratch buffer go through im2col in blocks
    import hetero_exec.kernels._conv_numpy as conv_numpy

    monkeypatch.setattr(conv_numpy, "SCRATCH_KEEP", 1)
    check(xp, "Conv", [f32(3, 4, 36, 36), f32(6, 4, 3, 3), f32(6)], pads=[1, 1, 1, 1])
    check(xp, "Conv", [f32(3, 4, 9, 9), f32(6, 2, 3, 3), f32(6)], group=2, strides=[2, 1])


def test_conv_float16(xp):
    x = f32(1, 3, 8, 8).astype(np.float16)
    w = f32(4, 3, 3, 3).astype(np.float16)
    check(xp, "Conv", [x, w], pads=[1, 1, 1, 1], rtol=1e-2, atol=1e-2)


def test_conv_resnet_shapes(xp):
    # stem-like (7x7 stride 2) and a stride-2 3x3: the flat and general im2col paths
    check(xp, "Conv", [f32(2, 3, 32, 32), f32(8, 3, 7, 7), f32(8)], strides=[2, 2],
          pads=[3, 3, 3, 3])
    check(xp, "Conv", [f32(2, 8, 15, 15), f32(16, 8, 3, 3)], strides=[2, 2], pads=[1, 1, 1, 1])
    check(xp, "Conv", [f32(3, 16, 7, 7), f32(16, 16, 3, 3), f32(16)], pads=[1, 1, 1, 1])


# --------------------------------------------------------------------------- ConvTranspose


CT_CASES = [
    ((1, 2, 3, 3), (2, 3, 3, 3), {}),
    ((2, 2, 3, 4), (2, 3, 3, 3), {"strides": [3, 2], "output_padding": [1, 1]}),
    ((1, 2, 3, 3), (2, 3, 3, 3), {"strides": [3, 2], "pads": [1, 2, 1, 2]}),
    ((1, 2, 3, 3), (2, 3, 3, 3), {"strides": [3, 2], "output_shape": [10, 8]}),
    ((1, 1, 3, 3), (1, 2, 2, 2), {"dilations": [2, 2]}),
    ((1, 1, 3, 3), (1, 2, 3, 3), {"auto_pad": "SAME_UPPER", "strides": [2, 2]}),
    ((1, 1, 3, 3), (1, 2, 3, 3), {"auto_pad": "SAME_LOWER", "strides": [2, 2]}),
    ((2, 3, 5), (3, 2, 3), {"strides": [2]}),  # 1D
    ((1, 2, 3, 4, 3), (2, 2, 3, 3, 2), {"strides": [2, 1, 2]}),  # 3D
]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("xs, ws, attrs", CT_CASES)
def test_conv_transpose(xp, xs, ws, attrs, bias):
    inputs = [f32(*xs), f32(*ws)] + ([f32(ws[1])] if bias else [])
    check(xp, "ConvTranspose", inputs, **attrs)


def test_conv_transpose_groups(xp):
    # the reference mishandles groups with several output channels each: compose groups
    x, w, b = f32(2, 4, 3, 3), f32(4, 3, 2, 2), f32(6)
    attrs = {"strides": [2, 2], "pads": [0, 1, 1, 0]}
    parts = [[x[:, 2 * g:2 * g + 2], w[2 * g:2 * g + 2], b[3 * g:3 * g + 3]] for g in range(2)]
    want = np.concatenate([reference("ConvTranspose", p, **attrs)[0] for p in parts], axis=1)
    got = ours(xp, "ConvTranspose", [x, w, b], group=2, **attrs)
    compare(got, [want], 1e-5, 1e-5)


# --------------------------------------------------------------------------- quantised conv


def test_conv_integer(xp):
    x = RNG.integers(0, 255, (1, 2, 5, 5)).astype(np.uint8)
    w = RNG.integers(0, 255, (3, 2, 3, 3)).astype(np.uint8)
    check(xp, "ConvInteger", [x, w, np.uint8(12), np.uint8(130)], pads=[1, 1, 1, 1], opset=10)
    check(xp, "ConvInteger", [x, w], strides=[2, 2], opset=10)


@pytest.mark.parametrize("per_channel", [False, True])
def test_qlinear_conv(xp, per_channel):
    x = RNG.integers(0, 255, (1, 2, 6, 6)).astype(np.uint8)
    w = RNG.integers(-128, 127, (3, 2, 3, 3)).astype(np.int8)
    ws = RNG.uniform(0.001, 0.01, 3).astype(np.float32) if per_channel else np.float32(0.004)
    wz = np.zeros(3, np.int8) if per_channel else np.int8(0)
    b = RNG.integers(-100, 100, 3).astype(np.int32)
    inputs = [x, np.float32(0.02), np.uint8(100), w, ws, wz, np.float32(0.05), np.uint8(120), b]
    check(xp, "QLinearConv", inputs, pads=[1, 1, 1, 1], opset=10)


# --------------------------------------------------------------------------- DeformConv, Col2Im...


@pytest.mark.parametrize("with_mask", [False, True])
def test_deform_conv(xp, with_mask):
    x = f32(2, 4, 5, 6)
    w = f32(6, 2, 2, 2)
    og = 2
    oh, ow = 6, 3
    off = f32(2, og * 2 * 2 * 2, oh, ow, lo=-1.5, hi=1.5)
    inputs = [x, w, off, f32(6)]
    if with_mask:
        inputs.append(f32(2, og * 2 * 2, oh, ow, lo=0, hi=1))
    check(xp, "DeformConv", inputs, group=2, offset_group=og, pads=[1, 0, 1, 1], strides=[1, 2],
          rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("attrs, img", [
    ({}, [5, 5]),
    ({"strides": [2, 2], "pads": [1, 0, 1, 1], "dilations": [1, 2]}, [6, 7]),
])
def test_col2im(xp, attrs, img):
    block = [2, 3]
    nd = len(img)
    s = attrs.get("strides", [1] * nd)
    d = attrs.get("dilations", [1] * nd)
    p = attrs.get("pads", [0] * 2 * nd)
    L = 1
    for i in range(nd):
        L *= (img[i] + p[i] + p[i + nd] - ((block[i] - 1) * d[i] + 1)) // s[i] + 1
    x = f32(2, 3 * 6, L)
    check(xp, "Col2Im", [x, np.array(img, np.int64), np.array(block, np.int64)], **attrs)


@pytest.mark.parametrize("activation", ["none", "silu"])
@pytest.mark.parametrize("past, bias", [(False, False), (True, True)])
def test_causal_conv_with_state(xp, activation, past, bias):
    x, w = f32(2, 3, 6), f32(3, 1, 4)
    inputs = [x, w, f32(3) if bias else None, f32(2, 3, 3) if past else None]
    while inputs and inputs[-1] is None:
        inputs.pop()
    check(xp, "CausalConvWithState", inputs, opset=27, n_outputs=2, activation=activation)


# --------------------------------------------------------------------------- pooling


POOL_CASES = [
    ((1, 2, 7, 7), {"kernel_shape": [3, 3]}),
    ((2, 2, 8, 8), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ((1, 2, 7, 8), {"kernel_shape": [3, 2], "strides": [2, 2], "ceil_mode": 1}),
    ((1, 1, 2, 2), {"kernel_shape": [3, 3], "strides": [3, 3], "pads": [1, 1, 1, 1],
                    "ceil_mode": 1}),
    ((1, 2, 9, 9), {"kernel_shape": [2, 2], "dilations": [2, 2], "strides": [2, 1]}),
    ((1, 2, 7, 7), {"kernel_shape": [2, 3], "auto_pad": "SAME_UPPER", "strides": [2, 2]}),
    ((1, 2, 7, 7), {"kernel_shape": [3, 3], "auto_pad": "SAME_LOWER"}),
    ((2, 3, 10), {"kernel_shape": [3], "strides": [2], "pads": [1, 1]}),
    ((1, 1, 5, 6, 7), {"kernel_shape": [2, 3, 2], "strides": [2, 2, 1]}),
]


@pytest.mark.parametrize("xs, attrs", POOL_CASES)
def test_max_pool(xp, xs, attrs):
    check(xp, "MaxPool", [f32(*xs)], **attrs)


@pytest.mark.parametrize("storage_order", [0, 1])
@pytest.mark.parametrize("xs, attrs", [c for c in POOL_CASES if len(c[0]) == 4])
def test_max_pool_indices(xp, xs, attrs, storage_order):
    x = f32(*xs)
    y, idx = ours(xp, "MaxPool", [x], opset=22, num_outputs=2, storage_order=storage_order, **attrs)
    y, idx = to_numpy(y), to_numpy(idx)
    assert idx.dtype == np.int64
    # the index addresses the max (row- or column-major over the spatial axes)
    src = x if storage_order == 0 else np.ascontiguousarray(x.transpose(0, 1, 3, 2))
    np.testing.assert_array_equal(src.ravel()[idx], y)
    if any(s != 1 for s in attrs.get("strides", [1])) and "dilations" not in attrs:
        # the reference computes indices only on its strided path
        want = reference("MaxPool", [x], opset=22, n_outputs=2, storage_order=storage_order,
                         **attrs)
        compare((y, idx), want, 0, 0)


def test_pools_blocked(xp, monkeypatch):
    # large inputs are pooled in cache-sized blocks of (N*C) planes
    import hetero_exec.kernels.pool as pool

    monkeypatch.setattr(pool, "_POOL_BLOCK", 3 * 9 * 9 * 4)
    x = f32(2, 5, 9, 9)
    attrs = {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}
    check(xp, "MaxPool", [x], **attrs)
    check(xp, "AveragePool", [x], **attrs)
    check(xp, "LpPool", [x], **attrs)


def test_max_pool_uint8(xp):
    x = RNG.integers(0, 255, (1, 2, 6, 6)).astype(np.uint8)
    check(xp, "MaxPool", [x], kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[2, 2])


@pytest.mark.parametrize("count_include_pad", [0, 1])
@pytest.mark.parametrize("xs, attrs", POOL_CASES)
def test_average_pool(xp, xs, attrs, count_include_pad):
    check(xp, "AveragePool", [f32(*xs)], count_include_pad=count_include_pad, **attrs)


@pytest.mark.parametrize("p", [1, 2, 3])
@pytest.mark.parametrize("xs, attrs", [POOL_CASES[0], POOL_CASES[1], POOL_CASES[4], POOL_CASES[7]])
def test_lp_pool(xp, xs, attrs, p):
    check(xp, "LpPool", [f32(*xs)], p=p, **attrs)


@pytest.mark.parametrize("xs", [(2, 3, 5, 4), (1, 2, 7), (1, 2, 3, 4, 2)])
def test_global_pools(xp, xs):
    x = f32(*xs)
    axes = tuple(range(2, x.ndim))
    # the reference's GlobalMaxPool reduces the wrong axes for non-4D inputs; it has no GlobalLpPool
    compare(ours(xp, "GlobalAveragePool", [x]), [x.mean(axis=axes, keepdims=True)], 1e-5, 1e-6)
    compare(ours(xp, "GlobalMaxPool", [x]), [x.max(axis=axes, keepdims=True)], 0, 0)
    for p in (1, 2, 3):
        want = (np.abs(x.astype(np.float64)) ** p).sum(axis=axes, keepdims=True) ** (1 / p)
        compare(ours(xp, "GlobalLpPool", [x], opset=2, p=p), [want.astype(np.float32)], 1e-5, 1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_global_average_pool_as_a_product(dtype):
    """Each plane's mean as a product with a column of 1/L: large planes, a strided input
    and float64 as close to the float64 mean as numpy's reduction is."""
    from hetero_exec.kernels.pool import GlobalAveragePool

    x = (f32(3, 8, 56, 58) * 4 + 3).astype(dtype)
    for v in (x, x[:, ::2, :, 1:]):
        want = v.astype(np.float64).mean(axis=(2, 3), keepdims=True)
        got = GlobalAveragePool(np, v)[0]
        assert got.dtype == dtype and got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-6 if dtype == np.float32 else 1e-13)


@pytest.mark.parametrize("with_shape", [False, True])
def test_max_unpool(xp, with_shape):
    x = f32(1, 2, 4, 4)
    y, idx = ours(np, "MaxPool", [x], kernel_shape=[2, 2], strides=[2, 2], num_outputs=2)
    inputs = [y, idx] + ([np.array([1, 2, 5, 5], np.int64)] if with_shape else [])
    check(xp, "MaxUnpool", inputs, kernel_shape=[2, 2], strides=[2, 2])


def _max_roi_pool_naive(x, rois, pooled, scale):
    R = rois.shape[0]
    C, H, W = x.shape[1:]
    PH, PW = pooled
    out = np.zeros((R, C, PH, PW), x.dtype)
    for r in range(R):
        b = int(rois[r, 0])
        x1, y1, x2, y2 = (int(np.round(v * scale)) for v in rois[r, 1:])
        rh, rw = max(y2 - y1 + 1, 1), max(x2 - x1 + 1, 1)
        for ph, pw in itertools.product(range(PH), range(PW)):
            hs = min(max(int(np.floor(ph * rh / PH)) + y1, 0), H)
            he = min(max(int(np.ceil((ph + 1) * rh / PH)) + y1, 0), H)
            ws = min(max(int(np.floor(pw * rw / PW)) + x1, 0), W)
            we = min(max(int(np.ceil((pw + 1) * rw / PW)) + x1, 0), W)
            if he > hs and we > ws:
                out[r, :, ph, pw] = x[b, :, hs:he, ws:we].max(axis=(1, 2))
    return out


def test_max_roi_pool(xp):
    x = f32(2, 3, 10, 12)
    rois = np.array([[0, 1, 1, 8, 6], [1, 0, 0, 11, 9], [1, 6.4, 2.2, 7.1, 3.9],
                     [0, 20, 20, 30, 30]], np.float32)
    got = ours(xp, "MaxRoiPool", [x, rois], opset=22, pooled_shape=[3, 2], spatial_scale=1.0)
    compare(got, [_max_roi_pool_naive(x, rois, (3, 2), 1.0)], 1e-6, 1e-6)
    got = ours(xp, "MaxRoiPool", [x, rois], opset=22, pooled_shape=[2, 2], spatial_scale=0.5)
    compare(got, [_max_roi_pool_naive(x, rois, (2, 2), 0.5)], 1e-6, 1e-6)


# --------------------------------------------------------------------------- normalisation


def test_batch_norm_inference(xp):
    x = f32(2, 3, 4, 5)
    var = f32(3, lo=0.5, hi=2)
    check(xp, "BatchNormalization", [x, f32(3), f32(3), f32(3), var], epsilon=1e-3)
    check(xp, "BatchNormalization", [f32(4, 3), f32(3), f32(3), f32(3), var])


def test_batch_norm_training(xp):
    x = f32(2, 3, 4, 5)
    var = f32(3, lo=0.5, hi=2)
    check(xp, "BatchNormalization", [x, f32(3), f32(3), f32(3), var], n_outputs=3, training_mode=1,
          momentum=0.8)


@pytest.mark.parametrize("axis", [-1, 1, 0, -2])
def test_layer_norm(xp, axis):
    x = f32(2, 3, 4)
    sh = x.shape[axis if axis >= 0 else axis + 3:]
    check(xp, "LayerNormalization", [x, f32(*sh), f32(*sh)], n_outputs=3, axis=axis, epsilon=1e-3,
          opset=17)
    check(xp, "LayerNormalization", [x, f32(*sh)], axis=axis, opset=17)


@pytest.mark.parametrize("axis", [-1, 1])
def test_rms_norm(xp, axis):
    x = f32(2, 3, 4)
    check(xp, "RMSNormalization", [x, f32(*x.shape[axis:])], axis=axis, opset=23)


def test_instance_norm(xp):
    check(xp, "InstanceNormalization", [f32(2, 3, 4, 5), f32(3), f32(3)], epsilon=1e-3)


@pytest.mark.parametrize("opset, per_group", [(21, False), (18, True)])
def test_group_norm(xp, opset, per_group):
    x = f32(2, 6, 3, 2)
    n = 3 if per_group else 6
    check(xp, "GroupNormalization", [x, f32(n), f32(n)], num_groups=3, epsilon=1e-3, opset=opset)


@pytest.mark.parametrize("size", [3, 4])
def test_lrn(xp, size):
    # the reference sums over the wrong axis range (loops over batch, not channels)
    x = f32(2, 5, 3, 3)
    alpha, beta, bias = 1e-3, 0.6, 1.5
    C = x.shape[1]
    sq = np.zeros_like(x, dtype=np.float64)
    for c in range(C):
        lo, hi = max(0, c - (size - 1) // 2), min(C, c + -(-(size - 1) // 2) + 1)
        sq[:, c] = (x[:, lo:hi].astype(np.float64) ** 2).sum(axis=1)
    want = (x / (bias + alpha / size * sq) ** beta).astype(np.float32)
    got = ours(xp, "LRN", [x], opset=13, size=size, alpha=alpha, beta=beta, bias=bias)
    compare(got, [want], 1e-5, 1e-6)


def test_mvn(xp):
    check(xp, "MeanVarianceNormalization", [f32(2, 3, 4, 5)])
    check(xp, "MeanVarianceNormalization", [f32(2, 3, 4, 5)], axes=[1, 3])


@pytest.mark.parametrize("p, axis", [(2, -1), (1, 0), (2, 1), (1, -1)])
def test_lp_normalization(xp, p, axis):
    x = f32(3, 4)
    x[0] = 0
    # the reference's L1 norm forgets the absolute value; the spec (and onnxruntime) use |x|
    norm = (np.abs(x.astype(np.float64)) ** p).sum(axis=axis, keepdims=True) ** (1 / p)
    want = np.where(norm == 0, 0, x / np.where(norm == 0, 1, norm)).astype(np.float32)
    compare(ours(xp, "LpNormalization", [x], opset=22, p=p, axis=axis), [want], 1e-5, 1e-6)


# --------------------------------------------------------------------------- linalg


@pytest.mark.parametrize("attrs", [{}, {"transA": 1}, {"transB": 1}, {"alpha": 0.5, "beta": 2.0}])
@pytest.mark.parametrize("c_shape", [None, (5,), (3, 5), (1,)])
def test_gemm(xp, attrs, c_shape):
    a = f32(4, 3) if attrs.get("transA") else f32(3, 4)
    b = f32(5, 4) if attrs.get("transB") else f32(4, 5)
    inputs = [a, b] + ([f32(*c_shape)] if c_shape else [])
    check(xp, "Gemm", inputs, opset=13, **attrs)


@pytest.mark.parametrize("sa, sb", [((3, 4), (4, 5)), ((4,), (4,)), ((2, 3, 4), (4,)),
                                    ((4,), (2, 4, 3)), ((2, 1, 3, 4), (3, 4, 2)),
                                    ((5, 3, 4), (5, 4, 2))])
def test_matmul(xp, sa, sb):
    check(xp, "MatMul", [f32(*sa), f32(*sb)], opset=13)


def test_matmul_float16(xp):
    a, b = f32(3, 8).astype(np.float16), f32(8, 2).astype(np.float16)
    check(xp, "MatMul", [a, b], opset=13, rtol=1e-2, atol=1e-2)


def test_matmul_integer(xp):
    a = RNG.integers(0, 255, (3, 4)).astype(np.uint8)
    b = RNG.integers(-128, 127, (4, 5)).astype(np.int8)
    check(xp, "MatMulInteger", [a, b, np.uint8(12), np.int8(-3)], opset=10)
    check(xp, "MatMulInteger", [a, b], opset=10)


def test_matmul_integer_per_row_col(xp):
    a = RNG.integers(0, 255, (3, 4)).astype(np.uint8)
    b = RNG.integers(0, 255, (4, 5)).astype(np.uint8)
    az = np.array([1, 2, 3], np.uint8)
    bz = np.array([4, 5, 6, 7, 8], np.uint8)
    want = (a.astype(np.int32) - az[:, None]) @ (b.astype(np.int32) - bz[None, :])
    compare(ours(xp, "MatMulInteger", [a, b, az, bz], opset=10), [want], 0, 0)


@pytest.mark.parametrize("dt", [np.uint8, np.int8])
def test_qlinear_matmul(xp, dt):
    info = np.iinfo(dt)
    a = RNG.integers(info.min, info.max, (2, 3, 4)).astype(dt)
    b = RNG.integers(info.min, info.max, (4, 5)).astype(dt)
    z = dt(info.min + 100)
    inputs = [a, np.float32(0.05), z, b, np.float32(0.02), z, np.float32(0.3), z]
    check(xp, "QLinearMatMul", inputs, opset=21)


@pytest.mark.parametrize("eq, shapes", [
    ("ij,jk->ik", [(3, 4), (4, 5)]),
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
    ("ii->i", [(4, 4)]),
    ("...ii->...i", [(2, 3, 3)]),
    ("ij->ji", [(3, 4)]),
    ("i,i", [(5,), (5,)]),
    ("ij->", [(3, 4)]),
    ("ab,bc,cd->ad", [(2, 3), (3, 4), (4, 5)]),
])
def test_einsum(xp, eq, shapes):
    check(xp, "Einsum", [f32(*s) for s in shapes], equation=eq, opset=12)


# --------------------------------------------------------------------------- quantisation


@pytest.mark.parametrize("zp_dtype", [np.uint8, np.int8, np.uint16, np.int16])
def test_quantize_per_tensor(xp, zp_dtype):
    x = f32(3, 4, lo=-300, hi=300)
    zp = np.array(3, dtype=zp_dtype)
    check(xp, "QuantizeLinear", [x, np.float32(0.7), zp], opset=21)
    want = reference("DequantizeLinear", [check(np, "QuantizeLinear", [x, np.float32(0.7), zp])[0],
                                          np.float32(0.7), zp])
    q = to_numpy(ours(xp, "QuantizeLinear", [x, np.float32(0.7), zp])[0])
    got = ours(xp, "DequantizeLinear", [q, np.float32(0.7), zp])
    compare(got, want, 1e-6, 1e-6)


def test_quantize_default_uint8_and_rounding(xp):
    x = np.array([0.5, 1.5, 2.5, -0.5, -1.5, 300, -300], np.float32)
    check(xp, "QuantizeLinear", [x, np.float32(1.0)], opset=13)


def test_quantize_per_axis(xp):
    x = f32(2, 3, 4, lo=-50, hi=50)
    scale = np.array([0.5, 1.0, 2.0], np.float32)
    zp = np.array([100, 128, 7], np.uint8)
    check(xp, "QuantizeLinear", [x, scale, zp], axis=1, opset=13)
    q = RNG.integers(0, 255, (2, 3, 4)).astype(np.uint8)
    check(xp, "DequantizeLinear", [q, scale, zp], axis=1, opset=19)
    scale4 = np.array([0.5, 2.0, 1.0, 3.0], np.float32)
    check(xp, "DequantizeLinear", [q, scale4], axis=-1, opset=19)


def test_quantize_blocked(xp):
    x = f32(3, 5, lo=-20, hi=20)
    scale = f32(3, 3, lo=0.1, hi=2)
    zp = RNG.integers(-5, 5, (3, 3)).astype(np.int8)
    check(xp, "QuantizeLinear", [x, scale, zp], axis=1, block_size=2, opset=21)
    q = RNG.integers(-128, 127, (3, 5)).astype(np.int8)
    check(xp, "DequantizeLinear", [q, scale, zp], axis=1, block_size=2, opset=21)
    check(xp, "QuantizeLinear", [x, scale], axis=1, block_size=2,
          output_dtype=TensorProto.INT16, opset=21)


def test_quantize_output_dtype_and_half_scale(xp):
    x = f32(4, 4, lo=-3, hi=3)
    check(xp, "QuantizeLinear", [x, np.float16(0.05)], output_dtype=TensorProto.INT8, opset=21)
    q = RNG.integers(0, 255, (4,)).astype(np.uint8)
    check(xp, "DequantizeLinear", [q, np.float16(0.05), np.uint8(9)], opset=21)
    check(xp, "DequantizeLinear", [q, np.float32(0.05), np.uint8(9)],
          output_dtype=TensorProto.FLOAT16, opset=23)


# ml_dtypes types exist on numpy only
@pytest.mark.parametrize("dtype", [ml_dtypes.int4, ml_dtypes.uint4, ml_dtypes.int2,
                                   ml_dtypes.uint2, ml_dtypes.float8_e4m3fn,
                                   ml_dtypes.float8_e5m2, ml_dtypes.float4_e2m1fn])
def test_quantize_small_types(dtype):
    x = f32(3, 4, lo=-40, hi=40)
    x[0, 0] = 1e6
    scale = np.array([2.0, 3.0, 4.0], np.float32)
    zp = np.zeros(3, dtype=dtype)
    check(np, "QuantizeLinear", [x, scale, zp], axis=0, opset=25)
    q = check(np, "QuantizeLinear", [x, scale, zp], axis=0, opset=25)[0]
    check(np, "DequantizeLinear", [q, scale, zp], axis=0, opset=25)


def test_quantize_float8_no_saturate():
    x = np.array([0.0, 1.0, 1e5, -1e5], np.float32)
    zp = np.zeros((), ml_dtypes.float8_e4m3fn)
    check(np, "QuantizeLinear", [x, np.float32(1.0), zp], saturate=0, opset=21)


@pytest.mark.parametrize("x", [
    np.array([0, 2, -3, -2.5, 1.34, 0.5], np.float32),
    np.array([-1.0, -2.1, -1.3, -2.5, -3.34, -4.0], np.float32),
    np.array([1, 2.1, 1.3, 2.5, 3.34, 4.0, 1.5, 2.6, 3.9, 4.0, 3.0, 2.345],
             np.float32).reshape(3, 4),
    np.zeros((2, 2), np.float32),
])
def test_dynamic_quantize_linear(xp, x):
    check(xp, "DynamicQuantizeLinear", [x], n_outputs=3, opset=11)


@pytest.mark.parametrize("shape, sshape", [((2, 40, 5, 7), (40, 1, 1)), ((3, 8, 33), (1, 8, 1)),
                                           ((1, 16, 4, 4), None), ((2, 6, 3, 3), (6, 3, 3))])
def test_channels_first_layer_norm(monkeypatch, shape, sshape):
    """FusedLayerNorm over axis 1 (ConvNeXt's channels-first LayerNorm): native/norm.c
    for a per-channel scale and bias, numpy for a scale that varies over the pixels too;
    both against float64."""
    from hetero_exec.kernels.native import packed_gemm as pg
    from hetero_exec.kernels.native import row_kernels
    from hetero_exec.kernels.norm import FusedLayerNorm

    if not pg.available():
        pytest.skip(pg.unavailable_reason())
    ran: list[int] = []
    run = row_kernels.layer_norm_channels
    monkeypatch.setattr(row_kernels, "layer_norm_channels", lambda *a: ran.append(1) or run(*a))
    x = f32(*shape) * 3 + 1
    g = None if sshape is None else f32(*sshape)
    b = None if sshape is None else f32(*sshape)
    got = FusedLayerNorm(np, x, g, b, epsilon=1e-6, axes=[1])[0]
    x64 = x.astype(np.float64)
    d = x64 - x64.mean(axis=1, keepdims=True)
    want = d / np.sqrt((d * d).mean(axis=1, keepdims=True) + 1e-6)
    want = want * (1 if g is None else g) + (0 if b is None else b)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert ran == ([] if sshape == (6, 3, 3) else [1])


@pytest.mark.parametrize("shape", [(2, 40, 5, 7), (1, 17, 33), (3, 96, 4, 4)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_layer_norm_of_a_channels_last_view(monkeypatch, shape, with_bias):
    """LayerNorm over the last axis of an NCHW array permuted to channels-last (ConvNeXt's
    block): native/norm.c reads the NCHW array and writes channels-last, against the
    reference on the copied view."""
    from hetero_exec.kernels.native import packed_gemm as pg
    from hetero_exec.kernels.native import row_kernels
    from hetero_exec.kernels.norm import LayerNormalization

    if not pg.available():
        pytest.skip(pg.unavailable_reason())
    ran: list[int] = []
    run = row_kernels.layer_norm_channels
    monkeypatch.setattr(row_kernels, "layer_norm_channels", lambda *a, **k: ran.append(1) or run(*a, **k))
    x = np.moveaxis(f32(*shape) * 2 + 1, 1, -1)  # a view: (n, *S, C)
    C = shape[1]
    args = [x, f32(C)] + ([f32(C)] if with_bias else [])
    want = reference("LayerNormalization", [np.ascontiguousarray(a) for a in args],
                     axis=-1, epsilon=1e-5)[0]
    got = LayerNormalization(np, *args, axis=-1, epsilon=1e-5)[0]
    assert got.shape == x.shape and got.flags.c_contiguous
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert ran == [1]
