"""cluster/local_cluster.sh is closed to the network: every node of the local cluster
listens on 127.0.0.1 only, Ray's token authentication is on, the environment the
script prints lets a driver in, and a driver without the token is refused.

The cluster runs on ports of its own and is stopped by the script (by pid, never
``ray stop``)."""

from __future__ import annotations

import os
import random
import re
import shlex
import socket
import stat
import subprocess
import sys

import pytest

pytestmark = pytest.mark.ray

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "cluster", "local_cluster.sh")
LOOPBACK = ("127.0.0.1", "[::ffff:127.0.0.1]", "[::1]")


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
            return True
        except OSError:
            return False


def free_base(workers: int) -> int:
    """A head port whose blocks (the script's: 100 ports a node above it) are free."""
    for _ in range(50):
        base = random.randrange(20000, 40000, 10)
        wanted = [base, base + 1] + [base + 100 * (k + 1) + d for k in range(workers + 1)
                                     for d in (0, 1, 2, 3, 4, 5, 10, 11)]
        if all(port_free(p) for p in wanted):
            return base
    pytest.skip("no free block of ports")


def descendants(roots: set[int]) -> set[int]:
    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError):
                pass
    out, frontier = set(roots), list(roots)
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p and c not in out]
        out.update(kids)
        frontier.extend(kids)
    return out


def listening_sockets(pids: set[int]) -> list[tuple[str, str]]:
    """(local address, line) of every TCP listener owned by ``pids`` (from ``ss``)."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        if {int(p) for p in re.findall(r"pid=(\d+)", line)} & pids:
            found.append((line.split()[3].rsplit(":", 1)[0], line))
    return found


@pytest.fixture
def cluster(tmp_path):
    if subprocess.run(["which", "ss"], capture_output=True).returncode != 0:
        pytest.skip("ss (iproute2) is not installed")
    base = free_base(workers=1)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_PORT=str(base), DASHBOARD_PORT=str(base + 2), STATE_DIR=str(tmp_path / "state"),
               PYTHON=sys.executable, PATH=f"{os.path.dirname(sys.executable)}:{env['PATH']}",
               HEAD_CPUS="1", WORKER_CPUS="1", WORKER_GPUS="1")
    started = subprocess.run(["bash", SCRIPT, "start", "1"], env=env, capture_output=True,
                             text=True, timeout=240)
    try:
        assert started.returncode == 0, started.stderr[-3000:]
        export = next(line for line in started.stdout.splitlines() if line.startswith("export "))
        client = dict(item.split("=", 1) for item in shlex.split(export)[1:])
        yield env, client, tmp_path / "state"
    finally:
        stopped = subprocess.run(["bash", SCRIPT, "stop"], env=env, capture_output=True,
                                 text=True, timeout=240)
        assert stopped.returncode == 0, stopped.stderr[-3000:]


DRIVER = """
import ray, sys
ray.init(logging_level="ERROR", log_to_driver=False)
@ray.remote(num_cpus=0)
def where():
    return ray.get_runtime_context().get_node_id()
print(len([n for n in ray.nodes() if n["Alive"]]), ray.get(where.remote()) is not None)
"""


@pytest.mark.timeout(420)
def test_the_local_cluster_listens_on_loopback_only_and_wants_its_token(cluster):
    env, client, state = cluster
    assert client["RAY_ADDRESS"].startswith("127.0.0.1:") and client["RAY_AUTH_MODE"] == "token"
    token = client["RAY_AUTH_TOKEN_PATH"]
    assert stat.S_IMODE(os.stat(token).st_mode) == 0o600
    pids = {int(p.read_text()) for p in state.glob("*.pid")}
    assert len(pids) == 2  # the head and one worker, each its own `ray start --block`
    sockets = listening_sockets(descendants(pids))
    assert len(sockets) >= 8  # GCS, raylets, object managers, agents...
    exposed = [line for host, line in sockets if host not in LOOPBACK]
    assert not exposed, "\n".join(exposed)

    base = {k: v for k, v in env.items() if not k.startswith("RAY_")}
    ok = subprocess.run([sys.executable, "-c", DRIVER], env={**base, **client}, cwd=ROOT,
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert ok.stdout.split() == ["2", "True"]

    intruder = {**base, **client, "RAY_AUTH_TOKEN": "0" * 64}  # a token, not the cluster's
    intruder.pop("RAY_AUTH_TOKEN_PATH")
    refused = subprocess.run([sys.executable, "-c", DRIVER], env=intruder, cwd=ROOT,
                             capture_output=True, text=True, timeout=180)
    assert refused.returncode != 0
    assert "Authentication token is missing or incorrect" in refused.stderr
