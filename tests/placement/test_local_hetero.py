"""In-process heterogeneous execution (executor="local"): small MLP/CNN models split
into sim-gpu and cpu segments with 1 to 4 seams give onnxruntime's outputs, and the
copies at seams are counted (LocalExecutor.copies / copy_bytes, sim-gpu's
bytes_to_device / bytes_to_host)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper as h

from hetero_exec import InferenceSession
from hetero_exec.exec.local import LocalExecutor
from tests.placement._models import assert_outputs, cnn, init, mlp, model, ort, rand, vi


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("HETERO_EXEC_HETERO", raising=False)
    monkeypatch.delenv("HETERO_EXEC_REQUIRE_GPU", raising=False)


def _device(sess):
    devs = [p for p in sess._build.providers if p.is_device]
    assert len(devs) == 1
    return devs[0]


def _segments(sess):
    return [(s.provider.name, [n.name for n in s.nodes]) for s in sess.placement.segments]


# mlp(4): x[2,16] -> (MatMul mm{i}, Add add{i}, Relu act{i}) x 4 -> y; every activation is
# 128 bytes. Pinning act nodes to cpu gives the seam count; per run the device receives x
# and every seam into a device segment, and returns every seam out of one plus y when
# the last segment is on the device.
MLP_CASES = {
    1: (["act3"], 128, 128),                # sim | cpu: add3_o
    2: (["act1"], 256, 256),                # sim | cpu | sim: add1_o, h1; y on the device
    3: (["act1", "act3"], 256, 256),        # add1_o, h1, add3_o
    4: (["act0", "act2"], 384, 384),        # add0_o, h0, add2_o, h2; y on the device
}


@pytest.mark.parametrize("seams", sorted(MLP_CASES))
def test_mlp_with_seams_matches_onnxruntime(seams):
    pins, to_device, to_host = MLP_CASES[seams]
    m = mlp(4)
    sess = InferenceSession(m, providers=["sim-gpu", "cpu"], hetero=True,
                            affinity=[("|".join(pins), "cpu")])
    assert len(sess.placement.seams) == seams
    assert len(sess.placement.segments) == seams + 1
    assert all(s.nbytes == 128 for s in sess.placement.seams)
    ex = sess._executor
    assert isinstance(ex, LocalExecutor)
    dev = _device(sess)
    x = rand(2, 16, seed=seams)
    want = ort(m, {"x": x})
    d0, h0 = dev.bytes_to_device, dev.bytes_to_host
    assert (ex.copies, ex.copy_bytes) == (0, 0)
    assert_outputs(sess.run(None, {"x": x}), want)
    # one copy for x into the first (device) segment, one per seam
    assert ex.copies == 1 + seams
    assert ex.copy_bytes == 128 * (1 + seams)
    assert dev.bytes_to_device - d0 == to_device
    assert dev.bytes_to_host - h0 == to_host
    # counters accumulate per run
    assert_outputs(sess.run(None, {"x": x}), want)
    assert ex.copies == 2 * (1 + seams)
    assert dev.bytes_to_device - d0 == 2 * to_device


CNN_CASES = {
    1: ["softmax"],                 # logits
    2: ["pool1"],                   # r1, p1
    3: ["pool1|softmax"],           # r1, p1, logits
    4: ["relu1|gap"],               # c1, r1, r2, gap
}


@pytest.mark.parametrize("seams", sorted(CNN_CASES))
def test_cnn_with_seams_matches_onnxruntime(seams):
    m = cnn(batch=2)
    sess = InferenceSession(m, providers=["sim-gpu"], hetero=True, affinity=[(CNN_CASES[seams][0], "cpu")])
    plan = sess.placement
    assert len(plan.seams) == seams
    cpu_nodes = sorted(n for p, names in _segments(sess) if p == "cpu" for n in names)
    assert cpu_nodes == sorted(CNN_CASES[seams][0].split("|"))
    x = rand(2, 3, 8, 8, seed=seams)
    assert_outputs(sess.run(None, {"x": x}), ort(m, {"x": x}), rtol=1e-4, atol=1e-5)
    ex = sess._executor
    assert ex.copies == 1 + seams
    assert ex.copy_bytes == x.nbytes + sum(s.nbytes for s in plan.seams)


def test_seam_bytes_known_for_cnn():
    sess = InferenceSession(cnn(batch=2), providers=["sim-gpu"], hetero=True, affinity=[("relu1|gap", "cpu")])
    assert {s.value: s.nbytes for s in sess.placement.seams} == {
        "c1": 2 * 8 * 8 * 8 * 4, "r1": 2 * 8 * 8 * 8 * 4, "r2": 2 * 16 * 4 * 4 * 4, "gap": 2 * 16 * 4}


def test_declined_ops_split_by_capability():
    """The split comes from the GPU's declines (exclude_ops), not only from pins."""
    m = cnn(batch=1)
    sess = InferenceSession(m, providers=[("sim-gpu", {"exclude_ops": ["MaxPool", "Softmax"]})], hetero=True,
                            optimize=False)  # the model's nodes, not the fused ones
    assert _segments(sess) == [
        ("sim-gpu:0", ["conv1", "relu1"]), ("cpu", ["pool1"]),
        ("sim-gpu:0", ["conv2", "relu2", "gap", "flatten", "fc"]), ("cpu", ["softmax"])]
    x = rand(1, 3, 8, 8, seed=11)
    assert_outputs(sess.run(None, {"x": x}), ort(m, {"x": x}), rtol=1e-4, atol=1e-5)


def test_each_device_segment_holds_only_its_own_weights():
    """The coordinator holds no whole-model weights and each segment only its own: the
    GPU receives each weight once, for the segment that reads it."""
    m = mlp(3)
    sess = InferenceSession(m, providers=[("sim-gpu", {"exclude_ops": ["Relu"]})], hetero=True)
    dev = _device(sess)
    assert [p for p, _ in _segments(sess)] == ["sim-gpu:0", "cpu"] * 3
    weights = 3 * (16 * 16 * 4 + 16 * 4)
    assert dev.bytes_to_device == weights


def test_async_and_repeated_runs_agree():
    m = mlp(4)
    sess = InferenceSession(m, providers=["sim-gpu"], hetero=True, affinity=[("act1", "cpu")])
    feeds = [{"x": rand(2, 16, seed=s)} for s in range(4)]
    outs = sess.run_many(feeds)
    for f, o in zip(feeds, outs):
        assert_outputs(o, ort(m, f))
    assert sess._executor.copies == 4 * 3


def test_output_subset_and_intermediate_on_device():
    """Asking for one output of a heterogeneous session returns it on the host."""
    m = cnn(batch=1)
    sess = InferenceSession(m, providers=["sim-gpu"], hetero=True, affinity=[("pool1", "cpu")])
    x = rand(1, 3, 8, 8)
    (y,) = sess.run(["y"], {"x": x})
    assert isinstance(y, np.ndarray)
    assert_outputs([y], ort(m, {"x": x}), rtol=1e-4, atol=1e-5)


def _tied_head():
    """y = x @ Transpose(w), the Transpose named "tr": a tied LM head, whose transposed
    weight a cpu pin makes a seam into the device's MatMul."""
    w = rand(24, 16, seed=5)
    nodes = [h.make_node("Transpose", ["w"], ["wt"], name="tr"),
             h.make_node("MatMul", ["x", "wt"], ["y"], name="head")]
    return model(nodes, [vi("x", shape=[3, 16])], [vi("y", shape=[3, 24])], [init("w", w)])


def test_a_seam_folded_from_constants_moves_once_at_build():
    m = _tied_head()
    sess = InferenceSession(m, providers=["sim-gpu", "cpu"], hetero=True, affinity=[("tr", "cpu")])
    assert [s.value for s in sess.placement.seams] == ["wt"]
    ex, dev = sess._executor, _device(sess)
    # the device's plan holds the transposed weight as its own constant: not an input
    assert [n for n, _ in ex.segments[1].plan.input_slots] == ["x"]
    x = rand(3, 16, seed=1)
    d0 = dev.bytes_to_device
    for run in (1, 2):
        assert_outputs(sess.run(None, {"x": x}), ort(m, {"x": x}), rtol=1e-5, atol=1e-5)
        # each run moves x alone to the device, never the 24 x 16 weight
        assert (ex.copies, ex.copy_bytes) == (run, run * x.nbytes)
        assert dev.bytes_to_device - d0 == run * x.nbytes


def _host_value_across_a_seam():
    """dev: Relu, Shape, Gather (a host step: its one reader is in another segment) |
    cpu: Softmax (excluded) | dev: ArgMax, then Add(argmax, d): d, made on the host by
    the first device segment, read as data by a device kernel of the second (TorchScript
    exports of BART compute such shape values beside their activations)."""
    from onnx import TensorProto as T
    from onnx import numpy_helper

    nodes = [
        h.make_node("Relu", ["x"], ["r"], name="dev/relu"),
        h.make_node("Shape", ["r"], ["s"], name="dev/shape"),
        h.make_node("Gather", ["s", "one"], ["d"], axis=0, name="dev/gather"),
        h.make_node("Softmax", ["r"], ["y"], axis=-1, name="cpu/softmax"),
        h.make_node("ArgMax", ["y"], ["am"], axis=1, keepdims=1, name="dev2/argmax"),
        h.make_node("Add", ["am", "d"], ["ai"], name="dev2/add"),
        h.make_node("Cast", ["ai"], ["c"], to=T.FLOAT, name="dev2/cast"),
        h.make_node("Mul", ["y", "c"], ["z"], name="dev2/mul"),
    ]
    graph = h.make_graph(nodes, "host_value_seam", [vi("x", shape=["N", 4])], [vi("z", shape=["N", 4])],
                         [numpy_helper.from_array(np.array(1, np.int64), "one")])
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])


def test_a_host_value_crossing_a_device_seam_reaches_the_next_segment_on_the_device():
    m = _host_value_across_a_seam()
    sess = InferenceSession(m, [("sim-gpu", {"exclude_ops": ["Softmax"]}), "cpu"], hetero=True)
    segs = _segments(sess)
    assert [p for p, _ in segs] == ["sim-gpu:0", "cpu", "sim-gpu:0"], segs
    assert "dev/gather" in segs[0][1] and "dev2/add" in segs[2][1]
    x = rand(3, 4)
    assert_outputs(sess.run(None, {"x": x}), ort(m, {"x": x}))
