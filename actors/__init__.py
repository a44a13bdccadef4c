"""The Ray layer of hetero_exec: a session's pipeline stages run by Ray actors.

``InferenceSession(model, providers, executor="ray", ...)`` reaches it through one lazy
import of `actors.coordinator.RayExecutor`. A plan's segments are grouped into
*stages* (`hetero_exec.placement.stages`); each stage is one actor; seams between
stages go through a transport. Modules, in the order data flows:

* stage -> actor -> transport:
  ``stage_model`` (a stage cut out as ONNX bytes: its nodes, its weights once, its
  segments' bounds and providers), ``stage`` (StageActor: compiles the stage's
  segments where it runs, runs a group of requests through them with in-process
  seam moves), ``transport/`` (seams between stages, each transport built from the
  session's `SeamConfig`: shared memory on one node, the object store, msgpack wire);
* the coordinator and its concerns, a file each:
  ``connect`` (join a cluster or start a local Ray), ``runtime_env`` (how workers
  import this checkout), ``cluster_plan`` (the stages for this cluster, the seam
  transport "auto" picks, `stage_bundles`), ``hop_cost`` (what a hop costs here, for
  the stage planner), ``reservation`` (bundles, placement group, actor start-up and
  teardown), ``request`` (a request's state, its outputs), ``request_pool`` (the one
  submit path's slots and Futures, answered in one place), ``dispatch`` (a group's
  stage tasks, in order, and their outputs), ``async_results`` (groups answered from
  Ray callbacks), ``replay`` (faults: bring actors back, replay from the dead stage),
  ``compiled`` (a second way to run the chain: a Ray compiled graph), ``coordinator``
  (RayExecutor, tying them together), ``remote_errors``, ``profile`` (Chrome traces,
  a lane per stage actor), ``options``;
* beside it: ``serve/`` (Ray Serve over the Open Inference Protocol), ``oip`` (the
  protocol's encodings), ``batching`` (a replica's dynamic batching), ``client``,
  ``data`` (Ray Data).

hetero_exec never imports this package except through that one lazy import.
"""

from __future__ import annotations

from typing import Any


def stage_bundles(model: Any, providers: Any = None, **session_options: Any) -> list[dict[str, float]]:
    """The Ray bundles a Ray session of ``model`` reserves, one per stage (see
    `actors.cluster_plan.stage_bundles`)."""
    from actors.cluster_plan import stage_bundles as bundles

    return bundles(model, providers, **session_options)


__all__ = ["stage_bundles"]
