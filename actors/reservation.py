"""Reserving a plan's actors together: bundles, a placement group, actor start-up.

`plan_slots` decides which actor hosts which segments (one per segment, or one per
device when colocated) and what each reserves; `Reservation` turns that into a
placement group and started actors, or releases everything it made and raises
(SEMANTICS.md section 6: a failed build leaks nothing).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.options import RayOptions
from actors.remote_errors import user_error
from actors.segment import remote_class
from actors.segment_model import SegmentSpec
from hetero_exec.errors import ActorError, BuildError

log = logging.getLogger(__name__)


@dataclass
class ActorSlot:
    """One segment actor: the segments it hosts, what it reserves, its live handle."""

    index: int
    specs: list[SegmentSpec]
    device: str  # "cpu" or a device provider's name ("sim-gpu:0")
    bundle: int
    num_cpus: float
    num_gpus: float
    local_values: frozenset[str] = frozenset()
    handle: Any = None
    #: the actor's constructor arguments, put once and held: Ray re-reads them at each
    #: restart, so they must outlive the creation task (ray-project/ray#53727)
    init_args: Any = None
    incarnation: str = ""
    generation: int = 0  # bumped when the actor is re-created
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    _methods: dict[tuple[int, int, bool], Any] = field(default_factory=dict, repr=False)

    @property
    def labels(self) -> str:
        return ", ".join(s.label for s in self.specs)

    def method(self, num_returns: int, fetching: bool) -> Any:
        """The live handle's ``run`` (or ``run_fetching``) with ``num_returns`` set, made
        once per handle (``.options()`` costs a wrapper per call otherwise)."""
        key = (id(self.handle), num_returns, fetching)
        m = self._methods.get(key)
        if m is None:
            if len(self._methods) > 16:  # handles of re-created actors
                self._methods.clear()
            target = self.handle.run_fetching if fetching else self.handle.run
            m = self._methods[key] = target.options(num_returns=num_returns)
        return m


def plan_slots(
    specs: Sequence[SegmentSpec], graph_outputs: Sequence[str], opts: RayOptions
) -> tuple[list[ActorSlot], list[dict[str, float]]]:
    """The actor slots for ``specs`` and the placement group's bundles.

    A device provider gets one bundle of ``device_num_gpus`` GPUs, shared by the actors
    on it in equal fractions; each cpu actor gets a bundle of ``segment_num_cpus`` CPUs.

    >>> from actors.segment_model import SegmentSpec
    >>> mk = lambda i, kind: SegmentSpec(i, kind, {} if kind == "cpu" else {"device_id": 0},
    ...                                  b"", (), "graph", ("x",), (f"y{i}",))
    >>> specs = [mk(0, "sim-gpu"), mk(1, "cpu"), mk(2, "sim-gpu")]
    >>> slots, bundles = plan_slots(specs, ["y2"], RayOptions())
    >>> [(s.device, s.num_gpus) for s in slots], bundles
    ([('sim-gpu:0', 0.5), ('cpu', 0), ('sim-gpu:0', 0.5)], [{'GPU': 1.0}, {'CPU': 1.0}])
    """
    groups: list[tuple[str, list[SegmentSpec]]] = []
    for spec in specs:
        device = spec.provider_name
        if opts.colocate and groups and any(d == device for d, _ in groups):
            next(g for d, g in groups if d == device).append(spec)
        else:
            groups.append((device, [spec]))
    per_device: dict[str, int] = {}
    for device, _ in groups:
        per_device[device] = per_device.get(device, 0) + 1
    bundles: list[dict[str, float]] = []
    bundle_of_device: dict[str, int] = {}
    slots: list[ActorSlot] = []
    for i, (device, group) in enumerate(groups):
        if device == "cpu":
            bundles.append({"CPU": float(opts.segment_num_cpus)})
            slots.append(ActorSlot(i, group, device, len(bundles) - 1, opts.segment_num_cpus, 0))
            continue
        if device not in bundle_of_device:
            bundles.append({"GPU": float(opts.device_num_gpus)})
            bundle_of_device[device] = len(bundles) - 1
        share = math.floor(opts.device_num_gpus / per_device[device] * 1e4) / 1e4
        slots.append(ActorSlot(i, group, device, bundle_of_device[device], 0, share))
    for slot, local in zip(slots, local_values(slots, graph_outputs)):
        slot.local_values = local
    return slots, bundles


def local_values(slots: Sequence[ActorSlot], graph_outputs: Sequence[str]) -> list[frozenset[str]]:
    """Per slot: values produced and read only there (they stay in the actor's memory)."""
    producer = {o: slot.index for slot in slots for s in slot.specs for o in s.outputs}
    readers: dict[str, set[int]] = {}
    for slot in slots:
        for s in slot.specs:
            for name in s.inputs:
                readers.setdefault(name, set()).add(slot.index)
    outs = set(graph_outputs)
    local: list[set[str]] = [set() for _ in slots]
    for name, p in producer.items():
        if name not in outs and readers.get(name) == {p}:
            local[p].add(name)
    return [frozenset(v) for v in local]


def default_runtime_env() -> dict[str, Any] | None:
    """What the actors need to import hetero_exec and actors from this checkout.

    Nothing when the job already provides it (a ``working_dir``, or PYTHONPATH naming
    the checkout): actors then reuse the job's pre-started workers. Otherwise
    PYTHONPATH with the checkout.
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        job_env = dict(ray.get_runtime_context().runtime_env or {})
    except Exception:  # not connected yet, or an older Ray
        job_env = {}
    job_path = (job_env.get("env_vars") or {}).get("PYTHONPATH", "")
    if job_env.get("working_dir") or root in job_path.split(os.pathsep):
        return None
    paths = [root] + [
        p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != root
    ]
    return {"env_vars": {"PYTHONPATH": os.pathsep.join(paths)}}


class Reservation:
    """A placement group and the started actors of its slots.

    >>> res = Reservation(slots, bundles, RayOptions())  # doctest: +SKIP
    >>> res.start(); [s.handle for s in res.slots]  # doctest: +SKIP
    >>> res.release()  # doctest: +SKIP
    """

    def __init__(
        self,
        slots: list[ActorSlot],
        bundles: list[dict[str, float]],
        opts: RayOptions,
        profile: bool = False,
        shm_prefix: str = "hetero_exec",
    ):
        self.slots = slots
        self.bundles = bundles
        self.opts = opts
        self.profile = profile
        self.shm_prefix = shm_prefix  # shared-memory seam files: <prefix>-s<slot>-...
        self.pg: Any = None
        self.runtime_env = (
            opts.runtime_env if opts.runtime_env is not None else default_runtime_env()
        )

    # -- build ----------------------------------------------------------------------

    def start(self) -> None:
        """Reserve and start everything; on any failure release it all, then raise."""
        try:
            self._check_fits()
            self._reserve()
            self._start_actors()
        except BaseException as build_error:
            try:
                self.release()
            except Exception as release_error:
                raise BuildError(build_error, release_error) from build_error
            raise

    def _check_fits(self) -> None:
        """Refuse at once what this cluster can never hold (no need to wait for it)."""
        total = ray.cluster_resources()
        need: dict[str, float] = {}
        for b in self.bundles:
            for k, v in b.items():
                need[k] = need.get(k, 0.0) + v
        short = {k: (v, total.get(k, 0.0)) for k, v in need.items() if v > total.get(k, 0.0) + 1e-9}
        if short:
            detail = ", ".join(
                f"{k}: needs {v:g}, cluster has {t:g}" for k, (v, t) in sorted(short.items())
            )
            raise ActorError(
                f"the plan cannot be placed on this Ray cluster ({detail}); "
                f"bundles {self.bundles} for {len(self.slots)} segment actor(s)"
            )
        alive = [n for n in ray.nodes() if n.get("Alive")]
        if self.opts.placement_strategy == "STRICT_SPREAD" and len(self.bundles) > len(alive):
            raise ActorError(
                f"placement_strategy STRICT_SPREAD needs {len(self.bundles)} nodes "
                f"for bundles {self.bundles}, the cluster has {len(alive)}"
            )

    def _reserve(self) -> None:
        started = time.perf_counter()
        log.info(
            "reserving %d bundle(s) %s with strategy %s",
            len(self.bundles),
            self.bundles,
            self.opts.placement_strategy,
        )
        self.pg = placement_group(self.bundles, strategy=self.opts.placement_strategy)
        try:
            ray.get(self.pg.ready(), timeout=self.opts.placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise ActorError(
                f"placement group for {len(self.slots)} segment actor(s) (bundles {self.bundles}, "
                f"strategy {self.opts.placement_strategy}) was not placed within "
                f"{self.opts.placement_timeout_s:g}s; available resources: "
                f"{_brief(ray.available_resources())}"
            ) from None
        log.info("placement group ready in %.2fs", time.perf_counter() - started)

    def _start_actors(self) -> None:
        started = time.perf_counter()
        pending = {}
        for slot in self.slots:
            slot.handle = self._new_actor(slot)
            pending[slot.handle.ready.remote()] = slot
        log.info("starting %d segment actor(s)", len(pending))
        deadline = time.monotonic() + self.opts.actor_start_timeout_s
        while pending:
            done, _ = ray.wait(
                list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic())
            )
            if not done:
                waiting = "; ".join(s.labels for s in pending.values())
                raise ActorError(
                    f"segment actor(s) not ready within "
                    f"{self.opts.actor_start_timeout_s:g}s: {waiting}"
                )
            slot = pending.pop(done[0])
            info = self._ready(slot, done[0])
            log.info(
                "actor %d/%d ready: %s on node %s (pid %s, %s)",
                len(self.slots) - len(pending),
                len(self.slots),
                slot.labels,
                info["node"][:8],
                info["pid"],
                ", ".join(
                    f"compile {s['compile_s']:.2f}s, {s['weight_bytes']} weight bytes"
                    for s in info["segments"]
                ),
            )
        log.info(
            "all %d segment actor(s) ready in %.2fs", len(self.slots), time.perf_counter() - started
        )

    def _ready(self, slot: ActorSlot, ref: Any) -> dict[str, Any]:
        try:
            info = ray.get(ref)
        except ray.exceptions.RayError as e:
            typed = user_error(e)
            if typed is not None:
                raise typed from None  # the segment could not be built (its own typed error)
            raise ActorError(f"segment actor for {slot.labels} failed to start: {e}") from e
        slot.incarnation = info["incarnation"]
        return info

    def _new_actor(self, slot: ActorSlot) -> Any:
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=self.pg, placement_group_bundle_index=slot.bundle
        )
        if slot.init_args is None:
            slot.init_args = ray.put(slot.specs)
        return (
            remote_class()
            .options(
                num_cpus=slot.num_cpus,
                num_gpus=slot.num_gpus,
                max_restarts=self.opts.max_restarts,
                max_task_retries=0,
                scheduling_strategy=strategy,
                runtime_env=self.runtime_env or None,
            )
            .remote(
                (slot.init_args,),
                slot.local_values,
                self.opts.seam_transport,
                self.profile,
                {"prefix": f"{self.shm_prefix}-s{slot.index}", "budget": self.opts.shm_seam_bytes},
            )
        )

    # -- recovery ---------------------------------------------------------------------

    def recreate(self, slot: ActorSlot) -> None:
        """Replace a permanently dead actor in its bundle (its weights load again)."""
        if self.pg is None:
            raise ActorError(
                f"cannot re-create the actor of {slot.labels}: the reservation was released"
            )
        log.warning("re-creating the segment actor of %s", slot.labels)
        try:
            ray.kill(slot.handle, no_restart=True)
        except Exception:  # already gone
            pass
        slot.handle = self._new_actor(slot)
        slot.generation += 1
        try:
            info = ray.get(slot.handle.ready.remote(), timeout=self.opts.actor_start_timeout_s)
        except Exception as e:
            raise ActorError(f"could not re-create the segment actor of {slot.labels}: {e}") from e
        slot.incarnation = info["incarnation"]

    # -- teardown ----------------------------------------------------------------------

    def release(self) -> None:
        """Kill every actor and remove the placement group; raise the first failure."""
        errors: list[BaseException] = []
        for slot in self.slots:
            if slot.handle is not None:
                try:
                    ray.kill(slot.handle, no_restart=True)
                except Exception as e:
                    errors.append(e)
                slot.handle = None
            slot.init_args = None
        if self.pg is not None:
            try:
                remove_placement_group(self.pg)
            except Exception as e:
                errors.append(e)
            self.pg = None
        if errors:
            raise ActorError(f"releasing segment actors failed: {errors[0]!r}") from errors[0]


def _brief(resources: dict[str, float]) -> str:
    keep = {
        k: v
        for k, v in resources.items()
        if not k.startswith(("node:", "bundle_group", "memory", "object_store_memory"))
    }
    return ", ".join(f"{k}={v:g}" for k, v in sorted(keep.items())) or "none"
