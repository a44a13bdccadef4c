"""The stage planner (placement.stages): pure, no Ray.

Plans are built by hand (build_plan over a Relu chain, a provider per segment), with
explicit segment costs and hop models, so every expectation can be worked out by hand
or checked against a brute force over all valid cuts."""

from __future__ import annotations

import itertools
import json
import random

import numpy as np
import pytest

from hetero_exec import InferenceSession
from hetero_exec.errors import PlacementError
from hetero_exec.ir import load
from hetero_exec.placement.segments import build_plan
from hetero_exec.placement.stages import HopModel, Stage, cut_positions, plan_stages
from hetero_exec.providers import parse_provider
from tests.placement._models import chain, mlp

PROVIDERS = {name: parse_provider(name) for name in ("cpu", "sim-gpu:0", "sim-gpu:1")}
FREE_HOP = HopModel(task_s=0.0, bytes_per_s=1e30)


def plan_of(segments: list[str]):
    """One Relu per segment, segment k on ``segments[k]`` (a [16] float seam between: 64 bytes)."""
    _, graph = load(chain(["Relu"] * len(segments), n=16))
    assign = {node: PROVIDERS[p] for node, p in zip(graph.nodes, segments)}
    return build_plan(graph, graph.nodes, assign)


def devices(stages: list[Stage]) -> list[str | None]:
    return [s.device for s in stages]


def groups(stages: list[Stage]) -> list[list[int]]:
    return [s.segments for s in stages]


def test_one_device_between_cpu_segments_is_one_stage():
    plan = plan_of(["sim-gpu:0", "cpu", "sim-gpu:0", "cpu", "sim-gpu:0"])
    stages = plan_stages(plan, "auto", HopModel(), segment_costs=[1e-3] * 5)
    assert groups(stages) == [[0, 1, 2, 3, 4]] and devices(stages) == ["sim-gpu:0"]
    assert stages[0].inputs == ["x"] and stages[0].outputs == ["y"]


def test_heavy_cpu_ends_get_stages_of_their_own_when_the_hop_pays():
    plan = plan_of(["cpu", "sim-gpu:0", "cpu", "sim-gpu:0", "cpu"])
    costs = [10e-3, 4e-3, 1e-3, 4e-3, 10e-3]
    cheap = plan_stages(plan, "auto", HopModel(task_s=1e-3, bytes_per_s=1e12), costs, cores=3)
    assert groups(cheap) == [[0], [1, 2, 3], [4]]
    assert devices(cheap) == [None, "sim-gpu:0", None]
    # on one core every hop is host work: 29 + 30 ms of it per request whole, against
    # 29 + 2 x 30 ms with one cut
    dear = plan_stages(plan, "auto", HopModel(task_s=30e-3), costs, cores=1)
    assert groups(dear) == [[0, 1, 2, 3, 4]]
    # on 2 cores one cut pays (max(19 + 30, (29 + 60) / 2) = 49 ms < 59 ms), a second
    # does not (max(40, (29 + 90) / 2) = 59.5 ms)
    assert groups(plan_stages(plan, "auto", HopModel(task_s=30e-3), costs, cores=2)) == [
        [0, 1, 2, 3], [4]]
    # with a core per stage every stage pays one hop anyway: three stages
    assert len(plan_stages(plan, "auto", HopModel(task_s=30e-3), costs)) == 3


def test_auto_keeps_the_fewest_stages_among_near_equal_periods():
    plan = plan_of(["cpu", "sim-gpu:0", "cpu"])
    # a cut would shave 2% off the period: not worth an actor and a hop
    stages = plan_stages(plan, "auto", FREE_HOP, [0.02e-3, 1e-3, 0.0])
    assert len(stages) == 1


def test_each_device_gets_one_stage_and_cpu_between_goes_where_it_balances():
    plan = plan_of(["sim-gpu:0", "cpu", "sim-gpu:0", "cpu", "sim-gpu:1", "cpu", "sim-gpu:1"])
    costs = [2e-3, 1e-3, 2e-3, 0.1e-3, 1e-3, 1e-3, 2e-3]
    stages = plan_stages(plan, "auto", FREE_HOP, costs)
    # a stage of its own for the 0.1 ms cpu segment #3 would save 2%: it joins the
    # lighter device stage
    assert devices(stages) == ["sim-gpu:0", "sim-gpu:1"]
    assert groups(stages) == [[0, 1, 2], [3, 4, 5, 6]]
    assert [s.predicted_s for s in stages] == pytest.approx([5e-3, 4.1e-3], rel=1e-4)
    with pytest.raises(PlacementError, match="2 device"):
        plan_stages(plan, 1, FREE_HOP, costs)


def test_k_stages_is_the_best_k_split():
    plan = plan_of(["cpu", "sim-gpu:0", "cpu"])
    costs = [1e-3, 3e-3, 2e-3]
    two = plan_stages(plan, 2, FREE_HOP, costs)
    assert groups(two) == [[0, 1], [2]]  # 4 ms | 2 ms beats 1 ms | 5 ms
    assert len(plan_stages(plan, 3, FREE_HOP, costs)) == 3
    with pytest.raises(PlacementError, match="only 3 segment"):
        plan_stages(plan, 4, FREE_HOP, costs)
    with pytest.raises(PlacementError, match="at least 1"):
        plan_stages(plan, 0, FREE_HOP, costs)


def test_explicit_cuts_are_checked():
    plan = plan_of(["sim-gpu:0", "cpu", "sim-gpu:0", "cpu"])
    stages = plan_stages(plan, [3], FREE_HOP, [1e-3] * 4)
    assert groups(stages) == [[0, 1, 2], [3]] and devices(stages) == ["sim-gpu:0", None]
    with pytest.raises(PlacementError, match=r"sim-gpu:0 has segments #0..#2, which must run on one"):
        plan_stages(plan, [2], FREE_HOP, [1e-3] * 4)
    for bad in ([3, 3], [3, 2], [0], [4], ["1"], [True]):
        with pytest.raises(PlacementError, match="cuts"):
            plan_stages(plan, bad, FREE_HOP, [1e-3] * 4)
    for bad in ("fast", 2.5, None):
        with pytest.raises(PlacementError, match="stages must be"):
            plan_stages(plan, bad, FREE_HOP)


def test_two_devices_in_one_stage_is_refused():
    plan = plan_of(["sim-gpu:0", "sim-gpu:1"])
    with pytest.raises(PlacementError, match=r"2 devices \(sim-gpu:0, sim-gpu:1\)"):
        plan_stages(plan, [], FREE_HOP, [1e-3, 1e-3])


def test_interleaved_devices_may_span_stages():
    plan = plan_of(["sim-gpu:0", "sim-gpu:1", "sim-gpu:0"])
    stages = plan_stages(plan, "auto", FREE_HOP, [1e-3] * 3)
    assert devices(stages) == ["sim-gpu:0", "sim-gpu:1", "sim-gpu:0"]


def test_the_hop_into_a_stage_counts_its_seam_bytes():
    plan = plan_of(["cpu", "sim-gpu:0"])
    hop = HopModel(task_s=1e-3, bytes_per_s=64e3, local_bytes_per_s=1e30)
    stages = plan_stages(plan, [1], hop, [0.0, 0.0])
    # the seam is [16] float32 = 64 bytes: 1 ms + 64 B / 64 kB/s
    assert stages[1].hop_s == pytest.approx(2e-3)
    assert stages[0].hop_s == pytest.approx(1e-3)  # the feed comes from the driver: no seam
    assert stages[0].outputs == ["t0"] and stages[1].inputs == ["t0"]


def test_moves_between_providers_inside_a_stage_are_costed():
    plan = plan_of(["sim-gpu:0", "cpu", "sim-gpu:0"])
    hop = HopModel(task_s=0.0, bytes_per_s=1e30, local_bytes_per_s=64e3)
    (stage,) = plan_stages(plan, [], hop, [0.0, 0.0, 0.0])
    assert stage.compute_s == pytest.approx(2e-3)  # two 64-byte moves at 64 kB/s


def test_one_core_never_buys_a_cpu_stage_but_devices_keep_theirs():
    plan = plan_of(["cpu", "sim-gpu:0", "cpu", "sim-gpu:1", "cpu"])
    costs = [5e-3, 1e-3, 1e-3, 1e-3, 5e-3]
    hop = HopModel(task_s=1e-4, bytes_per_s=1e30)
    assert len(plan_stages(plan, "auto", hop, costs)) == 4
    assert devices(plan_stages(plan, "auto", hop, costs, cores=1)) == ["sim-gpu:0", "sim-gpu:1"]


def brute_force_period(plan, costs, hop) -> float:
    from hetero_exec.placement.stages import _Layout

    layout = _Layout(plan, [(c, 0.0, None) for c in costs], hop, {})
    n, best = len(plan.segments), float("inf")
    for k in range(n):
        for cuts in itertools.combinations(range(1, n), k):
            bounds = [0, *cuts, n]
            if all(layout.valid(a, b) for a, b in zip(bounds, bounds[1:])):
                best = min(best, max(layout.cost(a, b) for a, b in zip(bounds, bounds[1:])))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_auto_is_within_its_tolerance_of_the_best_period(seed):
    rnd = random.Random(seed)
    kinds = ["cpu", "sim-gpu:0", "sim-gpu:1"]
    segs = [rnd.choice(kinds[:2]) for _ in range(rnd.randint(2, 6))]
    if seed % 3 == 0:  # a second device after the first
        segs += ["sim-gpu:1", "cpu"]
    segs = [s for i, s in enumerate(segs) if i == 0 or s != segs[i - 1]]
    plan = plan_of(segs)
    costs = [rnd.uniform(0.1e-3, 5e-3) for _ in segs]
    hop = HopModel(task_s=rnd.uniform(0, 2e-3), bytes_per_s=1e6)
    period = max(s.predicted_s for s in plan_stages(plan, "auto", hop, costs))
    assert period <= brute_force_period(plan, costs, hop) * 1.05 + 1e-12


def test_cut_positions():
    assert cut_positions([[0], [1, 2], [3]]) == [1, 3]
    assert cut_positions([[0, 1]]) == []


# -- through the session: the option, reports, save and reload ----------------------------


def sim(*exclude: str):
    return ("sim-gpu", {"exclude_ops": list(exclude)})


def test_session_stages_option_and_report():
    m = mlp(4)  # MatMul, Add, Relu per layer: Relu declined -> 8 segments
    one = InferenceSession(m, [sim("Relu"), "cpu"], hetero=True, stages=1)
    assert len(one.placement.stages) == 1 and one.placement.stages[0].device == "sim-gpu:0"
    text = one.placement.report()
    assert "1 pipeline stage(s)" in text.splitlines()[0]
    assert "stage#0 on sim-gpu:0: segments #0..#7 (8), predicted" in text
    assert "pipeline period" in text
    cpu_tail = InferenceSession(m, [sim("Relu"), "cpu"], hetero=True, stages=[7])
    assert [s.segments for s in cpu_tail.placement.stages] == [list(range(7)), [7]]
    assert "stage#1 on cpu: segments #7" in cpu_tail.placement.report()
    with pytest.raises(PlacementError, match="must run on one actor"):
        InferenceSession(m, [sim("Relu"), "cpu"], hetero=True, stages=[3])
    x = {"x": np.ones((2, 16), np.float32)}
    np.testing.assert_allclose(cpu_tail.run(None, x)[0], InferenceSession(m).run(None, x)[0],
                               rtol=1e-5, atol=1e-6)


def test_single_provider_sessions_have_one_stage():
    sess = InferenceSession(mlp(2))
    assert [s.segments for s in sess.placement.stages] == [[0]]
    assert sess.placement.stages[0].device is None


def test_stages_survive_json_save_and_reload(tmp_path):
    m = mlp(4)
    sess = InferenceSession(m, [sim("Relu"), "cpu"], hetero=True, stages=[7])
    path = tmp_path / "plan.json"
    sess.placement.to_json(str(path))
    data = json.loads(path.read_text())
    assert [s["segments"] for s in data["stages"]] == [list(range(7)), [7]]
    assert data["stages"][1]["device"] is None and data["stages"][0]["predicted_compute_s"] > 0
    again = InferenceSession(m, [sim("Relu"), "cpu"], hetero=True, placement=str(path))
    assert [s.segments for s in again.placement.stages] == [list(range(7)), [7]]
    # the session's own stages option wins over the saved cuts
    one = InferenceSession(m, [sim("Relu"), "cpu"], hetero=True, placement=str(path), stages=1)
    assert len(one.placement.stages) == 1
    data["stages"] = [{"segments": [0, 1]}]
    path.write_text(json.dumps(data))
    with pytest.raises(PlacementError, match="'stages' must list every segment"):
        InferenceSession(m, [sim("Relu"), "cpu"], hetero=True, placement=str(path))


def test_dot_draws_a_cluster_per_stage():
    sess = InferenceSession(mlp(4), [sim("Relu"), "cpu"], hetero=True, stages=[7])
    dot = sess.placement.to_dot()
    assert dot.count("subgraph cluster_stage") == 2
    assert 'label="stage#1 on cpu' in dot and dot.count("subgraph cluster_") == 2 + 8


def test_a_stages_products_slow_down_when_stages_share_the_cores():
    """Two stages on 2 cores get a thread each, so the products each was costed with
    at 2 threads take twice as long: a cut pays only if what it overlaps is worth it."""
    plan = plan_of(["cpu", "sim-gpu:0", "cpu"])
    for seg, (fixed, product) in zip(plan.segments, [(1e-3, 8e-3), (1e-3, 1e-3), (1e-3, 0.0)]):
        seg.compute_cost, seg.product_cost, seg.cost_threads = fixed + product, product, 2
    hop = HopModel(task_s=1e-4, bytes_per_s=1e30)
    one = plan_stages(plan, 1, hop, cores=2)
    assert one[0].compute_s == pytest.approx(12e-3, rel=1e-3)  # at 2 threads, as costed
    two = plan_stages(plan, 2, hop, cores=2)
    # the heavy products of segment #0 run on one thread each stage: 1 + 16 ms alone
    assert two[0].compute_s == pytest.approx(17e-3, rel=1e-3)
    # so, on 2 cores, one actor with both threads has the shorter period
    assert len(plan_stages(plan, "auto", hop, cores=2)) == 1
    # products that do not dominate: the cut halves the period and pays
    for seg, (fixed, product) in zip(plan.segments, [(6e-3, 0.0), (1e-3, 0.0), (6e-3, 0.0)]):
        seg.compute_cost, seg.product_cost = fixed + product, product
    assert len(plan_stages(plan, "auto", hop, cores=2)) > 1
