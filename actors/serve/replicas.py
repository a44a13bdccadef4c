"""What one Serve replica reserves, planned from its model (`replica_resources`).

A replica reserves what its plan needs: a GPU per device of an in-process plan, or,
for a plan that runs on several stage actors, a placement group with the replica's
bundle first and the stages' bundles after it (``placement_group="current"``).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from hetero_exec.errors import HeteroExecError
from hetero_exec.model_plan import load_and_plan
from hetero_exec.options import SessionOptions

log = logging.getLogger(__name__)


@dataclass
class ReplicaResources:
    """What one replica reserves, and the session options its plan needs."""

    ray_actor_options: dict[str, Any]
    placement_group_bundles: list[dict[str, float]] | None
    session_options: dict[str, Any]


def replica_resources(model: Any, providers: Sequence[Any] | None,
                      session_options: Mapping[str, Any], num_cpus: float = 1,
                      generation: bool = False) -> ReplicaResources:
    """A replica's resources from its plan.

    A mixed plan of several pipeline stages (or any plan with ``executor="ray"``) runs on
    stage actors that the replica drives: the replica reserves a placement group, its
    own bundle first and then the stages' (`actors.stage_bundles`), which its session
    fills (``placement_group="current"``). Any other plan runs in the replica's process,
    which reserves a GPU per device the plan places nodes on.

    >>> import onnx.helper as h
    >>> g = h.make_graph([h.make_node("Relu", ["x"], ["y"])], "g",
    ...     [h.make_tensor_value_info("x", 1, [2])], [h.make_tensor_value_info("y", 1, [2])])
    >>> res = replica_resources(h.make_model(g).SerializeToString(), ["sim-gpu"], {}, num_cpus=2)
    >>> res.ray_actor_options, res.placement_group_bundles, res.session_options
    ({'num_cpus': 2, 'num_gpus': 1}, None, {'intra_op_num_threads': 2})
    """
    opts = dict(session_options)
    if generation and opts.get("executor") == "ray":
        # a decoder split over generation stages (``stages``: layers, not segments): its
        # genai Model starts the stage actors from the replica, in a placement group of
        # its own, and closes them with the replica (`GenerativeModel.__del__`)
        return ReplicaResources({"num_cpus": num_cpus, "num_gpus": 0}, None, opts)
    devices, segments = plan_devices(model, providers, opts)
    executor = opts.get("executor")
    if executor == "ray" or (executor is None and segments > 1):
        from actors import stage_bundles

        stages = stage_bundles(model, providers, **opts)
        if executor == "ray" or len(stages) > 1:
            opts.update(executor="ray", placement_group="current")
            return ReplicaResources({"num_cpus": num_cpus, "num_gpus": 0},
                                    [{"CPU": float(num_cpus)}, *stages], opts)
    # the replica runs the plan itself: its runs split over the CPUs it reserved, as Ray
    # sizes a worker's OMP_NUM_THREADS (all the node's cores per replica would have the
    # replicas, and the HTTP proxy, fight over them)
    opts.setdefault("intra_op_num_threads", max(1, int(num_cpus)))
    return ReplicaResources({"num_cpus": num_cpus, "num_gpus": len(devices)}, None, opts)


def plan_devices(model: Any, providers: Any, opts: Mapping[str, Any]) -> tuple[set[str], int]:
    """The device providers the plan places nodes on, and its segment count; by name
    where this process cannot plan (e.g. a head node without the GPU library)."""
    core = {k: v for k, v in opts.items() if k in SessionOptions.KNOWN and k != "executor"}
    try:
        segments = load_and_plan(model, providers, SessionOptions.from_kwargs(core)
                                 ).build.placement.segments
        return {s.provider.name for s in segments if s.provider.is_device}, len(segments)
    except (HeteroExecError, ImportError) as e:
        log.warning("cannot plan here (%s): reserving a GPU per non-cpu provider named", e)
        names = [p if isinstance(p, str) else p[0] for p in providers or ()]
        return {n for n in names if not n.startswith("cpu")}, 1


def model_name(model: Any) -> str:
    """A protocol-safe name: the file's stem, or the graph's name.

    >>> model_name("/models/my model.v2.onnx")
    'my_model.v2'
    """
    if isinstance(model, (str, os.PathLike)):
        raw = os.path.splitext(os.path.basename(os.fspath(model)))[0]
    else:
        from hetero_exec.ir import load

        raw = load(model)[1].name or "model"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", raw) or "model"
