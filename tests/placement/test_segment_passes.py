"""Provider passes per segment of a placed plan (placement/passes.py run_segment_passes):
placement is decided first (SEMANTICS.md section 2); then each segment's own nodes
are fused, nothing moves across providers, and the segments keep their inputs,
outputs and seams."""

from __future__ import annotations

import math

import numpy as np
import pytest
from onnx import helper as h

from hetero_exec import InferenceSession
from hetero_exec.placement import fusions, passes
from tests.placement._models import F, assert_outputs, init, model, ort, rand, vi

RTOL, ATOL = 1e-4, 1e-5


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("HETERO_EXEC_HETERO", raising=False)
    monkeypatch.delenv("HETERO_EXEC_REQUIRE_GPU", raising=False)


def block(width: int = 16):
    """x[2, 5, 16] -> MatMul+Add "fc1" -> LayerNorm written out ("ln_*") -> erf GELU
    ("gelu_*") -> MatMul+Add "fc2" -> y."""
    rng = np.random.default_rng(0)
    inits = [init("w1", rng.standard_normal((width, width)).astype(np.float32) * 0.3),
             init("b1", rng.standard_normal(width).astype(np.float32)),
             init("w2", rng.standard_normal((width, width)).astype(np.float32) * 0.3),
             init("b2", rng.standard_normal(width).astype(np.float32)),
             init("gamma", rng.uniform(0.5, 1.5, width).astype(np.float32)),
             init("beta", rng.normal(0, 0.2, width).astype(np.float32)),
             init("two", np.float32(2)), init("eps", np.float32(1e-5)),
             init("sqrt2", np.float32(math.sqrt(2))), init("one", np.float32(1)),
             init("half", np.float32(0.5))]
    n = h.make_node
    nodes = [n("MatMul", ["x", "w1"], ["m1"], name="fc1_mm"), n("Add", ["m1", "b1"], ["a1"], name="fc1_add"),
             n("ReduceMean", ["a1"], ["mu"], axes=[-1], name="ln_mean"),
             n("Sub", ["a1", "mu"], ["d"], name="ln_sub"), n("Pow", ["d", "two"], ["d2"], name="ln_pow"),
             n("ReduceMean", ["d2"], ["v"], axes=[-1], name="ln_var"),
             n("Add", ["v", "eps"], ["ve"], name="ln_eps"), n("Sqrt", ["ve"], ["s"], name="ln_sqrt"),
             n("Div", ["d", "s"], ["nrm"], name="ln_div"), n("Mul", ["nrm", "gamma"], ["g"], name="ln_scale"),
             n("Add", ["g", "beta"], ["ln"], name="ln_shift"),
             n("Div", ["ln", "sqrt2"], ["q"], name="gelu_div"), n("Erf", ["q"], ["e"], name="gelu_erf"),
             n("Add", ["e", "one"], ["e1"], name="gelu_add"), n("Mul", ["ln", "e1"], ["ge"], name="gelu_mul"),
             n("Mul", ["ge", "half"], ["act"], name="gelu_half"),
             n("MatMul", ["act", "w2"], ["m2"], name="fc2_mm"), n("Add", ["m2", "b2"], ["y"], name="fc2_add")]
    return model(nodes, [vi("x", F, [2, 5, width])], [vi("y", F, [2, 5, width])], inits, opset=13)


FEED = {"x": rand(2, 5, 16, seed=4)}


def layout(sess):
    return [(s.provider.name, [n.op_type for n in s.nodes]) for s in sess.placement.segments]


def seams(sess):
    return [(s.value, s.producer, s.consumers) for s in sess.placement.seams]


def test_cpu_and_device_segments_fused_in_place():
    m = block()
    pins = [("ln_.*", "cpu"), ("gelu_.*", "cpu")]
    plain = InferenceSession(m, ["sim-gpu", "cpu"], hetero=True, affinity=pins, optimize=False)
    sess = InferenceSession(m, ["sim-gpu", "cpu"], hetero=True, affinity=pins)
    assert layout(sess) == [("sim-gpu:0", ["FusedMatMul"]), ("cpu", ["FusedLayerNorm", "FusedGelu"]),
                            ("sim-gpu:0", ["FusedMatMul"])]
    # placement did not change: the same segments, the same seams and boundaries
    assert seams(sess) == seams(plain)
    for s, p in zip(sess.placement.segments, plain.placement.segments):
        assert (s.id, s.provider.name, s.outputs) == (p.id, p.provider.name, p.outputs)
        # only folded constants leave the inputs (the fused kernels take eps, 1/sqrt2 as attributes)
        assert [i for i in p.inputs if i not in s.inputs] == [
            i for i in p.inputs if i in ("two", "eps", "sqrt2", "one", "half")]
    want = ort(m, FEED)
    assert_outputs(sess.run(None, FEED), want, RTOL, ATOL)
    assert_outputs(plain.run(None, FEED), want, RTOL, ATOL)
    # the session still reports the model's own nodes where it is asked to
    assert sess._build.graph is sess.placement.graph and sess.graph is not sess.placement.graph


def test_a_chain_across_a_seam_is_not_fused():
    """MatMul on the device, its bias Add pinned to cpu: each stays where it was placed."""
    m = block()
    sess = InferenceSession(m, ["sim-gpu", "cpu"], hetero=True, affinity=[("fc1_add", "cpu")])
    segs = layout(sess)
    assert segs[0] == ("sim-gpu:0", ["MatMul"])
    assert segs[1] == ("cpu", ["Add"])
    assert ("m1", 0, [1]) in seams(sess)
    assert_outputs(sess.run(None, FEED), ort(m, FEED), RTOL, ATOL)


def test_a_fused_op_the_device_declines_is_not_placed_there():
    """Each fused node is asked of its segment's provider: declined, the chain stays."""
    m = block()
    dev = ("sim-gpu", {"exclude_ops": ["hetero_exec::FusedMatMul"]})
    sess = InferenceSession(m, [dev, "cpu"], hetero=True, affinity=[("ln_.*", "cpu"), ("gelu_.*", "cpu")])
    assert layout(sess) == [("sim-gpu:0", ["MatMul", "Add"]), ("cpu", ["FusedLayerNorm", "FusedGelu"]),
                            ("sim-gpu:0", ["MatMul", "Add"])]
    assert_outputs(sess.run(None, FEED), ort(m, FEED), RTOL, ATOL)


def test_seam_values_are_kept():
    """The LayerNorm's centred value read by another segment: the chain cannot fuse."""
    m = block()
    sess = InferenceSession(m, ["sim-gpu", "cpu"], hetero=True,
                            affinity=[("ln_.*", "cpu")])
    segs = layout(sess)
    assert ("cpu", ["FusedLayerNorm"]) in segs
    sess2 = InferenceSession(m, ["sim-gpu", "cpu"], hetero=True,
                             affinity=[("ln_(mean|sub|pow|var|eps|sqrt|scale|shift)", "cpu")])
    assert not any("FusedLayerNorm" in ops for _, ops in layout(sess2))
    assert "d" in [s[0] for s in seams(sess2)]
    for s in (sess, sess2):
        assert_outputs(s.run(None, FEED), ort(m, FEED), RTOL, ATOL)


def test_a_failing_segment_pass_leaves_the_plan_as_placed():
    def broken(graph, region):
        region.nodes.clear()  # damage, then fail: nothing of it may survive
        raise RuntimeError("broken pass")

    passes.register_segment_pass("cpu", broken)
    try:
        m = block()
        sess = InferenceSession(m, ["sim-gpu", "cpu"], hetero=True, affinity=[("ln_.*", "cpu")])
    finally:
        passes.unregister_segment_pass("cpu", broken)
    assert ("cpu", ["ReduceMean", "Sub", "Pow", "ReduceMean", "Add", "Sqrt", "Div", "Mul", "Add"]) \
        in layout(sess)
    assert sess.placement.graph is sess.graph  # the placed graph, unchanged
    assert_outputs(sess.run(None, FEED), ort(m, FEED), RTOL, ATOL)


def test_optimize_false_keeps_segments_unfused():
    sess = InferenceSession(block(), ["sim-gpu", "cpu"], hetero=True, affinity=[("ln_.*", "cpu")],
                            optimize=False)
    assert not any(op.startswith("Fused") for _, ops in layout(sess) for op in ops)


def test_fuse_on_a_region_touches_only_its_nodes():
    from hetero_exec.ir.load import load

    _, graph = load(block())
    ln = [n for n in graph.nodes if n.name.startswith("ln_")]
    region = fusions.Region(list(ln), keep={"ln"})
    assert fusions.fuse(graph, region) is graph
    assert [n.op_type for n in region.nodes] == ["FusedLayerNorm"]
    assert [n.op_type for n in graph.nodes if not n.name.startswith("ln_")] == [
        "MatMul", "Add", "Div", "Erf", "Add", "Mul", "Mul", "MatMul", "Add"]
