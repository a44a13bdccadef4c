"""The packed float32 GEMM (kernels/native/packed_gemm.py, gemm.c): the kernel against
float64 numpy on ragged shapes, and the ops that use it (MatMul, Gemm, FusedMatMul, the
pointwise Conv) against onnx's ReferenceEvaluator through a session, each checked to
have taken the packed path; the fallbacks (a fed weight, the switch, no compiler)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import hetero_exec
from hetero_exec import InferenceSession
from hetero_exec.kernels import _packed as packed
from hetero_exec.kernels.native import packed_gemm as pg
from hetero_exec.kernels.native import plane_kernels, row_kernels

needs_packed = pytest.mark.skipif(not pg.available(),
                                  reason=f"packed GEMM off: {pg.unavailable_reason()}")


def _ref_act(y, act, lo, hi):
    if act == pg.ACT_RELU:
        return np.maximum(y, 0)
    if act == pg.ACT_CLIP:
        return np.clip(y, lo, hi)
    return y


@needs_packed
@pytest.mark.parametrize("M, K, N", [(1, 1, 1), (4, 7, 31), (5, 300, 33), (13, 513, 64),
                                     (32, 256, 100), (70, 257, 45), (96, 384, 130)])
@pytest.mark.parametrize("act", [pg.ACT_NONE, pg.ACT_RELU, pg.ACT_CLIP])
@pytest.mark.parametrize("split", [False, True])
def test_right_product(monkeypatch, M, K, N, act, split):
    """On one thread and split over the workers (by row tiles from 64 rows, else by
    panels)."""
    if split:
        monkeypatch.setattr(pg.library, "SPLIT_FLOPS", 0.0)
    rng = np.random.default_rng(M * 1000 + K + N)
    A = rng.standard_normal((M, K), dtype=np.float32)
    Bt = rng.standard_normal((N, K), dtype=np.float32)
    bias = rng.standard_normal(N, dtype=np.float32)
    z = rng.standard_normal((M, N), dtype=np.float32)
    for B in (Bt.T, np.ascontiguousarray(Bt.T)):  # a transposed view and a plain array
        got = pg.PackedRight(B).matmul(A, bias=bias, z=z, act=act, lo=-0.5, hi=0.7)
        want = _ref_act(A.astype(np.float64) @ B + bias + z, act, -0.5, 0.7)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4 * np.sqrt(K))
    got = pg.PackedRight(Bt.T).matmul(A.reshape(1, M, K))  # leading dims kept
    assert got.shape == (1, M, N)
    np.testing.assert_allclose(got[0], A.astype(np.float64) @ Bt.T, rtol=1e-5,
                               atol=1e-4 * np.sqrt(K))


@needs_packed
@pytest.mark.parametrize("n, M, K, L", [(1, 1, 1, 1), (2, 13, 300, 33), (3, 12, 16, 100),
                                        (2, 25, 513, 64), (4, 7, 5, 1)])
@pytest.mark.parametrize("act", [pg.ACT_NONE, pg.ACT_RELU, pg.ACT_CLIP])
def test_left_product(n, M, K, L, act):
    rng = np.random.default_rng(n + M + K + L)
    W = rng.standard_normal((M, K), dtype=np.float32)
    X = rng.standard_normal((n, K, L + 3), dtype=np.float32)[:, :, 2:L + 2]  # row stride > L
    bias = rng.standard_normal(M, dtype=np.float32)
    z = rng.standard_normal((n, M, L), dtype=np.float32)
    got = pg.PackedLeft(W).matmul(X, bias=bias, z=z, act=act, lo=-0.5, hi=0.7)
    want = _ref_act(W.astype(np.float64) @ X + bias[:, None] + z, act, -0.5, 0.7)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4 * np.sqrt(K))


@needs_packed
@pytest.mark.parametrize("L", [16, 40, 69])
def test_left_product_split_by_rows(monkeypatch, L):
    """One image of few 32-column panels (a small plane at batch 1) is cut by the
    weight's rows; a ragged last block of rows too."""
    monkeypatch.setattr(pg.library, "SPLIT_FLOPS", 0.0)
    rng = np.random.default_rng(L)
    W = rng.standard_normal((100, 37), dtype=np.float32)
    X = rng.standard_normal((1, 37, L), dtype=np.float32)
    bias, z = rng.standard_normal(100, dtype=np.float32), rng.standard_normal((1, 100, L),
                                                                               dtype=np.float32)
    got = pg.PackedLeft(W).matmul(X, bias=bias, z=z, act=pg.ACT_CLIP, lo=-0.5, hi=0.7)
    want = _ref_act(W.astype(np.float64) @ X + bias[:, None] + z, pg.ACT_CLIP, -0.5, 0.7)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


@needs_packed
def test_nan_and_inf_propagate_through_the_store():
    A = np.ones((4, 3), np.float32)
    A[1, 0], A[2, 0] = np.nan, np.inf
    B = np.ones((3, 5), np.float32)
    for act in (pg.ACT_NONE, pg.ACT_RELU, pg.ACT_CLIP):
        got = pg.PackedRight(B).matmul(A, act=act, lo=-1.0, hi=2.0)
        with np.errstate(invalid="ignore"):
            want = _ref_act(A @ B, act, -1.0, 2.0)
        np.testing.assert_array_equal(got, want)  # NaN stays NaN under Relu and Clip


def test_weight_checks():
    if pg.available():
        with pytest.raises(ValueError, match="2-D float32"):
            pg.PackedRight(np.ones((2, 2), np.float64))
        with pytest.raises(ValueError, match="rows"):
            pg.PackedLeft(np.ones((2, 3), np.float32)).matmul(np.ones((1, 4, 5), np.float32))


# ------------------------------------------------------------------ through a session


def _model(nodes, inputs, outputs, inits, opset=17):
    graph = helper.make_graph(nodes, "g", inputs, outputs,
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _f(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _mlp(rng, K=40, N=70):
    """Gemm(transB, bias)+Relu, MatMul+Add+Clip, MatMul, Gemm(alpha=2): the packed path,
    fused or not, and one Gemm it leaves to the generic kernel."""
    inits = {"w0": rng.standard_normal((N, K), dtype=np.float32), "b0": rng.standard_normal(N, dtype=np.float32),
             "w1": rng.standard_normal((N, N), dtype=np.float32), "b1": rng.standard_normal(N, dtype=np.float32),
             "w2": rng.standard_normal((N, 33), dtype=np.float32),
             "w3": rng.standard_normal((33, 9), dtype=np.float32),
             "lo": np.array(-1.0, np.float32), "hi": np.array(1.5, np.float32)}
    nodes = [helper.make_node("Gemm", ["x", "w0", "b0"], ["g0"], transB=1),
             helper.make_node("Relu", ["g0"], ["r0"]),
             helper.make_node("MatMul", ["r0", "w1"], ["m1"]),
             helper.make_node("Add", ["m1", "b1"], ["a1"]),
             helper.make_node("Clip", ["a1", "lo", "hi"], ["c1"]),
             helper.make_node("MatMul", ["c1", "w2"], ["m2"]),
             helper.make_node("Gemm", ["m2", "w3"], ["y"], alpha=2.0)]
    return _model(nodes, [_f("x", ["N", K])], [_f("y", ["N", 9])], inits)


def _counting(monkeypatch, owner, name: str) -> list[int]:
    """Count the calls of ``owner.name`` (a method) for the rest of the test."""
    calls: list[int] = []
    method = getattr(owner, name)

    def counted(self, *args, **kwargs):
        calls.append(1)
        return method(self, *args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


def _count_packed(monkeypatch) -> list[int]:
    """Count the products that take the packed weight."""
    return _counting(monkeypatch, packed.PackedWeight, "packed")


def _count_depthwise(monkeypatch) -> list[int]:
    """Count the depthwise convs that native/depthwise.c computes."""
    calls: list[int] = []
    run = plane_kernels.depthwise_call  # (depthwise_2d and the sessions' bound calls go through it)
    monkeypatch.setattr(plane_kernels, "depthwise_call", lambda *a, **k: calls.append(1) or run(*a, **k))
    return calls


@needs_packed
@pytest.mark.parametrize("optimized", [True, False])
def test_products_through_a_session(monkeypatch, optimized):
    rng = np.random.default_rng(0)
    model = _mlp(rng)
    hits = _count_packed(monkeypatch)
    so = hetero_exec.SessionOptions()
    if not optimized:  # the ops as written: MatMul, Gemm, no FusedMatMul
        so.graph_optimization_level = hetero_exec.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = InferenceSession(model.SerializeToString(), so, ["cpu"])
    ref = ReferenceEvaluator(model)
    # below the packed rows (none), inside them (the three weights Gemm_packed and
    # MatMul_packed take), and above them: there only the weights of at least
    # WIDE_COLUMNS columns (70, not 33)
    for n, packed_here in ((1, 0), (6, 3), (32, 3), (200, 2)):
        before = len(hits)
        x = rng.standard_normal((n, 40), dtype=np.float32)
        np.testing.assert_allclose(sess.run(None, {"x": x})[0], ref.run(None, {"x": x})[0],
                                   rtol=1e-4, atol=1e-3)
        assert len(hits) - before == packed_here, n


@needs_packed
def test_a_fed_weight_is_not_the_packed_constant():
    """An overridable initializer (also a graph input) that the run feeds: its value."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((16, 24), dtype=np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [_f("x", ["N", 16]), _f("w", [16, 24])], [_f("y", ["N", 24])],
                              [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    sess = InferenceSession(model.SerializeToString(), ["cpu"])
    x = rng.standard_normal((8, 16), dtype=np.float32)
    other = rng.standard_normal((16, 24), dtype=np.float32)
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], x @ w, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(sess.run(None, {"x": x, "w": other})[0], x @ other,
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], x @ w, rtol=1e-5, atol=1e-5)


def _pointwise_model(rng, C=24, M=40, act="Relu", residual=False):
    inits = {"w": rng.standard_normal((M, C, 1, 1), dtype=np.float32),
             "b": rng.standard_normal(M, dtype=np.float32),
             "lo": np.array(0.0, np.float32), "hi": np.array(6.0, np.float32)}
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"])]
    y = "c"
    if residual:
        inits["w2"] = rng.standard_normal((M, C, 1, 1), dtype=np.float32)
        nodes.append(helper.make_node("Conv", ["x", "w2"], ["c2"]))
        nodes.append(helper.make_node("Add", [y, "c2"], ["s"]))
        y = "s"
    if act == "Relu":
        nodes.append(helper.make_node("Relu", [y], ["y"]))
    elif act == "Clip":
        nodes.append(helper.make_node("Clip", [y, "lo", "hi"], ["y"]))
    elif act == "Sigmoid":
        nodes.append(helper.make_node("Sigmoid", [y], ["y"]))
    else:
        nodes.append(helper.make_node("Identity", [y], ["y"]))
    return _model(nodes, [_f("x", ["N", C, 30, 37])], [_f("y", ["N", M, 30, 37])], inits)


@needs_packed
@pytest.mark.parametrize("act", ["", "Relu", "Clip", "Sigmoid"])
@pytest.mark.parametrize("residual", [False, True])
def test_pointwise_conv_through_a_session(monkeypatch, act, residual):
    rng = np.random.default_rng(2)
    model = _pointwise_model(rng, act=act, residual=residual)
    lefts = _counting(monkeypatch, pg.PackedLeft, "matmul_call")
    monkeypatch.setattr(pg.library, "SPLIT_FLOPS", 0.0)  # this small model takes it too
    sess = InferenceSession(model.SerializeToString(), ["cpu"])
    ref = ReferenceEvaluator(model)
    for n in (1, 3):
        x = rng.standard_normal((n, 24, 30, 37), dtype=np.float32)
        np.testing.assert_allclose(sess.run(None, {"x": x})[0], ref.run(None, {"x": x})[0],
                                   rtol=1e-4, atol=1e-4)
    assert lefts, "the batch of 3 took the packed path"


def test_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv(pg.ENV, "0")
    pg.reset()
    try:
        assert not pg.available() and pg.ENV in pg.unavailable_reason()
        rng = np.random.default_rng(3)
        model = _mlp(rng)
        sess = InferenceSession(model.SerializeToString(), ["cpu"])
        x = rng.standard_normal((8, 40), dtype=np.float32)
        np.testing.assert_allclose(sess.run(None, {"x": x})[0],
                                   ReferenceEvaluator(model).run(None, {"x": x})[0],
                                   rtol=1e-4, atol=1e-3)
    finally:
        monkeypatch.delenv(pg.ENV)
        pg.reset()


def test_no_compiler_at_run_time_changes_nothing(monkeypatch):
    """The library is the build's: a process without a C compiler loads it all the same."""
    monkeypatch.setenv("CC", "no-such-compiler-here")
    monkeypatch.setenv("PATH", "/nonexistent")
    pg.reset()
    try:
        before = pg.unavailable_reason()
        assert pg.available() == (before is None)
        if pg.available():
            A = np.ones((8, 40), np.float32)
            B = np.ones((40, 33), np.float32)
            np.testing.assert_allclose(pg.PackedRight(B).matmul(A), A @ B)
    finally:
        monkeypatch.undo()
        pg.reset()


def _conv_model(rng, C, M, H, Wd, attrs, act="", residual=False, group=1):
    """Conv (+ bias) of x (N, C, H, W), then an optional residual input ``r`` and an
    activation: one the store applies (Relu, Clip) or one it leaves to the epilogue."""
    kh, kw = attrs.pop("k")
    inits = {"w": rng.standard_normal((M, C // group, kh, kw), dtype=np.float32),
             "b": rng.standard_normal(M, dtype=np.float32),
             "lo": np.array(-0.5, np.float32), "hi": np.array(2.0, np.float32)}
    ins = [_f("x", ["N", C, H, Wd])]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], group=group, **attrs)]
    y = "c"
    if residual:
        ins.append(_f("r", ["n", "m", "h", "w"]))
        nodes.append(helper.make_node("Add", ["c", "r"], ["s"]))
        y = "s"
    op, args = {"Relu": ("Relu", [y]), "Clip": ("Clip", [y, "lo", "hi"]),
                "HardSigmoid": ("HardSigmoid", [y]),
                "HardSwish": ("HardSwish", [y])}.get(act, ("Identity", [y]))
    nodes.append(helper.make_node(op, args, ["y"]))
    return _model(nodes, ins, [_f("y", ["n", "m", "h", "w"])], inits)


def _agrees_with_reference(model, rng, x_shape, residual=False) -> np.ndarray:
    """A session's output against the ReferenceEvaluator's for 1 and 3 images (fed a
    residual ``r`` of the output's shape when asked); the last reference output."""
    sess = InferenceSession(model.SerializeToString(), ["cpu"])
    ref = ReferenceEvaluator(model)
    for n in (1, 3):
        feeds = {"x": rng.standard_normal((n, *x_shape), dtype=np.float32)}
        if residual:
            shape = ref.run(None, {**feeds, "r": np.zeros(1, np.float32)})[0].shape
            feeds["r"] = rng.standard_normal(shape, dtype=np.float32)
        want = ref.run(None, feeds)[0]
        np.testing.assert_allclose(sess.run(None, feeds)[0], want, rtol=1e-4, atol=1e-4)
    return want


CONVS = [  # (C, M, H, W, attributes): ragged widths, both pads, dilation, strides
    (3, 16, 17, 37, {"k": (3, 3), "pads": [1, 1, 1, 1]}),
    (8, 13, 9, 28, {"k": (3, 3), "pads": [0, 1, 2, 1]}),
    (5, 30, 12, 30, {"k": (3, 3), "pads": [2, 2, 2, 2], "dilations": [2, 2]}),
    (4, 25, 15, 14, {"k": (5, 3), "pads": [2, 1, 2, 1], "strides": [2, 1]}),
    (6, 12, 13, 13, {"k": (3, 3), "auto_pad": "SAME_UPPER"}),
    (7, 9, 8, 47, {"k": (1, 7), "pads": [0, 3, 0, 3]}),
    (4, 10, 25, 29, {"k": (3, 3), "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    (3, 14, 40, 60, {"k": (7, 7), "strides": [2, 2], "pads": [3, 3, 3, 3]}),  # ResNet's stem
    (5, 12, 20, 45, {"k": (3, 3), "strides": [1, 3], "pads": [0, 2, 1, 0], "dilations": [1, 2]}),
    (4, 10, 9, 9, {"k": (3, 3), "pads": [1, 1, 1, 1]}),  # 9 of 11 lanes: taken (flat grid)
    (4, 12, 7, 7, {"k": (3, 3), "pads": [1, 1, 1, 1]}),  # ResNet's 7x7: 7 of 9, not taken
    (4, 12, 12, 12, {"k": (3, 3), "pads": [1, 1, 1, 1]}),  # 12 of 14: taken
    (4, 10, 5, 5, {"k": (3, 3), "pads": [2, 2, 2, 2], "dilations": [2, 2]}),  # 5 of 9: not taken
    (4, 10, 9, 9, {"k": (3, 3), "strides": [2, 1], "pads": [1, 1, 1, 1]}),  # 9 of 16: not taken
    (120, 14, 9, 11, {"k": (3, 3), "pads": [1, 1, 1, 1]}),  # 1080 taps: two blocks (flat)
    (120, 10, 9, 16, {"k": (3, 3), "strides": [2, 1], "pads": [1, 1, 1, 1]}),  # two, by rows
]


@needs_packed
@pytest.mark.parametrize("case", range(len(CONVS)))
@pytest.mark.parametrize("act, residual", [("", False), ("Relu", True), ("Clip", False),
                                           ("HardSigmoid", True)])
def test_conv_through_a_session(monkeypatch, case, act, residual):
    C, M, H, Wd, attrs = CONVS[case]
    rng = np.random.default_rng(case)
    model = _conv_model(rng, C, M, H, Wd, dict(attrs), act, residual)
    convs = _counting(monkeypatch, pg.PackedLeft, "conv_call")
    monkeypatch.setattr(pg.library, "SPLIT_FLOPS", 0.0)  # these small convs take it too
    want = _agrees_with_reference(model, rng, (C, H, Wd), residual)
    # the lanes holding output pixels must be 4/5 at least: of the padded rows at strides
    # 1, else of the runs of 16 pixels within each output row
    OW = want.shape[-1]
    pads = attrs.get("pads", [1, 1, 1, 1] if "auto_pad" in attrs else [0, 0, 0, 0])
    lanes = Wd + pads[1] + pads[3] if attrs.get("strides", [1, 1]) == [1, 1] else 16 * -(-OW // 16)
    assert bool(convs) == (OW >= pg.LANES_FILLED * lanes), (OW, lanes)


@needs_packed
@pytest.mark.parametrize("attrs", [{"pads": [1, 1]}, {"pads": [2, 0], "strides": [2]},
                                   {"pads": [2, 2], "dilations": [2]}])
@pytest.mark.parametrize("depthwise", [False, True])
def test_conv1d_through_a_session(monkeypatch, attrs, depthwise):
    """A Whisper-style front end, Conv1d (k=3) + bias, then Relu; ungrouped (the packed
    conv) or depthwise (depthwise.c)."""
    rng = np.random.default_rng(7)
    M, group = (6, 6) if depthwise else (20, 1)
    inits = {"w": rng.standard_normal((M, 6 // group, 3), dtype=np.float32),
             "b": rng.standard_normal(M, dtype=np.float32)}
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], group=group, **attrs),
             helper.make_node("Relu", ["c"], ["y"])]
    model = _model(nodes, [_f("x", ["N", 6, 61])], [_f("y", ["n", "m", "l"])], inits)
    calls = (_count_depthwise(monkeypatch) if depthwise
             else _counting(monkeypatch, pg.PackedLeft, "conv_call"))
    monkeypatch.setattr(pg.library, "SPLIT_FLOPS", 0.0)
    sess = InferenceSession(model.SerializeToString(), ["cpu"])
    x = rng.standard_normal((2, 6, 61), dtype=np.float32)
    np.testing.assert_allclose(sess.run(None, {"x": x})[0],
                               ReferenceEvaluator(model).run(None, {"x": x})[0],
                               rtol=1e-4, atol=1e-4)
    assert calls


# ------------------------------------------------------------------ gemm.c's workers


@needs_packed
def test_concurrent_callers_share_the_workers():
    """Two threads splitting at once: one holds the workers, the other runs its parts
    itself (never waits on the first); every result is right."""
    import threading

    rng = np.random.default_rng(9)
    B = rng.standard_normal((512, 300), dtype=np.float32)
    packed_b = pg.PackedRight(B)
    W = rng.standard_normal((40, 27), dtype=np.float32)
    packed_w = pg.PackedLeft(W)
    errors: list[BaseException] = []

    def caller(seed: int) -> None:
        r = np.random.default_rng(seed)
        try:
            for _ in range(30):
                A = r.standard_normal((24, 512), dtype=np.float32)
                np.testing.assert_allclose(packed_b.matmul(A), A.astype(np.float64) @ B,
                                           rtol=1e-4, atol=1e-3)
                X = r.standard_normal((2, 3, 20, 40), dtype=np.float32)
                got = packed_w.conv(X, (3, 3), (1, 1), (1, 1), (0, 0, 0, 0), (18, 38))
                cols = np.stack([X[:, :, i:i + 18, j:j + 38] for i in range(3) for j in range(3)],
                                axis=2).reshape(2, 27, 18 * 38)
                np.testing.assert_allclose(got.reshape(2, 40, -1), W.astype(np.float64) @ cols,
                                           rtol=1e-4, atol=1e-3)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=caller, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors[0]
    assert not any(t.is_alive() for t in threads)


_CHILD = r"""
import os, sys, time
import numpy as np
from hetero_exec.kernels.native import packed_gemm as pg
assert pg.available(), pg.unavailable_reason()
B = np.ones((256, 512), np.float32)
p = pg.PackedRight(B)
A = np.ones((16, 256), np.float32)
assert p.matmul(A)[0, 0] == 256  # split over the workers (over 4 MFLOP)
if sys.argv[1] == "fork":
    pid = os.fork()
    if pid == 0:  # the parent's workers do not exist here: the split must not hang
        ok = p.matmul(A)[3, 7] == 256
        os._exit(0 if ok else 3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
else:  # idle after a split: the workers spin their 100 us, then sleep
    time.sleep(0.05)
    t0 = time.process_time()
    time.sleep(0.3)
    print(time.process_time() - t0)
"""


@needs_packed
@pytest.mark.parametrize("mode", ["fork", "idle"])
def test_workers_after_fork_and_when_idle(mode):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _CHILD, mode], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    if mode == "idle":  # a worker that never stopped spinning would take ~0.3 s of CPU
        assert float(done.stdout.split()[-1]) < 0.03, done.stdout


POOLS = [  # (H, W, attributes): MaxPool cases, with pads, strides, dilation, ceil mode
    (16, 40, {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),  # ResNet's
    (9, 13, {"kernel_shape": [2, 3], "strides": [1, 2], "pads": [0, 1, 1, 0]}),
    (11, 21, {"kernel_shape": [3, 3], "strides": [2, 3], "dilations": [2, 1], "ceil_mode": 1}),
    (8, 8, {"kernel_shape": [2, 2], "strides": [2, 2], "auto_pad": "SAME_UPPER"}),
    (7, 33, {"kernel_shape": [1, 5], "strides": [1, 1]}),
    (5, 1, {"kernel_shape": [2, 1], "strides": [1, 2]}),  # one column, two phases
    (6, 3, {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    (4, 70, {"kernel_shape": [3, 3], "strides": [3, 3], "pads": [1, 2, 1, 0]}),
]


@needs_packed
@pytest.mark.parametrize("case", range(len(POOLS)))
def test_max_pool_against_the_reference(monkeypatch, case):
    H, Wd, attrs = POOLS[case]
    calls: list[int] = []
    pool = plane_kernels.max_pool_2d
    monkeypatch.setattr(plane_kernels, "max_pool_2d", lambda *a: calls.append(1) or pool(*a))
    model = _model([helper.make_node("MaxPool", ["x"], ["y"], **attrs)],
                   [_f("x", ["N", 3, H, Wd])], [_f("y", ["n", "c", "h", "w"])], {}, opset=12)
    rng = np.random.default_rng(case)
    x = rng.standard_normal((2, 3, H, Wd), dtype=np.float32)
    x[1, 2] = -np.inf
    sess = InferenceSession(model.SerializeToString(), ["cpu"])
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0],
                                  ReferenceEvaluator(model).run(None, {"x": x})[0])
    assert calls
    # NaN propagates, as in the numpy path (numpy's maximum); the reference skips NaN
    x[0, 1, 2 % H, 3 % Wd] = np.nan
    got = sess.run(None, {"x": x})[0]
    monkeypatch.setitem(pg.library._state, "reason", "off for the comparison")
    want = InferenceSession(model.SerializeToString(), ["cpu"]).run(None, {"x": x})[0]
    assert np.isnan(got).any()
    np.testing.assert_array_equal(got, want)


@needs_packed
def test_a_providers_own_copy_of_the_weight_is_packed(monkeypatch):
    """sim-gpu's host mode holds its own copy of every initializer: its segments pack
    that copy (the array the plan's slot holds run after run)."""
    rng = np.random.default_rng(4)
    model = _mlp(rng)
    hits = _count_packed(monkeypatch)
    sess = InferenceSession(model.SerializeToString(), [("sim-gpu", {"strict": False}), "cpu"],
                            hetero=True)
    ref = ReferenceEvaluator(model)
    for _ in range(2):
        x = rng.standard_normal((8, 40), dtype=np.float32)
        np.testing.assert_allclose(sess.run(None, {"x": x})[0], ref.run(None, {"x": x})[0],
                                   rtol=1e-4, atol=1e-3)
    assert len(hits) >= 2 * 3


# ------------------------------------------------------------------ depthwise.c


DEPTHWISE = [  # (C, H, W, attributes): MobileNet's and ConvNeXt's, and odd geometry
    (5, 16, 16, {"k": (3, 3), "pads": [1, 1, 1, 1]}),
    (4, 17, 23, {"k": (3, 3), "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    (3, 16, 16, {"k": (3, 3), "strides": [2, 2], "pads": [0, 0, 1, 1]}),  # TF-style pads
    (3, 13, 11, {"k": (5, 5), "pads": [2, 2, 2, 2]}),
    (6, 14, 14, {"k": (7, 7), "pads": [3, 3, 3, 3]}),  # ConvNeXt
    (6, 7, 7, {"k": (7, 7), "pads": [3, 3, 3, 3]}),
    (4, 4, 4, {"k": (3, 3), "pads": [1, 1, 1, 1]}),  # MobileNet's last planes
    (3, 12, 12, {"k": (3, 3), "pads": [2, 2, 2, 2], "dilations": [2, 2]}),
    (3, 14, 19, {"k": (3, 3), "strides": [3, 3], "pads": [1, 1, 1, 1]}),  # gathers
    (3, 11, 20, {"k": (3, 3), "strides": [1, 2], "pads": [1, 0, 1, 2]}),
    (3, 11, 20, {"k": (3, 3), "strides": [2, 1], "pads": [0, 1, 2, 1]}),
    (3, 9, 15, {"k": (3, 3), "strides": [2, 2], "auto_pad": "SAME_UPPER"}),
    (3, 8, 16, {"k": (3, 7), "pads": [1, 9, 1, 9], "dilations": [1, 3]}),  # runs by rows
    (3, 6, 70, {"k": (1, 1)}),
    (3, 5, 40, {"k": (2, 4), "pads": [0, 0, 0, 0]}),  # no padding at all
    (20, 8, 8, {"k": (3, 3), "pads": [1, 1, 1, 1]}),  # a block of 16 channels and 4 more
    (33, 5, 6, {"k": (7, 7), "pads": [3, 2, 3, 4]}),
]


@needs_packed
@pytest.mark.parametrize("case", range(len(DEPTHWISE)))
@pytest.mark.parametrize("act, residual", [("", False), ("Relu", True), ("Clip", False),
                                           ("HardSwish", True)])
@pytest.mark.parametrize("along", [False, True])
def test_depthwise_through_a_session(monkeypatch, case, act, residual, along):
    """By planes (depthwise.c) and along the channels (depthwise_cl.c), every geometry."""
    monkeypatch.setattr(plane_kernels, "depthwise_along_channels", lambda *a: along)
    C, H, Wd, attrs = DEPTHWISE[case]
    rng = np.random.default_rng(case)
    model = _conv_model(rng, C, C, H, Wd, dict(attrs), act, residual, group=C)
    calls = _count_depthwise(monkeypatch)
    _agrees_with_reference(model, rng, (C, H, Wd), residual)
    assert len(calls) == 2


@needs_packed
@pytest.mark.parametrize("along", [False, True])
def test_depthwise_nan_inf_and_other_dtypes(monkeypatch, along):
    """NaN and inf propagate as in the numpy path, by planes and along the channels;
    float64 takes the numpy path (depthwise.c is float32 only)."""
    monkeypatch.setattr(plane_kernels, "depthwise_along_channels", lambda *a: along)
    rng = np.random.default_rng(9)
    model = _conv_model(rng, 4, 4, 9, 9, {"k": (3, 3), "pads": [1, 1, 1, 1]}, "Clip", group=4)
    x = rng.standard_normal((2, 4, 9, 9), dtype=np.float32)
    x[0, 1, 4, 4] = np.nan
    x[1, 2, 0, 0] = np.inf
    calls = _count_depthwise(monkeypatch)
    got = InferenceSession(model.SerializeToString(), ["cpu"]).run(None, {"x": x})[0]
    assert calls
    # (the numpy column-band path spreads a NaN along its band's row: NaN * 0)
    want = ReferenceEvaluator(model).run(None, {"x": x})[0]
    assert np.isnan(got[0, 1, 3:6, 3:6]).all() and not np.isnan(got[0, 0]).any()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    calls.clear()
    m64 = _conv_model(rng, 4, 4, 9, 9, {"k": (3, 3), "pads": [1, 1, 1, 1]}, group=4)
    for t in m64.graph.initializer:
        if t.name in ("w", "b"):
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float64),
                                               t.name))
    for v in list(m64.graph.input) + list(m64.graph.output):
        v.type.tensor_type.elem_type = TensorProto.DOUBLE
    x64 = rng.standard_normal((2, 4, 9, 9))
    np.testing.assert_allclose(InferenceSession(m64.SerializeToString(), ["cpu"]).run(
        None, {"x": x64})[0], ReferenceEvaluator(m64).run(None, {"x": x64})[0], rtol=1e-10)
    assert not calls


# ------------------------------------------------------------------ softmax.c


@needs_packed
@pytest.mark.parametrize("n", [1, 5, 16, 17, 128, 1000])
def test_softmax_rows_against_float64(monkeypatch, n):
    """The Softmax kernel (and FusedAttention's scores) on the compiled rows: within
    float32's rounding of the float64 softmax, every row summing to 1."""
    from hetero_exec.kernels.fused_attention import _softmax_last_inplace
    from hetero_exec.kernels.reduce import Softmax

    ran: list[int] = []
    run = row_kernels.softmax_rows
    monkeypatch.setattr(row_kernels, "softmax_rows", lambda x: ran.append(1) or run(x))
    rng = np.random.default_rng(n)
    x = (rng.standard_normal((3, 7, n)) * 8).astype(np.float32)
    z = x.astype(np.float64) - x.max(axis=-1, keepdims=True)
    want = np.exp(z) / np.exp(z).sum(axis=-1, keepdims=True)
    for got in (Softmax(np, x)[0], _softmax_last_inplace(np, x.copy())):
        # (x - max rounds to float32 first: an error of |z| * 6e-8 in the exponent)
        np.testing.assert_allclose(got, want, rtol=1e-6 + 6e-8 * np.abs(z).max(), atol=1e-37)
        np.testing.assert_allclose(got.sum(axis=-1), 1.0, rtol=1e-5)
    assert ran == [1, 1]


@needs_packed
def test_softmax_rows_special_values_as_numpy():
    """-inf scores give 0; a NaN anywhere, or a row whose maximum is +-inf, gives a row of
    NaN (numpy's arithmetic: inf - inf); the strided input takes numpy's path, same result."""
    from hetero_exec.kernels.reduce import Softmax

    x = np.array([[0.0, -np.inf, 1.0, -np.inf], [np.nan, 0.0, 0.0, 1.0],
                  [-np.inf] * 4, [np.inf, 0.0, 0.0, 0.0], [-200.0, 0.0, -90.0, 3.0]], np.float32)
    got = row_kernels.softmax_rows(x.copy())
    assert np.isnan(got[1:4]).all() and not np.isnan(got[[0, 4]]).any()
    np.testing.assert_allclose(got[0], [0.26894142, 0.0, 0.7310586, 0.0], rtol=1e-6)
    assert got[4, 0] == 0.0 and got[4, 2] == 0.0  # exp(-203), exp(-93): 0, not subnormal
    strided = np.asfortranarray(x)
    np.testing.assert_array_equal(np.isnan(Softmax(np, strided)[0]), np.isnan(got))
    np.testing.assert_allclose(Softmax(np, strided)[0], got, rtol=1e-6, atol=1e-37)


# ------------------------------------------------------------------ act.c


@needs_packed
@pytest.mark.parametrize("name", ["", "Relu", "Clip", "HardSigmoid", "HardSwish", "Gelu",
                                  "GeluTanh", "SiLU", "Sigmoid", "Tanh"])
def test_last_axis_activation_matches_the_numpy_definition(monkeypatch, name):
    """act(y + bias) on a vector of lanes (native/act.c) against the numpy formulas in
    float64; at +-inf, NaN, the rationals' clamps and far beyond them too. FusedMatMul's
    epilogue takes it."""
    from hetero_exec.kernels import fused
    from hetero_exec.kernels.fused import FusedMatMul
    from hetero_exec.kernels.native.activation import ACT_CODES, ACT_DEFAULTS
    from tests.kernels._ref import activation_reference

    rng = np.random.default_rng(len(name))
    special = [np.nan, np.inf, -np.inf, 100, -100, 0, 1e30, -1e30, 3e38, -3e38, 7.9, -7.9,
               7.91, -7.91, 4.5 * np.sqrt(2), -6.4]
    y = np.concatenate([np.array(special, np.float32),
                        (rng.standard_normal(3 * 37 - 16) * 5).astype(np.float32)]).reshape(3, 37)
    bias = np.concatenate([np.zeros(16, np.float32), rng.standard_normal(21).astype(np.float32)])
    code = ACT_CODES[name]
    p0, p1 = ACT_DEFAULTS.get(name, (-1.0, 2.0)) if name != "Clip" else (-1.0, 2.0)
    params = (p0, p1) if name in ACT_DEFAULTS else None
    got = y.copy()
    with np.errstate(all="ignore"):
        want = activation_reference(name, params, (y + bias).astype(np.float64))
    row_kernels.last_axis(got, bias, code, p0, p1)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2.2e-6)
    ran: list[int] = []
    run = row_kernels.last_axis
    monkeypatch.setattr(row_kernels, "last_axis", lambda *a: ran.append(1) or run(*a))
    # few values: numpy's one pass after the bias for Relu, Clip, Tanh (and a bias
    # alone), the compiled epilogue for the others; many values: the compiled one
    for rows, compiled in ((5, name not in fused._ONE_PASS), (fused.SMALL_EPILOGUE // 37 + 1, True)):
        ran.clear()
        a = rng.standard_normal((rows, 8), dtype=np.float32)
        w = rng.standard_normal((8, 37), dtype=np.float32)
        out = FusedMatMul(np, a, w, bias, name, params)[0]
        want = activation_reference(name, params, a.astype(np.float64) @ w + bias)
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
        assert bool(ran) == compiled, rows


@needs_packed
@pytest.mark.parametrize("cols", [1, 7, 16, 100, 768])
@pytest.mark.parametrize("rms", [False, True])
def test_row_norm_against_float64(cols, rms):
    """LayerNorm and RMSNorm over the last axis in float32 (native/norm.c), ragged rows,
    with and without scale and bias, against float64 formulas."""
    rng = np.random.default_rng(cols)
    x = (rng.standard_normal((9, cols)) * 3 + 2).astype(np.float32)
    g = rng.standard_normal(cols).astype(np.float32)
    b = rng.standard_normal(cols).astype(np.float32)
    x64 = x.astype(np.float64)
    for scale, bias in ((None, None), (g, None), (g, b)):
        bias = None if rms else bias
        got, mean, inv = row_kernels.row_norm(x, scale, bias, 1e-5, rms=rms)
        m = 0.0 if rms else x64.mean(axis=1, keepdims=True)
        iv = 1.0 / np.sqrt(((x64 - m) ** 2).mean(axis=1, keepdims=True) + 1e-5)
        want = (x64 - m) * iv * (1.0 if scale is None else scale)
        want = want + (0.0 if bias is None else bias)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(inv, iv[:, 0], rtol=2e-5)
        if not rms:
            np.testing.assert_allclose(mean, m[:, 0], rtol=1e-5, atol=1e-5)
