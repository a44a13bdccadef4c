"""A driver on the embedded default (a local Ray it starts itself) that ends badly with a
live Ray session: ``raise`` (an exception out of the function that built it, so the
traceback holds the session), ``exit3`` (``sys.exit(3)``, the session a module global)
or ``sigterm`` (waits to be killed). Prints its Ray's session folder and pids first.

    python -m tests.ray.failing_driver_main raise|exit3|sigterm
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from hetero_exec import InferenceSession
from tests.ray.models import mlp


def build(width: int = 32) -> InferenceSession:
    """A session on stage actors (width 256: stages too large to travel inline in their
    actors' constructors, which load them after)."""
    sess = InferenceSession(mlp(width, layers=2), [("sim-gpu", {"exclude_ops": ["Relu"]}),
                                                   "cpu"], hetero=True, executor="ray")
    sess.run(None, {"x": np.ones((2, width), np.float32)})
    from ray._private import worker

    node = worker._global_node
    pids = [p.process.pid for procs in node.all_processes.values() for p in procs]
    print(json.dumps({"session_dir": node.get_session_dir_path(), "pids": pids}), flush=True)
    return sess


def main() -> None:
    mode = sys.argv[1]
    if mode == "raise":
        sess = build()  # noqa: F841 - the traceback's frame holds it
        raise RuntimeError("user code fails")
    global SESSION
    SESSION = build(256 if mode == "exit3" else 32)
    if mode == "exit3":
        sys.exit(3)
    while True:  # sigterm: the test kills it
        time.sleep(0.1)


if __name__ == "__main__":
    main()
