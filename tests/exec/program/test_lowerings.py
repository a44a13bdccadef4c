"""Bound plans run as programs (exec/program): each lowering against onnxruntime on odd
shapes, broadcasting, transposed and sliced operands. A session's second run at one
input-shape signature binds its plan and lowers it; the third runs the program. Every
case asserts that the program really ran (no step left in Python where none should be)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from onnx import TensorProto, helper

import hetero_exec as hx
from hetero_exec.errors import KernelError
from hetero_exec.exec.program.run import Region
from hetero_exec.kernels.native import library
from tests._models import BOOL, I64, F, assert_outputs, init, model, ort_run, ref_run, vi

pytestmark = pytest.mark.skipif(not library.available(), reason="no C library in this tree")

RNG = np.random.default_rng(7)


def rand(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


def python_steps(sess) -> list[str]:
    """The op types of the steps the bound plans run in Python."""
    out = []
    for seg in sess._executor.segments:
        for plan in seg.bound._bound.values():
            out += [st.node.op_type for st in plan.steps if not isinstance(st.fn, Region)]
    return out


def check(m, feed, python=(), rtol=1e-5, atol=1e-6, runs=4):
    sess = hx.InferenceSession(m.SerializeToString())
    want = ort_run(m, feed)
    for _ in range(runs):
        assert_outputs(sess.run(None, feed), want, rtol, atol)
    assert sorted(python_steps(sess)) == sorted(python)
    return sess


# -- element-wise ---------------------------------------------------------------------

UNARY = ["Neg", "Abs", "Sqrt", "Reciprocal", "Exp", "Log", "Sigmoid", "Tanh", "Cos", "Sin",
         "Erf", "Relu", "Floor", "Ceil", "Softplus"]


@pytest.mark.parametrize("op", UNARY)
def test_unary_over_a_transposed_input(op):
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[2, 0, 1]),
             helper.make_node(op, ["t"], ["y"])]
    m = model(nodes, [vi("x", F, [3, 5, 7])], [vi("y", F, [7, 3, 5])])
    x = np.abs(rand(3, 5, 7)) + 0.1 if op in ("Sqrt", "Log") else rand(3, 5, 7)
    check(m, {"x": x}, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div", "Pow", "Max", "Min"])
def test_binary_broadcasts(op):
    nodes = [helper.make_node(op, ["a", "b"], ["t"]), helper.make_node("Identity", ["t"], ["y"])]
    m = model(nodes, [vi("a", F, [2, 1, 5, 3]), vi("b", F, [4, 1, 3])], [vi("y", F, [2, 4, 5, 3])])
    a = np.abs(rand(2, 1, 5, 3)) + 0.5 if op == "Pow" else rand(2, 1, 5, 3)
    check(m, {"a": a, "b": rand(4, 1, 3)}, rtol=1e-5)


@pytest.mark.parametrize("op", ["Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual"])
@pytest.mark.parametrize("dtype", [TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT32])
def test_comparisons(op, dtype):
    np_dt = {TensorProto.FLOAT: np.float32, TensorProto.INT64: np.int64, TensorProto.INT32: np.int32}[dtype]
    m = model([helper.make_node(op, ["a", "b"], ["t"]), helper.make_node("Not", ["t"], ["y"])],
              [vi("a", dtype, [3, 4]), vi("b", dtype, [4])], [vi("y", BOOL, [3, 4])])
    a = RNG.integers(-3, 3, (3, 4)).astype(np_dt)
    check(m, {"a": a, "b": RNG.integers(-3, 3, (4,)).astype(np_dt)})


def test_integer_arithmetic_logic_and_where():
    nodes = [helper.make_node("Add", ["a", "b"], ["s"]), helper.make_node("Mul", ["s", "a"], ["p"]),
             helper.make_node("Sub", ["p", "b"], ["d"]), helper.make_node("Max", ["d", "a"], ["mx"]),
             helper.make_node("Greater", ["mx", "b"], ["g"]), helper.make_node("Not", ["g"], ["ng"]),
             helper.make_node("And", ["g", "c"], ["and"]), helper.make_node("Or", ["ng", "c"], ["or"]),
             helper.make_node("Xor", ["and", "or"], ["x"]), helper.make_node("Where", ["x", "mx", "b"], ["y"]),
             helper.make_node("Neg", ["y"], ["z"])]
    m = model(nodes, [vi("a", I64, [2, 5]), vi("b", I64, [5]), vi("c", BOOL, [2, 1])],
              [vi("z", I64, [2, 5]), vi("x", BOOL, [2, 5])])
    feed = {"a": RNG.integers(-9, 9, (2, 5)), "b": RNG.integers(-9, 9, (5,)),
            "c": np.array([[True], [False]])}
    check(m, feed)


def test_nan_and_inf_follow_numpy():
    nodes = [helper.make_node("Max", ["a", "b"], ["mx"]), helper.make_node("Min", ["a", "b"], ["mn"]),
             helper.make_node("IsNaN", ["mx"], ["isnan"]), helper.make_node("IsInf", ["a"], ["isinf"]),
             helper.make_node("Relu", ["a"], ["r"])]
    m = model(nodes, [vi("a", F, [6]), vi("b", F, [6])],
              [vi("mx", F, [6]), vi("mn", F, [6]), vi("isnan", BOOL, [6]), vi("isinf", BOOL, [6]),
               vi("r", F, [6])])
    a = np.array([np.nan, 1.0, -np.inf, np.inf, 0.5, -2.0], np.float32)
    b = np.array([1.0, np.nan, 0.0, 1.0, np.nan, -3.0], np.float32)
    check(m, {"a": a, "b": b})


@pytest.mark.parametrize("to", [TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT32,
                                TensorProto.BOOL, TensorProto.DOUBLE, TensorProto.UINT8])
@pytest.mark.parametrize("src", [TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL])
def test_casts(src, to):
    np_src = {TensorProto.FLOAT: np.float32, TensorProto.INT64: np.int64, TensorProto.BOOL: np.bool_}[src]
    x = np.array([[0, 1.5, -2.25, 3], [7.75, 0, -1, 100]]).astype(np_src) if src != TensorProto.BOOL \
        else np.array([[True, False, True, True], [False, False, True, False]])
    if to == TensorProto.UINT8 and src == TensorProto.FLOAT:
        x = np.abs(x)  # (a negative float to uint8 is undefined)
    nodes = [helper.make_node("Transpose", ["x"], ["t"]), helper.make_node("Cast", ["t"], ["y"], to=to)]
    check(model(nodes, [vi("x", src, [2, 4])], [vi("y", to, [4, 2])]), {"x": x})


# -- movement ---------------------------------------------------------------------------

def test_views_slices_concat_split_expand():
    i64 = lambda *v: np.array(v, np.int64)  # noqa: E731
    nodes = [helper.make_node("Slice", ["x", "st", "en", "ax", "sp"], ["s"]),
             helper.make_node("Transpose", ["s"], ["t"], perm=[1, 0, 2]),
             helper.make_node("Reshape", ["t", "shape"], ["r"]),
             helper.make_node("Unsqueeze", ["r", "zero"], ["u"]),
             helper.make_node("Expand", ["u", "eshape"], ["e"]),
             helper.make_node("Split", ["e", "halves"], ["e0", "e1"], axis=2),
             helper.make_node("Concat", ["e1", "e0", "e1"], ["c"], axis=2),
             helper.make_node("Flatten", ["c"], ["f"], axis=2),
             helper.make_node("Squeeze", ["x1", "one"], ["sq"]),
             helper.make_node("Add", ["f", "bias"], ["y"])]
    inits = [init("st", i64(4, 0)), init("en", i64(-100, 5)), init("ax", i64(2, 0)),
             init("sp", i64(-2, 1)), init("shape", i64(5, -1)), init("zero", i64(0)),
             init("eshape", i64(3, 1, 1)), init("halves", i64(4, 5)), init("one", i64(1)),
             init("bias", rand(1))]
    m = model(nodes, [vi("x", F, [6, 3, 7]), vi("x1", F, [2, 1, 3])],
              [vi("y", F, [15, 14]), vi("sq", F, [2, 3])], inits)
    check(m, {"x": rand(6, 3, 7), "x1": rand(2, 1, 3)})


def test_gather_rows_and_inner_axis_with_negative_indices():
    nodes = [helper.make_node("Gather", ["w", "ids"], ["g"], axis=0),
             helper.make_node("Gather", ["g", "cols"], ["y"], axis=2)]
    m = model(nodes, [vi("ids", I64, [2, 3])], [vi("y", F, [2, 3, 2])],
              [init("w", rand(10, 4)), init("cols", np.array([-1, 1], np.int64))])
    check(m, {"ids": np.array([[0, 9, -3], [4, 4, 1]], np.int64)})


@pytest.mark.parametrize("dtype", [TensorProto.BOOL, TensorProto.FLOAT, TensorProto.INT64])
def test_gather_of_single_elements_and_rows_of_odd_widths(dtype):
    """A decoder's mask Gather picks one element per index (1, 4 or 8 bytes: moved as
    words); rows of 3 elements take the byte copies."""
    np_type = {TensorProto.BOOL: np.bool_, TensorProto.FLOAT: np.float32,
               TensorProto.INT64: np.int64}[dtype]
    data = (RNG.standard_normal((40, 3)) * 9).astype(np_type)
    nodes = [helper.make_node("Flatten", ["d"], ["flat"], axis=0),
             helper.make_node("Reshape", ["flat", "n"], ["line"]),
             helper.make_node("Gather", ["line", "picks"], ["one"], axis=0),
             helper.make_node("Gather", ["d", "rows"], ["three"], axis=0)]
    m = model(nodes, [vi("picks", I64, [77]), vi("rows", I64, [5])],
              [vi("one", dtype, [77]), vi("three", dtype, [5, 3])],
              [init("d", data), init("n", np.array([120], np.int64))])
    check(m, {"picks": RNG.integers(-120, 120, 77), "rows": np.array([0, 39, -1, 7, 7], np.int64)})


@pytest.mark.parametrize("x_shape,y_shape", [([], []), ([37], []), ([], [37]), ([37], [37]),
                                             ([1, 37], [2, 1])])
def test_where_over_a_mask_row(x_shape, y_shape):
    """Where(cond, x, y) with each branch a row or one value (a decoder's mask over its
    context), and a broadcast the dense loops do not take."""
    out_shape = list(np.broadcast_shapes((37,), tuple(x_shape), tuple(y_shape)))
    nodes = [helper.make_node("Greater", ["a", "zero"], ["cond"]),
             helper.make_node("Where", ["cond", "x", "y"], ["w"])]
    m = model(nodes, [vi("a", F, [37]), vi("x", F, x_shape), vi("y", F, y_shape)],
              [vi("w", F, out_shape)], [init("zero", np.array(0.0, np.float32))])
    check(m, {"a": rand(37), "x": rand(*x_shape), "y": rand(*y_shape)})


def test_an_index_out_of_range_is_a_kernel_error_and_the_session_goes_on():
    m = model([helper.make_node("Gather", ["w", "ids"], ["g"]), helper.make_node("Relu", ["g"], ["y"])],
              [vi("ids", I64, [3])], [vi("y", F, [3, 4])], [init("w", rand(10, 4))])
    sess = check(m, {"ids": np.array([1, 2, 3], np.int64)})
    with pytest.raises(KernelError, match="Gather"):
        sess.run(None, {"ids": np.array([1, 12, 3], np.int64)})
    ok = {"ids": np.array([9, 0, -10], np.int64)}
    assert_outputs(sess.run(None, ok), ort_run(m, ok))


# -- reductions, products, rows ------------------------------------------------------------

@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd"])
@pytest.mark.parametrize("axes,keep", [([1], 1), ([0, 2], 0), ([-1], 1), ([], 0)])
def test_reductions(op, axes, keep):
    inputs = ["x", "axes"] if axes else ["x"]
    nodes = [helper.make_node(op, inputs, ["t"], keepdims=keep), helper.make_node("Identity", ["t"], ["y"])]
    inits = [init("axes", np.array(axes, np.int64))] if axes else []
    x = rand(3, 4, 5) * 0.5 + 1.0
    shape = list(np.sum(x, axis=tuple(axes) if axes else None, keepdims=bool(keep)).shape)
    m = model(nodes, [vi("x", F, [3, 4, 5])], [vi("y", F, shape)], inits)
    check(m, {"x": x}, rtol=1e-5)


def test_integer_sum_over_a_mask():
    nodes = [helper.make_node("ReduceSum", ["m", "axes"], ["t"], keepdims=0),
             helper.make_node("Neg", ["t"], ["y"])]
    m = model(nodes, [vi("m", I64, [3, 9])], [vi("y", I64, [3])], [init("axes", np.array([1], np.int64))])
    check(m, {"m": RNG.integers(0, 2, (3, 9))})


@pytest.mark.parametrize("M,K,N", [(1, 16, 5), (3, 33, 17), (7, 64, 96), (70, 129, 200)])
def test_products_on_a_packed_weight_with_bias(M, K, N):
    nodes = [helper.make_node("MatMul", ["x", "w"], ["p"]), helper.make_node("Add", ["p", "b"], ["y"])]
    m = model(nodes, [vi("x", F, [M, K])], [vi("y", F, [M, N])], [init("w", rand(K, N)), init("b", rand(N))])
    check(m, {"x": rand(M, K)}, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("trans_a,trans_b", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_gemm(trans_a, trans_b):
    a = rand(6, 5) if not trans_a else rand(5, 6)
    w = rand(5, 4) if not trans_b else rand(4, 5)
    nodes = [helper.make_node("Gemm", ["a", "w", "c"], ["t"], transA=trans_a, transB=trans_b),
             helper.make_node("Identity", ["t"], ["y"])]
    m = model(nodes, [vi("a", F, list(a.shape))], [vi("y", F, [6, 4])], [init("w", w), init("c", rand(4))])
    check(m, {"a": a}, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("big", [False, True])
def test_batched_products_of_strided_operands(big):
    # attention's shapes: q @ k^T (k transposed as a view), batch dims broadcast
    h, s, d = (8, 64, 96) if big else (3, 5, 4)
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["s"]),
             helper.make_node("Softmax", ["s"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["y"])]
    m = model(nodes, [vi("q", F, [2, h, s, d]), vi("k", F, [1, h, s, d]), vi("v", F, [2, 1, s, d])],
              [vi("y", F, [2, h, s, d])])
    check(m, {"q": rand(2, h, s, d), "k": rand(1, h, s, d), "v": rand(2, 1, s, d)}, rtol=1e-4, atol=1e-5)


def test_layer_norms_and_skip_norms():
    ms = [helper.make_opsetid("com.microsoft", 1)]
    nodes = [helper.make_node("LayerNormalization", ["x", "g", "b"], ["ln"], epsilon=1e-5),
             helper.make_node("SkipSimplifiedLayerNormalization", ["ln", "skip", "g"], ["sn", "", "", "sum"],
                              domain="com.microsoft", epsilon=1e-6),
             helper.make_node("SkipLayerNormalization", ["sn", "sum", "g", "b", "bias"], ["y"],
                              domain="com.microsoft", epsilon=1e-6)]
    g = helper.make_graph(nodes, "g", [vi("x", F, [2, 3, 24]), vi("skip", F, [2, 3, 24])],
                          [vi("y", F, [2, 3, 24]), vi("sum", F, [2, 3, 24])],
                          [init("g", rand(24)), init("b", rand(24)), init("bias", rand(24))])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)] + ms, ir_version=10)
    check(m, {"x": rand(2, 3, 24), "skip": rand(2, 3, 24)}, rtol=1e-4, atol=1e-5)


# -- threads ------------------------------------------------------------------------------

def test_runs_on_two_threads_keep_their_own_scratch():
    nodes = [helper.make_node("MatMul", ["x", "w"], ["p"]), helper.make_node("Tanh", ["p"], ["y"])]
    m = model(nodes, [vi("x", F, [4, 32])], [vi("y", F, [4, 32])], [init("w", rand(32, 32))])
    sess = hx.InferenceSession(m.SerializeToString())
    feeds = [{"x": rand(4, 32)} for _ in range(2)]
    wants = [ort_run(m, f) for f in feeds]
    for f in feeds:
        sess.run(None, f)
    errors = []

    def worker(i):
        try:
            for _ in range(200):
                assert_outputs(sess.run(None, feeds[i]), wants[i], 1e-5, 1e-5)
        except AssertionError as e:  # pragma: no cover - the failure itself
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert python_steps(sess) == []


@pytest.mark.parametrize("shape", [[64, 512], [1, 256], [3]])
@pytest.mark.parametrize("op", ["Tanh", "Sigmoid", "Exp", "Erf"])
def test_unary_values_take_vector_loops_or_stay_numpy(op, shape):
    """act.c's vector loops at any size (a decode step's 256 values too); libm's Exp one
    value at a time up to LARGE, numpy's beyond. Against the ONNX reference evaluator:
    onnxruntime's own logistic is off by ~1e-6 absolute far below zero (0.91 relative at
    x = -18), and this logistic's error stays relative there."""
    nodes = [helper.make_node(op, ["x"], ["t"]), helper.make_node("Mul", ["t", "x"], ["y"])]
    m = model(nodes, [vi("x", F, shape)], [vi("y", F, shape)])
    python = [op] if op == "Exp" and shape[0] == 64 else []  # (Erf: act.c's rational)
    sess = hx.InferenceSession(m.SerializeToString())
    x = {"x": rand(*shape) * 4}
    want = ref_run(m, x)
    for _ in range(3):
        assert_outputs(sess.run(None, x), want, rtol=1e-5, atol=1e-6)
    assert [o for o in python_steps(sess) if o != "Mul"] == python


@pytest.mark.parametrize("batch_dims", [0, 1])
def test_gather_nd_with_constant_indices(batch_dims):
    idx = np.array([[[1, 0], [0, 2]], [[1, 1], [0, 0]]], np.int64) if not batch_dims \
        else np.array([[[1], [0]], [[2], [2]]], np.int64)
    nodes = [helper.make_node("GatherND", ["x", "i"], ["g"], batch_dims=batch_dims),
             helper.make_node("Neg", ["g"], ["y"])]
    out = [2, 2, 4] if not batch_dims else [2, 2, 4]
    m = model(nodes, [vi("x", F, [2, 3, 4])], [vi("y", F, out)], [init("i", idx)])
    check(m, {"x": rand(2, 3, 4)})


def test_a_feed_with_a_zero_stride_along_a_dim_of_one_is_read():
    # np.linspace(...)[None] has stride 0 along its dim of 1: a real feed, not a placeholder
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Neg", ["r"], ["y"])]
    m = model(nodes, [vi("x", F, [1, 16])], [vi("y", F, [1, 16])])
    check(m, {"x": np.linspace(-1, 1, 16, dtype=np.float32)[None]})


@pytest.mark.parametrize("variant", ["bert", "no_mask", "pre_transposed", "dynamo", "where", "gqa"])
def test_fused_attention_chains(variant):
    """FusedAttention lowered a row at a time (native/attention.c), GPT-2's Where
    condition included."""
    from tests.placement.test_fusion_patterns import attention, attention_feed

    m = attention(variant)
    sess = check(m, attention_feed(m), rtol=1e-5, atol=2e-6)
    ops = {int(op) for seg in sess._executor.segments for plan in seg.bound._bound.values()
           for st in plan.steps if isinstance(st.fn, Region) for op in st.fn.program.records["op"]}
    assert library.constant("OP_ATTENTION") in ops


def test_a_region_reading_a_view_made_in_an_earlier_region_keeps_its_array():
    # p comes from a Python step (Hardmax); region 0 reshapes it (a view, no record: no
    # record there reads p) and is p's last reader in the plan; another Python step
    # follows; region 1 reads the view. p's release must move to region 1, or region 1
    # is handed no array for it
    import gc

    nodes = [helper.make_node("Hardmax", ["x"], ["p"]),
             helper.make_node("Mul", ["x", "two"], ["a"]),
             helper.make_node("Reshape", ["p", "shape"], ["pr"]),
             helper.make_node("Add", ["a", "x"], ["a2"]),
             helper.make_node("Hardmax", ["a2"], ["h"]),
             helper.make_node("Reshape", ["h", "shape"], ["hr"]),
             helper.make_node("Add", ["hr", "pr"], ["z"]),
             helper.make_node("Mul", ["z", "two"], ["y"])]
    m = model(nodes, [vi("x", F, [2, 3, 4])], [vi("y", F, [6, 4])],
              [init("two", np.array(2.0, np.float32)), init("shape", np.array([6, 4], np.int64))])
    sess = hx.InferenceSession(m.SerializeToString())
    junk = []
    for _ in range(6):
        x = rand(2, 3, 4)
        want = ort_run(m, {"x": x})
        gc.collect()
        junk.append([np.ones(n, np.float32) for n in range(1, 64)])  # reuse freed memory
        assert_outputs(sess.run(None, {"x": x}), want, 1e-6, 1e-6)
    assert python_steps(sess) == ["Hardmax", "Hardmax"]
