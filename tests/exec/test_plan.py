"""Run plans (SEMANTICS.md section 4): pre-parsed steps over int slots, liveness,
optional-input positions, constant folding, thread safety, kernel and
unsupported-operator errors."""

from __future__ import annotations

import sys
import threading

import numpy as np
import onnx
import pytest
from onnx import helper

import hetero_exec.exec.plan as plan_mod
import hetero_exec.ir.graph as graph_mod
import hetero_exec.kernels.registry as registry_mod
from hetero_exec import InferenceSession
from hetero_exec.errors import HeteroExecError, KernelError, UnsupportedOperatorError
from hetero_exec.exec.plan import NONE_SLOT, Compiler, RunPlan
from hetero_exec.ir.load import load
from tests._models import BOOL, I64, F, assert_outputs, graph, init, mlp, model, ort_run, vi


def compile_model(m: onnx.ModelProto, fold: bool = True, merge: bool = False) -> RunPlan:
    """The plan step by step (element-wise runs not merged unless ``merge``)."""
    _, g = load(m)
    compiler = Compiler(fold_constants=fold)
    compiler.merge_elementwise = merge
    return compiler.compile_graph(g)


def step_of(plan: RunPlan, name: str):
    matches = [s for s in plan.steps if s.node.name == name]
    assert len(matches) == 1, [s.node.name for s in plan.steps]
    return matches[0]


def releases(plan: RunPlan) -> dict[str, int]:
    """value name -> index of the step that releases it."""
    name_of = {s: n for n, s in plan.slot_of.items()}
    out: dict[str, int] = {}
    for idx, step in enumerate(plan.steps):
        for s in step.release:
            assert name_of[s] not in out, f"{name_of[s]} released twice"
            out[name_of[s]] = idx
    return out


def check_release_invariants(plan: RunPlan) -> None:
    """A released slot is never read again, and was read or written at or before its release."""
    for idx, step in enumerate(plan.steps):
        for s in step.release:
            touched = any(s in st.inputs or s in st.outputs for st in plan.steps[: idx + 1])
            assert touched, (idx, s)
            for later in plan.steps[idx + 1:]:
                assert s not in later.inputs, f"slot {s} read by {later.node.identity} after release"


# --- pre-parsed steps ----------------------------------------------------------------


def _attr_heavy_model() -> onnx.ModelProto:
    rng = np.random.default_rng(1)
    return model(
        [helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0], name="transpose"),
         helper.make_node("Gemm", ["xt", "W", "C"], ["g"], alpha=0.5, beta=2.0, transB=1, name="gemm"),
         helper.make_node("Split", ["g"], ["s0", "s1"], axis=1, num_outputs=2, name="split"),
         helper.make_node("Concat", ["s1", "s0"], ["cat"], axis=1, name="concat"),
         helper.make_node("Cast", ["cat"], ["y"], to=onnx.TensorProto.DOUBLE, name="cast"),
         helper.make_node("LeakyRelu", ["s0"], ["z"], alpha=0.2, name="leaky")],
        [vi("x", F, [4, 3])], [vi("y", onnx.TensorProto.DOUBLE, [3, 6]), vi("z", F, [3, 3])],
        [init("W", rng.standard_normal((6, 4)).astype(np.float32)),
         init("C", rng.standard_normal((6,)).astype(np.float32))])


def _no_protos(v) -> bool:
    if isinstance(v, (onnx.AttributeProto, onnx.TensorProto, onnx.GraphProto)):
        return False
    if isinstance(v, (list, tuple)):
        return all(_no_protos(x) for x in v)
    return True


def test_steps_carry_preparsed_kwargs_and_int_slots():
    p = compile_model(_attr_heavy_model())
    assert [s.node.op_type for s in p.steps] == ["Transpose", "Gemm", "Split", "Concat", "Cast", "LeakyRelu"]
    for step in p.steps:
        for slots in (step.inputs, step.outputs, step.release):
            assert isinstance(slots, tuple) and all(type(s) is int for s in slots), step
            assert all(0 <= s < len(p.template) for s in slots)
        assert all(_no_protos(v) for v in step.kwargs.values()), step.kwargs
        assert callable(step.fn)
    assert step_of(p, "transpose").kwargs["perm"] == [1, 0]
    gemm = step_of(p, "gemm").kwargs
    assert gemm["alpha"] == pytest.approx(0.5) and gemm["beta"] == pytest.approx(2.0) and gemm["transB"] == 1
    assert isinstance(gemm["alpha"], float) and isinstance(gemm["transB"], int)
    assert step_of(p, "cast").kwargs["to"] == onnx.TensorProto.DOUBLE
    assert step_of(p, "leaky").kwargs["alpha"] == pytest.approx(0.2)
    assert all(type(s) is int for _, s in p.input_slots) and all(type(s) is int for s in p.output_slots)


def test_run_does_no_attribute_parsing_or_kernel_lookup(monkeypatch):
    m = _attr_heavy_model()
    sess = InferenceSession(m)
    x = np.random.default_rng(2).standard_normal((4, 3)).astype(np.float32)
    want = ort_run(m, {"x": x})

    def forbidden(*a, **k):
        raise AssertionError("attribute parsing / kernel lookup at run time")

    monkeypatch.setattr(plan_mod, "attr_value", forbidden)
    monkeypatch.setattr(graph_mod, "attr_value", forbidden)
    monkeypatch.setattr(onnx.helper, "get_attribute_value", forbidden)
    monkeypatch.setattr(plan_mod, "lookup", forbidden)
    monkeypatch.setattr(registry_mod, "lookup", forbidden)
    for _ in range(2):
        assert_outputs(sess.run(None, {"x": x}), want)


# --- liveness -------------------------------------------------------------------------


def test_intermediate_released_right_after_last_use():
    nodes = [helper.make_node("Abs", ["x"], ["a"], name="abs"),       # 0
             helper.make_node("Neg", ["a"], ["b"], name="neg"),       # 1
             helper.make_node("Add", ["a", "b"], ["c"], name="add"),  # 2: last use of a
             helper.make_node("Mul", ["c", "W"], ["d"], name="mul"),  # 3: last use of c
             helper.make_node("Relu", ["d"], ["y"], name="relu"),     # 4: last use of d
             helper.make_node("Sigmoid", ["b"], ["z"], name="sig")]   # 5: last use of b
    m = model(nodes, [vi("x", F, [2, 3])], [vi("y", F, [2, 3]), vi("z", F, [2, 3])],
              [init("W", np.full((3,), 1.5, np.float32))])
    p = compile_model(m)
    assert [s.node.name for s in p.steps] == ["abs", "neg", "add", "mul", "relu", "sig"]
    assert releases(p) == {"a": 2, "c": 3, "d": 4, "b": 5}
    check_release_invariants(p)
    x = np.random.default_rng(3).standard_normal((2, 3)).astype(np.float32)
    sess = InferenceSession(m)
    for _ in range(2):  # the template survives a run: releases act on the run's own slots
        assert_outputs(sess.run(None, {"x": x}), ort_run(m, {"x": x}))


def test_unread_outputs_are_released_at_their_producer():
    nodes = [helper.make_node("Split", ["x"], ["p", "q"], axis=0, num_outputs=2, name="split"),
             helper.make_node("Relu", ["p"], ["y"], name="relu")]
    m = model(nodes, [vi("x", F, [4])], [vi("y", F, [2])])
    p = compile_model(m)
    assert releases(p) == {"q": 0, "p": 1}


def _if_capture_model() -> onnx.ModelProto:
    """"a" is read only by the If's branches (an outer-scope capture)."""
    then_b = graph([helper.make_node("Mul", ["a", "a"], ["t"])], [], [vi("t", F, [3])], "then")
    else_b = graph([helper.make_node("Neg", ["a"], ["e"])], [], [vi("e", F, [3])], "else")
    return model([helper.make_node("Abs", ["x"], ["a"], name="abs"),
                  helper.make_node("Sigmoid", ["x"], ["unrelated"], name="sig"),
                  helper.make_node("If", ["cond"], ["o"], name="if", then_branch=then_b, else_branch=else_b),
                  helper.make_node("Add", ["o", "unrelated"], ["y"], name="add")],
                 [vi("cond", BOOL, []), vi("x", F, [3])], [vi("y", F, [3])])


def test_value_read_only_by_a_branch_lives_until_the_if():
    m = _if_capture_model()
    p = compile_model(m)
    names = [s.node.name for s in p.steps]
    assert names == ["abs", "sig", "if", "add"]
    rel = releases(p)
    assert rel["a"] == names.index("if")
    assert rel["o"] == names.index("add") and rel["unrelated"] == names.index("add")
    check_release_invariants(p)
    sess = InferenceSession(m)
    x = np.array([-1.0, 0.5, 2.0], np.float32)
    for c in (True, False, True):
        feed = {"cond": np.array(c), "x": x}
        assert_outputs(sess.run(None, feed), ort_run(m, feed))


def test_value_read_only_by_a_nested_body_lives_until_the_loop():
    # "a" is read only by an If nested in the Loop body
    then_b = graph([helper.make_node("Add", ["v_in", "a"], ["t"])], [], [vi("t", F, [3])], "then")
    else_b = graph([helper.make_node("Sub", ["v_in", "a"], ["e"])], [], [vi("e", F, [3])], "else")
    body = graph([helper.make_node("Identity", ["keep"], ["keep_out"]),
                  helper.make_node("If", ["keep"], ["v_out"], then_branch=then_b, else_branch=else_b)],
                 [vi("i", I64, []), vi("keep", BOOL, []), vi("v_in", F, [3])],
                 [vi("keep_out", BOOL, []), vi("v_out", F, [3])], "body")
    m = model([helper.make_node("Abs", ["x"], ["a"], name="abs"),
               helper.make_node("Neg", ["x"], ["v0"], name="neg"),
               helper.make_node("Loop", ["n", "cond", "v0"], ["v"], name="loop", body=body),
               helper.make_node("Relu", ["v"], ["y"], name="relu")],
              [vi("n", I64, []), vi("cond", BOOL, []), vi("x", F, [3])], [vi("y", F, [3])])
    p = compile_model(m)
    names = [s.node.name for s in p.steps]
    rel = releases(p)
    assert rel["a"] == names.index("loop")
    assert rel["v0"] == names.index("loop")
    check_release_invariants(p)
    sess = InferenceSession(m)
    x = np.array([-1.0, 0.5, 2.0], np.float32)
    for n in (0, 2, 3):
        feed = {"n": np.array(n, np.int64), "cond": np.array(True), "x": x}
        assert_outputs(sess.run(None, feed), ort_run(m, feed))


def test_initializers_inputs_and_outputs_are_never_released():
    # W: a plain initializer; B: an initializer-backed (overridable) graph input;
    # a: a graph output that later nodes read too
    nodes = [helper.make_node("Mul", ["x", "W"], ["a"], name="mul"),
             helper.make_node("Add", ["a", "B"], ["b"], name="add"),
             helper.make_node("Relu", ["b"], ["y"], name="relu")]
    m = model(nodes, [vi("x", F, [3]), vi("B", F, [3])], [vi("a", F, [3]), vi("y", F, [3])],
              [init("W", np.array([1.0, -2.0, 3.0], np.float32)), init("B", np.array([0.5, 0.5, -9.0], np.float32))])
    p = compile_model(m)
    rel = releases(p)
    assert rel == {"b": 2}
    for name in ("x", "W", "B", "a", "y"):
        assert name not in rel
    sess = InferenceSession(m)
    x = np.array([1.0, 2.0, 3.0], np.float32)
    override = np.array([-1.0, 10.0, 1.0], np.float32)
    for feed in ({"x": x}, {"x": x, "B": override}, {"x": x}):
        assert_outputs(sess.run(None, feed), ort_run(m, feed))


# --- optional inputs --------------------------------------------------------------------


def test_omitted_optional_inputs_keep_position_and_trailing_ones_are_trimmed():
    nodes = [helper.make_node("Clip", ["x", "", "hi"], ["y1"], name="inner_omitted"),
             helper.make_node("Clip", ["x", "lo", ""], ["y2"], name="trailing_omitted"),
             helper.make_node("Clip", ["x", "", ""], ["y3"], name="both_omitted")]
    m = model(nodes, [vi("x", F, [5]), vi("lo", F, []), vi("hi", F, [])],
              [vi("y1", F, [5]), vi("y2", F, [5]), vi("y3", F, [5])])
    p = compile_model(m)
    sx, slo, shi = p.slot_of["x"], p.slot_of["lo"], p.slot_of["hi"]
    assert NONE_SLOT == 0
    assert step_of(p, "inner_omitted").inputs == (sx, NONE_SLOT, shi)
    assert step_of(p, "trailing_omitted").inputs == (sx, slo)
    assert step_of(p, "both_omitted").inputs == (sx,)
    sess = InferenceSession(m)
    feed = {"x": np.array([-3.0, -1.0, 0.0, 1.0, 3.0], np.float32),
            "lo": np.array(-0.5, np.float32), "hi": np.array(2.0, np.float32)}
    assert_outputs(sess.run(None, feed), ort_run(m, feed))


# --- constant folding --------------------------------------------------------------------


def _foldable_model() -> onnx.ModelProto:
    return model(
        [helper.make_node("Constant", [], ["k"], value=onnx.numpy_helper.from_array(np.array([2.0, 3.0], np.float32)),
                          name="const"),
         helper.make_node("Add", ["A", "B"], ["c"], name="fold_add"),
         helper.make_node("Mul", ["c", "k"], ["d"], name="fold_mul"),
         helper.make_node("Shape", ["d"], ["shp"], name="fold_shape"),
         helper.make_node("Reshape", ["d", "shp"], ["d2"], name="fold_reshape"),
         helper.make_node("Mul", ["x", "d2"], ["e"], name="live_mul"),
         helper.make_node("Mul", ["P", "A"], ["pa"], name="override_mul"),
         helper.make_node("Add", ["e", "pa"], ["y"], name="live_add")],
        [vi("x", F, [2]), vi("P", F, [2])], [vi("y", F, [2])],
        [init("A", np.array([1.0, -1.0], np.float32)), init("B", np.array([0.5, 4.0], np.float32)),
         # P is an overridable initializer: nothing that reads it may be folded
         init("P", np.array([10.0, 20.0], np.float32))])


def test_constant_subgraphs_are_folded():
    m = _foldable_model()
    p = compile_model(m)
    assert [s.node.name for s in p.steps] == ["live_mul", "override_mul", "live_add"]
    folded = p.template[p.slot_of["d2"]]
    np.testing.assert_allclose(folded, ort_run(m, {"x": np.ones(2, np.float32), "P": np.zeros(2, np.float32)})[0])
    unfolded = compile_model(m, fold=False)
    assert [s.node.name for s in unfolded.steps] == [
        "const", "fold_add", "fold_mul", "fold_shape", "fold_reshape", "live_mul", "override_mul", "live_add"]
    for fold in (True, False):
        sess = InferenceSession(m, fold_constants=fold)
        # the session's own plan, whose segment lists the initializers among its inputs
        # (until 2026-12 that listing kept every one of them from folding)
        steps = {s.node.name for s in sess._executor.segments[0].plan.steps}
        assert steps.isdisjoint({"const", "fold_add", "fold_mul", "fold_shape", "fold_reshape"}) == fold, steps
        for feed in ({"x": np.array([1.5, -2.0], np.float32)},
                     {"x": np.array([1.5, -2.0], np.float32), "P": np.array([0.0, 1.0], np.float32)}):
            assert_outputs(sess.run(None, feed), ort_run(m, feed))


def test_folded_transposes_are_contiguous():
    """A folded Transpose of a weight is stored C-contiguous, not as a strided view that
    every run's reader would walk across cache lines."""
    w = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    m = model([helper.make_node("Transpose", ["W"], ["wt"], perm=[2, 0, 1], name="t"),
               helper.make_node("Add", ["x", "wt"], ["y"], name="add")],
              [vi("x", F, [4, 2, 3])], [vi("y", F, [4, 2, 3])], [init("W", w)])
    for providers in (["cpu"], ["sim-gpu", "cpu"]):
        sess = InferenceSession(m, providers=providers, hetero=len(providers) > 1,
                                provider_options=[{"strict": False}, {}] if len(providers) > 1 else None)
        plan = sess._executor.segments[0].plan
        assert [s.node.name for s in plan.steps] == ["add"]
        folded = plan.template[plan.slot_of["wt"]]
        assert folded.flags.c_contiguous
        assert plan.template[plan.slot_of["W"]] is None  # not held twice
        x = np.ones((4, 2, 3), np.float32)
        assert_outputs(sess.run(None, {"x": x}), ort_run(m, {"x": x}))


def test_random_ops_are_not_folded():
    m = model([helper.make_node("RandomUniform", [], ["r"], shape=[3], name="rand"),
               helper.make_node("Add", ["x", "r"], ["y"], name="add")],
              [vi("x", F, [3])], [vi("y", F, [3])])
    p = compile_model(m)
    assert [s.node.name for s in p.steps] == ["rand", "add"]


# --- concurrency -------------------------------------------------------------------------------


def test_run_from_eight_threads():
    # switch threads as often as possible, so runs interleave inside the step loop
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        _eight_threads()
    finally:
        sys.setswitchinterval(old)


def _eight_threads() -> None:
    m = mlp("N")
    sess = InferenceSession(m)
    rng = np.random.default_rng(4)
    feeds = [{"x": rng.standard_normal((i + 1, 4)).astype(np.float32)} for i in range(8)]
    wants = [ort_run(m, f) for f in feeds]
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            barrier.wait()
            for _ in range(30):
                assert_outputs(sess.run(None, feeds[i]), wants[i])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors[0]


# --- errors -----------------------------------------------------------------------------------


def _reshape_model() -> onnx.ModelProto:
    return model([helper.make_node("Abs", ["x"], ["a"], name="abs"),
                  helper.make_node("Reshape", ["a", "s"], ["r"], name="reshape"),
                  helper.make_node("Relu", ["r"], ["y"], name="relu")],
                 [vi("x", F, ["N"]), vi("s", I64, [2])], [vi("y", F, [None, None])])


def test_kernel_failure_names_node_op_and_shapes_and_session_survives():
    m = _reshape_model()
    sess = InferenceSession(m)
    x = np.arange(4, dtype=np.float32) - 2
    with pytest.raises(KernelError) as ei:
        sess.run(None, {"x": x, "s": np.array([3, 5], np.int64)})
    e = ei.value
    assert isinstance(e, HeteroExecError)
    assert e.node == 'graph/node#1 "reshape"'
    assert e.op == "ai.onnx::Reshape"
    msg = str(e)
    assert 'graph/node#1 "reshape"' in msg and "Reshape" in msg
    assert "float32[4]" in msg and "int64[2]" in msg
    good = {"x": x, "s": np.array([2, 2], np.int64)}
    assert_outputs(sess.run(None, good), ort_run(m, good))


def _foo_model(shape) -> onnx.ModelProto:
    return model([helper.make_node("Abs", ["x"], ["a"], name="abs"),
                  helper.make_node("Foo", ["a"], ["b"], name="foo", domain="com.example"),
                  helper.make_node("Relu", ["b"], ["y"], name="relu")],
                 [vi("x", F, shape)], [vi("y", F, shape)], extra_opsets={"com.example": 3})


def test_op_without_kernel_with_symbolic_inputs_fails_the_build():
    """No kernel at all is known without shapes: the build fails (not the first run)."""
    with pytest.raises(UnsupportedOperatorError) as ei:
        InferenceSession(_foo_model(["N"]))
    e = ei.value
    assert e.node == 'graph/node#1 "foo"'
    assert (e.domain, e.op_type, e.opset, e.provider) == ("com.example", "Foo", 3, "cpu")
    assert "com.example::Foo" in str(e)


def test_unsupported_op_with_static_inputs_fails_the_build():
    with pytest.raises(UnsupportedOperatorError) as ei:
        InferenceSession(_foo_model([4]))
    e = ei.value
    assert isinstance(e, HeteroExecError)
    assert e.node == 'graph/node#1 "foo"'
    assert (e.domain, e.op_type, e.opset, e.provider) == ("com.example", "Foo", 3, "cpu")
    assert e.reason
    msg = str(e)
    for part in ('graph/node#1 "foo"', "com.example::Foo", "opset 3", "cpu", e.reason):
        assert part in msg


def test_end_profiling_writes_a_chrome_trace(tmp_path, monkeypatch):
    import json

    import numpy as np
    from onnx import TensorProto, helper

    from hetero_exec import InferenceSession

    monkeypatch.chdir(tmp_path)
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["r"], name="relu"),
                           helper.make_node("Neg", ["r"], ["y"], name="neg")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    sess = InferenceSession(m, providers=[("sim-gpu", {"exclude_ops": ["Neg"]}), "cpu"], hetero=True,
                            enable_profiling=True)
    y = sess.run(None, {"x": np.array([-1, 0, 2], np.float32)})[0]
    np.testing.assert_array_equal(y, np.array([0, 0, -2], np.float32))
    path = sess.end_profiling()
    events = json.load(open(path))["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["name"] for e in spans} >= {"Relu", "Neg", "segment#0", "segment#1", "seam copy"}
    lanes = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert "segment#0 (sim-gpu:0)" in lanes and "segment#1 (cpu)" in lanes
