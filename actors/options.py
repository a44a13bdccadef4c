"""The Ray executor's options, read from ``SessionOptions.executor_options``.

Every session keyword that is not a core option lands there; this module names the
ones the Ray executor knows, with their defaults, and refuses the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from hetero_exec.errors import ProviderError

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")

#: options of the segment-per-actor executor, and what replaced them
RENAMED = {
    "colocate": "an actor runs a pipeline stage (one device and the cpu segments beside "
                "it); choose them with the session option stages='auto' | K | [cuts]",
    "segment_num_cpus": "use stage_num_cpus",
}


@dataclass
class RayOptions:
    """What ``InferenceSession(..., executor="ray", **options)`` may set.

    >>> RayOptions.parse({"max_inflight": 4, "placement_strategy": "spread"}).placement_strategy
    'SPREAD'
    """

    #: None: RAY_ADDRESS, else a cluster ``ray.init()`` discovers (``ray start``), else a
    #: local Ray sized to the machine; "auto" or "host:port": join that cluster
    ray_address: str | None = None
    ray_init: dict[str, Any] = field(default_factory=dict)  # extra ray.init kwargs (local start)
    runtime_env: dict[str, Any] | None = None  # the actors' runtime_env (default: PYTHONPATH)
    max_inflight: int = 8  # requests dispatched and not yet answered (back-pressure beyond)
    coalesce: int = 4  # most requests per actor task (run_many, concurrent run_async)
    placement_strategy: str = "PACK"
    placement_timeout_s: float = 30.0  # how long a placement group may wait for resources
    actor_start_timeout_s: float = 120.0
    #: logical CPUs a stage actor reserves: a fraction, so a laptop hosts every stage
    #: (and later sessions' stages); the pipeline's real parallelism comes from the cores
    stage_num_cpus: float = 0.25
    device_num_gpus: float = 1.0  # GPUs a device's bundle reserves (shared by its stages)
    #: BLAS threads per stage actor (None: the node's cores over the stages on it)
    stage_threads: int | None = None
    #: None: a placement group of the plan's own; "current": the bundles 1.. of the
    #: placement group the caller runs in (a Serve replica's ``placement_group_bundles``)
    placement_group: str | None = None
    seam_transport: str = "auto"  # auto | shared_memory | object_store | wire
    shm_seam_bytes: int = 1 << 30  # shared_memory: the most buffer bytes one process keeps
    ray_compiled: bool = (
        False  # a Ray Compiled Graph for a static chain (see actors/compiled.py)
    )
    max_restarts: int = 4  # Ray restarts of a dead segment actor before it is re-created
    max_replays: int = 3  # replays of one request after faults before ActorError
    recovery_timeout_s: float = 60.0  # how long to wait for an actor to come back
    #: the stage planner's hop cost (placement.stages.HopModel); None: measured on the
    #: cluster (actors.hop_cost)
    hop_model: Any = None

    @classmethod
    def parse(cls, given: Mapping[str, Any]) -> "RayOptions":
        known = {f.name for f in fields(cls)}
        for old, new in RENAMED.items():
            if old in given:
                raise ProviderError(f"option {old!r} is gone: {new}")
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
        if not float(opts.stage_num_cpus) > 0:
            raise ProviderError(f"stage_num_cpus must be above 0, got {opts.stage_num_cpus!r}")
        if opts.stage_threads is not None and int(opts.stage_threads) < 1:
            raise ProviderError(f"stage_threads must be at least 1, got {opts.stage_threads!r}")
        if opts.placement_group not in (None, "current"):
            raise ProviderError(
                f"placement_group must be None or 'current', got {opts.placement_group!r}"
            )
        from actors.transport import SEAM_TRANSPORTS

        if opts.seam_transport != "auto" and opts.seam_transport not in SEAM_TRANSPORTS:
            raise ProviderError(
                f"seam_transport must be 'auto' or one of {sorted(SEAM_TRANSPORTS)}, "
                f"got {opts.seam_transport!r}"
            )
        return opts
