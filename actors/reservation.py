"""Reserving a plan's stage actors together: bundles, a placement group, start-up.

`plan_slots` gives each pipeline stage an actor slot and decides what it reserves: a
fraction of a CPU (``stage_num_cpus``), and for a device stage its device's GPUs;
`Reservation` turns that into a placement group (its own, or the caller's with
``placement_group="current"``) and started actors, or releases everything it made and
raises (SEMANTICS.md section 6: a failed build leaks nothing).
"""

from __future__ import annotations

import logging
import math
import pickle
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.code_version import check_failed_actor, check_same_code
from actors.connect import ray_usable
from actors.options import RayOptions
from actors.remote_errors import user_error
from actors.runtime_env import default_runtime_env
from actors.stage import remote_class
from actors.stage_model import StageSpec
from actors.transport.base import SeamConfig
from hetero_exec.errors import ActorError, BuildError

log = logging.getLogger(__name__)


@dataclass
class ActorSlot:
    """One stage actor: the stage it runs, what it reserves, its live handle."""

    index: int
    spec: StageSpec
    bundle: int
    num_cpus: float
    num_gpus: float
    threads: int | None = None  # BLAS threads in the actor (None: its host's cores / share)
    share: int = 1  # this plan's stages on the same node (they split its cores)
    handle: Any = None
    #: the stage when it travels inline in the constructor (small); else None and
    #: ``stage_ref`` holds it, put once: the actor loads it after its constructor, and
    #: again after each restart (`actors.replay`), so no constructor argument lives in
    #: the object store (ray-project/ray#53727)
    init_args: Any = None
    stage_ref: Any = None
    incarnation: str = ""
    generation: int = 0  # bumped when the actor is re-created
    node: str = ""  # the Ray node it runs on (from ready())
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    _methods: dict[tuple[int, int, bool], Any] = field(default_factory=dict, repr=False)

    @property
    def labels(self) -> str:
        return f"{self.spec.label}: {self.spec.segment_labels}"

    @property
    def device(self) -> str:
        return self.spec.device

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


def plan_slots(specs: Sequence[StageSpec], opts: RayOptions
               ) -> tuple[list[ActorSlot], list[dict[str, float]]]:
    """An actor slot per stage, and the placement group's bundles (one per stage).

    >>> from actors.stage_model import StageSpec
    >>> mk = lambda i, dev: StageSpec(i, dev, b"", (), "graph", (), ("x",), (f"y{i}",))
    >>> slots, bundles = plan_slots([mk(0, "sim-gpu:0"), mk(1, "cpu")], RayOptions())
    >>> [(s.num_cpus, s.num_gpus) for s in slots], bundles
    ([(0.25, 1.0), (0.25, 0.0)], [{'CPU': 0.25, 'GPU': 1.0}, {'CPU': 0.25}])
    """
    bundles = bundles_for([spec.device for spec in specs], opts, cluster_has_gpus())
    slots = [ActorSlot(i, spec, i, b["CPU"], b.get("GPU", 0.0), threads=opts.stage_threads)
             for i, (spec, b) in enumerate(zip(specs, bundles))]
    return slots, bundles


def bundles_for(devices: Sequence[str], opts: RayOptions, emulated_gpus: bool = True
                ) -> list[dict[str, float]]:
    """A bundle per stage (``devices``: each stage's provider): ``stage_num_cpus`` CPUs,
    and for a device stage ``device_num_gpus`` GPUs, split in equal fractions when a
    device spans several stages (a plan that interleaves two devices). An emulated
    device (sim-gpu) reserves GPUs only with ``emulated_gpus``: on a cluster that
    declares none (a plain ``ray start``) it places where a cpu stage would; a real
    ``gpu`` stage always reserves them.

    >>> bundles_for(["sim-gpu:0", "cpu", "sim-gpu:0"], RayOptions())
    [{'CPU': 0.25, 'GPU': 0.5}, {'CPU': 0.25}, {'CPU': 0.25, 'GPU': 0.5}]
    >>> bundles_for(["sim-gpu:0", "cpu"], RayOptions(), emulated_gpus=False)
    [{'CPU': 0.25}, {'CPU': 0.25}]
    """
    def reserves_gpu(d: str) -> bool:
        return d != "cpu" and (emulated_gpus or not d.startswith("sim-gpu"))

    per_device: dict[str, int] = {}
    for d in devices:
        if reserves_gpu(d):
            per_device[d] = per_device.get(d, 0) + 1
    bundles = []
    for d in devices:
        bundle = {"CPU": float(opts.stage_num_cpus)}
        if reserves_gpu(d):
            bundle["GPU"] = math.floor(opts.device_num_gpus / per_device[d] * 1e4) / 1e4
        bundles.append(bundle)
    return bundles


def cluster_has_gpus() -> bool:
    """Whether the connected cluster declares any GPU (logical ones count); True when
    not connected, so that plans made offline keep their GPU bundles."""
    if not ray.is_initialized():
        return True
    return ray.cluster_resources().get("GPU", 0.0) > 0


def stage_shares(slots: Sequence[ActorSlot]) -> None:
    """How many of the plan's stages share each slot's node: an actor without a thread
    count takes its host's cores over that share (one stage alone on a 2-core laptop
    uses both cores, two stages one each)."""
    on_node: dict[str, int] = {}
    for slot in slots:
        on_node[slot.node] = on_node.get(slot.node, 0) + 1
    for slot in slots:
        slot.share = on_node[slot.node]


class Reservation:
    """A placement group and the started actors of its slots.

    Needs a cluster, so its example does not run here:

    >>> res = Reservation(slots, bundles, RayOptions())  # doctest: +SKIP
    >>> res.start(); [s.handle for s in res.slots]  # doctest: +SKIP
    >>> res.release()  # doctest: +SKIP
    """

    def __init__(
        self,
        slots: list[ActorSlot],
        bundles: list[dict[str, float]],
        opts: RayOptions,
        seam_config: SeamConfig | None = None,
        profile: bool = False,
    ):
        self.slots = slots
        self.bundles = bundles
        self.opts = opts
        self.seam_config = seam_config or SeamConfig(opts.seam_transport)  # each actor's end: its own files
        self.profile = profile
        self.pg: Any = None
        self.owns_pg = opts.placement_group is None
        self.first_bundle = 0 if self.owns_pg else 1  # bundle 0 is the caller's own
        self.runtime_env = (
            opts.runtime_env if opts.runtime_env is not None else default_runtime_env()
        )

    # -- build ----------------------------------------------------------------------

    def start(self) -> None:
        """Reserve and start everything; on any failure release it all, then raise."""
        try:
            if self.owns_pg:
                self._check_fits()
                self._reserve()
            else:
                self._join_current()
            self._locate()
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
        need = _sum(self.bundles)
        short = {k: (v, total.get(k, 0.0)) for k, v in need.items() if v > total.get(k, 0.0) + 1e-9}
        if short:
            detail = ", ".join(
                f"{k}: needs {v:g}, cluster has {t:g}" for k, (v, t) in sorted(short.items())
            )
            raise ActorError(
                f"the plan cannot be placed on this Ray cluster ({detail}); "
                f"bundles {self.bundles} for {len(self.slots)} stage actor(s)"
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
                f"placement group for {len(self.slots)} stage actor(s) (bundles {self.bundles}, "
                f"strategy {self.opts.placement_strategy}) was not placed within "
                f"{self.opts.placement_timeout_s:g}s; available resources: "
                f"{_brief(ray.available_resources())}"
            ) from None
        log.info("placement group ready in %.2fs", time.perf_counter() - started)

    def _join_current(self) -> None:
        """``placement_group="current"``: the stages take bundles 1.. of the caller's group
        (a Serve replica started with ``placement_group_bundles=[own, *stage_bundles]``)."""
        from ray.util import get_current_placement_group

        pg = get_current_placement_group()
        if pg is None:
            raise ActorError("placement_group='current', but this code does not run in a "
                             "placement group (start it with placement_group_bundles)")
        have = list(pg.bundle_specs)[self.first_bundle:]
        if len(have) < len(self.bundles) or any(
                any(got.get(k, 0.0) + 1e-9 < v for k, v in want.items())
                for want, got in zip(self.bundles, have)):
            raise ActorError(f"the current placement group's bundles {list(pg.bundle_specs)} do "
                             f"not hold this plan's stage bundles {self.bundles} after bundle 0 "
                             f"(actors.stage_bundles gives them)")
        self.pg = pg

    def _locate(self) -> None:
        """Each slot's node, from where its bundle was placed (for thread counts)."""
        try:
            table = ray.util.placement_group_table(self.pg)
            nodes = table.get("bundles_to_node_id") or {}
        except Exception:  # older Rays: every slot counts as one node
            nodes = {}
        for slot in self.slots:
            slot.node = str(nodes.get(slot.bundle + self.first_bundle, ""))
        stage_shares(self.slots)

    def _start_actors(self) -> None:
        started = time.perf_counter()
        pending = {}
        for slot in self.slots:
            slot.handle = self._new_actor(slot)
            pending[slot.handle.ready.remote()] = slot
        log.info("starting %d stage actor(s)", len(pending))
        deadline = time.monotonic() + self.opts.actor_start_timeout_s
        while pending:
            done, _ = ray.wait(
                list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic())
            )
            if not done:
                waiting = "; ".join(s.labels for s in pending.values())
                raise ActorError(
                    f"stage actor(s) not ready within "
                    f"{self.opts.actor_start_timeout_s:g}s: {waiting}"
                )
            slot = pending.pop(done[0])
            info = self._ready(slot, done[0])
            log.info(
                "actor %d/%d ready: %s on node %s (pid %s, %s threads, compiled in %.2fs, "
                "%d weight bytes)",
                len(self.slots) - len(pending),
                len(self.slots),
                slot.labels,
                info["node"][:8],
                info["pid"],
                info["threads"],
                info["compile_s"],
                info["weight_bytes"],
            )
        log.info(
            "all %d stage actor(s) ready in %.2fs", len(self.slots), time.perf_counter() - started
        )

    def _ready(self, slot: ActorSlot, ref: Any) -> dict[str, Any]:
        what = f"the stage actor of {slot.labels}"
        try:
            info = ray.get(ref)
        except ray.exceptions.RayError as e:
            check_failed_actor(what, slot.handle)
            typed = user_error(e)
            if typed is not None:
                raise typed from None  # the stage could not be built (its own typed error)
            raise ActorError(f"stage actor for {slot.labels} failed to start: {e}") from e
        check_same_code(what, info.get("code"))
        slot.incarnation = info["incarnation"]
        slot.node = info["node"] or slot.node
        return info

    def _new_actor(self, slot: ActorSlot) -> Any:
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=self.pg,
            placement_group_bundle_index=slot.bundle + self.first_bundle,
        )
        if slot.init_args is None and slot.stage_ref is None:
            if len(pickle.dumps(slot.spec, protocol=5)) <= INLINE_SPEC_BYTES:
                slot.init_args = slot.spec
            else:
                slot.stage_ref = ray.put(slot.spec)
        handle = (
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
                slot.init_args,
                self.seam_config.for_owner(f"s{slot.index}"),
                self.profile,
                slot.threads or -slot.share,  # negative: a share of the host's cores
            )
        )
        send_stage(slot, handle)  # before ready(): one caller's tasks run in order
        return handle

    # -- recovery ---------------------------------------------------------------------

    def recreate(self, slot: ActorSlot) -> None:
        """Replace a permanently dead actor in its bundle (its weights load again); the
        caller waits for it to answer (`actors.replay`), and re-creates it again if it
        dies before it does."""
        if self.pg is None:
            raise ActorError(
                f"cannot re-create the actor of {slot.labels}: the reservation was released"
            )
        log.warning("re-creating the stage actor of %s", slot.labels)
        try:
            ray.kill(slot.handle, no_restart=True)
        except Exception:  # already gone
            pass
        slot.handle = self._new_actor(slot)
        slot.generation += 1

    # -- teardown ----------------------------------------------------------------------

    def release(self) -> None:
        """Kill every actor and remove the placement group (only one of our own); raise
        the first failure. Once Ray is shut down (or the interpreter finalizes) the
        handles are only dropped: the job's end took the actors and the group."""
        errors: list[BaseException] = []
        usable = ray_usable()
        for slot in self.slots:
            if slot.handle is not None and usable:
                try:
                    ray.kill(slot.handle, no_restart=True)
                except Exception as e:
                    errors.append(e)
                slot.handle = None
            slot.init_args = slot.stage_ref = None
        if self.pg is not None and self.owns_pg and usable:
            try:
                remove_placement_group(self.pg)
            except Exception as e:
                errors.append(e)
        self.pg = None
        if errors:
            raise ActorError(f"releasing stage actors failed: {errors[0]!r}") from errors[0]


#: a stage whose pickle is at most this travels inline in its actor's constructor
#: (under Ray's 100 KiB limit for inline arguments); a larger one is loaded after it
INLINE_SPEC_BYTES = 64 << 10


def send_stage(slot: ActorSlot, handle: Any) -> None:
    """Send the stage to a new or restarted actor when it did not travel inline."""
    if slot.stage_ref is not None:
        handle.load.remote([slot.stage_ref])


def _sum(bundles: Sequence[dict[str, float]]) -> dict[str, float]:
    need: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            need[k] = need.get(k, 0.0) + v
    return need


def _brief(resources: dict[str, float]) -> str:
    keep = {
        k: v
        for k, v in resources.items()
        if not k.startswith(("node:", "bundle_group", "memory", "object_store_memory"))
    }
    return ", ".join(f"{k}={v:g}" for k, v in sorted(keep.items())) or "none"
