"""The Ray executor's options, read from ``SessionOptions.executor_options``.

Every session keyword that is not a core option lands there; this module names the
ones the Ray executor knows, with their defaults, and refuses the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from hetero_exec.errors import ProviderError

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass
class RayOptions:
    """What ``InferenceSession(..., executor="ray", **options)`` may set.

    >>> RayOptions.parse({"max_inflight": 4, "placement_strategy": "spread"}).placement_strategy
    'SPREAD'
    """

    ray_address: str | None = None  # None: the running Ray, else start a local one; "auto": join
    ray_init: dict[str, Any] = field(default_factory=dict)  # extra ray.init kwargs (local start)
    runtime_env: dict[str, Any] | None = None  # the actors' runtime_env (default: PYTHONPATH)
    max_inflight: int = 8  # requests dispatched and not yet answered (back-pressure beyond)
    coalesce: int = 4  # most requests per actor task (run_many, concurrent run_async)
    placement_strategy: str = "PACK"
    placement_timeout_s: float = 30.0  # how long a placement group may wait for resources
    actor_start_timeout_s: float = 120.0
    segment_num_cpus: float = 1.0  # logical CPUs a cpu segment actor reserves
    device_num_gpus: float = 1.0  # GPUs one device's bundle reserves (shared by its actors)
    colocate: bool = False  # one actor per device (device-local seams) instead of per segment
    seam_transport: str = "auto"  # auto | shared_memory | object_store | wire
    shm_seam_bytes: int = 1 << 30  # shared_memory: the most buffer bytes one process keeps
    ray_compiled: bool = (
        False  # a Ray Compiled Graph for a static chain (see transport/compiled.py)
    )
    max_restarts: int = 4  # Ray restarts of a dead segment actor before it is re-created
    max_replays: int = 3  # replays of one request after faults before ActorError
    recovery_timeout_s: float = 60.0  # how long to wait for an actor to come back

    @classmethod
    def parse(cls, given: Mapping[str, Any]) -> "RayOptions":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise ProviderError(
                f"unknown option(s) for executor='ray': {unknown}; known: {sorted(known)}"
            )
        opts = cls(**dict(given))
        opts.placement_strategy = str(opts.placement_strategy).upper()
        if opts.placement_strategy not in PLACEMENT_STRATEGIES:
            raise ProviderError(
                f"placement_strategy must be one of {PLACEMENT_STRATEGIES}, "
                f"got {given['placement_strategy']!r}"
            )
        if int(opts.max_inflight) < 1:
            raise ProviderError(f"max_inflight must be at least 1, got {opts.max_inflight!r}")
        if int(opts.coalesce) < 1:
            raise ProviderError(f"coalesce must be at least 1, got {opts.coalesce!r}")
        from actors.transport import SEAM_TRANSPORTS

        if opts.seam_transport != "auto" and opts.seam_transport not in SEAM_TRANSPORTS:
            raise ProviderError(
                f"seam_transport must be 'auto' or one of {sorted(SEAM_TRANSPORTS)}, "
                f"got {opts.seam_transport!r}"
            )
        return opts
