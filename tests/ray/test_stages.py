"""Real heterogeneous plans on Ray: the benchmark models with device declines that
give 10-30 segments place on this small cluster as a few stage actors (one per
device), two sessions built one after the other in one driver both place, and their
outputs equal the cpu executor's."""

from __future__ import annotations

import numpy as np
import pytest
import ray

from bench.models import MODELS, inputs, mlp
from hetero_exec import InferenceSession

pytestmark = pytest.mark.ray

#: op types the device declines, as real GPU capability gaps do: 15-19 segments each
DECLINES = {
    "mlp": ["Relu"],
    "resnet18": ["MaxPool", "Add"],
    "bert": ["Softmax", "Erf"],
    "gpt2": ["Softmax", "Tanh"],
}


def model_of(name: str):
    return mlp(layers=8) if name == "mlp" else MODELS[name]()


def mixed(name: str, *devices: str):
    return [(d, {"exclude_ops": DECLINES[name]}) for d in devices or ("sim-gpu",)] + ["cpu"]


def assert_close(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.timeout(600)
def test_real_plans_place_whatever_their_segment_count(ray_session):
    """Four sessions of 15-19 segments each, built one after the other and none closed
    until the end (as in a notebook): each places as one actor per device."""
    sessions = []
    try:
        for name in DECLINES:
            m = model_of(name)
            sess = InferenceSession(m, mixed(name), hetero=True, executor="ray", max_inflight=4)
            sessions.append((name, m, sess))
            plan = sess.placement
            assert 10 <= len(plan.segments) <= 30, (name, len(plan.segments))
            # one device: its stage holds the cpu segments between its own
            devices = [s.device for s in plan.stages if s.device is not None]
            assert devices == ["sim-gpu:0"], (name, [s.segments for s in plan.stages])
            assert len(sess.stage_actors) == len(plan.stages) <= 3
            assert {sp.device for sp in sess._executor.specs} <= {"sim-gpu:0", "cpu"}
        for name, m, sess in sessions:
            feeds = [inputs(name, batch, seed=batch, seq=8) for batch in (1, 2, 2)]
            local = InferenceSession(m, ["cpu"])
            got = [sess.run(None, feeds[0]), *sess.run_many(feeds[1:])]
            for g, f in zip(got, feeds):
                assert_close(g, local.run(None, f))
    finally:
        for *_, sess in sessions:
            sess.close()


def test_a_second_session_places_beside_the_first(ray_session):
    first = InferenceSession(model_of("resnet18"), mixed("resnet18"), hetero=True, executor="ray")
    try:
        free = ray.available_resources().get("CPU", 0.0)
        second = InferenceSession(model_of("mlp"), mixed("mlp"), hetero=True, executor="ray")
        try:
            # each stage reserves a fraction of a CPU, so a small machine holds many
            reserved = sum(s.num_cpus for s in second._executor.slots)
            assert reserved <= 0.25 * len(second.stage_actors) < free
            x = inputs("mlp", 3, seed=0)
            assert_close(second.run(None, x), InferenceSession(model_of("mlp")).run(None, x))
        finally:
            second.close()
    finally:
        first.close()


def test_two_devices_give_a_stage_each(ray_session):
    name = "bert"
    m = model_of(name)
    with InferenceSession(m, mixed(name, "sim-gpu:0", "sim-gpu:1"), hetero=True,
                          strategy="balanced", executor="ray") as sess:
        stages = sess.placement.stages
        assert [s.device for s in stages if s.device] == ["sim-gpu:0", "sim-gpu:1"]
        assert len(sess.stage_actors) == len(stages)
        text = sess.placement.report()
        assert "stage#1 on sim-gpu:1" in text and "pipeline period" in text
        feeds = [inputs(name, 2, seed=i, seq=8) for i in range(6)]
        local = InferenceSession(m, ["cpu"])
        for g, f in zip(sess.run_many(feeds), feeds):
            assert_close(g, local.run(None, f))
        stats = sess._executor.stage_stats()
        assert all(v["runs"] >= 6 for v in stats.values())


def test_a_saved_plan_brings_its_stages_to_ray(ray_session, tmp_path):
    from tests.ray.models import mlp as small_mlp

    m = small_mlp(layers=2)  # Relu declined: dev, cpu, dev, cpu
    providers = [("sim-gpu", {"exclude_ops": ["Relu"]}), "cpu"]
    path = tmp_path / "plan.json"
    InferenceSession(m, providers, hetero=True, stages=[3]).placement.to_json(str(path))
    with InferenceSession(m, providers, hetero=True, executor="ray", placement=str(path)) as sess:
        assert [s.segments for s in sess.placement.stages] == [[0, 1, 2], [3]]
        assert len(sess.stage_actors) == 2
        x = {"x": np.random.default_rng(3).standard_normal((2, 32)).astype(np.float32)}
        assert_close(sess.run(None, x), InferenceSession(m).run(None, x))


@ray.remote(num_cpus=0.25)
class _Replica:
    """What a Serve replica with placement_group_bundles does: drive its own stages."""

    def __init__(self, model_bytes: bytes, providers, stages):
        self.sess = InferenceSession(model_bytes, providers, hetero=True, executor="ray",
                                     placement_group="current", stages=stages)

    def run(self, feed):
        return self.sess.run(None, feed)

    def placed(self):
        from ray.util import get_current_placement_group

        ex = self.sess._executor
        return {"pg": get_current_placement_group().id.hex(),
                "own": ex.reservation.pg.id.hex(),
                "bundles": [s.bundle + ex.reservation.first_bundle for s in ex.slots]}

    def close(self):
        self.sess.close()


def test_stage_actors_go_into_the_callers_placement_group(ray_session):
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    import actors
    from tests.ray.models import mlp as small_mlp

    m = small_mlp(layers=2)
    providers = [("sim-gpu", {"exclude_ops": ["Relu"]}), "cpu"]
    bundles = actors.stage_bundles(m, providers, hetero=True, stages=[3])
    assert bundles == [{"CPU": 0.25, "GPU": 1.0}, {"CPU": 0.25}]
    pg = placement_group([{"CPU": 0.25}, *bundles])
    ray.get(pg.ready(), timeout=60)
    try:
        replica = _Replica.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=0,
            placement_group_capture_child_tasks=True)).remote(m.SerializeToString(), providers,
                                                              [3])
        where = ray.get(replica.placed.remote())
        assert where["own"] == where["pg"] == pg.id.hex() and where["bundles"] == [1, 2]
        x = {"x": np.random.default_rng(0).standard_normal((2, 32)).astype(np.float32)}
        assert_close(ray.get(replica.run.remote(x)), InferenceSession(m).run(None, x))
        ray.get(replica.close.remote())
        ray.kill(replica)
    finally:
        remove_placement_group(pg)
    # without a placement group to join, the session says so
    with pytest.raises(Exception, match="does not run in a placement group"):
        InferenceSession(m, providers, hetero=True, executor="ray", placement_group="current")
