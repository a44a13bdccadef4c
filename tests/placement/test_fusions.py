"""The cpu fusion passes (hetero_exec/placement/fusions.py): what they rewrite, what they
leave alone, and that results match onnxruntime with and without them."""

from __future__ import annotations

import math

import numpy as np
import pytest
from onnx import helper as h

from hetero_exec import InferenceSession
from hetero_exec.ir.load import load
from hetero_exec.placement import fusions, passes
from tests.placement._models import F, init, model, ort, rand, vi

RTOL, ATOL = 1e-4, 1e-5


@pytest.fixture
def no_fusions():
    """The cpu provider without its fusion pass, for the unfused baseline."""
    passes.unregister_pass("cpu", fusions.fuse_cpu)
    try:
        yield
    finally:
        passes.register_pass("cpu", fusions.fuse_cpu)


def ops_of(sess) -> list[str]:
    return [n.op_type for seg in sess.placement.segments for n in seg.nodes]


def nodes_of(sess):
    return [n for seg in sess.placement.segments for n in seg.nodes]


def run_both(m, feed):
    sess = InferenceSession(m, providers=["cpu"])
    got = sess.run(None, feed)
    want = ort(m, feed)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL)
    return sess, got


# --- models -----------------------------------------------------------------------------


def _bn_inits(prefix: str, c: int, seed: int):
    rng = np.random.default_rng(seed)
    return [init(f"{prefix}_s", rng.uniform(0.5, 1.5, c).astype(np.float32)),
            init(f"{prefix}_b", rng.normal(0, 0.1, c).astype(np.float32)),
            init(f"{prefix}_m", rng.normal(0, 0.1, c).astype(np.float32)),
            init(f"{prefix}_v", rng.uniform(0.5, 1.5, c).astype(np.float32))]


def conv_bn_relu(residual: bool = True, conv_bias: bool = True, extra_output: str | None = None,
                 extra_reader: bool = False, opset: int = 17):
    """x[2,4,9,9] -> Conv "conv" (3x3, pad 1, 8 ch) -> BN "bn" [-> Add(skip)] -> Relu "relu" -> y.

    skip = 1x1 Conv "skip_conv" of x. ``extra_output`` also exposes that intermediate;
    ``extra_reader`` adds a Neg reading the conv output (a second consumer)."""
    rng = np.random.default_rng(1)
    inits = [init("w", (rng.standard_normal((8, 4, 3, 3)) * 0.3).astype(np.float32))]
    w_skip = init("w_skip", (rng.standard_normal((8, 4, 1, 1)) * 0.3).astype(np.float32))
    conv_in = ["x", "w"]
    if conv_bias:
        inits.append(init("cb", rng.normal(0, 0.1, 8).astype(np.float32)))
        conv_in.append("cb")
    inits += _bn_inits("bn", 8, 2)
    nodes = [h.make_node("Conv", conv_in, ["c"], name="conv", kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             h.make_node("BatchNormalization", ["c", "bn_s", "bn_b", "bn_m", "bn_v"], ["n"], name="bn",
                         epsilon=1e-3)]
    last = "n"
    if residual:
        inits.append(w_skip)
        nodes.append(h.make_node("Conv", ["x", "w_skip"], ["skip"], name="skip_conv",
                                 kernel_shape=[1, 1]))
        nodes.append(h.make_node("Add", ["n", "skip"], ["s"], name="add"))
        last = "s"
    nodes.append(h.make_node("Relu", [last], ["y"], name="relu"))
    outputs = [vi("y", F, [2, 8, 9, 9])]
    if extra_output:
        outputs.append(vi(extra_output, F, [2, 8, 9, 9]))
    if extra_reader:
        nodes.append(h.make_node("Neg", ["c"], ["z"], name="neg"))
        outputs.append(vi("z", F, [2, 8, 9, 9]))
    return model(nodes, [vi("x", F, [2, 4, 9, 9])], outputs, inits, opset=opset)


def _feed_x():
    return {"x": rand(2, 4, 9, 9, seed=3)}


# --- BatchNormalization folding and FusedConv ------------------------------------------------


@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("conv_bias", [True, False])
def test_conv_bn_relu_fused_matches_ort(residual, conv_bias):
    m = conv_bn_relu(residual=residual, conv_bias=conv_bias)
    sess, _ = run_both(m, _feed_x())
    ops = ops_of(sess)
    assert "BatchNormalization" not in ops and "Relu" not in ops
    assert ops.count("FusedConv") == 1
    fused = next(n for n in nodes_of(sess) if n.op_type == "FusedConv")
    assert fused.domain == "hetero_exec" and fused.name == "conv"  # the first node's identity
    assert fused.outputs == ["y"]
    if residual:
        assert "Add" not in ops and fused.inputs[3] == "skip"
        # the residual is produced before the fused node runs (order stays topological)
        order = [n.name for n in nodes_of(sess)]
        assert order.index("skip_conv") < order.index("conv")


def test_fused_equals_unfused(no_fusions):
    m = conv_bn_relu()
    plain = InferenceSession(m, providers=["cpu"])
    assert "BatchNormalization" in ops_of(plain)
    want = plain.run(None, _feed_x())
    passes.register_pass("cpu", fusions.fuse_cpu)
    try:
        fused = InferenceSession(m, providers=["cpu"])
    finally:
        passes.unregister_pass("cpu", fusions.fuse_cpu)
    assert "FusedConv" in ops_of(fused)
    np.testing.assert_allclose(fused.run(None, _feed_x())[0], want[0], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(want[0], ort(m, _feed_x())[0], rtol=RTOL, atol=ATOL)


def test_skipped_when_the_intermediate_is_a_graph_output():
    # the Conv's output exposed: no fold, no fusion
    sess, _ = run_both(conv_bn_relu(residual=False, extra_output="c"), _feed_x())
    assert ops_of(sess) == ["Conv", "BatchNormalization", "Relu"]
    # BN's output exposed: BN folds into the Conv, but the Relu stays separate
    sess, _ = run_both(conv_bn_relu(residual=False, extra_output="n"), _feed_x())
    assert sorted(ops_of(sess)) == ["Conv", "Relu"]


def test_skipped_when_the_intermediate_has_other_readers():
    m = conv_bn_relu(residual=True, extra_reader=True)
    sess, _ = run_both(m, _feed_x())
    ops = ops_of(sess)
    assert "BatchNormalization" in ops and "Neg" in ops
    # the BN output still has one reader (the Add): Add+Relu fuse into nothing without a
    # Conv producer, so they stay as they are
    assert ops.count("Conv") + ops.count("FusedConv") == 2


def test_overridable_initializers_are_not_folded():
    """An initializer that is also a graph input may be fed at run time: no fold."""
    m = conv_bn_relu(residual=False)
    m.graph.input.append(vi("bn_v", F, [8]))
    sess, _ = run_both(m, _feed_x())
    assert "BatchNormalization" in ops_of(sess)
    var = np.full(8, 2.0, np.float32)
    feed = {**_feed_x(), "bn_v": var}
    np.testing.assert_allclose(sess.run(None, feed)[0], ort(m, feed)[0], rtol=RTOL, atol=ATOL)


def test_training_batchnorm_is_not_folded():
    m = conv_bn_relu(residual=False)
    bn = next(n for n in m.graph.node if n.op_type == "BatchNormalization")
    bn.attribute.append(h.make_attribute("training_mode", 1))
    _, graph = load(m)
    assert fusions.fold_batchnorm(graph) is None


def test_fold_batchnorm_pass_alone():
    _, graph = load(conv_bn_relu(residual=False))
    out = fusions.fold_batchnorm(graph)
    assert out is not None
    assert [n.op_type for n in out.nodes] == ["Conv", "Relu"]
    conv = out.nodes[0]
    assert conv.name == "conv" and conv.outputs == ["n"]
    # the old weights are gone, the folded ones are registered with their values
    assert "w" not in out.initializers and conv.inputs[1] in out.initializers
    assert out.values[conv.inputs[1]].shape == (8, 4, 3, 3)
    assert out.consumers["n"] == [out.nodes[1]] and out.producer["n"] is conv


# --- MatMul / Gemm ---------------------------------------------------------------------------


def _mm_model(relu: bool, bias_reader: bool = False):
    rng = np.random.default_rng(5)
    inits = [init("w1", rng.standard_normal((16, 12)).astype(np.float32)),
             init("b1", rng.standard_normal(12).astype(np.float32)),
             init("w2", rng.standard_normal((10, 12)).astype(np.float32)),  # Gemm transB
             init("b2", rng.standard_normal((1, 10)).astype(np.float32))]
    nodes = [h.make_node("MatMul", ["x", "w1"], ["m"], name="mm"),
             h.make_node("Add", ["m", "b1"], ["a"], name="add")]
    last = "a"
    if relu:
        nodes.append(h.make_node("Relu", ["a"], ["r"], name="relu"))
        last = "r"
    nodes.append(h.make_node("Gemm", [last, "w2", "b2"], ["g"], name="gemm", transB=1))
    nodes.append(h.make_node("Relu", ["g"], ["y"], name="relu2"))
    outputs = [vi("y", F, [3, 10])]
    if bias_reader:
        outputs.append(vi("m", F, [3, 12]))
    return model(nodes, [vi("x", F, [3, 16])], outputs, inits)


@pytest.mark.parametrize("relu", [True, False])
def test_matmul_add_relu_and_gemm(relu):
    sess, _ = run_both(_mm_model(relu), {"x": rand(3, 16, seed=7)})
    fused = nodes_of(sess)
    assert [n.op_type for n in fused] == ["FusedMatMul", "FusedMatMul"]
    assert [n.name for n in fused] == ["mm", "gemm"]
    acts = [n.attrs["activation"].s.decode() for n in fused]
    assert acts == (["Relu", "Relu"] if relu else ["", "Relu"])


def test_matmul_output_read_elsewhere_is_not_fused():
    sess, _ = run_both(_mm_model(True, bias_reader=True), {"x": rand(3, 16, seed=7)})
    assert ops_of(sess)[:3] == ["MatMul", "Add", "Relu"]


# --- Gelu ------------------------------------------------------------------------------------


def _gelu_erf_model():
    inits = [init("sqrt2", np.float32(math.sqrt(2))), init("one", np.float32(1)),
             init("half", np.float32(0.5))]
    nodes = [h.make_node("Div", ["x", "sqrt2"], ["d"], name="div"),
             h.make_node("Erf", ["d"], ["e"], name="erf"),
             h.make_node("Add", ["e", "one"], ["a"], name="add"),
             h.make_node("Mul", ["x", "a"], ["m"], name="mul"),
             h.make_node("Mul", ["m", "half"], ["y"], name="mul_half")]
    return model(nodes, [vi("x", F, [4, 64])], [vi("y", F, [4, 64])], inits)


def _gelu_tanh_model(expose: str | None = None):
    inits = [init("three", np.float32(3)), init("c", np.float32(0.044715)),
             init("k", np.float32(math.sqrt(2 / math.pi))), init("one", np.float32(1)),
             init("half", np.float32(0.5))]
    nodes = [h.make_node("Pow", ["x", "three"], ["p"], name="pow"),
             h.make_node("Mul", ["p", "c"], ["pc"], name="mul_c"),
             h.make_node("Add", ["x", "pc"], ["inner"], name="add_inner"),
             h.make_node("Mul", ["inner", "k"], ["u"], name="mul_k"),
             h.make_node("Tanh", ["u"], ["t"], name="tanh"),
             h.make_node("Mul", ["x", "half"], ["xh"], name="mul_half"),
             h.make_node("Add", ["t", "one"], ["t1"], name="add_one"),
             h.make_node("Mul", ["xh", "t1"], ["y"], name="mul_out")]
    outputs = [vi("y", F, [4, 64])] + ([vi(expose, F, [4, 64])] if expose else [])
    return model(nodes, [vi("x", F, [4, 64])], outputs, inits)


def test_gelu_erf_chain():
    x = (rand(4, 64, seed=9) * 3).astype(np.float32)
    sess, _ = run_both(_gelu_erf_model(), {"x": x})
    (node,) = nodes_of(sess)
    assert node.op_type == "FusedGelu" and node.name == "div"
    assert node.attrs["approximate"].s == b"none"


def test_gelu_tanh_chain():
    x = (rand(4, 64, seed=9) * 3).astype(np.float32)
    sess, _ = run_both(_gelu_tanh_model(), {"x": x})
    (node,) = nodes_of(sess)
    assert node.op_type == "FusedGelu" and node.name == "pow"
    assert node.attrs["approximate"].s == b"tanh"


def test_gelu_chain_with_an_exposed_intermediate_is_kept():
    x = rand(4, 64, seed=9)
    sess, _ = run_both(_gelu_tanh_model(expose="t"), {"x": x})
    assert "FusedGelu" not in ops_of(sess) and "Tanh" in ops_of(sess)


# --- the benchmark models --------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mlp", "resnet18", "bert", "gpt2"])
def test_bench_models_fused_match_ort(name):
    from bench.models import MODELS, inputs

    m = MODELS[name]()
    feed = inputs(name, 1, seq=16) if name in ("bert", "gpt2") else inputs(name, 1)
    sess, _ = run_both(m, feed)
    ops = ops_of(sess)
    assert any(op.startswith("Fused") for op in ops)
    assert "BatchNormalization" not in ops and "Erf" not in ops and "Tanh" not in ops


def test_saved_plan_of_a_fused_session_loads_onto_the_model(tmp_path):
    """A saved plan lists the model's nodes a fused node stands for, so it reloads onto
    the model as written; the loaded plan's segments then get their passes again."""
    m = conv_bn_relu()
    sess = InferenceSession(m, providers=["cpu"])
    path = tmp_path / "plan.json"
    sess.placement.to_json(str(path))
    import json

    saved = json.loads(path.read_text())["segments"][0]["nodes"]
    assert sorted(saved) == sorted(f'graph/node#{i} "{n.name}"' for i, n in enumerate(m.graph.node))
    again = InferenceSession(m, providers=["cpu"], placement=str(path))
    assert sorted(ops_of(again)) == sorted(ops_of(sess))
    plain = InferenceSession(m, providers=["cpu"], placement=str(path), optimize=False)
    assert sorted(ops_of(plain)) == sorted(n.op_type for n in m.graph.node)
    for s in (again, plain):
        np.testing.assert_allclose(s.run(None, _feed_x())[0], sess.run(None, _feed_x())[0],
                                   rtol=RTOL, atol=ATOL)
