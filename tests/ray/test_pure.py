"""The Ray layer's pieces that need no Ray cluster: wire format, segment cutting,
actor slots, options, error carriers. Fast; no ray.init."""

from __future__ import annotations

import pickle

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import helper

from actors.options import RayOptions
from actors.remote_errors import SegmentRunError, user_error
from actors.reservation import plan_slots
from actors.segment_model import load_segment_graph, segment_spec
from actors.transport.base import SeamKey
from actors.transport.device_local import DeviceLocalTransport, LocalSeam, MissingLocalSeam
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
from tests.ray.models import SKIP_PLACEMENT, hand_build, mlp, skip_model


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


def test_device_local_transport_keeps_values_until_dropped():
    t = DeviceLocalTransport()
    marker = t.write(SeamKey(1, "h"), np.ones(3))
    assert isinstance(marker, LocalSeam)
    assert t.read(SeamKey(1, "h"), marker) is t.read(
        SeamKey(1, "h"), marker
    )  # no copy, re-readable
    t.drop(1)
    with pytest.raises(MissingLocalSeam):
        t.read(SeamKey(1, "h"), marker)


def test_segment_spec_holds_only_its_weights_and_compiles_alike():
    graph, build = hand_build(mlp(layers=2), ["sim-gpu:0", "cpu", "sim-gpu:0", "cpu"])
    specs = [segment_spec(graph, s) for s in build.placement.segments]
    weights = [{i.name for i in onnx.load_from_string(s.model).graph.initializer} for s in specs]
    assert weights == [{"w0", "b0"}, set(), {"w1", "b1"}, set()]
    x = np.random.default_rng(0).standard_normal((3, 32)).astype(np.float32)
    env = {"x": x}
    for spec, seg in zip(specs, build.placement.segments):
        sub = load_segment_graph(spec)
        assert [n.identity for n in sub.nodes] == [n.identity for n in seg.nodes]
        plan = Compiler().compile(sub, sub.nodes, spec.inputs, spec.outputs)
        env.update(zip(spec.outputs, execute(plan, [env.get(n) for n in spec.inputs])))
    full = Compiler().compile_graph(graph)
    np.testing.assert_allclose(env["y"], execute(full, [x])[0], rtol=1e-6)


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
    sub = load_segment_graph(segment_spec(graph, build.placement.segments[1]))
    assert sub.nodes[0].identity == 'graph/node#1 "branch"'
    inner = sub.nodes[0].subgraphs["then_branch"].nodes[0]
    assert inner.identity == graph.nodes[1].subgraphs["then_branch"].nodes[0].identity


def test_plan_slots_colocates_by_device_and_keeps_local_values():
    graph, build = hand_build(skip_model(), SKIP_PLACEMENT)
    specs = [segment_spec(graph, s) for s in build.placement.segments]
    slots, bundles = plan_slots(specs, graph.outputs, RayOptions(colocate=True))
    assert [s.device for s in slots] == ["sim-gpu:0", "cpu"]
    assert [sp.segment_id for sp in slots[0].specs] == [0, 2]
    assert slots[0].local_values == {"h"} and slots[0].num_gpus == 1.0
    assert bundles == [{"GPU": 1.0}, {"CPU": 1.0}]
    slots, bundles = plan_slots(specs, graph.outputs, RayOptions())
    assert [s.num_gpus for s in slots] == [0.5, 0, 0.5] and not any(s.local_values for s in slots)


def test_options_are_checked():
    assert RayOptions.parse({}).max_inflight == 8
    with pytest.raises(ProviderError, match="unknown option"):
        RayOptions.parse({"max_inflite": 3})
    with pytest.raises(ProviderError, match="placement_strategy"):
        RayOptions.parse({"placement_strategy": "SCATTER"})
    with pytest.raises(ProviderError, match="seam_transport"):
        RayOptions.parse({"seam_transport": "pigeon"})


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
