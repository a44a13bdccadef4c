"""Loop and Scan bodies compiled once and run with one slot list per call
(exec.executor.BodyRuns): captures stay readable on every iteration, the iteration
number reaches bodies that read it (even only inside a nested If), and nothing a body
hands out aliases a caller's input."""

from __future__ import annotations

import numpy as np
from onnx import helper

from hetero_exec import InferenceSession
from hetero_exec.exec.bound import BoundBody
from hetero_exec.exec.executor import BodyRuns
from hetero_exec.exec.plan import Compiler
from hetero_exec.ir.load import load
from tests._models import BOOL, I64, F, assert_outputs, graph, model, ort_run, vi


def _loop(body, carried=("v0",)):
    return model([helper.make_node("Neg", ["x"], ["v0"], name="neg"),
                  helper.make_node("Loop", ["n", "", *carried], ["v", "scan"], name="loop", body=body)],
                 [vi("n", I64, []), vi("x", F, [3])], [vi("v", F, [3]), vi("scan", F, ["T", 3])])


def _feeds():
    x = np.array([-1.0, 0.5, 2.0], np.float32)
    return [{"n": np.array(n, np.int64), "x": x} for n in (0, 1, 4)]


def test_iteration_number_read_only_by_a_nested_if():
    # the body reads i only inside the If's branches (a capture), never as a step input
    then_b = graph([helper.make_node("Cast", ["i"], ["fi"], to=F),
                    helper.make_node("Add", ["v_in", "fi"], ["t"])], [], [vi("t", F, [3])], "then")
    else_b = graph([helper.make_node("Sub", ["v_in", "x"], ["e"])], [], [vi("e", F, [3])], "else")
    body = graph([helper.make_node("Identity", ["keep"], ["keep_out"]),
                  helper.make_node("ReduceSum", ["v_in"], ["s"], keepdims=0),
                  helper.make_node("Less", ["s", "zero"], ["neg"]),
                  helper.make_node("If", ["neg"], ["v_out"], then_branch=then_b, else_branch=else_b),
                  helper.make_node("Identity", ["v_out"], ["scan_out"])],
                 [vi("i", I64, []), vi("keep", BOOL, []), vi("v_in", F, [3])],
                 [vi("keep_out", BOOL, []), vi("v_out", F, [3]), vi("scan_out", F, [3])], "body")
    m = _loop(body)
    m.graph.initializer.append(helper.make_tensor("zero", F, [], [0.0]))
    sess = InferenceSession(m)
    _, g = load(m)
    loop_body = Compiler().compile_graph(g).steps[1].kwargs["body"]
    assert loop_body.reads_input(0) and loop_body.reads_input(2)
    for feed in _feeds():
        assert_outputs(sess.run_outputs(None, feed), ort_run(m, feed))


def test_body_that_ignores_the_iteration_number():
    body = graph([helper.make_node("Identity", ["keep"], ["keep_out"]),
                  helper.make_node("Mul", ["v_in", "x"], ["v_out"]),
                  helper.make_node("Relu", ["v_out"], ["scan_out"])],
                 [vi("i", I64, []), vi("keep", BOOL, []), vi("v_in", F, [3])],
                 [vi("keep_out", BOOL, []), vi("v_out", F, [3]), vi("scan_out", F, [3])], "body")
    m = _loop(body)
    _, g = load(m)
    loop_body = Compiler().compile_graph(g).steps[1].kwargs["body"]
    assert not loop_body.reads_input(0) and loop_body.reads_input(2)
    sess = InferenceSession(m)
    for feed in _feeds():
        assert_outputs(sess.run_outputs(None, feed), ort_run(m, feed))


def test_body_runs_reuse_one_slot_list():
    """Released intermediates are rewritten each run; inputs, captures and outputs stay."""
    body = graph([helper.make_node("Identity", ["keep"], ["keep_out"]),
                  helper.make_node("Mul", ["v_in", "x"], ["t"]),
                  helper.make_node("Add", ["t", "v_in"], ["v_out"]),
                  helper.make_node("Neg", ["t"], ["scan_out"])],
                 [vi("i", I64, []), vi("keep", BOOL, []), vi("v_in", F, [3])],
                 [vi("keep_out", BOOL, []), vi("v_out", F, [3]), vi("scan_out", F, [3])], "body")
    _, g = load(_loop(body))
    plan = Compiler().compile_graph(g)
    sub = plan.steps[1].kwargs["body"]
    scope = plan.template.copy()
    x = np.array([1.0, 2.0, 3.0], np.float32)
    scope[plan.slot_of["x"]] = x
    runs = sub.start(scope)
    # the reused slot list until the body's shapes repeat, then its bound plan
    assert isinstance(runs, (BodyRuns, BoundBody))
    v = np.ones(3, np.float32)
    for _ in range(3):
        keep, v2, s = runs([None, np.array(True), v])
        np.testing.assert_allclose(v2, v * x + v)
        np.testing.assert_allclose(s, -(v * x))
        v = v2


def test_scan_state_passed_through_is_not_a_view_of_the_input():
    # the state becomes the last scan slice itself: the output must own its data
    body = graph([helper.make_node("Identity", ["x_t"], ["s_out"]),
                  helper.make_node("Neg", ["x_t"], ["y_t"])],
                 [vi("s_in", F, [2]), vi("x_t", F, [2])], [vi("s_out", F, [2]), vi("y_t", F, [2])], "body")
    m = model([helper.make_node("Scan", ["s0", "xs"], ["s", "ys"], name="scan", body=body,
                                num_scan_inputs=1)],
              [vi("s0", F, [2]), vi("xs", F, [4, 2])], [vi("s", F, [2]), vi("ys", F, [4, 2])], opset=17)
    xs = np.arange(8, dtype=np.float32).reshape(4, 2)
    feed = {"s0": np.zeros(2, np.float32), "xs": xs}
    sess = InferenceSession(m)
    got = sess.run(None, feed)
    assert_outputs(got, ort_run(m, feed))
    xs[:] = -1  # the caller reuses its buffer
    np.testing.assert_array_equal(got[0], [6.0, 7.0])
