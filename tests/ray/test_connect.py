"""The embedded default joins a running cluster instead of refusing it.

A ``ray start --head`` node is started by the test on ports of its own (never ``ray
stop``: it is stopped by its pid), and a driver in a fresh process builds a Ray
session with no address: it must join that cluster (which bare ``ray.init()``
discovers) rather than fail on the ``num_cpus`` a local start would pass.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.ray

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ADDRESS_FILE = "/tmp/ray/ray_current_cluster"

DRIVER = """
import json, numpy as np, ray
from hetero_exec import InferenceSession
from tests.ray.models import mlp
m = mlp(layers=2)
x = {"x": np.ones((2, 32), np.float32)}
sess = InferenceSession(m, [("sim-gpu", {"exclude_ops": ["Relu"]}), "cpu"], hetero=True,
                        executor="ray")
second = InferenceSession(m, [("sim-gpu", {"exclude_ops": ["Relu"]}), "cpu"], hetero=True,
                          executor="ray")
want = InferenceSession(m).run(None, x)[0]
ok = all(np.allclose(s.run(None, x)[0], want, rtol=1e-5, atol=1e-6) for s in (sess, second))
print(json.dumps({"how": sess._executor.connected, "gcs": ray.get_runtime_context().gcs_address,
                  "cpus": ray.cluster_resources().get("CPU"), "ok": bool(ok),
                  "actors": len(sess.stage_actors) + len(second.stage_actors)}))
sess.close(); second.close()
"""


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.3)
        return s.connect_ex(("127.0.0.1", port)) == 0


def recorded(port: int) -> bool:
    try:
        with open(ADDRESS_FILE) as f:
            return f.read().strip().endswith(f":{port}")
    except OSError:
        return False


def start_head(log_path, gpus: int = 2) -> tuple[subprocess.Popen, int]:
    """`ray start --head --block` on free ports of 127.0.0.1 (its workers' range clear of
    them), with ``gpus`` logical GPUs (0: none declared, as a plain `ray start` on a
    machine without GPUs)."""
    ports = free_ports(8)
    worker_lo = max(ports) + 1
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    cmd = [
        ray_cli, "start", "--head", "--block", f"--port={ports[0]}", "--num-cpus=2",
        f"--num-gpus={gpus}", "--node-ip-address=127.0.0.1", "--include-dashboard=false", f"--ray-client-server-port={ports[1]}",
        f"--node-manager-port={ports[2]}", f"--object-manager-port={ports[3]}",
        f"--dashboard-agent-listen-port={ports[4]}", f"--dashboard-agent-grpc-port={ports[5]}",
        f"--runtime-env-agent-port={ports[6]}", f"--metrics-export-port={ports[7]}",
        f"--min-worker-port={worker_lo}", f"--max-worker-port={min(worker_lo + 100, 65535)}",
    ]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = ROOT
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return proc, ports[0]


def stop(proc: subprocess.Popen, port: int) -> None:
    """SIGTERM to the node's `ray start` process, which drains the node and stops the
    processes it started, then to its process group for anything left (never `ray
    stop`). A SIGTERM to the whole group at once stopped the GCS first, and the CLI's
    drain then waited 30 s for it: 34 s a test, against 2.6 s this way."""
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    if recorded(port):  # a stale record would send later bare ray.init()s here
        os.unlink(ADDRESS_FILE)


def running_head(tmp_path, gpus: int = 2):
    """A running head node, retried on fresh ports if one was taken meanwhile; yields
    its GCS port, and stops it by its pid after."""
    for attempt in range(3):
        log = tmp_path / f"head{attempt}.log"
        proc, port = start_head(log, gpus)
        deadline = time.monotonic() + 60
        while proc.poll() is None and not (listening(port) and recorded(port)):
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
        if proc.poll() is None and listening(port):
            break
        stop(proc, port)
    else:
        pytest.fail(f"the head node did not come up: {log.read_text()[-3000:]}")
    try:
        yield port
    finally:
        stop(proc, port)


@pytest.fixture
def head_node(tmp_path):
    yield from running_head(tmp_path)


@pytest.fixture
def gpuless_head(tmp_path):
    """`ray start --head --num-cpus=2`, no GPU declared."""
    yield from running_head(tmp_path, gpus=0)


@pytest.mark.timeout(300)
def test_an_existing_cluster_is_joined_not_refused(head_node):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = ROOT
    proc = subprocess.run([sys.executable, "-c", DRIVER], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["how"].startswith("joined") and report["gcs"].endswith(f":{head_node}")
    assert report["cpus"] == 2.0  # the cluster's own, not what a local start would size
    assert report["ok"] and report["actors"] >= 2  # two sessions placed side by side


@pytest.mark.timeout(300)
def test_sim_gpu_places_on_a_cluster_without_gpus(gpuless_head):
    """sim-gpu exists to exercise placement, seams and actors where there is no GPU: on
    a cluster that declares none, its stages reserve like cpu stages."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = ROOT
    proc = subprocess.run([sys.executable, "-c", DRIVER], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["gcs"].endswith(f":{gpuless_head}") and report["cpus"] == 2.0
    assert report["ok"] and report["actors"] >= 2


def test_forget_raylet_semaphores_takes_only_a_dead_raylets():
    from actors.connect import SHM_DIR, forget_raylet_semaphores

    if not os.path.isdir(SHM_DIR):
        pytest.skip("no /dev/shm")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    names = [f"sem.obj{dead.pid}-1", f"sem.hdr{dead.pid}-1", f"sem.obj{os.getpid()}-1"]
    for n in names:
        with open(os.path.join(SHM_DIR, n), "wb") as f:
            f.write(b"\0" * 32)
    try:
        assert forget_raylet_semaphores(os.getpid(), wait_s=0.1) == 0  # alive: left alone
        assert forget_raylet_semaphores(dead.pid) == 2
        left = set(os.listdir(SHM_DIR))
        assert names[0] not in left and names[1] not in left and names[2] in left
    finally:
        for n in names:
            try:
                os.unlink(os.path.join(SHM_DIR, n))
            except OSError:
                pass


def test_a_driver_on_the_embedded_default_leaves_no_semaphores():
    """Ray's compiled-graph channels are semaphores in /dev/shm that its raylet unlinks only
    on a clean exit, which ray.shutdown() does not give it: the driver that started that
    Ray removes them at its exit."""
    from actors.connect import SHM_DIR, discovered_cluster, raylet_semaphores

    if not os.path.isdir(SHM_DIR):
        pytest.skip("no /dev/shm")
    if discovered_cluster() is not None:
        pytest.skip("a `ray start` cluster runs here: the driver would join it")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = ROOT
    proc = subprocess.run([sys.executable, "-m", "tests.ray.compiled_exit_main"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    pid = report["raylet"]
    assert pid is not None and report["semaphores"] > 0  # the channels had them
    assert raylet_semaphores(pid) == []
