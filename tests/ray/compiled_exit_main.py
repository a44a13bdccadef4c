"""A driver on the embedded default (a local Ray it starts itself) that runs a session
through Ray's compiled graphs and exits without closing it or Ray. Prints the pid of
the raylet it started and the compiled-graph semaphores that raylet holds meanwhile.

    python -m tests.ray.compiled_exit_main
"""

from __future__ import annotations

import json

import numpy as np

from actors.connect import raylet_pid, raylet_semaphores
from hetero_exec import InferenceSession
from tests.ray.models import mlp


def main() -> None:
    sess = InferenceSession(mlp(layers=1), [("sim-gpu", {"exclude_ops": ["Relu"]}), "cpu"],
                            hetero=True, executor="ray", ray_compiled=True, stages=2)
    for i in range(3):
        sess.run(None, {"x": np.full((2, 32), i, np.float32)})
    pid = raylet_pid()
    held = [] if pid is None else raylet_semaphores(pid)
    print(json.dumps({"raylet": pid, "semaphores": len(held)}), flush=True)


if __name__ == "__main__":
    main()
