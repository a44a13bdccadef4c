"""A multi-node check in its own process: a ray.cluster_utils.Cluster of 3 nodes (a
CPU head, two workers with 2 logical GPUs each), a 4-device sim-gpu plan spread
across them, outputs compared with the local executor. Prints one JSON line.

Run by tests/ray/test_multinode.py (a separate process, so the shared test Ray is
untouched); also runnable by hand: ``python -m tests.ray.multinode_main``.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
import ray
from ray.cluster_utils import Cluster

from hetero_exec import InferenceSession
from hetero_exec.errors import ActorError
from tests.ray.models import mlp

DEVICES = ["sim-gpu:0", "sim-gpu:1", "sim-gpu:2", "sim-gpu:3", "cpu"]


def main() -> int:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    started = time.monotonic()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "num_gpus": 0,
            "resources": {"head": 1},
            "include_dashboard": False,
            "object_store_memory": 256 << 20,
        },
    )
    workers = [
        cluster.add_node(
            num_cpus=1, num_gpus=2, resources={f"gpu_node_{i}": 1}, object_store_memory=256 << 20
        )
        for i in range(2)
    ]
    ray.init(
        address=cluster.address, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": root}}
    )
    cluster.wait_for_nodes()
    report: dict = {"nodes": len([n for n in ray.nodes() if n["Alive"]]), "workers": len(workers)}
    try:
        model = mlp(width=32, layers=4)
        x = np.random.default_rng(0).standard_normal((4, 32)).astype(np.float32)
        want = InferenceSession(model, ["cpu"]).run(None, {"x": x})[0]
        with InferenceSession(
            model,
            DEVICES,
            hetero=True,
            strategy="greedy",
            executor="ray",
            ray_address="auto",
            placement_strategy="SPREAD",
        ) as sess:
            ex = sess._executor
            info = ray.get([h.ready.remote() for h in sess.stage_actors])
            report["segments"] = [s.provider_name for s in sess.placement.segments]
            report["actor_nodes"] = len({i["node"] for i in info})
            got = sess.run_many([{"x": x}] * 8)
            report["match"] = all(np.allclose(g[0], want, rtol=1e-5, atol=1e-6) for g in got)
            report["gpu_shares"] = [s.num_gpus for s in ex.slots]
            report["seam_transport"] = ex.opts.seam_transport
        try:
            InferenceSession(
                model, DEVICES, hetero=True, executor="ray", placement_strategy="STRICT_SPREAD"
            )
            report["strict_spread"] = "placed"
        except ActorError as e:
            report["strict_spread"] = str(e)[:80]
        from tests.ray.helpers import eventually, live_stage_actors

        report["leftover_actors"] = (
            0 if eventually(lambda: not live_stage_actors()) else len(live_stage_actors())
        )
    finally:
        ray.shutdown()
        cluster.shutdown()
    report["seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
