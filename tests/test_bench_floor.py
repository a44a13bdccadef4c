"""bench/floor.py: the FLOP counts behind bench_cpu's physical floor, checked by hand."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from bench.floor import blas_gflops, model_flops


def _model(nodes, inputs, inits):
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.zeros(s, np.float32), n) for n, s in inits])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_conv_flops_count_groups_strides_and_pads():
    # 8 -> 16 channels, group 2, 3x3 stride 2 pad 1 on 10x10: output 5x5
    m = _model([helper.make_node("Conv", ["x", "w"], ["y"], group=2, strides=[2, 2],
                                 pads=[1, 1, 1, 1])], [("x", ["N", 8, 10, 10])],
               [("w", (16, 4, 3, 3))])
    assert model_flops(m, {"x": [3, 8, 10, 10]}) == 2 * 3 * 16 * 25 * 4 * 9


def test_batched_matmul_and_relu():
    m = _model([helper.make_node("MatMul", ["a", "b"], ["t"]),
                helper.make_node("Relu", ["t"], ["y"])],
               [("a", ["N", 5, 6])], [("b", (6, 7))])
    assert model_flops(m, {"a": [2, 5, 6]}) == 2 * 2 * 5 * 7 * 6  # Relu counts nothing


def test_gemm_with_transposes():
    m = _model([helper.make_node("Gemm", ["a", "w"], ["y"], transA=1, transB=1)],
               [("a", [6, "N"])], [("w", (4, 6))])
    assert model_flops(m, {"a": [6, 3]}) == 2 * 3 * 4 * 6


def test_blas_rate_is_positive():
    assert blas_gflops(n=64, runs=2) > 0


def test_shapes_inference_misses_come_from_a_run():
    """A MatMul after Where on a sliced mask: onnx shape inference loses the shape, one
    onnxruntime run finds it (gpt2's attention)."""
    pytest.importorskip("onnxruntime")
    from bench.models import gpt2, inputs

    feed = inputs("gpt2", 1, seq=16)
    model = gpt2(layers=1)
    total = model_flops(model, feed)
    # embeddings aside, every MatMul counts: qkv, scores, context, out, 2 MLP, LM head
    hidden, s, vocab = 256, 16, 8192
    want = 2 * s * (hidden * 3 * hidden + 2 * s * hidden + hidden * hidden
                    + 2 * hidden * 4 * hidden + hidden * vocab)
    assert total == want
