"""A QDQ model's weights: DequantizeLinear of a constant is folded at compile time, and
the MatMul that reads it specializes on the float weight (packed) as in a float model."""

from __future__ import annotations

import numpy as np
import onnxruntime
from onnx import TensorProto, helper

from hetero_exec.exec.plan import Compiler
from hetero_exec.ir.load import load
from hetero_exec.kernels.native import packed_gemm
from tests._models import assert_outputs, init, model, vi


def test_dequantized_weight_reaches_the_matmul_hook():
    rng = np.random.default_rng(0)
    K, N = 64, 48
    Wq = rng.integers(-127, 128, (K, N)).astype(np.int8)
    nodes = [helper.make_node("DequantizeLinear", ["Wq", "ws"], ["W"]),
             helper.make_node("MatMul", ["x", "W"], ["y"])]
    m = model(nodes, [vi("x", TensorProto.FLOAT, ["M", K])], [vi("y", TensorProto.FLOAT, ["M", N])],
              [init("Wq", Wq), init("ws", np.array(0.02, np.float32))])
    _, g = load(m)
    plan = Compiler().compile_graph(g)
    assert [s.node.op_type for s in plan.steps] == ["MatMul"]  # the DequantizeLinear folded
    if packed_gemm.available():
        assert plan.steps[0].fn.__name__ == "MatMul_packed"
    x = rng.standard_normal((40, K)).astype(np.float32)
    from hetero_exec import InferenceSession

    got = InferenceSession(m.SerializeToString(), providers=["cpu"]).run(None, {"x": x})
    so = onnxruntime.SessionOptions()  # the nodes as written (its fusions quantize x)
    so.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    want = onnxruntime.InferenceSession(m.SerializeToString(), so,
                                        providers=["CPUExecutionProvider"]).run(None, {"x": x})
    assert_outputs(got, want, rtol=1e-5, atol=1e-5)
