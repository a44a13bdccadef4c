"""The Ray layer of hetero_exec: a session's pipeline stages run by Ray actors.

``InferenceSession(model, providers, executor="ray", ...)`` reaches it through one lazy
import of `actors.coordinator.RayExecutor`. A plan's segments are grouped into
*stages* (`hetero_exec.placement.stages`); each stage is one actor; seams between
stages go through a transport. Modules, in the order data flows:

* stage -> actor -> transport:
  ``stage_model`` (a stage cut out as ONNX bytes: its nodes, its weights once, its
  segments' bounds and providers), ``stage`` (StageActor: compiles the stage's
  segments where it runs, runs a group of requests through them with in-process
  seam moves), ``transport/`` (seams between stages: shared memory on one node, the
  object store, msgpack wire; Ray Compiled Graphs);
* the coordinator and its concerns, a file each:
  ``connect`` (join a cluster or start a local Ray), ``hop_cost`` (what a hop costs
  here, for the stage planner), ``reservation`` (bundles, placement group, actor
  start-up and teardown), ``dispatch`` (a group's stage tasks, in order, and their
  outputs), ``async_results`` (Futures answered from Ray callbacks), ``replay``
  (faults: bring actors back, replay from the dead stage), ``coordinator``
  (RayExecutor, tying them together), ``request``, ``remote_errors``, ``profile``
  (Chrome traces, a lane per stage actor), ``options``.

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
