"""The placement planner: classify_placement, segments and seams, the order that
minimises segments, host-preferred shape arithmetic, control flow on the host,
multi-GPU strategies and the cost model, affinity, saved plans, report / DOT and the
`hetero-exec plan` CLI. Outputs are checked against onnxruntime."""

from __future__ import annotations

import itertools
import json
import math
import os
import stat

import numpy as np
import onnx
import pytest
from onnx import helper as h

from hetero_exec import InferenceSession
from hetero_exec.errors import MemoryAdmissionError, PlacementError
from hetero_exec.ir import load
from hetero_exec.ir.graph import node_reads
from hetero_exec.placement import planner
from hetero_exec.placement.decide import parse_providers
from hetero_exec.placement.partition import CostModel, node_cost
from hetero_exec.placement.planner import classify_placement
from hetero_exec.placement.segments import build_plan
from tests.placement._models import (
    F,
    assert_outputs,
    cnn,
    if_model,
    init,
    matmul_chain,
    mlp,
    model,
    ort,
    rand,
    vi,
)

SIMS4 = ["sim-gpu:0", "sim-gpu:1", "sim-gpu:2", "sim-gpu:3"]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("HETERO_EXEC_HETERO", raising=False)
    monkeypatch.delenv("HETERO_EXEC_REQUIRE_GPU", raising=False)


def sim(*exclude: str, name: str = "sim-gpu", **opts):
    return (name, {"exclude_ops": list(exclude), **opts})


def graph_of(m: onnx.ModelProto):
    return load(m)[1]


def by_name(plan) -> dict[str, str]:
    """node name -> provider name."""
    return {n.name: s.provider.name for s in plan.segments for n in s.nodes}


def check_plan(plan, graph) -> None:
    """The invariants every plan must hold, recomputed from the graph."""
    segs = plan.segments
    placed = [n for s in segs for n in s.nodes]
    # every top-level node placed exactly once
    assert len(placed) == len(graph.nodes)
    assert sorted(n.identity for n in placed) == sorted(n.identity for n in graph.nodes)
    assert [s.id for s in segs] == list(range(len(segs)))
    # maximal: neighbouring segments run on different providers
    for a, b in zip(segs, segs[1:]):
        assert a.provider.name != b.provider.name, (a.name, b.name)
    # the segment order is a topological order
    available = set(graph.inputs) | set(graph.initializers)
    seg_of: dict[str, int] = {}
    for s in segs:
        for n in s.nodes:
            for name in node_reads(n):
                assert name in available, f"{n.identity} reads {name!r} before it is produced"
            for o in n.outputs:
                if o:
                    available.add(o)
                    seg_of[o] = s.id
    # seams: exactly the values produced in one segment and read in another
    crossing: dict[str, set[int]] = {}
    for s in segs:
        for n in s.nodes:
            for name in node_reads(n):
                if name in seg_of and seg_of[name] != s.id:
                    crossing.setdefault(name, set()).add(s.id)
    got = {seam.value: (seam.producer, seam.consumers) for seam in plan.seams}
    assert got == {v: (seg_of[v], sorted(c)) for v, c in crossing.items()}
    for seam in plan.seams:
        v = graph.value(seam.value)
        assert seam.dtype == v.dtype_name
        assert (tuple(seam.shape) if seam.shape is not None else None) == v.shape
        if v.shape is not None and all(isinstance(d, int) for d in v.shape):
            assert seam.nbytes == math.prod(v.shape) * v.dtype.itemsize
    # graph outputs are produced somewhere
    for o in graph.outputs:
        assert o in available


# --- classify_placement --------------------------------------------------------------------


def test_classify_single_provider_returns_none():
    g = graph_of(mlp(3))
    assert classify_placement(g, parse_providers(["sim-gpu"])) is None
    assert classify_placement(g, parse_providers(["sim-gpu", "cpu"])) is None
    # a decline makes it a plan
    plan = classify_placement(g, parse_providers([sim("Relu")]))
    assert plan is not None and len(plan.segments) > 1


def test_session_exposes_single_segment_plan():
    m = mlp(2)
    sess = InferenceSession(m, providers=["sim-gpu"], hetero=True)
    assert len(sess.placement.segments) == 1 and sess.placement.seams == []
    assert sess.placement.segments[0].provider.name == "sim-gpu:0"
    assert len(sess.placement.segments[0].nodes) == 6


def test_mixed_plan_segments_and_seams():
    m = mlp(3)
    g = graph_of(m)
    plan = classify_placement(g, parse_providers([sim("Relu")]))
    check_plan(plan, g)
    assert [(s.provider.name, [n.name for n in s.nodes]) for s in plan.segments] == [
        ("sim-gpu:0", ["mm0", "add0"]), ("cpu", ["act0"]),
        ("sim-gpu:0", ["mm1", "add1"]), ("cpu", ["act1"]),
        ("sim-gpu:0", ["mm2", "add2"]), ("cpu", ["act2"])]
    assert [(s.value, s.producer, s.consumers, s.dtype, tuple(s.shape), s.nbytes) for s in plan.seams] == [
        ("add0_o", 0, [1], "float", (2, 16), 128), ("h0", 1, [2], "float", (2, 16), 128),
        ("add1_o", 2, [3], "float", (2, 16), 128), ("h1", 3, [4], "float", (2, 16), 128),
        ("add2_o", 4, [5], "float", (2, 16), 128)]
    assert plan.seam_bytes() == 5 * 128


def test_seam_with_several_consumers_and_unknown_bytes():
    """A value read by two later segments is one seam with both consumers; a symbolic
    shape has unknown bytes until a dim bound makes them known."""
    nodes = [h.make_node("Relu", ["x"], ["r"], name="relu"),
             h.make_node("Neg", ["r"], ["n"], name="neg"),
             h.make_node("Add", ["r", "n"], ["a"], name="add"),
             h.make_node("Neg", ["a"], ["b"], name="neg2"),
             h.make_node("Mul", ["r", "b"], ["y"], name="mul")]
    m = model(nodes, [vi("x", F, ["N", 4])], [vi("y", F, ["N", 4])])
    g = graph_of(m)
    plan = classify_placement(g, parse_providers([sim("Neg")]))
    check_plan(plan, g)
    assert by_name(plan) == {"relu": "sim-gpu:0", "neg": "cpu", "add": "sim-gpu:0",
                             "neg2": "cpu", "mul": "sim-gpu:0"}
    r = [s for s in plan.seams if s.value == "r"]
    assert len(r) == 1 and r[0].producer == 0 and r[0].consumers == [1, 2, 4]
    assert all(s.nbytes is None for s in plan.seams)
    assert r[0].shape == ("N", 4)
    bounded = classify_placement(g, parse_providers([sim("Neg")]), dim_bounds={"N": 3})
    assert {s.value: s.nbytes for s in bounded.seams} == {"r": 48, "n": 48, "a": 48, "b": 48}
    x = rand(3, 4)
    sess = InferenceSession(m, providers=[sim("Neg")], hetero=True)
    assert_outputs(sess.run(None, {"x": x}), ort(m, {"x": x}))


def _interleaved():
    """Two independent branches interleaved in file order: a* run on the GPU, b* (Neg)
    are declined."""
    nodes = [h.make_node("Relu", ["a"], ["a1"], name="a1"), h.make_node("Neg", ["b"], ["b1"], name="b1"),
             h.make_node("Sin", ["a1"], ["a2"], name="a2"), h.make_node("Neg", ["b1"], ["b2"], name="b2"),
             h.make_node("Relu", ["a2"], ["ya"], name="a3"), h.make_node("Neg", ["b2"], ["yb"], name="b3")]
    return model(nodes, [vi("a", F, [4]), vi("b", F, [4])], [vi("ya", F, [4]), vi("yb", F, [4])])


def test_order_minimises_segments_not_file_order():
    m = _interleaved()
    g = graph_of(m)
    provs = parse_providers([sim("Neg")])
    plan = classify_placement(g, provs)
    check_plan(plan, g)
    assert len(plan.segments) == 2
    assert {s.provider.name: sorted(n.name for n in s.nodes) for s in plan.segments} == {
        "sim-gpu:0": ["a1", "a2", "a3"], "cpu": ["b1", "b2", "b3"]}
    assert plan.seams == []
    # the file order itself would have made 6 segments
    assign = {n: (provs[1] if n.op_type == "Neg" else provs[0]) for n in g.nodes}
    assert len(build_plan(g, g.nodes, assign).segments) == 6
    feed = {"a": rand(4, seed=1), "b": rand(4, seed=2)}
    sess = InferenceSession(m, providers=[sim("Neg")], hetero=True)
    assert len(sess.placement.segments) == 2
    assert_outputs(sess.run(None, feed), ort(m, feed))


# --- host-preferred shape arithmetic ----------------------------------------------------------

SHAPE_INITS = [init("i0", np.array([0], np.int64)), init("m1", np.array([-1], np.int64))]


def _shape_chain(source_on_host: bool):
    """Shape -> Gather -> Concat feeds Reshape's shape input. The Shape reads a device
    tensor (Relu) or a host tensor (Sigmoid, which the GPU is told to decline)."""
    if source_on_host:
        nodes = [h.make_node("Sigmoid", ["x"], ["src"], name="sig"),
                 h.make_node("Shape", ["src"], ["shp"], name="shape"),
                 h.make_node("Gather", ["shp", "i0"], ["g"], name="gather", axis=0),
                 h.make_node("Concat", ["g", "m1"], ["ns"], name="concat", axis=0),
                 h.make_node("Relu", ["x"], ["r"], name="relu"),
                 h.make_node("Reshape", ["r", "ns"], ["y"], name="reshape")]
        outs = [vi("y", F, [2, 12]), vi("src", F, [2, 3, 4])]
    else:
        nodes = [h.make_node("Relu", ["x"], ["r"], name="relu"),
                 h.make_node("Shape", ["r"], ["shp"], name="shape"),
                 h.make_node("Gather", ["shp", "i0"], ["g"], name="gather", axis=0),
                 h.make_node("Concat", ["g", "m1"], ["ns"], name="concat", axis=0),
                 h.make_node("Reshape", ["r", "ns"], ["y0"], name="reshape"),
                 h.make_node("Sigmoid", ["y0"], ["y"], name="sig")]
        outs = [vi("y", F, [2, 12])]
    return model(nodes, [vi("x", F, [2, 3, 4])], outs, SHAPE_INITS)


def _host_steps(sess) -> dict[str, bool]:
    """node name -> whether it runs as a host (NumPy) step inside its device segment."""
    out = {}
    for cs in sess._executor.segments:
        for st in cs.plan.steps:
            out[st.node.name] = st.on_host
    return out


def test_shape_arithmetic_for_a_device_reshape_stays_on_host():
    m = _shape_chain(source_on_host=False)
    g = graph_of(m)
    plan = classify_placement(g, parse_providers([sim("Sigmoid")]))
    check_plan(plan, g)
    # the shape chain stays in the device segment: no seam carries shape values
    assert by_name(plan) == {"relu": "sim-gpu:0", "shape": "sim-gpu:0", "gather": "sim-gpu:0",
                             "concat": "sim-gpu:0", "reshape": "sim-gpu:0", "sig": "cpu"}
    assert [s.value for s in plan.seams] == ["y0"]
    sess = InferenceSession(m, providers=[sim("Sigmoid")], hetero=True, fold_constants=False)
    # ... and runs there on the host: Shape, Gather and Concat are NumPy steps
    assert _host_steps(sess) == {"relu": False, "shape": True, "gather": True, "concat": True,
                                 "reshape": False, "sig": False}
    x = rand(2, 3, 4)
    assert_outputs(sess.run(None, {"x": x}), ort(m, {"x": x}))


def test_host_steps_copy_nothing_back_and_forth():
    """Only x goes to the device and y0 comes back: the shape values never cross."""
    m = _shape_chain(source_on_host=False)
    sess = InferenceSession(m, providers=[sim("Sigmoid")], hetero=True)
    dev = [p for p in sess._build.all_providers if p.is_device][0]
    # the shape constants are read by host steps only: never uploaded
    assert dev.bytes_to_device == 0
    x = rand(2, 3, 4)
    sess.run(None, {"x": x})
    assert (dev.bytes_to_device, dev.bytes_to_host) == (x.nbytes, x.nbytes)


def test_shape_of_a_host_tensor_stays_on_host_and_saves_seam_bytes(monkeypatch):
    m = _shape_chain(source_on_host=True)
    g = graph_of(m)
    provs = parse_providers([sim("Sigmoid")])
    plan = classify_placement(g, provs)
    check_plan(plan, g)
    # Shape stays with its input's provider (cpu): no copy of the whole tensor to the GPU;
    # only the 3-element shape vector crosses
    assert by_name(plan)["sig"] == "cpu" and by_name(plan)["shape"] == "cpu"
    assert [(s.value, s.nbytes) for s in plan.seams] == [("shp", 24)]
    monkeypatch.setattr(planner, "metadata_follows_input", lambda *a, **k: None)
    without = classify_placement(g, provs)
    check_plan(without, g)
    assert by_name(without)["shape"] == "sim-gpu:0"
    assert plan.seam_bytes() < without.seam_bytes()
    monkeypatch.undo()
    sess = InferenceSession(m, providers=[sim("Sigmoid")], hetero=True)
    x = rand(2, 3, 4)
    assert_outputs(sess.run(None, {"x": x}), ort(m, {"x": x}))


def test_float_or_large_values_are_not_host_preferred():
    """Only small integer shape values move: a float chain feeding a device op stays."""
    nodes = [h.make_node("Relu", ["x"], ["r"], name="relu"),
             h.make_node("Neg", ["r"], ["n"], name="neg"),
             h.make_node("Abs", ["n"], ["y"], name="abs")]
    m = model(nodes, [vi("x", F, [4])], [vi("y", F, [4])])
    g = graph_of(m)
    plan = classify_placement(g, parse_providers([sim("Abs")]))
    assert by_name(plan) == {"relu": "sim-gpu:0", "neg": "sim-gpu:0", "abs": "cpu"}
    sess = InferenceSession(m, providers=[sim("Abs")], hetero=True)
    assert _host_steps(sess) == {"relu": False, "neg": False, "abs": False}


# --- control flow ------------------------------------------------------------------------------


def test_control_flow_runs_on_host_and_bodies_are_placed():
    m = if_model()
    sess = InferenceSession(m, providers=[sim("Neg")], hetero=True)
    assert by_name(sess.placement)["branch"] == "cpu"
    assert by_name(sess.placement)["sin"] == "sim-gpu:0"
    dev = [p for p in sess._build.all_providers if p.is_device][0]
    for c in (True, False):
        feed = {"c": np.array(c), "x": rand(4, seed=4)}
        before = dev.bytes_to_device
        assert_outputs(sess.run(None, feed), ort(m, feed))
        # x for Sin, y for Sigmoid, and x again into the branch body's GPU segment
        # (then: Relu on the GPU before the declined Neg; else: Abs on the GPU)
        assert dev.bytes_to_device - before == 3 * 16


def test_pinning_control_flow_to_the_gpu_is_an_error():
    with pytest.raises(PlacementError) as ei:
        InferenceSession(if_model(), providers=[sim("Neg")], hetero=True, affinity=[("If", "sim-gpu")])
    assert 'graph/node#1 "branch"' in str(ei.value) and "sim-gpu:0" in str(ei.value)


# --- multi-GPU -----------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["greedy", "balanced", "memory"])
def test_multi_gpu_strategies_valid_and_correct(strategy):
    m = mlp(6, width=32, batch=3)
    providers = SIMS4 + ["cpu"]
    if strategy == "memory":  # a layer is 4224 B of weights: each device fits two
        providers = [(p, {"mem_limit": 11000}) for p in SIMS4] + ["cpu"]
    sess = InferenceSession(m, providers=providers, hetero=True, strategy=strategy)
    plan = sess.placement
    check_plan(plan, plan.graph)  # the graph the (fused) plan runs
    assert plan.strategy == strategy
    names = [s.provider.name for s in plan.segments]
    assert set(names) <= set(SIMS4)
    assert len(names) >= 3
    assert names == sorted(names)  # pipeline stages in device order
    for s in plan.segments:
        assert s.predicted_cost is not None and s.predicted_cost > 0
    x = rand(3, 32, seed=7)
    assert_outputs(sess.run(None, {"x": x}), ort(m, {"x": x}), rtol=1e-4, atol=1e-5)


def test_multi_gpu_with_a_host_only_node():
    """Four GPUs and a node none of them runs: the node goes to cpu between stages."""
    m = mlp(4, width=16)
    g = graph_of(m)
    for strategy in ("greedy", "balanced"):
        plan = classify_placement(g, parse_providers([sim("Sigmoid", name=p) for p in SIMS4]),
                                  strategy=strategy, affinity=[("act1", "cpu")])
        check_plan(plan, g)
        assert by_name(plan)["act1"] == "cpu"
        assert {s.provider.name for s in plan.segments} >= {"cpu", "sim-gpu:0", "sim-gpu:3"}
    sess = InferenceSession(m, providers=SIMS4, hetero=True, strategy="balanced",
                            affinity=[("act1", "cpu")])
    x = rand(2, 16)
    assert_outputs(sess.run(None, {"x": x}), ort(m, {"x": x}), rtol=1e-4, atol=1e-5)


def _slowest(plan) -> float:
    return max(s.predicted_cost for s in plan.segments)


def test_balanced_slowest_stage_not_worse_than_greedy():
    cm = CostModel(flops_per_s=1e9)  # compute-bound, so the heavy tail dominates
    g = graph_of(matmul_chain([16, 16, 16, 16, 16, 16, 256, 256, 256]))
    provs = parse_providers(SIMS4)
    greedy = classify_placement(g, provs, strategy="greedy", cost_model=cm)
    balanced = classify_placement(g, provs, strategy="balanced", cost_model=cm)
    check_plan(greedy, g)
    check_plan(balanced, g)
    assert _slowest(balanced) <= _slowest(greedy)
    assert _slowest(balanced) < 0.9 * _slowest(greedy)  # on this chain greedy is clearly worse


def test_balanced_is_optimal_over_contiguous_splits():
    """Brute force every split of a chain into 4 contiguous stages: balanced's slowest
    stage (compute + seam transfer into it) is the minimum."""
    cm = CostModel(flops_per_s=1e9)
    m = matmul_chain([16, 64, 16, 128, 16, 16, 256])
    g = graph_of(m)
    plan = classify_placement(g, parse_providers(SIMS4), strategy="balanced", cost_model=cm)
    order = g.nodes  # a chain: the only topological order
    costs = [node_cost(g, n, {}, cm) for n in order]
    nbytes = [math.prod(g.value(n.outputs[0]).shape) * 4 for n in order]
    best = math.inf
    for cuts in itertools.combinations(range(1, len(order)), 3):
        bounds = (0,) + cuts + (len(order),)
        stages = [sum(costs[a:b]) + (cm.seam_seconds(nbytes[a - 1]) if a else 0.0)
                  for a, b in zip(bounds, bounds[1:])]
        best = min(best, max(stages))
    assert _slowest(plan) == pytest.approx(best, rel=1e-9)


def test_memory_strategy_respects_each_device_limit():
    m = mlp(6, width=32, batch=3)
    limits = {"sim-gpu:0": 11000, "sim-gpu:1": 6000, "sim-gpu:2": 11000, "sim-gpu:3": 11000}
    sess = InferenceSession(m, providers=[(p, {"mem_limit": limits[p]}) for p in SIMS4],
                            hetero=True, strategy="memory")
    plan = sess.placement
    check_plan(plan, plan.graph)  # the graph the (fused) plan runs
    used: dict[str, int] = {}
    for s in plan.segments:
        assert s.mem_need is not None and s.mem_need <= limits[s.provider.name]
        used[s.provider.name] = used.get(s.provider.name, 0) + s.mem_need
    assert all(used[p] <= limits[p] for p in used)
    assert len(used) >= 3
    x = rand(3, 32)
    assert_outputs(sess.run(None, {"x": x}), ort(m, {"x": x}), rtol=1e-4, atol=1e-5)


def test_memory_strategy_finds_an_admissible_split_when_one_exists():
    m = cnn(batch=1)
    providers = [(p, {"mem_limit": 12000}) for p in SIMS4]
    names = ["conv1", "relu1", "pool1", "conv2", "relu2", "gap", "flatten", "fc", "softmax"]
    ident = {n: f'graph/node#{i} "{n}"' for i, n in enumerate(names)}
    split = [["conv1"], ["relu1", "pool1"], ["conv2", "relu2", "gap", "flatten"], ["fc", "softmax"]]
    saved = {"format": "hetero_exec.placement/1",
             "segments": [{"provider": SIMS4[i], "nodes": [ident[n] for n in stage]}
                          for i, stage in enumerate(split)]}
    # this split is admitted on four 12000-byte devices (im2col workspaces included) ...
    admitted = InferenceSession(m, providers=providers, placement=saved)
    assert all(s.mem_need <= 12000 for s in admitted.placement.segments)
    # ... so the memory strategy should find one too
    sess = InferenceSession(m, providers=providers, hetero=True, strategy="memory")
    assert all(s.mem_need <= 12000 for s in sess.placement.segments)


def test_memory_strategy_errors_when_nothing_fits():
    with pytest.raises(MemoryAdmissionError) as ei:
        InferenceSession(mlp(4), providers=[(p, {"mem_limit": 500}) for p in SIMS4],
                         hetero=True, strategy="memory")
    assert ei.value.free <= 500 and ei.value.needed > ei.value.free
    assert "sim-gpu:" in str(ei.value)


def test_unknown_strategy_is_an_error():
    with pytest.raises(PlacementError) as ei:
        InferenceSession(mlp(2), providers=SIMS4, hetero=True, strategy="fastest")
    assert "fastest" in str(ei.value)


def test_predicted_cost_per_segment_matches_the_cost_model():
    """One MatMul on the GPU, its Relu declined: the GPU segment's cost is the model's
    flops/bytes formula; the cpu segment pays the seam transfer on top."""
    cm = CostModel(flops_per_s=1e9, bytes_per_s=1e8, per_node_s=1e-6, link_bytes_per_s=1e7,
                   link_latency_s=1e-5)
    g = graph_of(matmul_chain([64, 32], batch=4))
    plan = classify_placement(g, parse_providers([sim("Relu")]), cost_model=cm)
    mm, relu = plan.segments
    flops = 2 * 4 * 32 * 64
    io = (4 * 64 + 64 * 32 + 4 * 32) * 4
    assert mm.predicted_cost == pytest.approx(flops / 1e9 + io / 1e8 + 1e-6)
    seam = 4 * 32 * 4
    assert relu.predicted_cost == pytest.approx(4 * 32 / 1e9 + 2 * seam / 1e8 + 1e-6 + seam / 1e7 + 1e-5)
    assert "predicted" in plan.report()


def test_cost_model_calibrate_fits_samples():
    true = CostModel(flops_per_s=3e9, bytes_per_s=2e8, per_node_s=5e-6)
    rng = np.random.default_rng(0)
    samples = []
    for _ in range(20):
        f, b = float(rng.uniform(1e5, 1e8)), float(rng.uniform(1e3, 1e7))
        samples.append((f, b, true.node_seconds(f, b)))
    fit = CostModel.calibrate(None, samples)
    assert fit.flops_per_s == pytest.approx(3e9, rel=1e-6)
    assert fit.bytes_per_s == pytest.approx(2e8, rel=1e-6)
    assert fit.per_node_s == pytest.approx(5e-6, rel=1e-6)
    assert CostModel.calibrate(None, []) == CostModel()


# --- affinity ------------------------------------------------------------------------------------


def _affinity_plan(rules, providers=None):
    g = graph_of(mlp(3))
    return g, classify_placement(g, parse_providers(providers or ["sim-gpu"]), affinity=rules)


def test_affinity_by_node_name():
    g, plan = _affinity_plan([("mm1", "cpu")])
    check_plan(plan, g)
    placed = by_name(plan)
    assert placed["mm1"] == "cpu"
    assert all(p == "sim-gpu:0" for n, p in placed.items() if n != "mm1")


def test_affinity_by_op_type_and_regex():
    _, plan = _affinity_plan([("Add", "cpu")])
    assert {n: p for n, p in by_name(plan).items() if p == "cpu"} == {"add0": "cpu", "add1": "cpu", "add2": "cpu"}
    _, plan = _affinity_plan([("act[12]", "cpu")])
    assert sorted(n for n, p in by_name(plan).items() if p == "cpu") == ["act1", "act2"]


def test_affinity_first_match_wins():
    _, plan = _affinity_plan([("mm.*", "cpu"), ("mm1", "sim-gpu")])
    assert sorted(n for n, p in by_name(plan).items() if p == "cpu") == ["mm0", "mm1", "mm2"]
    _, plan = _affinity_plan([("mm1", "sim-gpu:0"), ("mm.*", "cpu")])
    assert sorted(n for n, p in by_name(plan).items() if p == "cpu") == ["mm0", "mm2"]


def test_affinity_session_outputs():
    m = mlp(3)
    sess = InferenceSession(m, providers=["sim-gpu"], hetero=True, affinity=[("mm1|act2", "cpu")])
    assert sorted(n for n, p in by_name(sess.placement).items() if p == "cpu") == ["act2", "mm1"]
    x = rand(2, 16)
    assert_outputs(sess.run(None, {"x": x}), ort(m, {"x": x}))


def test_affinity_to_a_provider_that_cannot_run_the_node():
    nodes = [h.make_node("Relu", ["x"], ["r"], name="relu"), h.make_node("Unique", ["r"], ["y"], name="uniq")]
    m = model(nodes, [vi("x", F, [6])], [vi("y", F, ["U"])])
    with pytest.raises(PlacementError) as ei:
        InferenceSession(m, providers=["sim-gpu"], hetero=True, affinity=[("uniq", "sim-gpu")])
    msg = str(ei.value)
    assert 'graph/node#1 "uniq"' in msg and "sim-gpu:0" in msg and "host-only" in msg
    with pytest.raises(PlacementError) as ei:
        InferenceSession(mlp(2), providers=[sim("Relu")], hetero=True, affinity=[("act0", "sim-gpu:0")])
    msg = str(ei.value)
    assert 'graph/node#2 "act0"' in msg and "sim-gpu:0" in msg and "excluded by provider options" in msg


def test_affinity_errors():
    with pytest.raises(PlacementError) as ei:  # a provider the session does not have
        InferenceSession(mlp(2), providers=["sim-gpu"], hetero=True, affinity=[("mm0", "sim-gpu:7")])
    assert "sim-gpu:7" in str(ei.value)
    with pytest.raises(PlacementError):  # not a (regex, provider) pair
        InferenceSession(mlp(2), providers=["sim-gpu"], hetero=True, affinity=[("mm0",)])
    with pytest.raises(PlacementError):  # a bad regex
        InferenceSession(mlp(2), providers=["sim-gpu"], hetero=True, affinity=[("mm(", "cpu")])
    with pytest.raises(PlacementError) as ei:  # pinning elsewhere needs hetero
        InferenceSession(mlp(2), providers=["sim-gpu"], affinity=[("mm0", "cpu")])
    assert "hetero" in str(ei.value)


# --- saved plans ---------------------------------------------------------------------------------


def _saved(tmp_path, m=None, providers=None, **opts):
    m = m or mlp(3)
    providers = providers or [sim("Relu")]
    sess = InferenceSession(m, providers=providers, hetero=True, **opts)
    path = tmp_path / "plan.json"
    text = sess.placement.to_json(str(path))
    assert json.loads(path.read_text()) == json.loads(text)
    return m, sess, path


def _layout(plan):
    return [(s.provider.name, [n.identity for n in s.nodes]) for s in plan.segments]


def test_saved_plan_round_trip(tmp_path):
    m, sess, path = _saved(tmp_path, affinity=[("add1", "cpu")])
    again = InferenceSession(m, providers=[sim("Relu")], placement=str(path))
    assert _layout(again.placement) == _layout(sess.placement)
    assert [(s.value, s.producer, s.consumers, s.nbytes) for s in again.placement.seams] == [
        (s.value, s.producer, s.consumers, s.nbytes) for s in sess.placement.seams]
    x = rand(2, 16, seed=9)
    assert_outputs(again.run(None, {"x": x}), ort(m, {"x": x}))
    # a dict works as well as a path
    from_dict = InferenceSession(m, providers=[sim("Relu")], placement=json.loads(path.read_text()))
    assert _layout(from_dict.placement) == _layout(sess.placement)


def test_saved_multi_gpu_plan_round_trip(tmp_path):
    m = mlp(4)
    m, sess, path = _saved(tmp_path, m=m, providers=SIMS4, strategy="balanced")
    again = InferenceSession(m, providers=SIMS4, placement=str(path))
    assert _layout(again.placement) == _layout(sess.placement)
    x = rand(2, 16)
    assert_outputs(again.run(None, {"x": x}), ort(m, {"x": x}), rtol=1e-4, atol=1e-5)


def _corrupt(data: dict, how: str) -> dict | str:
    data = json.loads(json.dumps(data))
    segs = data["segments"]
    if how == "truncated":
        return json.dumps(data)[:-40]
    if how == "format":
        data["format"] = "something/else"
    elif how == "unknown node":
        segs[0]["nodes"][0] = 'graph/node#99 "ghost"'
    elif how == "missing node":
        segs[-1]["nodes"].pop()
    elif how == "duplicate node":  # the last node twice, which no order check catches
        segs[-1]["nodes"].append(segs[-1]["nodes"][-1])
    elif how == "unknown provider":
        segs[0]["provider"] = "sim-gpu:5"
    elif how == "cannot run":  # the declined Relu moved onto the GPU
        segs[0]["nodes"].append(segs[1]["nodes"][0])
        segs[1]["nodes"] = []
    elif how == "order":
        segs[0], segs[1] = segs[1], segs[0]
    elif how == "no segments":
        del data["segments"]
    elif how == "no nodes key":
        del segs[0]["nodes"]
    elif how == "segments not a list":
        data["segments"] = 7
    elif how == "not an object":
        return json.dumps([1, 2, 3])
    return data


CORRUPTIONS = ["truncated", "format", "unknown node", "missing node", "duplicate node", "unknown provider",
               "cannot run", "order", "no segments", "no nodes key", "segments not a list", "not an object"]


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_corrupted_saved_plan_is_a_placement_error(tmp_path, how):
    m, _sess, path = _saved(tmp_path)
    bad = _corrupt(json.loads(path.read_text()), how)
    bad_path = tmp_path / "bad.json"
    bad_path.write_text(bad if isinstance(bad, str) else json.dumps(bad))
    with pytest.raises(PlacementError):
        InferenceSession(m, providers=[sim("Relu")], placement=str(bad_path))


def test_missing_saved_plan_is_a_placement_error(tmp_path):
    with pytest.raises(PlacementError) as ei:
        InferenceSession(mlp(2), providers=[sim("Relu")], placement=str(tmp_path / "nope.json"))
    assert "nope.json" in str(ei.value)


# --- report and DOT ------------------------------------------------------------------------------


def test_plan_report_contents():
    sess = InferenceSession(mlp(2), providers=[sim("Relu")], hetero=True, optimize=False)
    text = sess.placement.report()
    lines = text.splitlines()
    assert lines[0].startswith("placement (hetero): 4 segment(s), 3 seam(s), 384 seam bytes known")
    assert lines[1].startswith("  segment#0 on sim-gpu:0: 2 node(s) [")
    assert "MatMulx1" in lines[1] and "Addx1" in lines[1] and "predicted" in lines[1] and "needs 1344 B" in lines[1]
    assert lines[2].startswith("  segment#1 on cpu: 1 node(s) [Relux1]")
    assert "  seam 'add0_o': segment#0 -> segment#1 (float [2, 16], 128 B)" in lines
    assert "  seam 'h0': segment#1 -> segment#2 (float [2, 16], 128 B)" in lines


def _fill_by_cluster(dot: str) -> dict[int, set[str]]:
    import re

    fills: dict[int, set[str]] = {}
    current = None
    for line in dot.splitlines():
        mm = re.match(r"\s*subgraph cluster_(\d+) \{", line)
        if mm:
            current = int(mm.group(1))
            fills[current] = set()
            continue
        if line.strip() == "}":
            current = None
        mm = re.search(r'fillcolor="([^"]+)"', line)
        if mm and current is not None:
            fills[current].add(mm.group(1))
    return fills


def test_plan_to_dot_clusters_and_colours():
    plan = InferenceSession(mlp(2), providers=[sim("Relu")], hetero=True).placement
    dot = plan.to_dot()
    assert dot.startswith("digraph") and dot.rstrip().endswith("}")
    assert dot.count("{") == dot.count("}")
    fills = _fill_by_cluster(dot)
    assert sorted(fills) == [s.id for s in plan.segments]
    for s in plan.segments:
        assert f'label="{s.name} on {s.provider.name}"' in dot
        assert len(fills[s.id]) == 1
    colour = {s.provider.name: next(iter(fills[s.id])) for s in plan.segments}
    for s in plan.segments:  # one colour per provider
        assert fills[s.id] == {colour[s.provider.name]}
    assert colour["cpu"] != colour["sim-gpu:0"]
    assert dot.count('label="seam"') == 3  # add0_o, h0, add1_o


def test_plan_to_dot_colours_each_gpu():
    plan = InferenceSession(mlp(4), providers=SIMS4, hetero=True, strategy="balanced").placement
    fills = _fill_by_cluster(plan.to_dot())
    colours = {s.provider.name: next(iter(fills[s.id])) for s in plan.segments}
    assert len(colours) == 4 and len(set(colours.values())) == 4


# --- the CLI -------------------------------------------------------------------------------------


def _cli_model(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(mlp(2), str(path))
    return str(path)


def _fake_dot(tmp_path) -> str:
    """A stand-in for graphviz's dot: writes an SVG wrapping the DOT it is given."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    exe = bindir / "dot"
    exe.write_text('#!/bin/sh\n# dot -Tsvg -o OUT < DOT\n{ echo "<svg>"; cat; echo "</svg>"; } > "$3"\n')
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return str(bindir)


def test_cli_plan_writes_json_and_dot(tmp_path, capsys, monkeypatch):
    from hetero_exec import cli

    model_path = _cli_model(tmp_path)
    j, d, s = tmp_path / "p.json", tmp_path / "p.dot", tmp_path / "p.svg"
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no graphviz
    rc = cli.main(["plan", model_path, "--providers", "sim-gpu,cpu", "--hetero",
                   "--json", str(j), "--dot", str(d), "--svg", str(s)])
    out = capsys.readouterr().out
    assert rc == 1
    assert "graphviz 'dot' is not installed" in out and "no SVG written" in out
    assert not s.exists()
    assert "placement (single): 1 segment(s)" in out and "segment#0 on sim-gpu:0" in out
    saved = json.loads(j.read_text())
    assert saved["format"] == "hetero_exec.placement/1"
    assert d.read_text().startswith("digraph placement")
    # the JSON is a loadable plan
    sess = InferenceSession(model_path, providers=["sim-gpu"], placement=str(j))
    x = rand(2, 16)
    assert_outputs(sess.run(None, {"x": x}), ort(mlp(2), {"x": x}))


def test_cli_plan_hetero_and_svg(tmp_path, capsys, monkeypatch):
    from hetero_exec import cli

    model_path = _cli_model(tmp_path)
    j, s = tmp_path / "p.json", tmp_path / "p.svg"
    monkeypatch.setenv("PATH", _fake_dot(tmp_path) + os.pathsep + os.environ.get("PATH", ""))
    rc = cli.main(["plan", model_path, "--providers", "sim-gpu:0,sim-gpu:1,cpu", "--hetero",
                   "--strategy", "balanced", "--json", str(j), "--svg", str(s)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "placement (balanced)" in out and "sim-gpu:1" in out
    svg = s.read_text()
    assert svg.startswith("<svg>") and "cluster_1" in svg
    assert [seg["provider"] for seg in json.loads(j.read_text())["segments"]] == ["sim-gpu:0", "sim-gpu:1"]


@pytest.mark.skipif(not __import__("shutil").which("dot"), reason="graphviz 'dot' is not installed")
def test_cli_plan_real_graphviz(tmp_path, capsys):
    from hetero_exec import cli

    s = tmp_path / "p.svg"
    rc = cli.main(["plan", _cli_model(tmp_path), "--providers", "sim-gpu:0,sim-gpu:1", "--hetero", "--svg", str(s)])
    assert rc == 0 and "<svg" in s.read_text()


def test_cli_plan_error_exit(tmp_path, capsys):
    from hetero_exec import cli

    rc = cli.main(["plan", _cli_model(tmp_path), "--providers", "tpu"])
    assert rc == 2
    assert "unknown provider" in capsys.readouterr().err
