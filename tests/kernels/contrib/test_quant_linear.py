"""com.microsoft QLinear* ops and GatherBlockQuantized against onnxruntime: a conv net
statically quantized by onnxruntime (QOperator format: every QLinear op in one chain),
and each op alone on odd shapes; cpu and strict sim-gpu."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnxruntime.quantization import (
    CalibrationDataReader,
    QuantFormat,
    QuantType,
    quantize_static,
)

from tests._models import init, model, ort_u8s8_saturates, vi
from tests.kernels.contrib._quant_helpers import MS, SIM, compare

U8, I8 = TensorProto.UINT8, TensorProto.INT8
_NP = {U8: np.uint8, I8: np.int8}
QLINEAR_OPS = ["QLinearLeakyRelu", "QLinearSigmoid", "QLinearMul", "QLinearAdd",
               "QLinearAveragePool", "QLinearConcat", "QLinearGlobalAveragePool"]


def _conv_net() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    C = 6
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("LeakyRelu", ["c"], ["l"], alpha=0.1),
             helper.make_node("Sigmoid", ["l"], ["s"]),
             helper.make_node("Mul", ["l", "s"], ["m"]),
             helper.make_node("Conv", ["m", "W2"], ["c2"]),
             helper.make_node("Add", ["c2", "m"], ["a"]),
             helper.make_node("AveragePool", ["a"], ["p"], kernel_shape=[3, 3], strides=[2, 2],
                              pads=[1, 1, 1, 1]),
             helper.make_node("Concat", ["p", "p"], ["cc"], axis=1),
             helper.make_node("GlobalAveragePool", ["cc"], ["y"])]
    return model(nodes, [vi("x", 1, [1, 3, 11, 9])], [vi("y", 1, [1, 2 * C, 1, 1])],
                 [init("W", (rng.standard_normal((C, 3, 3, 3)) * 0.3).astype(np.float32)),
                  init("W2", (rng.standard_normal((C, C, 1, 1)) * 0.3).astype(np.float32))],
                 opset=17)


class _Calibration(CalibrationDataReader):
    def __init__(self):
        rng = np.random.default_rng(1)
        self.feeds = iter([{"x": rng.standard_normal((1, 3, 11, 9)).astype(np.float32)}
                           for _ in range(8)])

    def get_next(self):
        return next(self.feeds, None)


@pytest.mark.parametrize("activation", [QuantType.QUInt8, QuantType.QInt8])
def test_quantize_static_qoperator_net(tmp_path, activation):
    src, dst = tmp_path / "f.onnx", tmp_path / "q.onnx"
    onnx.save(_conv_net(), src)
    # 7-bit weights where onnxruntime's u8 x s8 sums saturate: it stays exact there
    reduced = activation == QuantType.QUInt8 and ort_u8s8_saturates()
    quantize_static(str(src), str(dst), _Calibration(), quant_format=QuantFormat.QOperator,
                    activation_type=activation, weight_type=QuantType.QInt8,
                    reduce_range=reduced)
    q = onnx.load(dst)
    assert set(QLINEAR_OPS) <= {n.op_type for n in q.graph.node}
    x = np.random.default_rng(2).standard_normal((1, 3, 11, 9)).astype(np.float32)
    compare(q, {"x": x}, device_ops=QLINEAR_OPS, rtol=0, atol=0, weights_7bit=reduced)


def _q(rng, t, shape):
    info = np.iinfo(_NP[t])
    return rng.integers(info.min, int(info.max) + 1, size=shape).astype(_NP[t])


def _sz(t, shift=0):  # a scale and zero point of type t, as initializers' values
    return np.array(0.05 + 0.01 * shift, np.float32), np.array(_NP[t](3 * shift + 1))


@pytest.mark.parametrize("op", ["QLinearAdd", "QLinearMul"])
@pytest.mark.parametrize("t", [U8, I8])
@pytest.mark.parametrize("b_shape", [(3, 5, 7), (5, 1), (7,)])
def test_qlinear_binary(op, t, b_shape):
    rng = np.random.default_rng(3)
    (as_, az), (bs, bz), (cs, cz) = _sz(t, 0), _sz(t, 1), _sz(t, 4)
    node = helper.make_node(op, ["A", "as", "az", "B", "bs", "bz", "cs", "cz"], ["C"],
                            domain=MS)
    m = model([node], [vi("A", t, [3, 5, 7]), vi("B", t, list(b_shape))],
              [vi("C", t, [3, 5, 7])],
              [init("as", as_), init("az", az), init("bs", bs), init("bz", bz),
               init("cs", cs), init("cz", cz)], extra_opsets={MS: 1})
    compare(m, {"A": _q(rng, t, (3, 5, 7)), "B": _q(rng, t, b_shape)}, device_ops=[op],
            rtol=0, atol=0)


@pytest.mark.parametrize("op,attrs,y_scale", [("QLinearSigmoid", {}, 0.004),
                                              ("QLinearLeakyRelu", {"alpha": 0.2}, 0.05)])
@pytest.mark.parametrize("t", [U8, I8])
def test_qlinear_unary(op, attrs, y_scale, t):
    rng = np.random.default_rng(4)
    xs, xz = _sz(t, 2)
    yz = np.array(_NP[t](0 if t == U8 else -100))
    node = helper.make_node(op, ["X", "xs", "xz", "ys", "yz"], ["Y"], domain=MS, **attrs)
    m = model([node], [vi("X", t, [4, 9, 5])], [vi("Y", t, [4, 9, 5])],
              [init("xs", xs), init("xz", xz), init("ys", np.array(y_scale, np.float32)),
               init("yz", yz)], extra_opsets={MS: 1})
    compare(m, {"X": _q(rng, t, (4, 9, 5))}, device_ops=[op], rtol=0, atol=0)


@pytest.mark.parametrize("t", [U8, I8])
def test_qlinear_concat(t):
    rng = np.random.default_rng(5)
    names, inits, feeds = ["ys", "yz"], [init("ys", np.array(0.07, np.float32)),
                                         init("yz", np.array(_NP[t](2)))], {}
    for i, width in enumerate((3, 1, 4)):
        s, z = _sz(t, i + 1)
        names += [f"x{i}", f"s{i}", f"z{i}"]
        inits += [init(f"s{i}", s), init(f"z{i}", z)]
        feeds[f"x{i}"] = _q(rng, t, (2, 5, width))
    node = helper.make_node("QLinearConcat", names, ["Y"], domain=MS, axis=-1)
    m = model([node], [vi(k, t, list(v.shape)) for k, v in feeds.items()],
              [vi("Y", t, [2, 5, 8])], inits, extra_opsets={MS: 1})
    compare(m, feeds, device_ops=["QLinearConcat"], rtol=0, atol=0)


@pytest.mark.parametrize("channels_last", [0, 1])
@pytest.mark.parametrize("count_include_pad", [0, 1])
@pytest.mark.parametrize("t", [U8, I8])
@pytest.mark.parametrize("seed", [6, 61])
def test_qlinear_average_pools(channels_last, count_include_pad, t, seed):
    rng = np.random.default_rng(seed)
    shape = (2, 7, 10, 5) if channels_last else (2, 5, 7, 10)
    (xs, xz), (ys, yz) = _sz(t, 1), _sz(t, 2)
    q = [init("xs", xs), init("xz", xz), init("ys", ys), init("yz", yz)]
    pool = helper.make_node("QLinearAveragePool", ["X", "xs", "xz", "ys", "yz"], ["P"],
                            domain=MS, kernel_shape=[3, 2], strides=[2, 3], pads=[1, 0, 1, 1],
                            channels_last=channels_last, count_include_pad=count_include_pad)
    glob = helper.make_node("QLinearGlobalAveragePool", ["X", "xs", "xz", "ys", "yz"], ["G"],
                            domain=MS, channels_last=channels_last)
    m = model([pool, glob], [vi("X", t, list(shape))],
              [vi("P", t, ["a", "b", "c", "d"]), vi("G", t, ["e", "f", "g", "h"])], q,
              extra_opsets={MS: 1})
    # a mean that lands on a rounding tie may round either way by the order of its float
    # sum (onnxruntime's differs between its NCHW and NHWC loops): one code of slack
    compare(m, {"X": _q(rng, t, shape)},
            device_ops=["QLinearAveragePool", "QLinearGlobalAveragePool"], rtol=0, atol=1)


def _packed_table(rng, rows, cols, bits):
    codes = rng.integers(0, 1 << bits, size=(rows, cols)).astype(np.uint8)
    if bits == 8:
        return codes
    per = 8 // bits
    padded = np.zeros((rows, -(-cols // per) * per), np.uint8)
    padded[:, :cols] = codes
    g = padded.reshape(rows, -1, per)
    return sum((g[:, :, i] << (bits * i)) for i in range(per)).astype(np.uint8)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("with_zp", [False, True])
@pytest.mark.parametrize("scale_t", [np.float32, np.float16])
def test_gather_block_quantized_packed(bits, with_zp, scale_t):
    rng = np.random.default_rng(7)
    rows, cols, block = 11, 64, 16
    blocks = cols // block
    data = _packed_table(rng, rows, cols, bits)
    scales = (rng.random((rows, blocks)) * 0.1 + 0.01).astype(scale_t)
    names = ["data", "idx", "scales"]
    inits = [init("data", data), init("scales", scales)]
    if with_zp:
        names.append("zp")
        inits.append(init("zp", _packed_table(rng, rows, blocks, bits)))
    node = helper.make_node("GatherBlockQuantized", names, ["Y"], domain=MS, gather_axis=0,
                            quantize_axis=1, block_size=block, bits=bits)
    st = helper.np_dtype_to_tensor_dtype(np.dtype(scale_t))
    m = model([node], [vi("idx", TensorProto.INT64, [2, 3])], [vi("Y", st, [2, 3, cols])],
              inits, extra_opsets={MS: 1})
    idx = np.array([[0, 10, -1], [3, 3, 7]], np.int64)
    compare(m, {"idx": idx}, device_ops=["GatherBlockQuantized"], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("axes", [(0, 1), (1, 0)])
def test_gather_block_quantized_int4(signed, axes):
    rng = np.random.default_rng(8)
    gather_axis, quantize_axis = axes
    shape, block = (6, 48), 16
    lo, hi = (-8, 8) if signed else (0, 16)
    dt, t = ((ml_dtypes.int4, TensorProto.INT4) if signed else (ml_dtypes.uint4, TensorProto.UINT4))
    data = rng.integers(lo, hi, size=shape).astype(dt)
    sshape = list(shape)
    sshape[quantize_axis] = -(-shape[quantize_axis] // block)
    scales = (rng.random(sshape) * 0.1 + 0.01).astype(np.float32)
    zp = rng.integers(lo, hi, size=sshape).astype(dt)
    node = helper.make_node("GatherBlockQuantized", ["data", "idx", "scales", "zp"], ["Y"],
                            domain=MS, gather_axis=gather_axis, quantize_axis=quantize_axis,
                            block_size=block)
    m = model([node], [vi("idx", TensorProto.INT32, [4])], [vi("Y", 1, ["a", "b"])],
              [helper.make_tensor("data", t, shape, data.astype(np.int8).flatten().tolist()),
               init("scales", scales),
               helper.make_tensor("zp", t, sshape, zp.astype(np.int8).flatten().tolist())],
              extra_opsets={MS: 1})
    idx = np.array([0, 5, 2, 1], np.int32)
    compare(m, {"idx": idx}, providers=["cpu"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("activation", [QuantType.QUInt8, QuantType.QInt8])
def test_quantize_static_qdq_net(tmp_path, activation):
    """QDQ form: against onnxruntime running the Q/DQ nodes as written (no fusion into
    its integer kernels, which round otherwise)."""
    import onnxruntime

    from hetero_exec import InferenceSession

    src, dst = tmp_path / "f.onnx", tmp_path / "q.onnx"
    onnx.save(_conv_net(), src)
    quantize_static(str(src), str(dst), _Calibration(), quant_format=QuantFormat.QDQ,
                    activation_type=activation, weight_type=QuantType.QInt8)
    q = onnx.load(dst)
    assert {"QuantizeLinear", "DequantizeLinear"} <= {n.op_type for n in q.graph.node}
    x = np.random.default_rng(2).standard_normal((1, 3, 11, 9)).astype(np.float32)
    so = onnxruntime.SessionOptions()
    so.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    want = onnxruntime.InferenceSession(q.SerializeToString(), so,
                                        providers=["CPUExecutionProvider"]).run(None, {"x": x})
    for providers in (["cpu"], [SIM, "cpu"]):
        got = InferenceSession(q.SerializeToString(), providers=providers).run(None, {"x": x})
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
