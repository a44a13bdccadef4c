"""Loading (SEMANTICS.md section 1, steps 1-2): sources, external data, typed load
errors, cycle and control-flow checks, symbolic dims, producers/consumers, captures."""

from __future__ import annotations

import copy
import os

import numpy as np
import onnx
import pytest
from google.protobuf.message import DecodeError
from onnx import helper

from hetero_exec import InferenceSession
from hetero_exec.errors import ControlFlowError, GraphCycleError, HeteroExecError, ModelLoadError
from hetero_exec.ir.load import load
from tests._models import BOOL, I64, F, assert_outputs, graph, init, mlp, model, ort_run, vi

X2 = np.array([[1.0, -2.0, 3.0, 0.5], [-1.0, 0.25, -0.75, 2.0]], np.float32)


def _relu_model() -> onnx.ModelProto:
    return model([helper.make_node("Relu", ["x"], ["y"], name="r")], [vi("x", F, [2])], [vi("y", F, [2])])


def _check_load_error(exc: BaseException) -> None:
    assert isinstance(exc, ModelLoadError)
    assert isinstance(exc, HeteroExecError)
    assert not isinstance(exc, DecodeError)
    assert not isinstance(exc, onnx.checker.ValidationError)


# --- sources -------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["path", "pathlike", "bytes", "bytearray", "proto"])
def test_load_sources(tmp_path, kind):
    m = mlp(2)
    path = tmp_path / "m.onnx"
    onnx.save_model(m, str(path))
    source = {"path": str(path), "pathlike": path, "bytes": m.SerializeToString(),
              "bytearray": bytearray(m.SerializeToString()), "proto": m}[kind]
    proto, g = load(source)
    assert isinstance(proto, onnx.ModelProto)
    assert [n.op_type for n in g.nodes] == ["MatMul", "Add", "Relu", "Softmax"]
    assert g.inputs == ["x"] and g.outputs == ["y"]
    np.testing.assert_array_equal(g.initializers["W"], onnx.numpy_helper.to_array(m.graph.initializer[0]))
    sess = InferenceSession(source)
    assert_outputs(sess.run(None, {"x": X2}), ort_run(m, {"x": X2}))


def test_load_does_not_modify_the_callers_proto():
    m = mlp(2)
    before = m.SerializeToString()
    load(m)
    assert m.SerializeToString() == before


def _save_external(m: onnx.ModelProto, folder) -> str:
    path = os.path.join(folder, "model.onnx")
    m = copy.deepcopy(m)  # save_model moves the caller's tensors out in place
    onnx.save_model(m, path, save_as_external_data=True, all_tensors_to_one_file=True,
                    location="weights.bin", size_threshold=0)
    # the weights really are outside the model file
    assert os.path.exists(os.path.join(folder, "weights.bin"))
    raw = onnx.load(path, load_external_data=False)
    assert all(t.data_location == onnx.TensorProto.EXTERNAL for t in raw.graph.initializer)
    return path


def test_external_data_from_path(tmp_path):
    m = mlp(2)
    path = _save_external(m, tmp_path)
    _, g = load(path)
    for t in m.graph.initializer:
        np.testing.assert_array_equal(g.initializers[t.name], onnx.numpy_helper.to_array(t))
    sess = InferenceSession(path)
    assert_outputs(sess.run(None, {"x": X2}), ort_run(m, {"x": X2}))


def test_external_data_from_bytes_and_base_dir(tmp_path, monkeypatch):
    m = mlp(2)
    path = _save_external(m, tmp_path)
    data = open(path, "rb").read()
    monkeypatch.chdir(tmp_path.parent)  # the base_dir, not the cwd, locates the data
    _, g = load(data, base_dir=str(tmp_path))
    for t in m.graph.initializer:
        np.testing.assert_array_equal(g.initializers[t.name], onnx.numpy_helper.to_array(t))
    sess = InferenceSession(data, base_dir=str(tmp_path))
    assert_outputs(sess.run(None, {"x": X2}), ort_run(m, {"x": X2}))


def test_external_data_missing_is_a_load_error(tmp_path, monkeypatch):
    path = _save_external(mlp(2), tmp_path)
    data = open(path, "rb").read()
    monkeypatch.chdir(tmp_path.parent)
    # bytes referencing external data, without base_dir or with the wrong one
    for kwargs in ({}, {"base_dir": str(tmp_path.parent)}):
        with pytest.raises(ModelLoadError) as ei:
            load(data, **kwargs)
        _check_load_error(ei.value)
        assert "weights.bin" in str(ei.value) or "external" in str(ei.value)
    # the weights file is gone
    os.remove(tmp_path / "weights.bin")
    with pytest.raises(ModelLoadError) as ei:
        load(path)
    _check_load_error(ei.value)


# --- typed load errors -----------------------------------------------------------


def test_truncated_file(tmp_path):
    data = mlp(2).SerializeToString()
    path = tmp_path / "trunc.onnx"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError) as ei:
        load(str(path))
    _check_load_error(ei.value)
    assert "trunc.onnx" in str(ei.value)
    with pytest.raises(ModelLoadError):
        InferenceSession(str(path))


def test_truncation_anywhere_is_a_load_error_or_a_valid_model():
    data = mlp(2).SerializeToString()
    for cut in range(1, len(data), max(1, len(data) // 40)):
        try:
            load(data[:cut])
        except Exception as e:  # noqa: BLE001 - the point is which type escapes
            _check_load_error(e)


@pytest.mark.parametrize("blob", [b"\xff\xfe\xfd not a model" * 4, b"\x0a\xff\xff\xff\xff\x0f", b"\x00" * 7])
def test_corrupt_bytes(blob):
    with pytest.raises(ModelLoadError) as ei:
        load(blob)
    _check_load_error(ei.value)
    assert ei.value.__cause__ is None or not isinstance(ei.value.__cause__, DecodeError)


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.onnx"
    with pytest.raises(ModelLoadError) as ei:
        load(str(missing))
    _check_load_error(ei.value)
    assert "nope.onnx" in str(ei.value)
    with pytest.raises(ModelLoadError):
        InferenceSession(str(missing))


def test_invalid_model_is_a_load_error():
    m = model([helper.make_node("Relu", ["x"], ["y"])], [vi("x", F, [2])], [vi("y", F, [2])])
    m.graph.node[0].input[0] = "undefined_value"
    with pytest.raises(ModelLoadError) as ei:
        load(m)
    _check_load_error(ei.value)


# --- cycles ------------------------------------------------------------------------


def _ident(i: int, name: str = "") -> str:
    return f'graph/node#{i} "{name}"' if name else f"graph/node#{i}"


def test_cycle_names_exactly_its_nodes():
    # file order: a downstream node first, then an upstream one, the 2-node cycle, others
    nodes = [
        helper.make_node("Relu", ["c"], ["y"], name="after"),       # 0 reads the cycle
        helper.make_node("Abs", ["x"], ["a"], name="before"),       # 1 feeds the cycle
        helper.make_node("Add", ["a", "c"], ["b"], name="loop_a"),  # 2 cycle
        helper.make_node("Neg", ["b"], ["c"], name="loop_b"),       # 3 cycle
        helper.make_node("Sigmoid", ["x"], ["z"], name="aside"),    # 4 unrelated
    ]
    m = model(nodes, [vi("x", F, [2])], [vi("y", F, [2]), vi("z", F, [2])])
    with pytest.raises(GraphCycleError) as ei:
        load(m)
    e = ei.value
    assert isinstance(e, ModelLoadError)
    assert sorted(e.nodes) == sorted([_ident(2, "loop_a"), _ident(3, "loop_b")])
    msg = str(e)
    for name in ("loop_a", "loop_b"):
        assert name in msg
    for name in ("after", "before", "aside"):
        assert name not in msg


def test_three_node_cycle_unnamed_nodes():
    nodes = [
        helper.make_node("Relu", ["x"], ["p"]),            # 0
        helper.make_node("Add", ["p", "r"], ["q"]),        # 1 cycle
        helper.make_node("Relu", ["q"], ["s"]),            # 2 cycle
        helper.make_node("Neg", ["s"], ["r"]),             # 3 cycle
        helper.make_node("Relu", ["s"], ["y"]),            # 4
    ]
    m = model(nodes, [vi("x", F, [2])], [vi("y", F, [2])])
    with pytest.raises(GraphCycleError) as ei:
        load(m)
    assert sorted(ei.value.nodes) == [_ident(1), _ident(2), _ident(3)]
    assert "graph/node#0" not in str(ei.value) and "graph/node#4" not in str(ei.value)


def test_self_loop():
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="first"),
             helper.make_node("Add", ["a", "b"], ["b"], name="selfie"),
             helper.make_node("Relu", ["b"], ["y"], name="last")]
    m = model(nodes, [vi("x", F, [2])], [vi("y", F, [2])])
    with pytest.raises(GraphCycleError) as ei:
        load(m)
    assert ei.value.nodes == [_ident(1, "selfie")]


def test_cycle_through_a_branch_capture():
    # the If's then_branch reads "d", which is computed from the If's own output
    then_b = graph([helper.make_node("Identity", ["d"], ["t"])], [], [vi("t", F, [2])], "then")
    else_b = graph([helper.make_node("Identity", ["x"], ["e"])], [], [vi("e", F, [2])], "else")
    nodes = [helper.make_node("If", ["cond"], ["o"], name="branchy", then_branch=then_b, else_branch=else_b),
             helper.make_node("Neg", ["o"], ["d"], name="feedback"),
             helper.make_node("Relu", ["o"], ["y"], name="out")]
    m = model(nodes, [vi("cond", BOOL, []), vi("x", F, [2])], [vi("y", F, [2])])
    with pytest.raises(GraphCycleError) as ei:
        load(m)
    assert sorted(ei.value.nodes) == [_ident(0, "branchy"), _ident(1, "feedback")]


def test_unsorted_acyclic_graph_loads_and_runs():
    nodes = [helper.make_node("Mul", ["b", "x"], ["y"], name="last"),
             helper.make_node("Neg", ["a"], ["b"], name="middle"),
             helper.make_node("Abs", ["x"], ["a"], name="first")]
    m = model(nodes, [vi("x", F, [2, 4])], [vi("y", F, [2, 4])])
    _, g = load(m)
    seen = {"x"}
    for node in g.nodes:  # the loaded graph is in a valid order
        assert all(i in seen for i in node.inputs if i)
        seen.update(node.outputs)
    assert [n.name for n in g.nodes] == ["first", "middle", "last"]
    sess = InferenceSession(m)
    assert_outputs(sess.run(None, {"x": X2}), ort_run(m, {"x": X2}))


# --- control-flow signatures -----------------------------------------------------------


def _bad_if(name: str = "bad_if", cond: str = "cond") -> onnx.NodeProto:
    then_b = graph([helper.make_node("Identity", ["x"], ["t1"]), helper.make_node("Neg", ["x"], ["t2"])],
                   [], [vi("t1", F, [2]), vi("t2", F, [2])], "then")
    else_b = graph([helper.make_node("Abs", ["x"], ["e1"])], [], [vi("e1", F, [2])], "else")
    return helper.make_node("If", [cond], [f"{name}_o1", f"{name}_o2"], name=name,
                            then_branch=then_b, else_branch=else_b)


EXPECTED_REASON = "branches declare different output counts: then_branch has 2, else_branch has 1"


def test_if_branch_output_counts_differ():
    m = model([helper.make_node("Relu", ["x"], ["r"], name="pre"), _bad_if(),
               helper.make_node("Add", ["bad_if_o1", "bad_if_o2"], ["y"])],
              [vi("cond", BOOL, []), vi("x", F, [2])], [vi("y", F, [2])])
    with pytest.raises(ControlFlowError) as ei:
        load(m)
    e = ei.value
    assert isinstance(e, ModelLoadError)
    assert e.reason == EXPECTED_REASON
    assert str(e).endswith(EXPECTED_REASON)
    assert e.node == _ident(1, "bad_if") and e.op_type == "If"
    with pytest.raises(ControlFlowError):
        InferenceSession(m)


def test_if_branch_output_counts_differ_inside_a_loop_body():
    body = graph(
        [helper.make_node("Greater", ["v_in", "zero"], ["cond"]),
         _bad_if("inner_if"),
         helper.make_node("Add", ["inner_if_o1", "inner_if_o2"], ["v_out"]),
         helper.make_node("Identity", ["keep"], ["keep_out"])],
        [vi("i", I64, []), vi("keep", BOOL, []), vi("v_in", F, [2])],
        [vi("keep_out", BOOL, []), vi("v_out", F, [2])], "body")
    m = model([helper.make_node("Loop", ["n", "", "v0"], ["v"], name="the_loop", body=body)],
              [vi("n", I64, []), vi("v0", F, [2]), vi("x", F, [2]), vi("zero", F, [])],
              [vi("v", F, [2])])
    with pytest.raises(ControlFlowError) as ei:
        load(m)
    e = ei.value
    assert e.reason == EXPECTED_REASON
    assert str(e).endswith(EXPECTED_REASON)
    assert e.node == 'graph/node#0/body/node#1 "inner_if"'


def test_control_flow_is_checked_before_cycles():
    nodes = [_bad_if(), helper.make_node("Add", ["bad_if_o1", "c"], ["b"], name="loop_a"),
             helper.make_node("Neg", ["b"], ["c"], name="loop_b")]
    m = model(nodes, [vi("cond", BOOL, []), vi("x", F, [2])], [vi("b", F, [2])])
    with pytest.raises(ControlFlowError):
        load(m)


# --- values, producers, consumers ----------------------------------------------------


def test_symbolic_dims_are_kept():
    m = model([helper.make_node("MatMul", ["x", "w"], ["mm"]),
               helper.make_node("Relu", ["mm"], ["y"])],
              [vi("x", F, ["batch", "seq", 4]), vi("w", F, [4, "hidden"])],
              [vi("y", F, ["batch", "seq", "hidden"])])
    _, g = load(m)
    assert g.value("x").shape == ("batch", "seq", 4)
    assert g.value("w").shape == (4, "hidden")
    assert g.value("y").shape == ("batch", "seq", "hidden")
    # shape inference carries the symbols through the intermediate
    assert g.value("mm").shape == ("batch", "seq", "hidden")
    assert not g.value("x").static and g.value("x").dtype == np.float32


def test_unknown_dims_are_none():
    m = model([helper.make_node("Relu", ["x"], ["y"])], [vi("x", F, [None, 3])], [vi("y", F, [None, 3])])
    _, g = load(m)
    assert g.value("x").shape == (None, 3)


def test_producers_and_consumers():
    nodes = [helper.make_node("Abs", ["x"], ["a"], name="p"),
             helper.make_node("Neg", ["a"], ["b"], name="c1"),
             helper.make_node("Mul", ["a", "b"], ["y"], name="c2")]
    m = model(nodes, [vi("x", F, [2])], [vi("y", F, [2])])
    _, g = load(m)
    assert g.producer["a"].name == "p"
    assert g.producer["y"].name == "c2"
    assert "x" not in g.producer
    assert [n.name for n in g.consumers["a"]] == ["c1", "c2"]
    assert [n.name for n in g.consumers["x"]] == ["p"]
    assert [n.name for n in g.consumers["b"]] == ["c2"]
    assert "y" not in g.consumers
    assert g.nodes[1].identity == 'graph/node#1 "c1"'


def _names(nodes) -> list[str]:
    """Consumer node names, each once, in order (a node reading a value twice, or an If
    whose two branches both capture it, is one consumer)."""
    return list(dict.fromkeys(n.name for n in nodes))


def _if_reading_outer(name: str, outer: str, inner_in: str) -> onnx.NodeProto:
    """If(cond): then = Add(inner_in, outer), else = Sub(inner_in, outer)."""
    then_b = graph([helper.make_node("Add", [inner_in, outer], [f"{name}_t"])], [], [vi(f"{name}_t", F, [2])], "then")
    else_b = graph([helper.make_node("Sub", [inner_in, outer], [f"{name}_e"])], [], [vi(f"{name}_e", F, [2])], "else")
    return helper.make_node("If", ["cond" if name == "top_if" else f"{name}_cond"], [f"{name}_o"],
                            name=name, then_branch=then_b, else_branch=else_b)


def test_if_branch_captures_an_outer_value():
    m = model([helper.make_node("Abs", ["x"], ["a"], name="abs"), _if_reading_outer("top_if", "a", "x"),
               helper.make_node("Relu", ["top_if_o"], ["y"], name="relu")],
              [vi("cond", BOOL, []), vi("x", F, [2])], [vi("y", F, [2])])
    _, g = load(m)
    if_node = g.nodes[1]
    assert if_node.op_type == "If"
    assert if_node.subgraphs["then_branch"].captures == ["x", "a"]
    assert if_node.subgraphs["else_branch"].captures == ["x", "a"]
    assert g.captures == []
    # the If consumes what its branches capture
    assert _names(g.consumers["a"]) == ["top_if"]
    assert _names(g.consumers["x"]) == ["abs", "top_if"]
    assert if_node.subgraphs["then_branch"].scope == "graph/node#1/then_branch"
    sess = InferenceSession(m)
    x = np.array([-1.5, 2.0], np.float32)
    for c in (True, False):
        feed = {"cond": np.array(c), "x": x}
        assert_outputs(sess.run(None, feed), ort_run(m, feed))


def _loop_with_nested_if() -> onnx.ModelProto:
    """Loop body: an If whose branches read the loop-carried value and top-level "w"."""
    inner_if = _if_reading_outer("inner_if", "w", "v_in")
    body = graph(
        [helper.make_node("Cast", ["i"], ["i_f"], to=F),
         helper.make_node("ReduceSum", ["v_in"], ["s"], keepdims=0),
         helper.make_node("Greater", ["s", "i_f"], ["inner_if_cond"]),
         inner_if,
         helper.make_node("Identity", ["keep"], ["keep_out"]),
         helper.make_node("Identity", ["inner_if_o"], ["v_out"])],
        [vi("i", I64, []), vi("keep", BOOL, []), vi("v_in", F, [2])],
        [vi("keep_out", BOOL, []), vi("v_out", F, [2])], "body")
    return model([helper.make_node("Loop", ["n", "", "x"], ["v"], name="the_loop", body=body),
                  helper.make_node("Mul", ["v", "w"], ["y"], name="scale")],
                 [vi("n", I64, []), vi("x", F, [2])], [vi("y", F, [2])],
                 [init("w", np.array([0.5, -1.25], np.float32))])


def test_nested_if_in_loop_body_capture_reaches_the_loop_body():
    m = _loop_with_nested_if()
    _, g = load(m)
    loop = g.nodes[0]
    body = loop.subgraphs["body"]
    inner_if = body.nodes[3]
    assert inner_if.op_type == "If"
    # the branches read the body's own value and the top-level initializer
    assert inner_if.subgraphs["then_branch"].captures == ["v_in", "w"]
    # the Loop body defines v_in itself: only "w" comes from outside it
    assert body.captures == ["w"]
    assert g.captures == []
    assert _names(g.consumers["w"]) == ["the_loop", "scale"]
    sess = InferenceSession(m)
    for n in (0, 1, 3):
        feed = {"n": np.array(n, np.int64), "x": np.array([1.0, 2.0], np.float32)}
        # (onnx's ReferenceEvaluator gets this Loop wrong: it returns x * w for every n)
        assert_outputs(sess.run(None, feed), ort_run(m, feed))


# --- weights held apart from onnx's checker and shape inference ------------------


def _weighted_model(w: onnx.TensorProto) -> onnx.ModelProto:
    """x (2, 64) @ w (64, 128), reshaped by a shape tensor: inference needs w's shape
    and the shape tensor's values, never w's values."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("Reshape", ["h", "shape"], ["y"], name="rs")]
    return model(nodes, [vi("x", F, [2, 64])], [vi("y", F, [4, 64])],
                 [w, init("shape", np.array([4, 64], np.int64))])


def test_a_large_weight_keeps_its_values_and_the_inferred_shapes():
    from hetero_exec.ir.load import DETACH_BYTES

    w = np.random.default_rng(0).standard_normal((64, 128)).astype(np.float32)
    assert w.nbytes >= DETACH_BYTES
    m = _weighted_model(init("w", w))
    loaded, g = load(m)
    assert [i.name for i in loaded.graph.input] == ["x"]
    assert {t.name for t in loaded.graph.initializer} == {"w", "shape"}
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
              for v in loaded.graph.value_info}
    assert shapes["h"] == [2, 128]
    np.testing.assert_array_equal(g.initializers["w"], w)
    x = np.random.default_rng(1).standard_normal((2, 64)).astype(np.float32)
    assert_outputs(InferenceSession(m).run(None, {"x": x}), ort_run(m, {"x": x}))


def test_a_large_weight_of_the_wrong_size_is_still_a_load_error():
    w = init("w", np.ones((64, 128), np.float32))
    w.raw_data = w.raw_data[:-4]  # one element short
    with pytest.raises(ModelLoadError, match="initializer 'w'") as ei:
        load(_weighted_model(w))
    _check_load_error(ei.value)
