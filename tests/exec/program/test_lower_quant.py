"""MatMulNBits lowered into a program (exec/program/lower_quant.py, native/nbits.c's
record) against onnxruntime: 4 and 8 bits, zero points packed, float or none, bias, a
decode row and a few rows; past NATIVE_ROWS the step stays in Python (the float copy)."""

from __future__ import annotations

import numpy as np
import pytest

from hetero_exec.kernels.contrib import quant_matmul
from hetero_exec.kernels.native import library
from tests.exec.program.test_lowerings import check
from tests.kernels.contrib.test_quant_matmul_nbits import _x, nbits_model

pytestmark = pytest.mark.skipif(not library.available(), reason="no C library in this tree")


@pytest.mark.parametrize("bits,block,zp,bias", [(4, 32, "packed", False), (4, 16, "none", True),
                                                (4, 128, "float", True), (8, 64, "packed", True),
                                                (4, 256, "packed", False)])
@pytest.mark.parametrize("rows", [(1, 1), (2, 3)])
def test_matmul_nbits_runs_in_the_program(bits, block, zp, bias, rows):
    K = 2 * block + 7
    m = nbits_model(K, 45, bits, block, symmetric=zp == "none", zp=zp, bias=bias, seed=block)
    check(m, {"x": _x(K, rows=rows)}, rtol=1e-4, atol=1e-4)


def test_matmul_nbits_many_rows_stay_in_python():
    m = nbits_model(64, 20, 4, 32)
    check(m, {"x": _x(64, rows=(1, quant_matmul.NATIVE_ROWS + 1))}, python=["MatMulNBits"],
          rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("weight_type", ["QInt8", "QUInt8"])
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("rows", [1, 5])
def test_quantize_dynamic_model_runs_as_one_program(tmp_path, weight_type, per_channel, rows):
    """onnxruntime's quantize_dynamic MLP: DynamicQuantizeLinear, MatMulInteger (qgemm.c)
    and the casts and scales around them, all records of one program."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from tests.kernels.contrib.test_quant_integer import _mlp

    src, dst = tmp_path / "f.onnx", tmp_path / "q.onnx"
    onnx.save(_mlp(), src)
    quantize_dynamic(str(src), str(dst), weight_type=getattr(QuantType, weight_type),
                     per_channel=per_channel)
    x = np.random.default_rng(rows).standard_normal((rows, 72)).astype(np.float32)
    check(onnx.load(dst), {"x": x}, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("a_t,b_t", [(np.uint8, np.int8), (np.int8, np.int8),
                                     (np.uint8, np.uint8)])
def test_matmul_integer_in_the_program(a_t, b_t):
    from onnx import TensorProto, helper

    from tests._models import init, model, vi
    from tests.kernels.test_int_gemm import _T, _ints

    rng = np.random.default_rng(3)
    K, N = 301, 45
    B = _ints(rng, b_t, (K, N), True)
    node = helper.make_node("MatMulInteger", ["A", "B", "azp", "bzp"], ["Y"])
    m = model([node], [vi("A", _T[a_t], [2, 3, K])], [vi("Y", TensorProto.INT32, [2, 3, N])],
              [init("B", B), init("azp", np.array(a_t(5))),
               init("bzp", _ints(rng, b_t, (N,), False))])
    check(m, {"A": _ints(rng, a_t, (2, 3, K), True)}, rtol=0, atol=0)



@pytest.mark.parametrize("per_column", [False, True])
@pytest.mark.parametrize("rows", [1, 5])
def test_qdq_product_runs_in_the_program(per_column, rows):
    """DequantizeLinear(x_q) @ DequantizeLinear(W_q) + bias, Relu: fused into
    MatMulIntegerToFloat (placement/fusions/qdq.py), then a qgemm.c record with its cast,
    scale and bias records, and the Add and Relu after it: no Python step."""
    from onnx import TensorProto, helper

    from tests._models import F, init, model, vi

    rng = np.random.default_rng(rows)
    K, N = 70, 33
    w = rng.integers(-127, 128, (K, N)).astype(np.int8)
    ws = (rng.random(N) * 0.01 + 1e-3).astype(np.float32) if per_column \
        else np.array(0.004, np.float32)
    nodes = [helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
             helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wd"], axis=1),
             helper.make_node("MatMul", ["xd", "wd"], ["p"]),
             helper.make_node("Add", ["p", "bias"], ["s"]),
             helper.make_node("Relu", ["s"], ["y"])]
    m = model(nodes, [vi("xq", TensorProto.UINT8, [rows, K])], [vi("y", F, [rows, N])],
              [init("xs", np.array(0.02, np.float32)), init("xz", np.array(120, np.uint8)),
               init("w", w), init("ws", ws), init("wz", np.zeros(ws.shape, np.int8)),
               init("bias", rng.standard_normal(N).astype(np.float32))])
    feed = {"xq": rng.integers(0, 256, (rows, K)).astype(np.uint8)}
    sess = check(m, feed, rtol=1e-5, atol=1e-5)
    ops = [n.op_type for seg in sess.placement.segments for n in seg.nodes]
    assert "MatMulIntegerToFloat" in ops and "MatMul" not in ops


# -- QuantizeLinear / DequantizeLinear ------------------------------------------------------


def _ties(shape, scale: float, rng) -> np.ndarray:
    """Values whose quotient by ``scale`` (a power of two: exact) is an integer plus a
    half, positive and negative (rounding half to even decides them), mixed with others
    and with values far past the 8-bit range (saturation)."""
    k = rng.integers(-300, 300, shape).astype(np.float32)
    x = (k + np.where(rng.random(shape) < 0.6, 0.5, rng.random(shape))).astype(np.float32)
    x = x * np.float32(scale)
    x.reshape(-1)[:3] = [1e9, -1e9, 0.0]
    return x


@pytest.mark.parametrize("out_t", [np.uint8, np.int8])
@pytest.mark.parametrize("zp", [True, False])
def test_quantize_dequantize_per_tensor_round_half_to_even(out_t, zp):
    """Q then DQ (the pair a QDQ model keeps around a float op) and an Add between: every
    tie of x / scale rounded to even as onnxruntime rounds it, codes saturated."""
    from onnx import helper

    from tests._models import F, init, model, vi

    rng = np.random.default_rng(5)
    T = helper.np_dtype_to_tensor_dtype(np.dtype(out_t))
    zq = [init("z", np.array(7 if out_t is np.uint8 else -3, out_t))] if zp else []
    zin = ["z"] if zp else []
    nodes = [helper.make_node("QuantizeLinear", ["x", "s"] + zin, ["q"]),
             helper.make_node("DequantizeLinear", ["q", "s"] + zin, ["d"]),
             helper.make_node("Add", ["d", "x"], ["y"])]
    if not zp and out_t is np.int8:  # no zero point: the type comes from output_dtype
        nodes[0] = helper.make_node("QuantizeLinear", ["x", "s"], ["q"], output_dtype=T)
    m = model(nodes, [vi("x", F, [3, 5, 37])], [vi("q", T, [3, 5, 37]), vi("y", F, [3, 5, 37])],
              [init("s", np.array(0.25, np.float32))] + zq, opset=21)
    check(m, {"x": _ties((3, 5, 37), 0.25, rng)}, rtol=0, atol=0)


@pytest.mark.parametrize("axis", [1, -1, 0])
def test_quantize_dequantize_per_axis_of_a_transposed_input(axis):
    """Scales and zero points along one axis, the input a transposed (strided) view."""
    from onnx import TensorProto, helper

    from tests._models import F, init, model, vi

    rng = np.random.default_rng(6)
    shape = (4, 6, 9)  # after the transpose
    n = shape[axis]
    s = (2.0 ** rng.integers(-4, 1, n)).astype(np.float32)
    z = rng.integers(-20, 20, n).astype(np.int8)
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[1, 2, 0]),
             helper.make_node("QuantizeLinear", ["t", "s", "z"], ["q"], axis=axis),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], axis=axis)]
    m = model(nodes, [vi("x", F, [9, 4, 6])],
              [vi("q", TensorProto.INT8, list(shape)), vi("y", F, list(shape))],
              [init("s", s), init("z", z)])
    x = _ties((4, 6, 9), 0.0625, rng).transpose(2, 0, 1).copy()
    check(m, {"x": x}, rtol=0, atol=0)


@pytest.mark.parametrize("x_t", [np.uint8, np.int8, np.int32])
def test_dequantize_of_codes_and_int32_biases(x_t):
    from onnx import helper

    from tests._models import F, init, model, vi

    rng = np.random.default_rng(7)
    T = helper.np_dtype_to_tensor_dtype(np.dtype(x_t))
    info = np.iinfo(x_t)
    lo, hi = max(info.min, -(1 << 20)), min(info.max, 1 << 20)
    x = rng.integers(lo, hi, (5, 33), endpoint=True).astype(x_t)
    nodes = [helper.make_node("DequantizeLinear", ["x", "s", "z"], ["d"]),
             helper.make_node("DequantizeLinear", ["x", "s"], ["e"]),
             helper.make_node("Mul", ["d", "e"], ["y"])]
    m = model(nodes, [vi("x", T, [5, 33])], [vi("y", F, [5, 33])],
              [init("s", np.array(0.013, np.float32)), init("z", np.array(3, x_t))])
    check(m, {"x": x}, rtol=1e-6, atol=0)


def test_blocked_quantization_stays_in_python():
    """block_size (opset 21): the lowering refuses it; the kernel runs it."""
    from onnx import TensorProto, helper

    from tests._models import F, init, model, vi

    rng = np.random.default_rng(8)
    s = (rng.random((3, 2)) + 0.5).astype(np.float32)
    nodes = [helper.make_node("DequantizeLinear", ["x", "s"], ["d"], axis=1, block_size=4),
             helper.make_node("Softmax", ["d"], ["p"]), helper.make_node("MatMul", ["p", "w"], ["y"])]
    m = model(nodes, [vi("x", TensorProto.INT8, [3, 8])], [vi("y", F, [3, 5])],
              [init("s", s), init("w", rng.standard_normal((8, 5)).astype(np.float32))],
              opset=21)
    check(m, {"x": rng.integers(-128, 128, (3, 8)).astype(np.int8)},
          python=["DequantizeLinear"], rtol=1e-5, atol=1e-5)
