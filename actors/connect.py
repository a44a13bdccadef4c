"""Joining a Ray cluster, or starting a local one when none is running."""

from __future__ import annotations

import logging
import math
import os

import ray

from actors.options import RayOptions
from hetero_exec.errors import ActorError

log = logging.getLogger(__name__)


def ensure_ray(
    opts: RayOptions, demand: dict[str, float] | None = None, logical_gpus: bool = False
) -> None:
    """Connect this driver to Ray.

    Already connected: nothing to do. ``ray_address`` given (``"auto"``, ``"ray://..."``,
    ``"host:port"``): join that cluster. Otherwise start a local Ray (the embedded
    default; extra ``ray.init`` arguments come from the ``ray_init`` option). A local
    start declares at least the logical CPUs the plan's bundles ``demand``, and, for a
    plan whose devices are all emulated (``logical_gpus``), its GPUs too.

    >>> ensure_ray(RayOptions(ray_init={"num_cpus": 2}))  # doctest: +SKIP
    """
    if ray.is_initialized():
        return
    kwargs = {"include_dashboard": False, "logging_level": logging.WARNING, **opts.ray_init}
    demand = demand or {}
    if not opts.ray_address:
        if "num_cpus" not in kwargs and demand.get("CPU"):
            kwargs["num_cpus"] = max(os.cpu_count() or 1, math.ceil(demand["CPU"]) + 1)
        if "num_gpus" not in kwargs and logical_gpus and demand.get("GPU"):
            kwargs["num_gpus"] = math.ceil(demand["GPU"])
    try:
        if opts.ray_address:
            log.info("joining the Ray cluster at %s", opts.ray_address)
            kwargs.pop("include_dashboard", None)
            ray.init(address=opts.ray_address, **kwargs)
        else:
            log.info("starting a local Ray")
            ray.init(**kwargs)
    except (ConnectionError, RuntimeError, ValueError) as e:
        where = opts.ray_address or "a local Ray"
        raise ActorError(f"could not connect to {where}: {e}") from e
    log.info("Ray resources: %s", ray.cluster_resources())
