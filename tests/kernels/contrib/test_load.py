"""Models with onnxruntime's contrib ops at load: valid for onnx's checker once their
schemas are registered, and a checker complaint about a contrib op is not 'invalid model'."""

from __future__ import annotations

import pickle

import onnx
import pytest
from onnx import helper

import hetero_exec
from hetero_exec.errors import MissingKernelsError, ModelLoadError
from hetero_exec.ir.load import load

F = onnx.TensorProto.FLOAT


def _model(node, inputs, outputs):
    g = helper.make_graph([node], "g", inputs, outputs)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                               helper.make_opsetid("com.microsoft", 1)])


def test_simplified_layer_norm_in_default_domain_is_valid_and_typed():
    node = helper.make_node("SimplifiedLayerNormalization", ["x", "s"], ["y"], epsilon=1e-6)
    m = _model(node, [helper.make_tensor_value_info("x", F, ["B", 8]),
                      helper.make_tensor_value_info("s", F, [8])],
               [helper.make_tensor_value_info("y", F, ["B", 8])])
    model, graph = load(m.SerializeToString())
    onnx.checker.check_model(model)
    assert graph.nodes[0].op_type == "SimplifiedLayerNormalization"


def test_shape_inference_through_contrib_ops():
    """The registered inference functions type what follows a contrib op."""
    nodes = [helper.make_node("SkipLayerNormalization", ["x", "k", "g"], ["n"],
                              domain="com.microsoft"),
             helper.make_node("FastGelu", ["n"], ["f"], domain="com.microsoft"),
             helper.make_node("Relu", ["f"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [2, 3, 8]),
                                       helper.make_tensor_value_info("k", F, [2, 3, 8]),
                                       helper.make_tensor_value_info("g", F, [8])],
                          [helper.make_tensor_value_info("y", F, [2, 3, 8])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                            helper.make_opsetid("com.microsoft", 1)])
    _, graph = load(m.SerializeToString())
    assert graph.value("n").shape == (2, 3, 8) and graph.value("f").shape == (2, 3, 8)


def test_checker_failure_on_contrib_op_is_not_invalid_model():
    """An attribute our copy of the schema lacks: onnx's checker refuses the node, the
    model still loads (the kernel is what judges it)."""
    node = helper.make_node("FastGelu", ["x"], ["y"], domain="com.microsoft", extra_knob=1)
    m = _model(node, [helper.make_tensor_value_info("x", F, [4])],
               [helper.make_tensor_value_info("y", F, [4])])
    with pytest.raises(onnx.checker.ValidationError):
        onnx.checker.check_model(m)
    model, graph = load(m.SerializeToString())
    assert graph.nodes[0].op_type == "FastGelu"


def test_checker_failure_elsewhere_is_still_invalid_model():
    node = helper.make_node("Relu", ["x"], ["y"], extra_knob=1)
    m = _model(node, [helper.make_tensor_value_info("x", F, [4])],
               [helper.make_tensor_value_info("y", F, [4])])
    with pytest.raises(ModelLoadError, match="invalid ONNX model"):
        load(m.SerializeToString())


def test_missing_kernel_error_survives_pickling():
    node = helper.make_node("NoSuchOp", ["x"], ["y"], domain="com.microsoft")
    m = _model(node, [helper.make_tensor_value_info("x", F, ["N"])],
               [helper.make_tensor_value_info("y", F, ["N"])])
    with pytest.raises(MissingKernelsError) as ei:
        hetero_exec.InferenceSession(m.SerializeToString(), providers=["cpu"])
    back = pickle.loads(pickle.dumps(ei.value))
    assert back.missing == {"com.microsoft::NoSuchOp": 1} and str(back) == str(ei.value)


@pytest.mark.parametrize("attrs", [{"k_quant_type": "PER_TENSOR"}, {"causal": 0}])
def test_variant_the_kernel_does_not_take_is_refused_at_build(attrs):
    """A GroupQueryAttention variant the kernel refuses: a build error on cpu naming why,
    and a GPU decline with the same reason (not a failure at the first run)."""
    from hetero_exec.errors import HeterogeneousPlacementRequired, UnsupportedOperatorError

    node = helper.make_node("GroupQueryAttention", ["q", "k", "v", "", "", "sk", "tot"],
                            ["y"], domain="com.microsoft", num_heads=2, kv_num_heads=1, **attrs)
    m = helper.make_model(helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info("q", F, [1, 3, 16]),
         helper.make_tensor_value_info("k", F, [1, 3, 8]),
         helper.make_tensor_value_info("v", F, [1, 3, 8]),
         helper.make_tensor_value_info("sk", onnx.TensorProto.INT32, [1]),
         helper.make_tensor_value_info("tot", onnx.TensorProto.INT32, [])],
        [helper.make_tensor_value_info("y", F, [1, 3, 16])]),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    reason = "quantized key/value caches" if "k_quant_type" in attrs else "causal=0"
    with pytest.raises(UnsupportedOperatorError, match=reason):
        hetero_exec.InferenceSession(m.SerializeToString(), providers=["cpu"])
    with pytest.raises(HeterogeneousPlacementRequired, match=reason):
        hetero_exec.InferenceSession(m.SerializeToString(), providers=["sim-gpu"],
                                     require_gpu=True)
