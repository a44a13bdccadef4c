"""A driver whose stage actors import another checkout than it does (``runtime_env``'s
PYTHONPATH naming a copy with one file changed, as when a job's path and an editable
install disagree): each build must fail at once with a `CodeMismatchError`. Run from a
folder of its own (Ray puts the driver's folder first on its workers' path), on a local
Ray it starts; prints one JSON line: for each build, the error's type, message and the
seconds it took.

    python -m tests.ray.other_checkout_main <copy of the checkout>
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np  # noqa: F401 - the session's inputs

from hetero_exec import InferenceSession
from tests.genai._ref import model_path
from tests.ray.models import mlp


def attempt(build) -> dict[str, object]:
    started = time.monotonic()
    try:
        build()
    except Exception as e:  # the outcome is the report
        return {"type": type(e).__name__, "message": str(e), "s": time.monotonic() - started}
    return {"type": None, "message": "built", "s": time.monotonic() - started}


def main() -> None:
    import hetero_exec.genai as og

    env = {"env_vars": {"PYTHONPATH": sys.argv[1]}}
    report = {
        "session": attempt(lambda: InferenceSession(
            mlp(layers=2), [("sim-gpu", {"exclude_ops": ["Relu"]}), "cpu"], hetero=True,
            executor="ray", runtime_env=env)),
        "generation": attempt(lambda: og.Model(
            model_path("llama", "optimum"), executor="ray", stages=2,
            providers=["sim-gpu:0", "sim-gpu:1"], runtime_env=env)),
    }
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
