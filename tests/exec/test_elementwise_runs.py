"""Runs of element-wise float steps merged into one step at compile time
(exec/elementwise_runs.py): one dispatch, the same ufuncs in order, the graph and the
placement untouched; a run stops at anything another reader, an output or a widening
operand needs."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from hetero_exec import InferenceSession
from hetero_exec.errors import KernelError
from hetero_exec.exec import elementwise_runs
from tests._models import I64, F, assert_outputs, init, model, ort_run, vi

X = np.linspace(-2, 2, 12, dtype=np.float32).reshape(3, 4)


def chain(expose: str | None = None, second_reader: bool = False, wide: bool = False, dtype=F):
    """x[3,4] -> Add(c) -> Mul(row) -> Relu -> Sigmoid -> Sub(1, .) -> Neg -> Max(., c) -> y."""
    np_dt = np.float32 if dtype == F else np.int64
    inits = [init("c", np.array(0.25).astype(np_dt)), init("row", np.arange(4).astype(np_dt)),
             init("one", np.array(1).astype(np_dt))]
    nodes = [helper.make_node("Add", ["x", "c"], ["a"], name="add"),
             helper.make_node("Mul", ["a", "wide" if wide else "row"], ["m"], name="mul"),
             helper.make_node("Relu", ["m"], ["r"], name="relu")]
    if dtype == F:
        nodes += [helper.make_node("Sigmoid", ["r"], ["s"], name="sigmoid"),
                  helper.make_node("Sub", ["one", "s"], ["d"], name="sub")]
    else:
        nodes += [helper.make_node("Sub", ["one", "r"], ["d"], name="sub")]
    nodes += [helper.make_node("Neg", ["d"], ["n"], name="neg"),
              helper.make_node("Max", ["n", "c"], ["y"], name="max")]
    shape = [2, 3, 4] if wide else [3, 4]
    outputs = [vi("y", dtype, shape)]
    if wide:
        inits.append(init("wide", np.ones((2, 3, 4), np_dt)))
    if expose:
        outputs.append(vi(expose, dtype, shape))
    if second_reader:
        nodes.append(helper.make_node("Abs", ["r"], ["z"], name="abs"))
        outputs.append(vi("z", dtype, shape))
    return model(nodes, [vi("x", dtype, [3, 4])], outputs, inits)


def steps_of(sess) -> list[str]:
    return [st.fn.__name__ for st in sess._executor.segments[0].plan.steps]


def check(m, feed):
    sess = InferenceSession(m, providers=["cpu"], optimize=False)  # no graph fusions: plain nodes
    assert_outputs(sess.run(None, feed), ort_run(m, feed))
    return sess


def test_a_run_is_one_step():
    sess = check(chain(), {"x": X})
    assert steps_of(sess) == ["Add+Mul+Relu+Sigmoid+Sub+Neg+Max"]
    assert len(sess.placement.segments[0].nodes) == 7  # the graph is as it was


@pytest.mark.parametrize("kw,want", [
    (dict(expose="r"), ["Add+Mul+Relu", "Sigmoid+Sub+Neg+Max"]),
    (dict(second_reader=True), ["Add+Mul+Relu", "Sigmoid+Sub+Neg+Max", "Abs"]),
    (dict(wide=True), ["Add", "Mul+Relu+Sigmoid+Sub+Neg+Max"]),
], ids=["exposed", "second-reader", "widening-operand"])
def test_a_run_stops_where_it_must(kw, want):
    m = chain(**kw)
    sess = check(m, {"x": X})
    assert steps_of(sess) == want


def test_integer_steps_are_not_merged():
    sess = check(chain(dtype=I64), {"x": np.arange(12, dtype=np.int64).reshape(3, 4) - 6})
    assert "+" not in "".join(steps_of(sess))


def test_a_failing_step_inside_a_run_is_named(monkeypatch):
    # Neg bound to a ufunc that refuses floats: the run fails at that step
    monkeypatch.setitem(elementwise_runs.UNARY, "Neg", ("invert", None))
    sess = InferenceSession(chain(), providers=["cpu"], optimize=False)
    with pytest.raises(KernelError) as ei:
        sess.run(None, {"x": X})
    text = str(ei.value)
    assert '"neg"' in text and "ai.onnx::Neg" in text and "TypeError" in text
    with pytest.raises(KernelError):  # the same typed error again: the session is intact
        sess.run(None, {"x": X})


def test_the_caller_inputs_are_never_written():
    x = X.copy()
    sess = check(chain(), {"x": x})
    sess.run(None, {"x": x})
    np.testing.assert_array_equal(x, X)
