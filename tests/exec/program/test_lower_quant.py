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
