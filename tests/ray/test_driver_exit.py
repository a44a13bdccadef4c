"""A driver that ends badly with a live Ray session still exits, promptly, with its own
status, and leaves no Ray process behind (issue 27).

Each driver runs in a fresh process on the embedded default (it starts a local Ray of
its own). Its Ray's processes are found by pid and by its session folder, which every
Ray process started for it names on its command line.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.ray

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXIT_LIMIT_S = 30.0
#: Ray's C++ log lines at error level: ``[2026-12-02 11:27:15,332 E 5118 5118] file.cc:1: ...``
ERROR_LINE = re.compile(r"^\[[0-9-]+ [0-9:,]+ E \d+ \d+\]| ERROR |core_worker\.cc.*object store")
#: Ray's warning, on every build, that token authentication is on (or off) for its cluster
TOKEN_AUTH_WARNING = re.compile(r"[Tt]oken authentication is (enabled|disabled)|token-auth")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def processes_naming(folder: str) -> list[int]:
    """Live processes whose command line names ``folder`` (a Ray session's)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
        except OSError:
            continue
        if folder in cmd and _alive(int(entry)):
            found.append(int(entry))
    return found


def run_driver(mode: str) -> tuple[int, float, dict, str]:
    """Start the driver, SIGTERM it once it reported (``sigterm``), wait for its exit;
    returns its status, the seconds from its report to its exit, the report, stderr."""
    from actors.connect import discovered_cluster

    if discovered_cluster() is not None:
        pytest.skip("a `ray start` cluster runs here: the driver would join it")
    # as a user's shell has it: no address, and no auth mode (this test process's own
    # Ray sets RAY_AUTH_MODE when it starts, and with it set Ray says nothing of auth)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    env["PYTHONPATH"] = ROOT
    proc = subprocess.Popen([sys.executable, "-m", "tests.ray.failing_driver_main", mode],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        line = proc.stdout.readline()  # blocks until the report (or the driver's end)
        reported = time.monotonic()
        if not line:
            proc.wait(timeout=60)
            pytest.fail(f"the driver ended before building: {proc.stderr.read()[-3000:]}")
        report = json.loads(line)
        if mode == "sigterm":
            proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            rc = None
        took = time.monotonic() - reported
        err = proc.stderr.read() if rc is not None else ""
    finally:
        if proc.poll() is None:  # hung: kill what it started, by its process group
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert rc is not None, f"the {mode} driver did not exit within 120 s"
    return rc, took, report, err


def assert_no_ray_left(report: dict) -> None:
    deadline = time.monotonic() + 15  # Ray's processes see their parent go, then exit
    while time.monotonic() < deadline:
        left = [p for p in report["pids"] if _alive(p)] + processes_naming(report["session_dir"])
        if not left:
            return
        time.sleep(0.2)
    raise AssertionError(f"Ray processes of the driver survive it: {sorted(set(left))}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode, status", [("raise", 1), ("exit3", 3), ("sigterm", None)])
def test_a_failing_driver_exits_with_its_status_and_leaves_no_ray(mode, status):
    rc, took, report, err = run_driver(mode)
    if status is None:  # SIGTERM: Ray's driver handler exits with the signal's number
        assert rc in (15, -15, 128 + 15), err[-3000:]
    else:
        assert rc == status, err[-3000:]
    assert took < EXIT_LIMIT_S, f"exited {took:.1f} s after its report"
    assert "Started a local Ray instance" not in err  # no Ray auto-initialised at exit
    if mode == "raise":
        assert "RuntimeError: user code fails" in err
    # a build prints no error-level line (Ray's "constructor arguments in the object
    # store" among them): its stages traveled inline (raise) or were loaded after (exit3);
    # under SIGTERM Ray's own handler logs the signal at error level
    if mode != "sigterm":
        assert [line for line in err.splitlines() if ERROR_LINE.search(line)] == [], err[-3000:]
    # nor Ray's token-auth warning: hetero-exec says it once at INFO, in its own words
    assert [line for line in err.splitlines() if TOKEN_AUTH_WARNING.search(line)] == [], err[-3000:]
    assert_no_ray_left(report)
