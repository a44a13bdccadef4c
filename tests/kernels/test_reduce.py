"""Reduction, arg, cumulative, softmax-family, TopK and Det kernels against onnx.reference
(and exact numpy expectations for the opset<13 softmax semantics, which it lacks)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import to_numpy
from tests.kernels._ref import check, ours

RNG = np.random.default_rng(1)




REDUCE = ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1",
          "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare"]


def _input_axes_opset(op):
    return 13 if op == "ReduceSum" else 18


@pytest.mark.parametrize("op", REDUCE)
@pytest.mark.parametrize("axes", [None, [1], [0, 2], [-1], [-3, -1]])
@pytest.mark.parametrize("keepdims", [0, 1])
def test_reduce(xp, op, axes, keepdims):
    x = RNG.uniform(0.5, 1.5, (3, 4, 5)).astype(np.float32)
    # old opsets: axes attribute
    kw = {} if axes is None else {"axes": axes}
    check(xp, op, [x], opset=11, keepdims=keepdims, **kw)
    # new opsets: axes input
    ax = None if axes is None else np.array(axes, np.int64)
    check(xp, op, [x, ax], opset=_input_axes_opset(op), keepdims=keepdims)


@pytest.mark.parametrize("op", REDUCE)
def test_reduce_noop_and_empty(xp, op):
    x = RNG.uniform(0.5, 1.5, (2, 3)).astype(np.float32)
    opset = _input_axes_opset(op)
    empty_axes = np.array([], np.int64)
    check(xp, op, [x, empty_axes], opset=opset, noop_with_empty_axes=1)
    check(xp, op, [x, empty_axes], opset=opset)  # empty axes: reduce all
    e = np.zeros((2, 0, 4), np.float32)
    for axes in ([1], [0, 1], [2]):
        for kd in (0, 1):
            check(xp, op, [e, np.array(axes, np.int64)], opset=opset, keepdims=kd)


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint8, np.float16, np.float64])
@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceMean"])
def test_reduce_dtypes(xp, op, dtype):
    x = RNG.integers(1, 5, (3, 4)).astype(dtype)
    y = check(xp, op, [x, np.array([1], np.int64)], opset=_input_axes_opset(op), rtol=1e-3)
    assert to_numpy(y[0]).dtype == np.dtype(dtype)


def test_reduce_half_no_overflow(xp):
    x = np.full((4, 8), 300, np.float16)  # x*x overflows float16
    ax = np.array([1], np.int64)
    for op, want in [("ReduceL2", 300 * np.sqrt(8)), ("ReduceSumSquare", np.inf),
                     ("ReduceLogSumExp", 300 + np.log(8)), ("ReduceMean", 300)]:
        y = to_numpy(ours(xp, op, [x, ax], opset=18)[0])
        assert y.dtype == np.float16
        np.testing.assert_allclose(y.astype(np.float64), np.full((4, 1), want), rtol=1e-3)


def test_reduce_empty_identity(xp):
    e = np.zeros((0, 3), np.int32)
    ax = np.array([0], np.int64)
    assert (to_numpy(ours(xp, "ReduceMax", [e, ax], opset=20)[0]) == np.iinfo(np.int32).min).all()
    assert (to_numpy(ours(xp, "ReduceMin", [e, ax], opset=20)[0]) == np.iinfo(np.int32).max).all()
    ef = np.zeros((0, 3), np.float32)
    assert (to_numpy(ours(xp, "ReduceMax", [ef, ax], opset=20)[0]) == -np.inf).all()
    assert (to_numpy(ours(xp, "ReduceProd", [ef, ax], opset=18)[0]) == 1).all()
    eb = np.zeros((0, 3), bool)
    check(xp, "ReduceMax", [eb, ax], opset=20)
    check(xp, "ReduceMin", [eb, ax], opset=20)
    check(xp, "ReduceMax", [RNG.integers(0, 2, (3, 4)).astype(bool), ax], opset=20)


def test_reduce_logsumexp_large(xp):
    x = np.array([[1000.0, 1000.0], [-1000.0, -np.inf]], np.float32)
    y = to_numpy(ours(xp, "ReduceLogSumExp", [x, np.array([1], np.int64)], opset=18)[0])
    np.testing.assert_allclose(y, [[1000 + np.log(2)], [-1000]], rtol=1e-6)


@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("last", [0, 1])
def test_arg(xp, op, axis, keepdims, last):
    x = RNG.integers(0, 3, (3, 4, 5)).astype(np.float32)  # many ties
    check(xp, op, [x], opset=13, axis=axis, keepdims=keepdims, select_last_index=last)
    check(xp, op, [x.astype(np.int32)], opset=11, axis=axis, keepdims=keepdims)


@pytest.mark.parametrize("op", ["CumSum", "CumProd"])
@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("reverse", [0, 1])
@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.int64])
def test_cum(xp, op, axis, exclusive, reverse, dtype):
    x = RNG.integers(1, 4, (3, 4)).astype(dtype)
    opset = 14 if op == "CumSum" else 26
    check(xp, op, [x, np.array(axis, np.int32)], opset=opset, exclusive=exclusive, reverse=reverse)


def _softmax_2d(x, axis):
    s = x.shape
    a = axis % x.ndim
    f = x.reshape(int(np.prod(s[:a])), -1)
    e = np.exp(f - f.max(1, keepdims=True))
    return (e / e.sum(1, keepdims=True)).reshape(s)


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_softmax_family(xp, axis):
    x = RNG.standard_normal((2, 3, 4)).astype(np.float32)
    x[0, 0, 0] = 1000.0
    for op in ["Softmax", "Hardmax"]:
        check(xp, op, [x], opset=13, axis=axis)
    # the reference takes log(softmax), -inf where softmax underflows; ours stays finite
    m = x.max(axis, keepdims=True)
    want = x - m - np.log(np.exp(x - m).sum(axis, keepdims=True))
    np.testing.assert_allclose(to_numpy(ours(xp, "LogSoftmax", [x], opset=13, axis=axis)[0]), want,
                               rtol=1e-5, atol=1e-5)
    # opset < 13: the input flattened to 2-D at axis
    sm = to_numpy(ours(xp, "Softmax", [x], opset=11, axis=axis)[0])
    np.testing.assert_allclose(sm, _softmax_2d(x, axis), rtol=1e-5, atol=1e-7)
    lsm = to_numpy(ours(xp, "LogSoftmax", [x], opset=11, axis=axis)[0])
    np.testing.assert_allclose(np.exp(lsm), _softmax_2d(x, axis), rtol=1e-5, atol=1e-7)
    hm = to_numpy(ours(xp, "Hardmax", [x], opset=1, axis=axis)[0])
    f = x.reshape(int(np.prod(x.shape[:axis % 3])), -1)
    want = np.zeros_like(f)
    want[np.arange(f.shape[0]), f.argmax(1)] = 1
    np.testing.assert_array_equal(hm, want.reshape(x.shape))


def test_softmax_defaults(xp):
    x = RNG.standard_normal((2, 3, 4)).astype(np.float32)
    sm = to_numpy(ours(xp, "Softmax", [x], opset=11)[0])
    np.testing.assert_allclose(sm, _softmax_2d(x, 1), rtol=1e-5)
    check(xp, "Softmax", [x], opset=13)
    check(xp, "Hardmax", [np.ones((2, 3), np.float32)], opset=13)  # ties: first index
    check(xp, "Softmax", [x.astype(np.float16)], opset=13, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("largest", [0, 1])
@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.uint64])
def test_topk(xp, largest, axis, dtype):
    x = RNG.integers(0, 4, (4, 6)).astype(dtype)  # ties: lower index first
    k = np.array([3], np.int64)
    check(xp, "TopK", [x, k], opset=11, n_outputs=2, axis=axis, largest=largest)
    full = np.array([x.shape[axis]], np.int64)
    check(xp, "TopK", [x, full], opset=24, n_outputs=2, axis=axis, largest=largest)
    zero = np.array([0], np.int64)
    check(xp, "TopK", [x, zero], opset=11, n_outputs=2, axis=axis, largest=largest)


@pytest.mark.parametrize("largest", [0, 1])
@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.uint8])
def test_topk_long_axis(xp, largest, dtype):
    # long axis, small k: numpy selects by partition; ties across the k-th value
    x = RNG.integers(0, 30, (3, 200, 2)).astype(dtype)
    for k in (1, 7, 100):
        kk = np.array([k], np.int64)
        check(xp, "TopK", [x, kk], opset=11, n_outputs=2, axis=1, largest=largest)
    y = RNG.standard_normal((2, 300)).astype(np.float32)
    check(xp, "TopK", [y, np.array([5], np.int64)], opset=11, n_outputs=2, largest=largest)


def test_topk_old_opsets(xp):
    x = RNG.standard_normal((3, 5)).astype(np.float32)
    check(xp, "TopK", [x], opset=1, n_outputs=2, k=2)
    check(xp, "TopK", [x, np.array([2], np.int64)], opset=10, n_outputs=2, axis=0)
    x = np.array([1, 3, 3, 2, 3], np.float32)
    v, i = ours(xp, "TopK", [x, np.array([3], np.int64)], opset=11)
    np.testing.assert_array_equal(to_numpy(i), [1, 2, 4])


def test_det(xp):
    check(xp, "Det", [RNG.standard_normal((3, 3)).astype(np.float32)], rtol=1e-4)
    check(xp, "Det", [RNG.standard_normal((2, 3, 4, 4)).astype(np.float64)], rtol=1e-10)


def test_softmax_gives_no_subnormals():
    """Scores masked by -100 (Swin's shifted windows) have exps in float32's subnormal
    range, on which every later multiply is ~100x slower: they come out as exact zeros,
    the rest as the reference computes them."""
    from hetero_exec.kernels.fused_attention import _softmax_last_inplace
    from hetero_exec.kernels.reduce import Softmax

    x = np.array([[5.0, -95.0, -90.0, -82.0, -np.inf, 4.0, -100.0, 0.5] * 5,
                  [-np.inf] * 39 + [1.0]], np.float32)
    e = np.exp(x.astype(np.float64) - x.max(axis=-1, keepdims=True))
    want = e / e.sum(axis=-1, keepdims=True)
    tiny = np.finfo(np.float32).tiny
    for got in (Softmax(np, x)[0], _softmax_last_inplace(np, x.copy())):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-37)
        assert not np.any((got != 0) & (np.abs(got) < tiny)), got
        assert got[0, 1] == 0 and got[0, 2] == 0  # exp(-100), exp(-95): subnormal, now 0
    nan = np.array([[1.0, np.nan, 0.0]], np.float32)
    assert np.isnan(Softmax(np, nan)[0]).all()


# --- constant axes, specialised once per node (reduce._specialize_reduce) ----------------------


def _reduce_model(op, opset, axes, keepdims, dtype=np.float32):
    from onnx import helper, numpy_helper

    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    rank = 3 if keepdims else 3 - len(axes or range(3))
    inputs, inits, attrs = ["x"], [], {"keepdims": keepdims}
    if axes is not None and opset >= _input_axes_opset(op):
        inputs.append("axes")
        inits.append(numpy_helper.from_array(np.array(axes, np.int64), "axes"))
    elif axes is not None:
        attrs["axes"] = axes
    graph = helper.make_graph([helper.make_node(op, inputs, ["y"], **attrs)], "g",
                              [helper.make_tensor_value_info("x", elem, ["a", 4, "c"])],
                              [helper.make_tensor_value_info("y", elem, [f"d{i}" for i in range(rank)])],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin"])
@pytest.mark.parametrize("era", ["attribute", "input"])
@pytest.mark.parametrize("axes, keepdims", [(None, 1), ([1], 0), ([-1, 0], 1), ([0, 1, 2], 0)])
def test_constant_axes_take_the_specialised_reduction(monkeypatch, op, era, axes, keepdims):
    """Through a session, against the reference; the general kernel (`_reduce`) runs
    only for the empty set reduced."""
    from onnx.reference import ReferenceEvaluator

    from hetero_exec import InferenceSession
    from hetero_exec.kernels import reduce

    opset = 11 if era == "attribute" else _input_axes_opset(op)
    model = _reduce_model(op, opset, axes, keepdims)
    general: list[int] = []
    full = reduce._reduce
    monkeypatch.setattr(reduce, "_reduce", lambda *a, **k: general.append(1) or full(*a, **k))
    sess, ref = InferenceSession(model.SerializeToString(), ["cpu"]), ReferenceEvaluator(model)
    for shape in [(3, 4, 5), (1, 4, 1)]:
        x = RNG.standard_normal(shape).astype(np.float32)
        got = sess.run(None, {"x": x})[0]
        want = ref.run(None, {"x": x})[0]
        assert got.dtype == np.float32 and got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert not general
    if op in ("ReduceSum", "ReduceMean"):  # an empty set: the general kernel's identity
        x = np.zeros((0, 4, 2), np.float32)
        got, want = sess.run(None, {"x": x})[0], ref.run(None, {"x": x})[0]
        np.testing.assert_allclose(got, want)
        assert general == [1] if axes is None or 0 in [a % 3 for a in axes] else not general


def test_a_reduction_of_an_if_output_of_no_declared_rank_is_specialised_too(monkeypatch):
    """bench's loop_if: a Loop body whose second ReduceSum reads an If's output, declared
    without a shape; both reductions skip the general kernel, and the run agrees with
    onnxruntime (the reference evaluator's Loop fails on this model's scan output)."""
    import onnxruntime

    from bench.models import loop_if
    from hetero_exec import InferenceSession
    from hetero_exec.kernels import reduce

    general: list[int] = []
    full = reduce._reduce
    monkeypatch.setattr(reduce, "_reduce", lambda *a, **k: general.append(1) or full(*a, **k))
    model = loop_if(trips=5, width=8)
    h0 = RNG.standard_normal((3, 8)).astype(np.float32)
    got = InferenceSession(model.SerializeToString(), ["cpu"]).run(None, {"h0": h0})
    want = onnxruntime.InferenceSession(model.SerializeToString(),
                                        providers=["CPUExecutionProvider"]).run(None, {"h0": h0})
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    assert not general
