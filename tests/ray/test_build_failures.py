"""SEMANTICS.md section 6 on Ray: a failed session build releases its actors and
placement group before the error reaches the caller, and fails in bounded time."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
import ray
from onnx import helper
from ray.util.placement_group import placement_group, remove_placement_group

from actors.coordinator import RayExecutor
from hetero_exec import InferenceSession
from hetero_exec.errors import ActorError, UnsupportedOperatorError
from tests.ray.helpers import eventually, live_placement_groups, live_stage_actors
from tests.ray.models import hand_build, mlp, options

pytestmark = pytest.mark.ray


@pytest.fixture
def nothing_leaks(ray_session):
    actors, groups = live_stage_actors(), live_placement_groups()
    yield
    assert eventually(lambda: live_stage_actors() <= actors), "stage actors leaked"
    assert eventually(lambda: live_placement_groups() <= groups), "placement groups leaked"


def test_more_devices_than_the_cluster_has_fails_at_once(nothing_leaks):
    from hetero_exec.placement.partition import CostModel

    devices = [f"sim-gpu:{i}" for i in range(6)]  # 6 GPU bundles, the cluster has 4 GPUs
    even = CostModel(per_node_s=1.0)  # every node alike: one of the 6 nodes per device
    started = time.monotonic()
    with pytest.raises(ActorError, match=r"cannot be placed.*GPU: needs 6, cluster has 4"):
        InferenceSession(mlp(layers=3), devices + ["cpu"], hetero=True, executor="ray",
                         cost_model=even)
    assert time.monotonic() - started < 10


def test_busy_cluster_fails_after_a_bounded_wait(nothing_leaks):
    # the sessions of earlier tests release their placement groups asynchronously:
    # wait for them, or a CPU freed after the blocker was sized would let the plan in
    total = ray.cluster_resources().get("CPU", 0)
    eventually(lambda: ray.available_resources().get("CPU", 0) >= total)
    free = ray.available_resources().get("CPU", 0)
    blocker = placement_group([{"CPU": free}])  # every free CPU, held by someone else
    ray.get(blocker.ready(), timeout=30)
    try:
        started = time.monotonic()
        with pytest.raises(ActorError, match="was not placed within 2s"):
            InferenceSession(
                mlp(layers=1),
                [("sim-gpu", {"exclude_ops": ["Relu"]}), "cpu"],
                hetero=True,
                executor="ray",
                placement_timeout_s=2,
            )
        assert time.monotonic() - started < 15
    finally:
        remove_placement_group(blocker)


def test_strict_spread_on_one_node_is_refused(nothing_leaks):
    with pytest.raises(ActorError, match="STRICT_SPREAD needs 2 nodes"):
        InferenceSession(
            mlp(layers=1),
            [("sim-gpu", {"exclude_ops": ["Relu"]}), "cpu"],
            hetero=True,
            executor="ray",
            placement_strategy="STRICT_SPREAD",
            stages=2,
        )


def test_a_segment_that_fails_to_build_in_its_actor_releases_the_others(nothing_leaks):
    # a node no provider has a kernel for, placed by hand (the session would refuse it
    # up front): the actor's compile fails, after the other actors have started
    g = helper.make_graph(
        [
            helper.make_node("Relu", ["x"], ["a"]),
            helper.make_node("Frobnicate", ["a"], ["y"], domain="x.y"),
        ],
        "bad",
        [helper.make_tensor_value_info("x", 1, [2])],
        [helper.make_tensor_value_info("y", 1, [2])],
    )
    model = helper.make_model(
        g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("x.y", 1)]
    )
    graph, build = hand_build(model, ["sim-gpu:0", "cpu"])
    with pytest.raises(UnsupportedOperatorError, match="Frobnicate"):
        RayExecutor(graph, build, options())


def test_session_still_builds_after_failures(ray_session):
    with InferenceSession(mlp(layers=1), ["sim-gpu", "cpu"], hetero=True, executor="ray") as sess:
        x = np.ones((1, 32), np.float32)
        np.testing.assert_allclose(
            sess.run(None, {"x": x})[0],
            InferenceSession(mlp(layers=1), ["cpu"]).run(None, {"x": x})[0],
            rtol=1e-5, atol=1e-6,  # sim-gpu's products round once from float64
        )


def test_a_plan_the_stage_option_cannot_split_is_refused_before_any_actor(nothing_leaks):
    from hetero_exec.errors import PlacementError

    with pytest.raises(PlacementError, match="must run on one actor"):
        InferenceSession(
            mlp(layers=2),
            [("sim-gpu", {"exclude_ops": ["Relu"]}), "cpu"],
            hetero=True,
            executor="ray",
            stages=[1],  # a cut inside the device's segments
        )



def test_stage_actors_of_another_checkout_are_named_at_build(tmp_path):
    """A driver whose stage actors import other hetero_exec sources (a copy with one
    comment added) fails each build at once with an error naming both checkouts. Before,
    a generation ring whose frames the two sides read differently waited out the
    driver's timeout."""
    import json
    import os
    import shutil
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    other = tmp_path / "other_checkout"
    for package in ("hetero_exec", "actors"):
        shutil.copytree(os.path.join(root, package), other / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    with open(other / "actors" / "generation" / "group.py", "a") as f:
        f.write("# a later edit: the frames may differ\n")
    here = tmp_path / "driver"  # Ray puts the driver's folder first on its workers' path
    here.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    env["PYTHONPATH"] = root
    done = subprocess.run([sys.executable, "-m", "tests.ray.other_checkout_main", str(other)],
                          cwd=here, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    for what, label in (("session", r"the stage actor of stage#0 \(sim-gpu:0\): .+?"),
                        ("generation", r"stage#0 \(sim-gpu:0\)")):
        got = report[what]
        assert got["type"] == "CodeMismatchError", got
        assert re.match(rf"{label} runs other hetero_exec sources than this driver: "
                        rf"{re.escape(str(other))} \(digest \w+\) against {re.escape(root)} ",
                        got["message"]), got["message"]
        assert got["s"] < 60, got
