"""The cpu provider's float16 pass (placement/fusions/float16.py): a model converted by
onnxruntime's float16 tool runs its float32 chains in float32 (onnxruntime's cpu does the
same: it casts around each node, then removes the casts that cancel), so the fusions see
the chains and programs run them. Checked against onnxruntime on the float16 model and on
the float32 model; a graph without float16 weights keeps its per-node rounding."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper
from onnxruntime.transformers.float16 import convert_float_to_float16

import hetero_exec
from hetero_exec.ir.load import load
from hetero_exec.placement.fusions.float16 import float16_in_float32
from tests._models import init, model, vi

F16 = TensorProto.FLOAT16


def _attention_block(D: int = 32, H: int = 4) -> onnx.ModelProto:
    """x -> q, k, v projections -> heads -> softmax(q k^T / sqrt(d)) v -> out projection."""
    rng = np.random.default_rng(0)
    d = D // H

    def w(*shape, scale=0.3):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def heads(src: str, dst: str, perm: list[int]) -> list[onnx.NodeProto]:
        return [helper.make_node("Reshape", [src, "split"], [dst + "_r"]),
                helper.make_node("Transpose", [dst + "_r"], [dst], perm=perm)]

    nodes = [helper.make_node("MatMul", ["x", "Wq"], ["q0"]),
             helper.make_node("MatMul", ["x", "Wk"], ["k0"]),
             helper.make_node("MatMul", ["x", "Wv"], ["v0"]),
             *heads("q0", "q", [0, 2, 1, 3]), *heads("k0", "kt", [0, 2, 3, 1]),
             *heads("v0", "v", [0, 2, 1, 3]),
             helper.make_node("MatMul", ["q", "kt"], ["s0"]),
             helper.make_node("Div", ["s0", "sqrt_d"], ["s"]),
             helper.make_node("Softmax", ["s"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["a"]),
             helper.make_node("Transpose", ["a"], ["at"], perm=[0, 2, 1, 3]),
             helper.make_node("Reshape", ["at", "merge"], ["am"]),
             helper.make_node("MatMul", ["am", "Wo"], ["o"]),
             helper.make_node("Add", ["o", "x"], ["r"]),
             helper.make_node("LayerNormalization", ["r", "g", "b"], ["y"], axis=-1)]
    return model(nodes, [vi("x", 1, ["B", "S", D])], [vi("y", 1, ["B", "S", D])],
                 [init("Wq", w(D, D)), init("Wk", w(D, D)), init("Wv", w(D, D)),
                  init("Wo", w(D, D)), init("g", w(D) + 1), init("b", w(D)),
                  init("sqrt_d", np.array(np.sqrt(d), np.float32)),
                  init("split", np.array([0, 0, H, d], np.int64)),
                  init("merge", np.array([0, 0, D], np.int64))], opset=17)


def _ort(m: onnx.ModelProto, feed: dict) -> np.ndarray:
    so = onnxruntime.SessionOptions()
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return onnxruntime.InferenceSession(m.SerializeToString(), so,
                                        providers=["CPUExecutionProvider"]).run(None, feed)[0]


@pytest.mark.parametrize("keep_io_types", [False, True])
def test_a_float16_model_runs_its_chains_in_float32(keep_io_types):
    m32 = _attention_block()
    m16 = convert_float_to_float16(m32, keep_io_types=keep_io_types)
    x = np.random.default_rng(1).standard_normal((2, 7, 32)).astype(np.float32)
    x16 = x if keep_io_types else x.astype(np.float16)
    want32 = _ort(m32, {"x": x})
    ort16 = _ort(m16, {"x": x16}).astype(np.float32)
    sess = hetero_exec.InferenceSession(m16.SerializeToString(), providers=["cpu"])
    for _ in range(3):  # plain, binding, the bound program
        got = sess.run(None, {"x": x16})[0]
        assert got.dtype == (np.float32 if keep_io_types else np.float16)
        got = got.astype(np.float32)
        ort_err = float(np.abs(ort16 - want32).max())
        # as close to the float32 model as onnxruntime is
        assert float(np.abs(got - want32).max()) <= 1.5 * ort_err + 1e-3
        np.testing.assert_allclose(got, ort16, rtol=5e-3, atol=5e-3)
    graph = sess.placement.graph
    ops = [n.op_type for n in graph.nodes]
    # the attention chain is one fused node: its Softmax computes in float32 too
    assert "FusedAttention" in ops and "Softmax" not in ops
    halves = [n for n in graph.nodes for o in n.outputs
              if o and graph.values.get(o) is not None and graph.values[o].elem_type == F16]
    # float16 only where the graph says so: its output (and the input casts the tool wrote)
    assert all(n.op_type == "Cast" for n in halves)
    assert len(halves) <= (2 if keep_io_types else 1)


def test_a_graph_without_float16_weights_keeps_per_node_rounding():
    # float16 arithmetic with no weights (the ONNX node suite's expansions): the spec
    # rounds at every node, and so does the per-node path
    nodes = [helper.make_node("Mul", ["x", "x"], ["a"]),
             helper.make_node("Add", ["a", "x"], ["y"])]
    m = model(nodes, [vi("x", F16, [5])], [vi("y", F16, [5])], opset=17)
    _, g = load(m)
    assert float16_in_float32(g) is None
    x = np.array([1.001, 3.3, -2.7, 60.1, 0.3], np.float16)
    want = ((x * x).astype(np.float16) + x).astype(np.float16)  # each node rounds
    got = hetero_exec.InferenceSession(m.SerializeToString(), providers=["cpu"]).run(
        None, {"x": x})[0]
    np.testing.assert_array_equal(got, want)


def test_nodes_outside_both_sets_keep_float16_operands():
    # Sign is neither a float32-computing op nor a move: it reads float16, as the graph
    # says, and its readers get a float32 copy
    rng = np.random.default_rng(2)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]),
             helper.make_node("Sign", ["h"], ["s"]),
             helper.make_node("Mul", ["s", "h"], ["y"])]
    m = model(nodes, [vi("x", F16, [3, 8])], [vi("y", F16, [3, 8])],
              [init("W", rng.standard_normal((8, 8)).astype(np.float16))], opset=17)
    _, g = load(m)
    assert float16_in_float32(g) is not None
    sign = next(n for n in g.nodes if n.op_type == "Sign")
    assert g.values[sign.inputs[0]].elem_type == F16
    assert g.values[sign.outputs[0]].elem_type == F16
    x = rng.standard_normal((3, 8)).astype(np.float16)
    got = hetero_exec.InferenceSession(m.SerializeToString(), providers=["cpu"]).run(
        None, {"x": x})[0]
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float32), _ort(m, {"x": x}).astype(np.float32),
                               rtol=2e-3, atol=2e-3)


def test_a_float16_model_under_mixed_placement_on_strict_sim_gpu():
    # devices keep their float16 kernels (float32 accumulation), the cpu segment its
    # per-node path; together within onnxruntime's distance of the float32 model
    m32 = _attention_block()
    m16 = convert_float_to_float16(m32, keep_io_types=True)
    x = np.random.default_rng(3).standard_normal((2, 5, 32)).astype(np.float32)
    want32 = _ort(m32, {"x": x})
    ort16 = _ort(m16, {"x": x})
    sess = hetero_exec.InferenceSession(
        m16.SerializeToString(), providers=[("sim-gpu", {"strict": True,
                                                         "exclude_ops": ["Softmax"]}), "cpu"],
        hetero=True)
    assert sess.is_heterogeneous
    got = sess.run(None, {"x": x})[0]
    ort_err = float(np.abs(ort16 - want32).max())
    assert float(np.abs(got - want32).max()) <= 2 * ort_err + 2e-3
    np.testing.assert_allclose(got, ort16, rtol=5e-3, atol=5e-3)
