"""`hetero-exec serve` and `hetero-exec demo` on the embedded default, as a user runs
them (issue 27): every socket they and their Ray listen on is on loopback, and a
replica killed under load from several real clients loses no request, each error a
client could see being the JSON the app answers with; a bad request gets its 400 and
SIGINT stops the server cleanly, leaving none of HAProxy's files.

Sockets are read from /proc/net/tcp{,6} and mapped to the process tree of the command
through /proc/<pid>/fd. Each command runs in its own process and starts its own Ray.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import onnx
import pytest

from tests.ray.helpers import free_port, listening_sockets, not_loopback, process_tree
from tests.ray.models import mlp

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WIDTH = 16


def cli_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "RAY_SERVE_ENABLE_HA_PROXY")}
    env["PYTHONPATH"] = ROOT
    return env


def comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def haproxy_folders() -> set[str]:
    """The folders Serve's HAProxy ingresses keep their configuration in, one per node."""
    from ray.serve._private.constants import RAY_SERVE_HAPROXY_SOCKET_PATH

    base = os.path.dirname(RAY_SERVE_HAPROXY_SOCKET_PATH)
    return set(os.listdir(base)) if os.path.isdir(base) else set()


def infer_body(rows: int, seed: int) -> tuple[bytes, np.ndarray]:
    x = np.random.default_rng(seed).standard_normal((rows, WIDTH)).astype(np.float32)
    body = {"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                        "data": x.ravel().tolist()}]}
    return json.dumps(body).encode(), x


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`hetero-exec serve` of an mlp with two replicas on a Ray it starts itself: (the
    process, its port, the model's path, the HAProxy folders there were before it)."""
    from actors.connect import discovered_cluster

    if discovered_cluster() is not None:
        pytest.skip("a `ray start` cluster runs here: the CLI would not start its own Ray")
    path = str(tmp_path_factory.mktemp("ingress") / "mlp.onnx")
    onnx.save(mlp(WIDTH, layers=2), path)
    port = free_port()
    folders = haproxy_folders()
    # RAY_ADDRESS=local asks for a Ray of its own: the embedded default, HAProxy and all
    proc = subprocess.Popen(
        [sys.executable, "-m", "hetero_exec.cli", "serve", path, "--name", "m", "--port",
         str(port), "--providers", "cpu", "--replicas", "2"],
        cwd=ROOT, env={**cli_env(), "RAY_ADDRESS": "local"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                conn.request("GET", "/v2/models/m/ready")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail(f"the server did not come up: {proc.stdout.read()[-3000:]}")
        yield proc, port, path, folders
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)


def test_serve_listens_on_loopback_only(served):
    proc, port, _, _ = served
    # Sampled, not read once: a graceful HAProxy reload (replicas joining) starts a new
    # haproxy that takes the socket over, and one read can fall between the two processes.
    seen: dict[tuple[int, str, int], str] = {}  # socket -> its process's name when seen

    def sample() -> None:
        for s in listening_sockets(process_tree(proc.pid)):
            seen.setdefault(s, comm(s[0]))
        time.sleep(0.2)

    for _ in range(10):
        sample()
    deadline = time.monotonic() + 30
    while not any(p == port for _, _, p in seen) and time.monotonic() < deadline:
        sample()
    sockets = sorted(seen)
    assert any(p == port for _, _, p in sockets)  # the frontend is found: the scan works
    assert len({pid for pid, _, _ in sockets}) >= 4  # GCS, raylet, HAProxy, replicas...
    assert not_loopback(sockets) == [], [(pid, seen[(pid, a, p)], a, p)
                                         for pid, a, p in not_loopback(sockets)]
    # the frontend is HAProxy's (RAY_ADDRESS=local kept the embedded default's ingress)
    # ("" where the process was gone before its name was read)
    assert {name for (_, _, p), name in seen.items() if p == port and name} == {"haproxy"}


def test_local_is_the_embedded_default(monkeypatch):
    from actors.connect import given_address

    monkeypatch.setenv("RAY_ADDRESS", "local")
    assert given_address() is None and given_address("LOCAL") is None
    assert given_address("10.0.0.1:6379") == "10.0.0.1:6379"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.2:6379")
    assert given_address() == "10.0.0.2:6379" and given_address("local") is None


def test_demo_listens_on_loopback_only():
    from actors.connect import discovered_cluster

    if discovered_cluster() is not None:
        pytest.skip("a `ray start` cluster runs here: the demo would join it")
    proc = subprocess.Popen([sys.executable, "-m", "hetero_exec.cli", "demo", "--executor",
                             "ray", "--runs", "200"], cwd=ROOT, env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: set[tuple[int, str, int]] = set()
    while proc.poll() is None:  # sampled while it runs: its Ray goes with it
        seen.update(listening_sockets(process_tree(proc.pid)))
        time.sleep(0.2)
    out = proc.stdout.read()
    assert proc.returncode == 0, out[-3000:]
    assert len({pid for pid, _, _ in seen}) >= 2, seen  # its GCS and raylet at least
    assert not_loopback(list(seen)) == []


def test_a_replica_killed_under_load_loses_no_request(served, record_property):
    import onnxruntime as ort

    proc, port, path, _ = served
    opts = ort.SessionOptions()
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    ref = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    clients, stop = 4, threading.Event()
    lost: list[str] = []
    non_json: list[str] = []
    wrong: list[int] = []
    answered: list[float] = []
    lock = threading.Lock()

    stale: list[str] = []

    def post(conn: http.client.HTTPConnection, body: bytes) -> tuple[int, str, bytes]:
        conn.request("POST", "/v2/models/m/infer", body, {"content-type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.getheader("content-type") or "", resp.read()

    def client(k: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        i = 0
        while not stop.is_set():
            body, x = infer_body(2, seed=k * 100_000 + i)
            i += 1
            try:
                try:
                    status, ctype, data = post(conn, body)
                except (http.client.RemoteDisconnected, ConnectionResetError,
                        BrokenPipeError) as e:
                    # a keep-alive connection closed as the request went out (HAProxy's
                    # old process, at a reload, closing its idle connections: it logs no
                    # request): sent again once on a new connection, as HTTP/1.1 clients
                    # do (RFC 9112 9.3.1; actors.client.InferenceClient, urllib3)
                    with lock:
                        stale.append(f"{type(e).__name__}: {e}")
                    conn.close()
                    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
                    status, ctype, data = post(conn, body)
            except (OSError, http.client.HTTPException) as e:
                with lock:
                    lost.append(f"{type(e).__name__}: {e}")
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
                continue
            try:
                reply = json.loads(data)
            except ValueError:
                with lock:
                    non_json.append(f"{status} {ctype}: {data[:80]!r}")
                continue
            if status != 200:
                with lock:
                    lost.append(f"{status}: {reply.get('error')}")
                continue
            got = np.asarray(reply["outputs"][0]["data"], np.float32).reshape(2, WIDTH)
            ok = np.allclose(got, ref.run(None, {"x": x})[0], rtol=1e-4, atol=1e-5)
            with lock:
                answered.append(time.monotonic())
                if not ok:
                    wrong.append(i)

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(clients)]
    for t in threads:
        t.start()
    time.sleep(4)
    replicas = [p for p in process_tree(proc.pid) if comm(p).startswith("ray::ServeRepli")]
    assert len(replicas) == 2, [(p, comm(p)) for p in process_tree(proc.pid)]
    # the app answers on the replica's own loop, so no answer's headers leave alone
    # (actors.connect.REPLICA_LOOP_ENVS): a kill between them and the body would cut it
    with open(f"/proc/{replicas[0]}/environ", "rb") as f:
        environ = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    assert environ.get(b"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD") == b"0"
    before = len(answered)
    killed_at = time.monotonic()
    os.kill(replicas[0], signal.SIGKILL)
    time.sleep(12)  # Serve notices, restarts it; the clients keep going meanwhile
    stop.set()
    for t in threads:
        t.join(90)
    after = [t for t in answered if t > killed_at]
    stamps = sorted([killed_at] + after)
    gap = max(b - a for a, b in zip(stamps, stamps[1:])) if len(stamps) > 1 else float("inf")
    record_property("answered", len(answered))
    record_property("longest_gap_s", round(gap, 3))
    record_property("stale_connections", len(stale))
    print(f"\nreplica killed under {clients} clients: {len(answered)} answered ({before} "
          f"before the kill), {len(lost)} lost, {len(non_json)} non-JSON bodies, "
          f"{len(stale)} stale keep-alive connections sent again, longest gap after the "
          f"kill {gap:.2f} s")
    assert lost == [] and non_json == [] and wrong == [], (lost[:5], non_json[:5], wrong[:5])
    assert len(after) > 10 * clients  # it kept serving after the kill


def test_serve_answers_then_stops_at_sigint_leaving_no_files(served):
    """Last of the module's tests of `served`: through HAProxy, an answer matching
    onnxruntime, a bad request's own 400 with the server serving on, then SIGINT: a
    clean exit that leaves none of HAProxy's files behind."""
    import onnxruntime as ort

    from actors.client import InferenceClient, InferenceServerError

    proc, port, path, folders = served
    x = np.random.default_rng(7).standard_normal((2, WIDTH)).astype(np.float32)
    want = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    with InferenceClient(f"http://127.0.0.1:{port}", "m", timeout=30) as client:
        np.testing.assert_allclose(client.infer(x)["y"], want, rtol=1e-4, atol=1e-5)
        with pytest.raises(InferenceServerError) as bad:
            client.infer({"nope": x})
        assert bad.value.status == 400 and "nope" in bad.value.message
        np.testing.assert_allclose(client.infer(x)["y"], want, rtol=1e-4, atol=1e-5)
    assert "haproxy" in {comm(p) for p in process_tree(proc.pid)}
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-2000:]
    assert f"serving m at http://127.0.0.1:{port}" in out and "shutting down" in out
    assert haproxy_folders() <= folders
