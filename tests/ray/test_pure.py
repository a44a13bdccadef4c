"""The Ray layer's pieces that need no Ray cluster: wire format, stage cutting and
compiling, actor slots, options, error carriers. Fast; no ray.init."""

from __future__ import annotations

import pickle

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import helper

from actors.options import RayOptions
from actors.remote_errors import SegmentRunError, user_error
from actors.reservation import plan_slots, stage_shares
from actors.stage import compile_stage
from actors.stage_model import load_stage_graph, stage_spec
from actors.transport.wire import (
    WireFormatError,
    decode_tensor,
    decode_tensors,
    encode_tensor,
    encode_tensors,
)
from hetero_exec.errors import KernelError, ProviderError, UnsupportedOperatorError
from hetero_exec.exec.executor import execute
from hetero_exec.exec.plan import Compiler
from hetero_exec.placement.stages import plan_stages
from tests.ray.models import SKIP_PLACEMENT, hand_build, mlp, skip_model


def specs_of(graph, plan, cuts):
    plan.stages = plan_stages(plan, cuts)
    by_id = {s.id: s for s in plan.segments}
    return [stage_spec(graph, st, [by_id[i] for i in st.segments]) for st in plan.stages]


@pytest.mark.parametrize(
    "arr",
    [
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.array(3.5, dtype=np.float64),
        np.zeros((0, 5), np.int64),
        np.array([True, False]),
        np.arange(6, dtype=">i4").reshape(2, 3),  # big-endian in, little-endian on the wire
        np.arange(4, dtype=np.float32).astype(ml_dtypes.bfloat16),
        np.linspace(-2, 2, 5).astype(ml_dtypes.float8_e4m3fn),
        np.array([-3, 1, 7], dtype=ml_dtypes.int4),
        np.arange(8, dtype=np.float32).reshape(2, 4)[:, ::2],  # not contiguous
    ],
    ids=["f32", "scalar", "empty", "bool", "big-endian", "bf16", "f8", "int4", "strided"],
)
def test_wire_roundtrip(arr):
    back = decode_tensor(encode_tensor(arr))
    assert back.shape == arr.shape and back.dtype == arr.dtype.newbyteorder("=")
    np.testing.assert_array_equal(
        back.astype(np.float64) if back.dtype.kind == "V" else back,
        arr.astype(np.float64) if arr.dtype.kind == "V" else arr,
    )


def test_wire_strings_take_their_own_path():
    arr = np.array([["a", "héllo"], ["", "z"]], dtype=object)
    back = decode_tensor(encode_tensor(arr))
    assert back.dtype == object and back.tolist() == arr.tolist()
    frame = encode_tensors({"s": np.array(["x"]), "f": np.ones(2, np.float16)})
    assert sorted(decode_tensors(frame)) == ["f", "s"]


def test_wire_is_plain_msgpack_not_pickle():
    import msgpack

    frame = msgpack.unpackb(encode_tensor(np.ones(2, np.float32)), raw=False)
    assert (
        frame["dtype"] == "float32" and frame["shape"] == [2] and isinstance(frame["data"], bytes)
    )
    with pytest.raises(WireFormatError):
        decode_tensor(msgpack.packb({"v": 99, "dtype": "float32", "shape": [], "data": b""}))


def test_stage_spec_holds_only_its_weights_once_and_compiles_alike():
    graph, build = hand_build(mlp(layers=2), ["sim-gpu:0", "cpu", "sim-gpu:1", "cpu"])
    plan = build.placement
    specs = specs_of(graph, plan, [1, 2])  # stages: [0] [1] [2, 3]
    weights = [{i.name for i in onnx.load_from_string(s.model).graph.initializer} for s in specs]
    assert weights == [{"w0", "b0"}, set(), {"w1", "b1"}]
    assert [s.device for s in specs] == ["sim-gpu:0", "cpu", "sim-gpu:1"]
    assert [p.label for p in specs[2].segments] == ["segment#2 (sim-gpu:1)", "segment#3 (cpu)"]
    x = np.random.default_rng(0).standard_normal((3, 32)).astype(np.float32)
    env = {"x": x}
    for spec, stage in zip(specs, plan.stages):
        sub = load_stage_graph(spec)
        want = [n.identity for i in stage.segments for n in plan.segments[i].nodes]
        assert [n.identity for n in sub.nodes] == want
        chain, stats = compile_stage(spec)
        assert len(stats) == len(stage.segments)
        env.update(zip(spec.outputs, chain.run({n: env.get(n) for n in spec.inputs}, spec.outputs)))
    full = Compiler().compile_graph(graph)
    # (sim-gpu's products round once from float64, cpu's accumulate in float32)
    np.testing.assert_allclose(env["y"], execute(full, [x])[0], rtol=1e-5, atol=1e-6)


def test_a_stage_shares_a_weight_its_segments_both_read():
    from onnx import numpy_helper

    w = numpy_helper.from_array(np.eye(4, dtype=np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["a"]), helper.make_node("Relu", ["a"], ["b"]),
             helper.make_node("MatMul", ["b", "w"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", 1, [2, 4])],
                          [helper.make_tensor_value_info("y", 1, [2, 4])], [w])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    graph, build = hand_build(model, ["sim-gpu:0", "cpu", "sim-gpu:0"])
    (spec,) = specs_of(graph, build.placement, [])
    assert [i.name for i in onnx.load_from_string(spec.model).graph.initializer] == ["w"]
    assert spec.weight_bytes == 64
    chain, _ = compile_stage(spec)
    x = np.arange(8, dtype=np.float32).reshape(2, 4) - 4
    np.testing.assert_array_equal(chain.run({"x": x}, ["y"])[0], np.maximum(x, 0))


def test_segment_identity_survives_in_subgraph_scopes():
    then_g = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["t"], name="inner")],
        "then",
        [],
        [helper.make_tensor_value_info("t", 1, [2])],
    )
    else_g = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["e"])],
        "else",
        [],
        [helper.make_tensor_value_info("e", 1, [2])],
    )
    g = helper.make_graph(
        [
            helper.make_node("Relu", ["x"], ["r"]),
            helper.make_node(
                "If", ["c"], ["y"], then_branch=then_g, else_branch=else_g, name="branch"
            ),
        ],
        "g",
        [helper.make_tensor_value_info("x", 1, [2]), helper.make_tensor_value_info("c", 9, [])],
        [helper.make_tensor_value_info("y", 1, [2])],
    )
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    graph, build = hand_build(model, ["sim-gpu:0", "cpu"])
    sub = load_stage_graph(specs_of(graph, build.placement, [1])[1])
    assert sub.nodes[0].identity == 'graph/node#1 "branch"'
    inner = sub.nodes[0].subgraphs["then_branch"].nodes[0]
    assert inner.identity == graph.nodes[1].subgraphs["then_branch"].nodes[0].identity


def test_plan_slots_reserve_a_fraction_of_a_cpu_and_the_device_per_stage():
    graph, build = hand_build(skip_model(), SKIP_PLACEMENT)
    specs = specs_of(graph, build.placement, [])  # dev, dev, cpu, dev: one stage
    slots, bundles = plan_slots(specs, RayOptions())
    assert bundles == [{"CPU": 0.25, "GPU": 1.0}] and slots[0].num_gpus == 1.0
    graph, build = hand_build(mlp(layers=2), ["cpu", "sim-gpu:0", "cpu", "cpu/2"])
    specs = specs_of(graph, build.placement, [1, 3])
    slots, bundles = plan_slots(specs, RayOptions(stage_num_cpus=0.5))
    assert bundles == [{"CPU": 0.5}, {"CPU": 0.5, "GPU": 1.0}, {"CPU": 0.5}]
    for slot, node in zip(slots, ["a", "a", "b"]):
        slot.node = node
    stage_shares(slots)
    assert [s.share for s in slots] == [2, 2, 1] and all(s.threads is None for s in slots)


def test_options_are_checked():
    assert RayOptions.parse({}).max_inflight == 8
    with pytest.raises(ProviderError, match="unknown option"):
        RayOptions.parse({"max_inflite": 3})
    with pytest.raises(ProviderError, match="placement_strategy"):
        RayOptions.parse({"placement_strategy": "SCATTER"})
    with pytest.raises(ProviderError, match="seam_transport"):
        RayOptions.parse({"seam_transport": "pigeon"})
    with pytest.raises(ProviderError, match="'colocate' is gone: an actor runs a pipeline stage"):
        RayOptions.parse({"colocate": True})
    with pytest.raises(ProviderError, match="stage_num_cpus"):
        RayOptions.parse({"stage_num_cpus": 0})
    with pytest.raises(ProviderError, match="placement_group"):
        RayOptions.parse({"placement_group": "mine"})


def test_typed_errors_cross_pickling():
    err = UnsupportedOperatorError("graph/node#3", "ai.onnx", "Foo", 17, "cpu", "no kernel")
    back = pickle.loads(pickle.dumps(SegmentRunError("segment#1 (cpu)", err)))
    assert isinstance(back.error, UnsupportedOperatorError) and back.error.op_type == "Foo"
    assert str(back.error) == str(err)
    k = user_error(
        pickle.loads(
            pickle.dumps(
                SegmentRunError("s", KernelError("n", "ai.onnx::Div", "x", "segment#1 (cpu)"))
            )
        )
    )
    assert isinstance(k, KernelError) and k.segment == "segment#1 (cpu)"


def test_a_stage_compiles_a_seam_folded_from_constants_as_a_constant():
    """A weight transposed on cpu (folded there) and read by the device segment of the
    same stage is the device plan's constant, moved once at build, not per run."""
    from onnx import numpy_helper

    w = np.arange(24 * 16, dtype=np.float32).reshape(24, 16) / 100
    nodes = [helper.make_node("Transpose", ["w"], ["wt"]), helper.make_node("MatMul", ["x", "wt"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", 1, [3, 16])],
                          [helper.make_tensor_value_info("y", 1, [3, 24])],
                          [numpy_helper.from_array(w, "w")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    graph, build = hand_build(model, ["cpu", "sim-gpu:0"])
    (spec,) = specs_of(graph, build.placement, [])
    chain, _ = compile_stage(spec)
    (_, cpu_plan), (dev, dev_plan) = chain.parts
    assert list(cpu_plan.constant_outputs) == ["wt"]
    assert [n for n, _ in dev_plan.input_slots] == ["x"]
    x = np.linspace(-1, 1, 48, dtype=np.float32).reshape(3, 16)
    before = dev.bytes_to_device
    np.testing.assert_allclose(chain.run({"x": x}, ["y"])[0], x @ w.T, rtol=1e-5, atol=1e-6)
    assert dev.bytes_to_device - before == x.nbytes
