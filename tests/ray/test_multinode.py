"""Multi-node placement on a ray.cluster_utils.Cluster (3 nodes, logical GPUs on two).

It runs in its own process (tests/ray/multinode_main.py): a Cluster needs its own
Ray, and the shared test Ray of the other modules must stay up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.ray


def test_four_device_plan_spread_across_nodes():
    pytest.importorskip("ray")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.ray.multinode_main"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["nodes"] == 3
    assert report["segments"] == ["sim-gpu:0", "sim-gpu:1", "sim-gpu:2", "sim-gpu:3"]
    assert report["actor_nodes"] == 2  # the two GPU nodes, two devices each
    assert report["match"] is True
    assert report["gpu_shares"] == [1.0, 1.0, 1.0, 1.0]
    assert report["seam_transport"] == "object_store"  # "auto" across nodes
    assert "STRICT_SPREAD needs 4 nodes" in report["strict_spread"]
    assert report["leftover_actors"] == 0
