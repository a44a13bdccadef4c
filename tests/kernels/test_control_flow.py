"""Control-flow and sequence edge cases beyond the node suite, checked against
onnxruntime (and onnx's ReferenceEvaluator where it is right)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper as h

from hetero_exec import InferenceSession
from hetero_exec.errors import SequenceOutputError

F = T.FLOAT


def _model(nodes, inputs, outputs, inits=(), opset=17):
    g = h.make_graph(nodes, "g", inputs, outputs, list(inits))
    return h.make_model(g, opset_imports=[h.make_opsetid("", opset)])


def _ort(m, feed):
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)


def _loop_body(scan=True):
    """carried: acc += x * w (w captured from the outer graph); scan output: acc."""
    nodes = [h.make_node("Mul", ["x", "w"], ["xw"]),
             h.make_node("Add", ["acc_in", "xw"], ["acc_out"]),
             h.make_node("Identity", ["cond_in"], ["cond_out"])]
    outs = [h.make_tensor_value_info("cond_out", T.BOOL, []),
            h.make_tensor_value_info("acc_out", F, [2])]
    if scan:
        nodes.append(h.make_node("Identity", ["acc_out"], ["scan_out"]))
        outs.append(h.make_tensor_value_info("scan_out", F, [2]))
    return h.make_graph(nodes, "body",
                        [h.make_tensor_value_info("i", T.INT64, []),
                         h.make_tensor_value_info("cond_in", T.BOOL, []),
                         h.make_tensor_value_info("acc_in", F, [2])], outs)


def _loop_model():
    return _model(
        [h.make_node("Mul", ["x0", "two"], ["w"]),
         h.make_node("Loop", ["M", "cond", "acc0"], ["acc", "scans"], body=_loop_body())],
        [h.make_tensor_value_info("M", T.INT64, []), h.make_tensor_value_info("cond", T.BOOL, []),
         h.make_tensor_value_info("acc0", F, [2]), h.make_tensor_value_info("x0", F, [2]),
         h.make_tensor_value_info("x", F, [2])],
        [h.make_tensor_value_info("acc", F, [2]), h.make_tensor_value_info("scans", F, [None, 2])],
        [onnx.numpy_helper.from_array(np.array(2.0, np.float32), "two")])


@pytest.mark.parametrize("trips", [0, 1, 5])
def test_loop_with_outer_captures_and_scan_outputs(trips):
    m = _loop_model()
    feed = {"M": np.array(trips, np.int64), "cond": np.array(True), "acc0": np.zeros(2, np.float32),
            "x0": np.array([1.0, 2.0], np.float32), "x": np.array([0.5, -1.0], np.float32)}
    ours = InferenceSession(m).run(None, feed)
    theirs = _ort(m, feed)
    np.testing.assert_allclose(ours[0], theirs[0])
    assert ours[1].shape[0] == trips
    if trips:
        np.testing.assert_allclose(ours[1], theirs[1])


def test_loop_zero_trip_scan_output_is_empty_with_declared_dtype():
    m = _loop_model()
    feed = {"M": np.array(3, np.int64), "cond": np.array(False), "acc0": np.ones(2, np.float32),
            "x0": np.ones(2, np.float32), "x": np.ones(2, np.float32)}
    acc, scans = InferenceSession(m).run(None, feed)
    np.testing.assert_array_equal(acc, np.ones(2, np.float32))
    assert scans.shape[0] == 0 and scans.dtype == np.float32


def test_nested_if_in_loop_reads_top_level_value():
    then_b = h.make_graph([h.make_node("Add", ["acc_in", "w"], ["r"])], "then", [],
                          [h.make_tensor_value_info("r", F, [2])])
    else_b = h.make_graph([h.make_node("Sub", ["acc_in", "w"], ["r2"])], "else", [],
                          [h.make_tensor_value_info("r2", F, [2])])
    body = h.make_graph(
        [h.make_node("Less", ["i", "three"], ["small"]),
         h.make_node("If", ["small"], ["acc_out"], then_branch=then_b, else_branch=else_b),
         h.make_node("Identity", ["cond_in"], ["cond_out"])],
        "body",
        [h.make_tensor_value_info("i", T.INT64, []), h.make_tensor_value_info("cond_in", T.BOOL, []),
         h.make_tensor_value_info("acc_in", F, [2])],
        [h.make_tensor_value_info("cond_out", T.BOOL, []), h.make_tensor_value_info("acc_out", F, [2])])
    m = _model([h.make_node("Loop", ["M", "", "acc0"], ["acc"], body=body)],
               [h.make_tensor_value_info("M", T.INT64, []), h.make_tensor_value_info("acc0", F, [2]),
                h.make_tensor_value_info("w", F, [2])],
               [h.make_tensor_value_info("acc", F, [2])],
               [onnx.numpy_helper.from_array(np.array(3, np.int64), "three")])
    feed = {"M": np.array(5, np.int64), "acc0": np.zeros(2, np.float32), "w": np.array([1.0, 10.0], np.float32)}
    np.testing.assert_allclose(InferenceSession(m).run(None, feed)[0], _ort(m, feed)[0])


@pytest.mark.parametrize("in_dir,out_dir,out_axis", [(0, 0, 0), (1, 0, 0), (0, 1, 1), (1, 1, 1)])
def test_scan_directions_and_axes(in_dir, out_dir, out_axis):
    body = h.make_graph(
        [h.make_node("Add", ["s_in", "x_t"], ["s_out"]), h.make_node("Identity", ["s_out"], ["y_t"])],
        "body", [h.make_tensor_value_info("s_in", F, [3]), h.make_tensor_value_info("x_t", F, [3])],
        [h.make_tensor_value_info("s_out", F, [3]), h.make_tensor_value_info("y_t", F, [3])])
    m = _model([h.make_node("Scan", ["s0", "xs"], ["s", "ys"], body=body, num_scan_inputs=1,
                            scan_input_directions=[in_dir], scan_output_directions=[out_dir],
                            scan_output_axes=[out_axis])],
               [h.make_tensor_value_info("s0", F, [3]), h.make_tensor_value_info("xs", F, [4, 3])],
               [h.make_tensor_value_info("s", F, [3]), h.make_tensor_value_info("ys", F, [None, None])])
    feed = {"s0": np.zeros(3, np.float32), "xs": np.arange(12, dtype=np.float32).reshape(4, 3)}
    for a, b in zip(InferenceSession(m).run(None, feed), _ort(m, feed)):
        np.testing.assert_allclose(a, b)


def _sequence_model():
    return _model(
        [h.make_node("SplitToSequence", ["x"], ["seq"], axis=0, keepdims=0),
         h.make_node("SequenceLength", ["seq"], ["n"])],
        [h.make_tensor_value_info("x", F, [3, 2])],
        [h.make_tensor_value_info("n", T.INT64, []),
         h.make_value_info("seq", h.make_sequence_type_proto(h.make_tensor_type_proto(F, None)))])


def test_run_returns_a_sequence_output_as_a_list():
    m = _sequence_model()
    sess = InferenceSession(m)
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    n, seq = sess.run(None, {"x": x})  # as onnxruntime: sequences come back as lists
    assert int(n) == 3 and isinstance(seq, list) and len(seq) == 3
    for a, b in zip(seq, x):
        np.testing.assert_array_equal(a, b)
    # a run bound to device buffers is tensor-only: it names the call that returns sequences
    binding = sess.io_binding()
    binding.bind_cpu_input("x", x)
    binding.bind_output("seq")
    with pytest.raises(SequenceOutputError, match=r"session\.run\("):
        sess.run_with_iobinding(binding)
    assert int(sess.run(["n"], {"x": x})[0]) == 3  # the session keeps working


def test_sequence_map_with_outer_tensor():
    body = h.make_graph([h.make_node("Add", ["e", "b"], ["o"])], "body",
                        [h.make_tensor_value_info("e", F, [2]), h.make_tensor_value_info("b", F, [2])],
                        [h.make_tensor_value_info("o", F, [2])])
    m = _model(
        [h.make_node("SplitToSequence", ["x"], ["seq"], axis=0, keepdims=0),
         h.make_node("SequenceMap", ["seq", "b"], ["mapped"], body=body),
         h.make_node("ConcatFromSequence", ["mapped"], ["y"], axis=0, new_axis=1)],
        [h.make_tensor_value_info("x", F, [3, 2]), h.make_tensor_value_info("b", F, [2])],
        [h.make_tensor_value_info("y", F, [3, 2])])
    feed = {"x": np.arange(6, dtype=np.float32).reshape(3, 2), "b": np.array([10, 20], np.float32)}
    np.testing.assert_allclose(InferenceSession(m).run(None, feed)[0], _ort(m, feed)[0])


def test_optional_has_element_for_empty_and_full():
    m = _model([h.make_node("OptionalHasElement", ["x"], ["has"])],
               [h.make_value_info("x", h.make_optional_type_proto(h.make_tensor_type_proto(F, [2])))],
               [h.make_tensor_value_info("has", T.BOOL, [])], opset=18)
    sess = InferenceSession(m)
    assert bool(sess.run(None, {"x": np.ones(2, np.float32)})[0])
    assert not bool(sess.run(None, {"x": None})[0])


@pytest.mark.parametrize("src,dst,values", [
    (np.float32, "bfloat16", [1.0, 1.00390625, 3.3e38, -0.0]),
    (np.float32, "float8_e4m3fn", [0.1, 448.0, 1000.0, -1000.0]),
    (np.float32, "float8_e5m2", [0.1, 57344.0, 1e6, -3.0]),
    (np.float32, "int4", [-8.0, 7.0, 3.0, -1.0]),
])
def test_cast_to_ml_dtypes_matches_reference(src, dst, values):
    from onnx.reference import ReferenceEvaluator

    to = {"bfloat16": T.BFLOAT16, "float8_e4m3fn": T.FLOAT8E4M3FN, "float8_e5m2": T.FLOAT8E5M2,
          "int4": T.INT4}[dst]
    m = _model([h.make_node("Cast", ["x"], ["y"], to=to)], [h.make_tensor_value_info("x", F, [4])],
               [h.make_tensor_value_info("y", to, [4])], opset=21)
    x = np.array(values, src)
    ours = InferenceSession(m).run(None, {"x": x})[0]
    ref = ReferenceEvaluator(m).run(None, {"x": x})[0]
    assert ours.dtype == ref.dtype
    np.testing.assert_array_equal(ours.astype(np.float32), ref.astype(np.float32))
