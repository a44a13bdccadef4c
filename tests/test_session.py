"""InferenceSession (SEMANTICS.md section 3): typed input errors, each leaving the
session usable; metadata as onnxruntime reports it; providers; sequence outputs;
run_async; the context manager; the error hierarchy."""

from __future__ import annotations

import concurrent.futures
import inspect

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from hetero_exec import InferenceSession, errors
from hetero_exec.errors import (
    DimMismatchError,
    DtypeMismatchError,
    HeteroExecError,
    InputError,
    MissingInputError,
    ProviderError,
    RankMismatchError,
    SequenceOutputError,
    SymbolConflictError,
    UnknownInputError,
    UnknownOutputError,
)
from tests._models import I64, F, assert_outputs, init, mlp, model, ort_run, vi


def _two_input_model() -> onnx.ModelProto:
    """a[N,4] + b[N,4] (+ bias, an initializer-backed graph input) -> y; k[2,3] -> z."""
    return model(
        [helper.make_node("Add", ["a", "b"], ["s"], name="add"),
         helper.make_node("Add", ["s", "bias"], ["y"], name="bias_add"),
         helper.make_node("Relu", ["k"], ["z"], name="relu")],
        [vi("a", F, ["N", 4]), vi("b", F, ["N", 4]), vi("k", F, [2, 3]), vi("bias", F, [4])],
        [vi("y", F, ["N", 4]), vi("z", F, [2, 3])],
        [init("bias", np.array([1.0, -1.0, 0.5, 0.0], np.float32))])


RNG = np.random.default_rng(7)
GOOD = {"a": RNG.standard_normal((3, 4)).astype(np.float32),
        "b": RNG.standard_normal((3, 4)).astype(np.float32),
        "k": RNG.standard_normal((2, 3)).astype(np.float32)}


@pytest.fixture(scope="module")
def two():
    m = _two_input_model()
    return m, InferenceSession(m), ort_run(m, GOOD)


def _still_works(sess, m, want) -> None:
    assert_outputs(sess.run(None, GOOD), want)


# --- typed input errors ------------------------------------------------------------------


def test_unknown_input(two):
    m, sess, want = two
    with pytest.raises(UnknownInputError) as ei:
        sess.run(None, {**GOOD, "c": GOOD["a"]})
    assert ei.value.name == "c"
    assert "'c'" in str(ei.value) and "unknown input" in str(ei.value)
    _still_works(sess, m, want)


def test_missing_input(two):
    m, sess, want = two
    feed = dict(GOOD)
    del feed["b"]
    with pytest.raises(MissingInputError) as ei:
        sess.run(None, feed)
    assert ei.value.name == "b" and "'b'" in str(ei.value)
    _still_works(sess, m, want)


def test_initializer_backed_input_is_optional_and_overridable(two):
    m, sess, want = two
    assert "bias" not in {a.name for a in sess.get_inputs()}
    assert [a.name for a in sess.get_overridable_initializers()] == ["bias"]
    assert_outputs(sess.run(None, GOOD), want)  # not fed: the initializer's value
    override = {**GOOD, "bias": np.array([10.0, 20.0, 30.0, 40.0], np.float32)}
    got = sess.run(None, override)
    assert_outputs(got, ort_run(m, override))
    assert not np.allclose(got[0], want[0])
    _still_works(sess, m, want)


def test_dtype_mismatch(two):
    m, sess, want = two
    with pytest.raises(DtypeMismatchError) as ei:
        sess.run(None, {**GOOD, "a": GOOD["a"].astype(np.float64)})
    e = ei.value
    assert (e.name, e.expected, e.got) == ("a", "float", "float64")
    assert "expected float" in str(e) and "got float64" in str(e)
    with pytest.raises(DtypeMismatchError):
        sess.run(None, {**GOOD, "k": np.zeros((2, 3), np.int64)})
    _still_works(sess, m, want)


def test_rank_mismatch(two):
    m, sess, want = two
    with pytest.raises(RankMismatchError) as ei:
        sess.run(None, {**GOOD, "k": np.zeros((6,), np.float32)})
    e = ei.value
    assert e.name == "k" and e.expected == (2, 3) and e.got == (6,)
    assert "expected rank 2" in str(e) and "got rank 1" in str(e)
    _still_works(sess, m, want)


def test_static_dim_mismatch(two):
    m, sess, want = two
    with pytest.raises(DimMismatchError) as ei:
        sess.run(None, {**GOOD, "a": np.zeros((3, 5), np.float32), "b": np.zeros((3, 5), np.float32)})
    e = ei.value
    assert e.name == "a" and e.expected == ("N", 4) and e.got == (3, 5)
    assert "expected shape [N, 4]" in str(e) and "got shape [3, 5]" in str(e)
    with pytest.raises(DimMismatchError) as ei:
        sess.run(None, {**GOOD, "k": np.zeros((3, 2), np.float32)})
    assert "expected shape [2, 3]" in str(ei.value) and "got shape [3, 2]" in str(ei.value)
    _still_works(sess, m, want)


def test_symbol_conflict(two):
    m, sess, want = two
    with pytest.raises(SymbolConflictError) as ei:
        sess.run(None, {**GOOD, "a": np.zeros((2, 4), np.float32), "b": np.zeros((3, 4), np.float32)})
    e = ei.value
    assert (e.symbol, e.first, e.second) == ("N", 2, 3)
    msg = str(e)
    assert "'N'" in msg and "2" in msg and "3" in msg
    _still_works(sess, m, want)
    # a different consistent binding of N is fine
    other = {**GOOD, "a": np.ones((5, 4), np.float32), "b": np.ones((5, 4), np.float32)}
    assert_outputs(sess.run(None, other), ort_run(m, other))


def test_unknown_output(two):
    m, sess, want = two
    with pytest.raises(UnknownOutputError) as ei:
        sess.run(["y", "nope"], GOOD)
    assert ei.value.name == "nope" and "'nope'" in str(ei.value)
    assert_outputs(sess.run(["z"], GOOD), [want[1]])
    assert_outputs(sess.run(["z", "y"], GOOD), [want[1], want[0]])
    _still_works(sess, m, want)


def test_input_errors_are_value_errors_too(two):
    _, sess, _ = two
    with pytest.raises(ValueError):
        sess.run(None, {})
    assert issubclass(MissingInputError, InputError)


# --- metadata -----------------------------------------------------------------------------


def _typed_model() -> onnx.ModelProto:
    T = TensorProto
    ins = [vi("f", F, ["N", 3]), vi("b", T.BOOL, [2]), vi("i32", T.INT32, [None, "M"]),
           vi("h", T.FLOAT16, [1]), vi("s", T.STRING, [2]), vi("u8", T.UINT8, []),
           vi("d", T.DOUBLE, ["N"]), vi("W", F, [1, 3])]
    outs = [vi("f_out", F, ["N", 3]), vi("b_out", T.BOOL, [2]), vi("i32_out", T.INT32, [4, "M"]),
            vi("h_out", T.FLOAT16, [1]), vi("s_out", T.STRING, [2]), vi("u8_out", T.UINT8, []),
            vi("d_out", T.DOUBLE, ["N"]), vi("l_out", I64, ["N", 3])]
    nodes = [helper.make_node("Add", ["f", "W"], ["f_out"]), helper.make_node("Not", ["b"], ["b_out"]),
             helper.make_node("Identity", ["i32"], ["i32_out"]), helper.make_node("Identity", ["h"], ["h_out"]),
             helper.make_node("Identity", ["s"], ["s_out"]), helper.make_node("Identity", ["u8"], ["u8_out"]),
             helper.make_node("Neg", ["d"], ["d_out"]), helper.make_node("Cast", ["f"], ["l_out"], to=T.INT64)]
    return model(nodes, ins, outs, [init("W", np.zeros((1, 3), np.float32))])


def _args(args) -> list[tuple]:
    return [(a.name, a.shape, a.type) for a in args]


def test_inputs_and_outputs_as_onnxruntime_reports():
    m = _typed_model()
    ours = InferenceSession(m)
    theirs = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    assert _args(ours.get_inputs()) == _args(theirs.get_inputs())
    assert _args(ours.get_outputs()) == _args(theirs.get_outputs())
    assert [a.name for a in ours.get_overridable_initializers()] == [
        a.name for a in theirs.get_overridable_initializers()]
    assert ours.get_inputs()[0].type == "tensor(float)"


def test_unknown_output_dim_reported_as_none():
    m = model([helper.make_node("Identity", ["x"], ["y"])], [vi("x", F, [None, 3])], [vi("y", F, [None, 3])])
    ours = InferenceSession(m)
    theirs = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    assert _args(ours.get_outputs()) == _args(theirs.get_outputs())


def _seq_model() -> onnx.ModelProto:
    return model([helper.make_node("SplitToSequence", ["x"], ["seq"], axis=0),
                  helper.make_node("Relu", ["x"], ["y"])],
                 [vi("x", F, [3, 2])], [helper.make_tensor_sequence_value_info("seq", F, None), vi("y", F, [3, 2])])


def test_sequence_output_metadata_as_onnxruntime_reports():
    m = _seq_model()
    theirs = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    assert _args(InferenceSession(m).get_outputs()) == _args(theirs.get_outputs())


# --- providers ------------------------------------------------------------------------------


X = np.random.default_rng(8).standard_normal((2, 4)).astype(np.float32)


@pytest.mark.parametrize("providers", [None, ["cpu"], ["CPUExecutionProvider"], ["cpuexecutionprovider"],
                                       "cpu", [("cpu", {})], [("CPUExecutionProvider", {"mem_limit": 1 << 30})],
                                       ("cpu", {"exclude_ops": []})])
def test_cpu_provider_spellings(providers):
    m = mlp(2)  # static: a mem_limit needs every dim bounded (SEMANTICS.md section 5)
    sess = InferenceSession(m, providers=providers)
    # the caller's spelling: onnxruntime's name when given (or by default), else ours
    ort_spelled = providers is None or "cpuexecutionprovider" in str(providers).lower()
    assert sess.get_providers() == ["CPUExecutionProvider" if ort_spelled else "cpu"]
    assert_outputs(sess.run(None, {"x": X}), ort_run(m, {"x": X}))


@pytest.mark.parametrize("providers", [["tpu"], ["TensorrtExecutionProvider"], [42], []])
def test_unknown_provider(providers):
    with pytest.raises(ProviderError):
        InferenceSession(mlp("N"), providers=providers)


@pytest.mark.parametrize("providers", [[("cpu", {"bogus_option": 1})], [("cpu", {"mem_limit": -5})],
                                       [("cpu", {"mem_limit": "lots"})], [("cpu", "not a dict")],
                                       [("cpu", {}, "extra")], ["cpu:1"], ["cpu", "cpu"]])
def test_bad_provider_options(providers):
    with pytest.raises(ProviderError) as ei:
        InferenceSession(mlp("N"), providers=providers)
    assert isinstance(ei.value, HeteroExecError)


def test_unknown_session_option():
    with pytest.raises(ProviderError):
        InferenceSession(mlp("N"), not_an_option=True)


# --- sequence outputs -----------------------------------------------------------------------------


def test_sequence_outputs_come_back_as_lists_from_run():
    m = _seq_model()
    sess = InferenceSession(m)
    x = np.arange(6, dtype=np.float32).reshape(3, 2) - 2
    want = ort_run(m, {"x": x})
    got = sess.run(None, {"x": x})
    assert isinstance(got[0], list) and len(got[0]) == 3
    assert_outputs(got, want)
    assert_outputs(sess.run(["seq"], {"x": x}), [want[0]])
    assert_outputs(sess.run_outputs(None, {"x": x}), want)  # the alias
    assert_outputs(sess.run(["y"], {"x": x}), [want[1]])


def test_io_binding_of_a_sequence_output_names_run():
    m = _seq_model()
    sess = InferenceSession(m)
    x = np.arange(6, dtype=np.float32).reshape(3, 2) - 2
    b = sess.io_binding()
    b.bind_cpu_input("x", x)
    b.bind_output("seq")
    with pytest.raises(SequenceOutputError) as ei:
        sess.run_with_iobinding(b)
    e = ei.value
    assert e.name == "seq" and e.call == "run_with_iobinding" and e.use == "run"
    assert "'seq'" in str(e) and "session.run(" in str(e)
    b.clear_binding_outputs()
    b.bind_output("y")
    sess.run_with_iobinding(b)  # tensor outputs bind fine, and the session keeps working
    assert_outputs(b.copy_outputs_to_cpu(), ort_run(m, {"x": x}, ["y"]))


# --- run_async, context manager ----------------------------------------------------------------------


def test_run_async_returns_a_future():
    m = mlp("N")
    sess = InferenceSession(m)
    futures = [sess.run_async(None, {"x": X[: i + 1]}) for i in range(2)]
    for i, fut in enumerate(futures):
        assert isinstance(fut, concurrent.futures.Future)
        assert_outputs(fut.result(timeout=30), ort_run(m, {"x": X[: i + 1]}))
    bad = sess.run_async(None, {"x": X.astype(np.float64)})
    assert isinstance(bad.exception(timeout=30), DtypeMismatchError)
    assert_outputs(sess.run(None, {"x": X}), ort_run(m, {"x": X}))


def test_context_manager():
    m = mlp("N")
    with InferenceSession(m) as sess:
        assert isinstance(sess, InferenceSession)
        assert_outputs(sess.run(None, {"x": X}), ort_run(m, {"x": X}))
        assert_outputs(sess.run_async(None, {"x": X}).result(timeout=30), ort_run(m, {"x": X}))
    assert sess._closed
    sess.close()  # closing twice is harmless


# --- the error hierarchy ---------------------------------------------------------------------------


def test_every_error_subclasses_hetero_exec_error():
    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass)
               if issubclass(c, BaseException) and c.__module__ == errors.__name__]
    assert len(classes) >= 20
    for cls in classes:
        assert issubclass(cls, HeteroExecError), cls
