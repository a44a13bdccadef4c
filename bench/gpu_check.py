"""The device check: one prepared script for a lent GPU machine (bench/README.md).

It runs from the working tree on PYTHONPATH (no ``pip install`` of the project; the GPU
machine reaches no registry), within a time budget, and writes ``gpu_check.json`` and
``gpu_check.md`` (the table) to the folder named by ``--out``, after every section, so a
run that is cut short still leaves what it measured. Each section has a share of the
budget (``SHARES``, ``--shares``). Sections, in order:

1. ``env``: versions, CuPy's package, CUDA runtime and driver, the device, Ray.
2. ``node_suite``: the ONNX node suite on ``gpu`` with the GPU required: pass count over
   the claimed cases. Cases run in a fixed shuffled order, so a run cut short by its
   share is a uniform sample (``attempted`` says how many). It goes first: its figure
   matters most, and the CuPy kernels it compiles are cached for the later sections.
3. ``models``: the benchmark models (bench/models.py) on ``gpu`` against ``cpu`` (outputs)
   with latency against onnxruntime on the same machine (its CPU provider, and its CUDA
   provider when that onnxruntime has one), timed in turns.
4. ``hetero_local``: gpu + cpu mixed plans in process (the demo detector, whose NMS the
   GPU declines, and the MLP and BERT with a node pinned to cpu), outputs against cpu.
5. ``hetero_ray``: the same plans with ``executor="ray"`` (public API only), in a child
   process with its own timeout, so a Ray start that hangs cannot take the check down.
6. ``cuda_graph`` (``--cuda-graph``, experimental): replay of captured static gpu
   segments against eager runs (providers/gpu_graphs.py), behind a capability check.

Without a usable GPU the gpu parts report "unavailable" with CuPy's reason and the cpu
parts still run (a dry run). ``--gpu-provider sim-gpu`` rehearses every part on sim-gpu.

    bash bench/gpu_check.sh OUT_DIR                 # on the GPU machine (installs .whl/)
    python bench/gpu_check.py --out /tmp/gc         # here: a dry run
    python bench/gpu_check.py --out /tmp/gc --gpu-provider sim-gpu --budget 300
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
import warnings
import zlib
from typing import Any, Callable

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

#: nodes pinned to cpu so a benchmark model alternates devices (tests/ray/test_bench_models_ray.py)
PINS = {"mlp": ["Relu_1"], "resnet18": ["Relu_4"], "bert": ["MatMul_30"], "gpt2": ["Transpose_16"]}
RTOL, ATOL = 1e-3, 1e-4
#: seconds each section may take at most (--shares overrides); they add up to the budget
SHARES = {"node_suite": 170, "models": 110, "hetero_local": 30, "hetero_ray": 90, "cuda_graph": 40}


class Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def _median_ms(fn: Callable[[], Any], runs: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def _interleaved_ms(fns: dict[str, Callable[[], Any]], runs: int) -> dict[str, float]:
    """Median ms of each function, run in turns (a, b, c, a, b, c...) after one warm-up
    each, so a change in machine load hits them alike."""
    for fn in fns.values():
        fn()
    ts: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(runs):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            ts[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) * 1e3 for k, v in ts.items()}


def _diff(ref: list, got: list) -> tuple[float, bool]:
    worst, ok = 0.0, len(ref) == len(got)
    for a, b in zip(ref, got):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape or a.dtype != b.dtype:
            return float("inf"), False
        if a.dtype.kind in "fc":
            worst = max(worst, float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)), initial=0)))
            ok = ok and bool(np.allclose(b, a, rtol=RTOL, atol=ATOL, equal_nan=True))
        else:
            ok = ok and bool(np.array_equal(a, b))
    return worst, ok


def _gpu_spec(args) -> Any:
    return args.gpu_provider


# --- 1. environment ------------------------------------------------------------------------

def check_env(args) -> dict:
    from hetero_exec.providers import parse_provider

    out: dict[str, Any] = {"python": platform.python_version(), "numpy": np.__version__,
                           "machine": platform.machine(), "cpus": os.cpu_count()}
    for mod in ("onnx", "onnxruntime", "ray", "ml_dtypes"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            out[mod] = f"unavailable ({type(e).__name__}: {e})"
    try:
        import onnxruntime as ort

        out["onnxruntime_providers"] = ort.get_available_providers()
    except Exception:  # noqa: BLE001
        pass
    gpu = parse_provider(_gpu_spec(args))
    sup = gpu.available()
    out["gpu_provider"] = gpu.name
    out["gpu_available"] = bool(sup)
    out["gpu_unavailable_reason"] = sup.reason or None
    if gpu.kind == "gpu":
        try:
            import cupy as cp

            from hetero_exec.providers.gpu import cupy_info

            out["cupy"] = cupy_info(cp)
            if sup:
                props = cp.cuda.runtime.getDeviceProperties(gpu.options.device_id)
                name = props["name"]
                out["device"] = name.decode() if isinstance(name, bytes) else str(name)
                out["device_count"] = cp.cuda.runtime.getDeviceCount()
                out["device_memory_gib"] = round(props["totalGlobalMem"] / 2**30, 1)
        except Exception as e:  # noqa: BLE001
            out["cupy"] = f"not importable ({type(e).__name__}: {e})"
    return out


# --- 2. benchmark models -------------------------------------------------------------------

def _ort_sessions(data: bytes) -> dict:
    import onnxruntime as ort

    out = {}
    for prov in ("CPUExecutionProvider", "CUDAExecutionProvider"):
        if prov not in ort.get_available_providers():
            continue
        so = ort.SessionOptions()
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        out["ort_cpu" if prov.startswith("CPU") else "ort_cuda"] = ort.InferenceSession(
            data, so, providers=[prov])
    return out


def check_models(args, deadline: Deadline) -> dict:
    from bench.models import MODELS, inputs
    from hetero_exec import InferenceSession
    from hetero_exec.errors import HeterogeneousPlacementRequired

    rows, unavailable = [], None
    for name in args.models:
        if deadline.left() < 20:
            rows.append({"model": name, "skipped": "out of time"})
            continue
        model = MODELS[name]()
        data = model.SerializeToString()
        cpu = InferenceSession(data, providers=["cpu"])
        gpu = None
        if unavailable is None:
            try:
                gpu = InferenceSession(data, providers=[_gpu_spec(args)], require_gpu=True)
            except HeterogeneousPlacementRequired as e:
                unavailable = e.report.unavailable or e.report.grouped()
        ort_sessions = _ort_sessions(data)
        for batch in args.batches:
            feed = inputs(name, batch, seq=args.seq) if name in ("bert", "gpt2") else inputs(name, batch)
            row: dict[str, Any] = {"model": name, "batch": batch}
            ref = cpu.run(None, feed)
            fns: dict[str, Callable[[], Any]] = {}
            if args.time_cpu:  # our cpu provider's latency: optional, the reference run is not
                fns["cpu"] = lambda: cpu.run(None, feed)
            for key, sess in ort_sessions.items():
                fns[key] = functools.partial(sess.run, None, feed)
            if gpu is not None:
                t0 = time.perf_counter()
                got = gpu.run(None, feed)  # the first run compiles CuPy's kernels
                row["gpu_first_run_ms"] = (time.perf_counter() - t0) * 1e3
                row["max_abs_diff"], row["match"] = _diff(ref, got)
                fns["gpu"] = lambda: gpu.run(None, feed)
            row.update({f"{k}_ms": v for k, v in _interleaved_ms(fns, args.runs).items()})
            if gpu is not None:
                if "ort_cpu_ms" in row:
                    row["gpu_over_ort_cpu"] = row["gpu_ms"] / row["ort_cpu_ms"]
                if "ort_cuda_ms" in row:
                    row["gpu_over_ort_cuda"] = row["gpu_ms"] / row["ort_cuda_ms"]
            rows.append(row)
            logging.info("models: %s", row)
    return {"rows": rows, "gpu_unavailable": unavailable}


# --- 3./4. mixed plans ---------------------------------------------------------------------

def _mixed_cases(args) -> list[tuple[str, Any, dict, dict]]:
    """(label, model, feed, session options) of the mixed plans."""
    from bench.models import MODELS, inputs
    from hetero_exec.demo import demo_inputs, detector_model

    cases = [("detector (NMS declined)", detector_model(), demo_inputs(), {})]
    for name in args.mixed_models:
        feed = inputs(name, 2, seq=16) if name in ("bert", "gpt2") else inputs(name, 2)
        cases.append((f"{name} (pinned {','.join(PINS[name])})", MODELS[name](), feed,
                      {"affinity": [(p, "cpu") for p in PINS[name]]}))
    return cases


def _describe(sess) -> dict:
    plan = sess.placement
    out: dict[str, Any] = {"providers": sess.get_providers()}
    if plan is not None:
        out["segments"] = [f"{s.name}:{s.provider.name}:{len(s.nodes)}" for s in plan.segments]
        out["seams"] = len(plan.seams)
        stages = getattr(plan, "stages", None)
        if stages:
            out["stages"] = len(stages)
    if sess.fallback_report is not None:
        out["fallback"] = str(sess.fallback_report)[:300]
    actors = getattr(sess, "stage_actors", None)
    if actors:
        out["actors"] = len(actors)
    return out


def check_mixed(args, executor: str, deadline: Deadline) -> list[dict]:
    from hetero_exec import InferenceSession

    rows = []
    for label, model, feed, opts in _mixed_cases(args):
        if deadline.left() < 15:
            rows.append({"case": label, "skipped": "out of time"})
            continue
        row: dict[str, Any] = {"case": label, "executor": executor}
        try:
            ref = InferenceSession(model, ["cpu"]).run(None, feed)
            with InferenceSession(model, [_gpu_spec(args), "cpu"], hetero=True, executor=executor,
                                  **opts) as sess:
                row.update(_describe(sess))
                got = sess.run(None, feed)
                row["max_abs_diff"], row["match"] = _diff(ref, got)
                row["ms"] = _median_ms(lambda: sess.run(None, feed), args.runs)
        except Exception as e:  # noqa: BLE001 - one case must not hide the others
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        rows.append(row)
        logging.info("mixed/%s: %s", executor, row)
    return rows


def check_ray(args, deadline: Deadline) -> dict:
    """The Ray part in a child process (``--ray-child``), killed if it overruns."""
    budget = max(10, min(args.ray_timeout, deadline.left() - 5))
    path = os.path.join(args.out, "ray_child.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--out", args.out, "--ray-child",
           "--gpu-provider", str(args.gpu_provider), "--runs", str(args.runs),
           "--mixed-models", ",".join(args.mixed_models), "--budget", str(int(budget))]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=budget, start_new_session=True)
    except subprocess.TimeoutExpired as e:
        return {"error": f"timed out after {budget:.0f} s", "log_tail": (e.stdout or "")[-2000:]
                if isinstance(e.stdout, str) else ""}
    out: dict[str, Any] = {"seconds": round(time.monotonic() - t0, 1), "returncode": proc.returncode}
    if os.path.exists(path):
        with open(path) as f:
            out.update(json.load(f))
        os.remove(path)
    if proc.returncode != 0 or "rows" not in out:
        out["log_tail"] = (proc.stdout + proc.stderr)[-3000:]
    return out


def ray_child(args) -> int:
    deadline = Deadline(args.budget)
    out: dict[str, Any] = {}
    try:
        import ray

        num_gpus = 0
        if str(args.gpu_provider).startswith("gpu"):
            try:
                import cupy as cp

                num_gpus = cp.cuda.runtime.getDeviceCount()
            except Exception:  # noqa: BLE001 - no device: the session falls back to cpu
                num_gpus = 0
        else:
            num_gpus = 1  # sim-gpu segment actors reserve a logical GPU
        t0 = time.monotonic()
        # address="local": a Ray of its own, never one that is already running on the host
        ray.init(address="local", num_cpus=max(4, os.cpu_count() or 4), num_gpus=num_gpus,
                 include_dashboard=False,
                 log_to_driver=False, logging_level=logging.WARNING,
                 runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", ROOT)}})
        out["ray_version"] = ray.__version__
        out["ray_init_s"] = round(time.monotonic() - t0, 1)
        out["rows"] = check_mixed(args, "ray", deadline)
        ray.shutdown()
    except Exception:  # noqa: BLE001
        out["error"] = traceback.format_exc()[-2000:]
    with open(os.path.join(args.out, "ray_child.json"), "w") as f:
        json.dump(out, f, indent=2, default=str)
    return 0


# --- 5. the node suite ---------------------------------------------------------------------

def check_node_suite(args, deadline: Deadline) -> dict:
    from hetero_exec.errors import HeterogeneousPlacementRequired
    from hetero_exec.providers import parse_provider
    from tests.backend_cases import known_failures, node_cases, run_case

    sup = parse_provider(_gpu_spec(args)).available()
    if not sup:
        return {"unavailable": sup.reason}
    cases = node_cases()
    known = {**known_failures(),
             **known_failures(os.path.join(ROOT, "tests", "node_suite_simgpu_known_failures.txt"))}
    order = sorted(cases, key=lambda n: zlib.crc32(n.encode()))  # a fixed shuffle
    claimed = passed = known_failed = attempted = 0
    failures: dict[str, str] = {}
    slowest: list[tuple[float, str]] = []
    for name in order:
        if deadline.left() < 10:
            break
        attempted += 1
        t0 = time.perf_counter()
        try:
            run_case(cases[name], providers=[_gpu_spec(args)], require_gpu=True)
        except HeterogeneousPlacementRequired:
            continue
        except Exception as e:  # noqa: BLE001 - every failure is reported
            claimed += 1
            if name in known:
                known_failed += 1
            else:
                failures[name] = f"{type(e).__name__}: {str(e).strip()[:300]}"
            continue
        finally:
            slowest.append((time.perf_counter() - t0, name))
        claimed += 1
        passed += 1
    slowest.sort(reverse=True)
    return {"cases": len(cases), "attempted": attempted, "truncated": attempted < len(cases),
            "claimed": claimed, "passed": passed, "known_failures": known_failed,
            "unexpected_failures": len(failures), "failures": dict(list(sorted(failures.items()))[:80]),
            "slowest_s": [(round(t, 2), n) for t, n in slowest[:10]]}


# --- 6. CUDA graphs (experimental) ---------------------------------------------------------

def check_cuda_graph(args, deadline: Deadline) -> dict:
    from bench.cuda_graph_replay import compare_replay

    if deadline.left() < 30:
        return {"skipped": "out of time"}
    return compare_replay(args.models[:2], runs=args.runs)


# --- the table -----------------------------------------------------------------------------

def _fmt(v: Any, nd: int = 2) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return f"{v:.{nd}e}" if 0 < abs(v) < 1e-2 else f"{v:.{nd}f}"
    return str(v)


def table(summary: dict) -> str:
    lines = ["# gpu_check", ""]
    env = summary.get("env", {})
    lines.append(f"- python {env.get('python')}, numpy {env.get('numpy')}, onnx {env.get('onnx')}, "
                 f"onnxruntime {env.get('onnxruntime')}, ray {env.get('ray')}")
    lines.append(f"- {env.get('gpu_provider')}: "
                 + (f"available, {env.get('device', '')} {env.get('device_memory_gib', '')} GiB"
                    if env.get("gpu_available") else f"unavailable: {env.get('gpu_unavailable_reason')}"))
    if env.get("cupy"):
        lines.append(f"- {env['cupy']}")
    models = summary.get("models", {})
    if models.get("rows"):
        lines += ["", "## models (median ms)", "",
                  "| model | batch | gpu | gpu 1st run | cpu | ort cpu | ort cuda | gpu/ort cpu | gpu/ort cuda | max abs diff | match |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in models["rows"]:
            if "skipped" in r:
                lines.append(f"| {r['model']} | | {r['skipped']} |||||||||")
                continue
            lines.append("| " + " | ".join(_fmt(r.get(k)) for k in (
                "model", "batch", "gpu_ms", "gpu_first_run_ms", "cpu_ms", "ort_cpu_ms", "ort_cuda_ms",
                "gpu_over_ort_cpu", "gpu_over_ort_cuda", "max_abs_diff", "match")) + " |")
        if models.get("gpu_unavailable"):
            lines.append(f"\ngpu not run: {models['gpu_unavailable']}")
    for key in ("hetero_local", "hetero_ray"):
        sec = summary.get(key)
        if not sec:
            continue
        rows = sec if isinstance(sec, list) else sec.get("rows", [])
        lines += ["", f"## {key}", "", "| case | providers | segments | seams | stages | actors | match | ms | note |",
                  "|---|---|---:|---:|---:|---:|---|---:|---|"]
        for r in rows:
            note = r.get("error") or r.get("skipped") or r.get("fallback") or ""
            lines.append(f"| {r.get('case')} | {','.join(r.get('providers', []))} | "
                         f"{len(r.get('segments', [])) or ''} | {_fmt(r.get('seams'))} | {_fmt(r.get('stages'))} | "
                         f"{_fmt(r.get('actors'))} | {_fmt(r.get('match'))} | {_fmt(r.get('ms'))} | {note[:120]} |")
        if isinstance(sec, dict) and (sec.get("error") or sec.get("ray_init_s") is not None):
            lines.append(f"\nray {sec.get('ray_version', '')} init {sec.get('ray_init_s', '')} s "
                         f"{(sec.get('error') or '')[-300:]}")
    ns = summary.get("node_suite")
    if ns:
        lines += ["", "## node suite (gpu required)", ""]
        if "unavailable" in ns:
            lines.append(f"not run: {ns['unavailable']}")
        elif "passed" in ns:
            lines.append(f"{ns['passed']} passed of {ns['claimed']} claimed ({ns['attempted']} of "
                         f"{ns['cases']} cases attempted{', cut short by the budget' if ns['truncated'] else ''}); "
                         f"{ns['known_failures']} known failures, {ns['unexpected_failures']} unexpected")
            for n, m in list(ns["failures"].items())[:20]:
                lines.append(f"- {n}: {m[:160]}")
    for key, sec in summary.items():
        if isinstance(sec, dict) and "traceback" in sec:
            lines.append(f"\n{key} failed: {sec['traceback'][-400:]}")
    cg = summary.get("cuda_graph")
    if cg:
        lines += ["", "## CUDA graphs (experimental)", ""]
        if "unavailable" in cg or "skipped" in cg:
            lines.append(f"not run: {cg.get('unavailable') or cg.get('skipped')}")
        for r in cg.get("rows", []):
            lines.append(f"- {r['model']} b={r['batch']}: eager {_fmt(r.get('eager_ms'))} ms, replay "
                         f"{_fmt(r.get('replay_ms'))} ms, speedup {_fmt(r.get('speedup'))}, match "
                         f"{_fmt(r.get('match'))} {r.get('reason') or r.get('error') or ''}")
    timing = summary.get("seconds", {})
    lines += ["", "seconds: " + ", ".join(f"{k} {v}" for k, v in timing.items())]
    return "\n".join(lines) + "\n"


def write(summary: dict, out: str) -> None:
    with open(os.path.join(out, "gpu_check.json"), "w") as f:
        json.dump(summary, f, indent=2, default=str)
    with open(os.path.join(out, "gpu_check.md"), "w") as f:
        f.write(table(summary))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for gpu_check.json and gpu_check.md")
    ap.add_argument("--budget", type=float, default=420, help="seconds for the whole check")
    ap.add_argument("--gpu-provider", default="gpu", help="gpu (default), gpu:N, or sim-gpu")
    ap.add_argument("--models", default="mlp,resnet18,bert,gpt2")
    ap.add_argument("--mixed-models", default="mlp,bert")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--ray-timeout", type=float, default=150)
    ap.add_argument("--time-cpu", action="store_true", help="also time our cpu provider")
    ap.add_argument("--skip", default="", help="sections to skip, comma-separated")
    ap.add_argument("--shares", default="", help="seconds per section, e.g. node_suite=200,models=90")
    ap.add_argument("--cuda-graph", action="store_true", help="the experimental CUDA-graph section")
    ap.add_argument("--ray-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.models = [m for m in args.models.split(",") if m]
    args.mixed_models = [m for m in args.mixed_models.split(",") if m]
    args.batches = [int(b) for b in args.batches.split(",") if b]
    os.makedirs(args.out, exist_ok=True)
    warnings.simplefilter("ignore")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout)
    for noisy in ("hetero_exec", "ray"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    if args.ray_child:
        return ray_child(args)
    total = Deadline(args.budget)
    summary: dict[str, Any] = {"args": vars(args), "seconds": {}}
    skip = set(args.skip.split(","))
    shares = dict(SHARES, **{k: float(v) for k, v in (kv.split("=") for kv in args.shares.split(",") if kv)})
    # the node suite first: its figure matters most, and it compiles CuPy's kernels the
    # later sections reuse
    sections: list[tuple[str, Callable[[Deadline], Any]]] = [
        ("env", lambda d: check_env(args)),
        ("node_suite", lambda d: check_node_suite(args, d)),
        ("models", lambda d: check_models(args, d)),
        ("hetero_local", lambda d: check_mixed(args, "local", d)),
        ("hetero_ray", lambda d: check_ray(args, d)),
    ]
    if args.cuda_graph:
        sections.append(("cuda_graph", lambda d: check_cuda_graph(args, d)))
    t_all = time.monotonic()
    for key, fn in sections:
        if key in skip:
            continue
        t0 = time.monotonic()
        deadline = Deadline(min(shares.get(key, 60), total.left()))
        logging.info("== %s (%.0f s for it, %.0f s left)", key, deadline.left(), total.left())
        try:
            summary[key] = fn(deadline)
        except Exception:  # noqa: BLE001 - keep going: one section must not hide the others
            summary[key] = {"traceback": traceback.format_exc()[-3000:]}
            logging.info("%s failed:\n%s", key, summary[key]["traceback"])
        summary["seconds"][key] = round(time.monotonic() - t0, 1)
        write(summary, args.out)
    summary["seconds"]["total"] = round(time.monotonic() - t_all, 1)
    write(summary, args.out)
    print(table(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
