"""Session start-up with no cache anywhere against a warm start, ``--procs`` processes at
once (stage actors on a fresh node start together).

Each process imports hetero_exec, builds an InferenceSession on a model (bench/models.py)
and runs it once; it reports the seconds from its start to the first result. "cold":
the package's own caches (every __pycache__ under hetero_exec/: its bytecode) are
deleted; "warm": the same
processes again, with what the cold ones left. (The dependencies' bytecode stays: an
install compiles it.) The C kernels are the build's (setup.py):
nothing of theirs is compiled at run time in either case.

    python bench/bench_cold_start.py --procs 4 --models resnet18,bert
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import sys, time, json
t0 = time.perf_counter()
sys.path.insert(0, {root!r})
import hetero_exec as ort
from bench.models import MODELS, inputs
m = MODELS[{model!r}]()
sess = ort.InferenceSession(m.SerializeToString(), providers=["cpu"])
t1 = time.perf_counter()
sess.run(None, inputs({model!r}, 1, seq=16) if {model!r} in ("bert", "gpt2") else inputs({model!r}, 1))
t2 = time.perf_counter()
from hetero_exec.kernels.native import library
print(json.dumps({{"build_s": t1 - t0, "first_run_s": t2 - t1, "total_s": t2 - t0,
                  "native": library.describe()}}))
"""


def _round(env: dict[str, str], model: str, procs: int) -> list[dict]:
    code = CHILD.format(root=str(ROOT), model=model)
    ps = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True) for _ in range(procs)]
    out = []
    for p in ps:
        stdout, stderr = p.communicate(timeout=600)
        if p.returncode:
            raise RuntimeError(stderr[-2000:])
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--models", default="resnet18,bert")
    args = ap.parse_args()
    for model in args.models.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            env = dict(os.environ, TMPDIR=tmp)
            for cache in (ROOT / "hetero_exec").rglob("__pycache__"):
                shutil.rmtree(cache, ignore_errors=True)
            t = time.perf_counter()
            cold = _round(env, model, args.procs)
            cold_wall = time.perf_counter() - t
            t = time.perf_counter()
            warm = _round(env, model, args.procs)
            warm_wall = time.perf_counter() - t
        for name, rows, wall in (("cold", cold, cold_wall), ("warm", warm, warm_wall)):
            tot = [r["total_s"] for r in rows]
            print(f"{model:9s} {name}: {args.procs} procs, to first result median "
                  f"{statistics.median(tot):.2f} s (max {max(tot):.2f}; build "
                  f"{statistics.median(r['build_s'] for r in rows):.2f} s), wall {wall:.2f} s;"
                  f" {rows[0]['native']}")


if __name__ == "__main__":
    main()
