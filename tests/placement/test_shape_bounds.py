"""Admission's shapes in the input symbols (placement/shape_bounds.py): the dims onnx
leaves unnamed (a Range's length, a Reshape or ConstantOfShape of a computed shape) are
sized from ``dim_bounds``, so a provider ``mem_limit`` admits the decoders exporters write
(issue 23), and still refuses what does not fit."""

from __future__ import annotations

import glob
import os

import numpy as np
import onnx
import onnx.helper as h
import pytest
from onnx import TensorProto as T
from onnx import numpy_helper

import hetero_exec as hx
from hetero_exec.errors import MemoryAdmissionError, UnboundedSymbolError
from hetero_exec.ir import load
from hetero_exec.placement.dims import bound_dim
from hetero_exec.placement.shape_bounds import ShapeBounds
from hetero_exec.placement.symbolic import Poly, Span, arith, parse_dim, span, upper

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DECODERS = sorted(glob.glob(os.path.join(HERE, "genai", "models", "*.onnx")))
FOLDER = os.path.join(HERE, "genai", "models", "llama_genai", "model.onnx")
EXPORTS = sorted(glob.glob(os.path.join(HERE, "exports", "models", "*.onnx")))
#: one run's sizes, consistent across the exporters' symbols (total = past + sequence)
SIZES = {"batch": 2, "batch_size": 2, "sequence_length": 3, "past_sequence_length": 5,
         "total_length": 8, "total_sequence_length": 8, "encoder_sequence_length": 6,
         "decoder_sequence_length": 4, "kv_cache_dim": 16}  # the builder folder: head size


def test_polynomials_divide_out_and_ranges_bound_the_rest():
    b, s = Poly.symbol("batch"), Poly.symbol("seq")
    assert (b * s * 64).exact_div(b * 4) == s * 16
    assert ((b + s) * 3).exact_div(b + s) == Poly.const(3)
    assert (b + 1).exact_div(b) is None
    bounds = {"batch": 4, "seq": 10}
    assert upper(arith("-", s, b, bounds), bounds) == 10  # symbols count from 0
    assert arith("max", s, b, bounds) == Span(0, 10)
    assert arith("//", s, Poly.const(3), bounds) == Span(0, 3)
    assert upper(parse_dim("past + seq", {"past": 90, "seq": 10}), {"past": 90, "seq": 10}) == 100
    assert str(parse_dim("2*batch*seq - 1", bounds)) == "2*batch*seq - 1"
    missing = arith("+", s, Poly.symbol("past"), bounds)  # exact: a polynomial still
    assert upper(missing, bounds) is None and span(missing, bounds).missing == "past"


def _shape_subgraph_model() -> onnx.ModelProto:
    """x [batch, seq, 64] -> positions Range(0, seq), heads Reshape(x, [batch, seq, 4, -1])
    and ones ConstantOfShape([batch, seq]): onnx names none of their computed dims."""
    consts = {"zero": np.array(0, np.int64), "one": np.array(1, np.int64),
              "first": np.array([0], np.int64), "second": np.array([2], np.int64),
              "tail": np.array([4, -1], np.int64), "idx": np.array(1, np.int64)}
    nodes = [h.make_node("Shape", ["x"], ["s"]),
             h.make_node("Gather", ["s", "idx"], ["n"], axis=0),
             h.make_node("Range", ["zero", "n", "one"], ["pos"]),
             h.make_node("Slice", ["s", "first", "second"], ["bs"]),
             h.make_node("Concat", ["bs", "tail"], ["target"], axis=0),
             h.make_node("Reshape", ["x", "target"], ["heads"]),
             h.make_node("ConstantOfShape", ["bs"], ["ones"],
                         value=numpy_helper.from_array(np.array([1.0], np.float32)))]
    g = h.make_graph(nodes, "shape_subgraph", [h.make_tensor_value_info("x", T.FLOAT, ["batch", "seq", 64])],
                     [h.make_tensor_value_info("pos", T.INT64, [None]),
                      h.make_tensor_value_info("heads", T.FLOAT, [None] * 4),
                      h.make_tensor_value_info("ones", T.FLOAT, [None] * 2)],
                     [numpy_helper.from_array(a, n) for n, a in consts.items()])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])


def test_computed_dims_in_the_input_symbols():
    _, graph = load(_shape_subgraph_model())
    sb = ShapeBounds(graph, {"batch": 8, "seq": 100})
    assert [str(d) for d in sb.shape("pos")] == ["seq"]
    assert [str(d) for d in sb.shape("heads")] == ["batch", "seq", "4", "16"]  # -1 divided out
    assert [str(d) for d in sb.shape("ones")] == ["batch", "seq"]
    assert sb.ceiling("heads") == (8, 100, 4, 16)
    with pytest.raises(UnboundedSymbolError, match="'seq'"):
        ShapeBounds(graph, {"batch": 8}).ceiling("pos")


def test_admission_counts_the_computed_shapes_as_by_hand():
    m = _shape_subgraph_model()
    bounds = {"batch": 8, "seq": 100}
    B, S = 8, 100
    x = heads = B * S * 64 * 4
    pos, bs, target = S * 8, 2 * 8, 4 * 8
    # the peak is at the Reshape: x, pos (an output), bs (ConstantOfShape reads it later)
    # and target live, heads written; Shape's and Gather's outputs are freed by then
    peak = x + pos + bs + target + heads
    weights = 3 * 8 + 2 * 8 + 2 * 8  # int64 zero, one, idx; first, second; tail
    need = weights + peak
    sess = hx.InferenceSession(m, providers=[("cpu", {"mem_limit": need})], dim_bounds=bounds)
    assert sess.placement.segments[0].mem_need == need
    feed = np.random.default_rng(0).standard_normal((3, 5, 64)).astype(np.float32)
    got = sess.run(None, {"x": feed})
    np.testing.assert_array_equal(got[0], np.arange(5))
    np.testing.assert_array_equal(got[1], feed.reshape(3, 5, 4, 16))
    with pytest.raises(MemoryAdmissionError) as e:
        hx.InferenceSession(m, providers=[("cpu", {"mem_limit": need - 1})], dim_bounds=bounds)
    assert (e.value.needed, e.value.free) == (need, need - 1)
    assert f"{need} bytes" in str(e.value) and f"{need - 1} bytes are free" in str(e.value)
    assert e.value.segment in str(e.value)


def _sizes(path: str) -> dict[str, int]:
    """SIZES, at batch 1 for the builder folder (its GroupQueryAttention takes a prompt
    after a past at batch 1 only)."""
    return {**SIZES, "batch_size": 1} if path == FOLDER else SIZES


def _feeds(path: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    feeds = {}
    sizes = _sizes(path)
    past = sizes["past_sequence_length"]
    for i in onnx.load(path, load_external_data=False).graph.input:
        shape = [d.dim_value if d.HasField("dim_value") else bound_dim(d.dim_param, sizes)
                 for d in i.type.tensor_type.shape.dim]
        if i.type.tensor_type.elem_type != T.INT64:
            feeds[i.name] = rng.standard_normal(shape).astype(np.float32)
        elif "mask" in i.name:
            feeds[i.name] = np.ones(shape, np.int64)
        elif "position" in i.name:
            feeds[i.name] = np.broadcast_to(np.arange(past, past + shape[-1]), shape).copy()
        else:
            feeds[i.name] = rng.integers(3, 100, shape)
    return feeds


def _every_value(path: str) -> tuple[onnx.ModelProto, list[str]]:
    m = onnx.load(path)
    names = [o for n in m.graph.node for o in n.output if o]
    declared = {o.name for o in m.graph.output}
    m.graph.output.extend(onnx.ValueInfoProto(name=n) for n in names if n not in declared)
    return m, names


@pytest.mark.parametrize("path", DECODERS + [FOLDER] + EXPORTS,
                         ids=lambda p: os.path.relpath(p, HERE))
def test_ceilings_are_every_values_shape_at_the_bounds(path):
    """Run at the bounds themselves, every value of the model (onnxruntime's, all
    outputs) has exactly its ceiling's shape: nothing under-counted, nothing more."""
    ort = pytest.importorskip("onnxruntime")
    _, graph = load(path)
    sb = ShapeBounds(graph, _sizes(path))
    m, names = _every_value(path)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, _feeds(path))))
    wrong = [(n, sb.ceiling(n), np.shape(got[n])) for n in names
             if graph.value(n).kind == "tensor" and sb.ceiling(n) != np.shape(got[n])]
    assert not wrong, wrong[:5]


@pytest.mark.parametrize("path", DECODERS + [FOLDER], ids=lambda p: os.path.relpath(p, HERE))
def test_decoders_admitted_under_a_mem_limit_and_refused_under_less(path):
    """Mixed placement on strict sim-gpu, both providers with a budget: the plan is
    admitted, runs, and matches onnxruntime; one byte less on the device is refused."""
    ort = pytest.importorskip("onnxruntime")
    graph = onnx.load(path, load_external_data=False).graph
    bounds = {d.dim_param: 64 for i in graph.input for d in i.type.tensor_type.shape.dim
              if d.dim_param and "+" not in d.dim_param}

    def session(device_budget: int):
        return hx.InferenceSession(path, providers=[
            ("sim-gpu", {"mem_limit": device_budget, "exclude_ops": ["Softmax"]}),
            ("cpu", {"mem_limit": 1 << 30})], hetero=True, dim_bounds=bounds)

    sess = session(1 << 30)
    needs = [s.mem_need for s in sess.placement.segments if s.provider.name == "sim-gpu:0"]
    assert needs and all(n > 0 for n in needs)
    feeds = _feeds(path)
    want = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feeds)
    for g, w in zip(sess.run(None, feeds), want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
    with pytest.raises(MemoryAdmissionError, match="sim-gpu:0 needs"):
        session(max(needs) - 1)
