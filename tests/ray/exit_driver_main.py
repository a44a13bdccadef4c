"""A driver that builds a Ray session, serves one request and exits without closing it
(``hard``: without even Python's own shutdown). Prints its actors and placement group.

    python -m tests.ray.exit_driver_main GCS_ADDRESS soft|hard
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from hetero_exec import InferenceSession
from tests.ray.models import mlp


def main() -> None:
    address, mode = sys.argv[1], sys.argv[2]
    sess = InferenceSession(
        mlp(layers=2),
        [("sim-gpu", {"exclude_ops": ["Relu"]}), "cpu"],
        hetero=True,
        executor="ray",
        ray_address=address,
        stages=[3],
    )
    sess.run(None, {"x": np.ones((128, 32), np.float32)})  # 16 KiB seams
    report = {
        "actors": [h._actor_id.hex() for h in sess.stage_actors],
        "placement_group": sess._executor.reservation.pg.id.hex(),
    }
    print(json.dumps(report), flush=True)
    if mode == "hard":
        os._exit(0)  # no close(), no atexit, no ray.shutdown()


if __name__ == "__main__":
    main()
