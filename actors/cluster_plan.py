"""A plan's stages for the Ray cluster at hand: connecting for it, the seam transport
``"auto"`` picks, the stage cuts re-planned with the cluster's hop cost
(``stages="auto"``), and the bundles a Ray session reserves (`stage_bundles`), without
starting its actors.
"""

from __future__ import annotations

from typing import Any, Sequence

import ray

from actors.connect import ensure_ray
from actors.options import RayOptions
from actors.reservation import bundles_for, cluster_has_gpus
from hetero_exec.model_plan import load_and_plan
from hetero_exec.options import SessionOptions
from hetero_exec.placement.stages import HopModel, plan_stages


def connect_for(plan: Any, opts: RayOptions) -> str:
    """Connect to Ray for ``plan`` (a local start gets a logical GPU per emulated
    device), and resolve ``seam_transport="auto"`` on the cluster joined; returns how it
    connected (`ensure_ray`)."""
    devices = {s.provider_name for s in plan.segments if s.provider.is_device}
    emulated = all(s.provider.kind != "gpu" for s in plan.segments)
    how = ensure_ray(opts, {"GPU": float(len(devices))}, logical_gpus=emulated)
    if opts.seam_transport == "auto":
        opts.seam_transport = auto_transport(sum(1 for n in ray.nodes() if n.get("Alive")))
    return how


def auto_transport(nodes: int) -> str:
    """``seam_transport="auto"`` on a cluster of ``nodes`` live nodes: shared memory on
    one node (every actor and the driver share /dev/shm), Ray's object store otherwise.

    >>> auto_transport(1), auto_transport(3)
    ('shared_memory', 'object_store')
    """
    return "shared_memory" if nodes == 1 else "object_store"


def replan_stages(plan: Any, opts: RayOptions, options: Any) -> None:
    """The plan's stages for Ray. ``stages="auto"``: cut where it pays on this cluster
    (its hop cost, its cores); a saved plan's cuts, or the session's own K or cuts,
    stand as planned. Needs Ray connected and ``opts.seam_transport`` resolved
    (`connect_for`)."""
    spec = getattr(options, "stages", "auto")
    bounds = dict(getattr(options, "dim_bounds", None) or {})
    if spec == "auto" and plan.saved_cuts is not None:
        spec = plan.saved_cuts
    if spec != "auto":
        if not plan.stages:  # a plan made without the session's planner (by hand)
            plan.stages = plan_stages(plan, spec, bounds=bounds)
        return
    from actors.hop_cost import hop_model
    from actors.runtime_env import default_runtime_env

    cores = float(ray.cluster_resources().get("CPU", 1.0))
    hop = opts.hop_model
    if hop is None:
        # measuring the hop costs a probe actor (about half a second): skip it when the
        # choice cannot depend on it (free and prohibitive hops give the same cuts, as
        # for a plan whose one device spans all its segments)
        free = plan_stages(plan, "auto", HopModel(0.0, 1e30), cores=cores, bounds=bounds)
        dear = plan_stages(plan, "auto", HopModel(1.0, 1e6), cores=cores, bounds=bounds)
        if [s.segments for s in free] != [s.segments for s in dear]:
            # the hop's copy is measured as seams will travel: through shared memory
            # when they do, else through the object store
            one_node = opts.seam_transport == "shared_memory"
            hop = hop_model(one_node, opts.runtime_env or default_runtime_env())
    plan.stages = plan_stages(plan, "auto", hop or HopModel(), cores=cores, bounds=bounds)


def stage_bundles(model: Any, providers: Sequence[Any] | None = None,
                  **session_options: Any) -> list[dict[str, float]]:
    """The Ray resource bundles a Ray session of ``model`` reserves, one per stage.

    For a Serve replica that drives its own stage actors: deploy it with
    ``placement_group_bundles=[replica_bundle, *stage_bundles(...)]`` and build the
    session inside with ``executor="ray", placement_group="current"``. Plans the
    session without starting actors (connects to Ray for ``stages="auto"``, whose cuts
    depend on the cluster's hop cost; fixed cuts need no Ray):

    >>> import numpy as np, onnx.helper as h, onnx.numpy_helper as nh
    >>> g = h.make_graph(
    ...     [h.make_node("MatMul", ["x", "w"], ["h"]), h.make_node("Relu", ["h"], ["y"])], "g",
    ...     [h.make_tensor_value_info("x", 1, [1, 4])], [h.make_tensor_value_info("y", 1, [1, 4])],
    ...     [nh.from_array(np.ones((4, 4), np.float32), "w")])
    >>> stage_bundles(h.make_model(g), [("sim-gpu", {"exclude_ops": ["Relu"]}), "cpu"],
    ...               hetero=True, stages=2)
    [{'CPU': 0.25, 'GPU': 1.0}, {'CPU': 0.25}]
    """
    opts = SessionOptions.from_kwargs({**session_options, "executor": "ray"})
    ray_opts = RayOptions.parse(opts.executor_options)
    plan = load_and_plan(model, providers, opts).build.placement
    if opts.stages == "auto" and plan.saved_cuts is None:
        connect_for(plan, ray_opts)
        replan_stages(plan, ray_opts, opts)
    return bundles_for([st.provider for st in plan.stages], ray_opts, cluster_has_gpus())


__all__ = ["auto_transport", "connect_for", "replan_stages", "stage_bundles"]
