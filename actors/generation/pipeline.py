"""RayDecoder: a decoder split at layer boundaries over stage actors (`stage.py`), the
driver's side of generation on ``executor="ray"``.

Built by ``hetero_exec.genai.Model(path, executor="ray", stages=K, providers=[...])``:
the rewritten decoder is cut into K stage models (`split.py`: layers shared out evenly,
or ``stage_layers=[3, 1]`` names each stage's count), each stage gets one
device of ``providers`` (in order; cpu entries join every stage as its fallback), and
its actor compiles the stage as an in-process session. Actors sit in a placement
group of their own (``placement_strategy``), restart on death (``max_restarts``), and
are killed with the group on `close` (also at the driver's exit).

Faults: a generator that sees no progress checks the stages (`check`); when an actor
died or was restarted, every live group is replayed (`recover`): the restarted actor
loads its stage again, each group opens again there and runs a prefill over its
tokens so far through the whole ring (the surviving stages rewrite the same values),
then goes on. ``max_replays`` bounds the replays of one group.

The ring's hops go over a Unix socket between stages on one node and by Ray calls
across nodes (`channel.py`); ``stage_link="ray"`` makes every hop a Ray call. The
driver's own steps (a prompt, a rewind's tokens) go to stage 0 the same way
(`channel.DriverLink`). ``stage_cores`` ("auto", or a core list per stage) pins each
stage's process to its own cores (`cores.py`); by default the OS places them, and where
a node has no core beyond its stages, a stage running one group alone steps on the
node's turn core, with the others there (`cores.TurnCore`; ``"os"``: never). With
``yield_to_stages=True`` the driver waits for tokens without preempting the stages on
its node (`inbox.yield_thread`): tokens/s over each token's hand-over time.
A stage's runs split their work over its share of its node's cores (the stages there
divide them; pinned, its own), unless ``intra_op_num_threads`` names a count
(`GenerationStage.share`). A stage running one group alone polls for its next step up
to ``stage_spin_ms`` after each step before it sleeps (`spin.py`; by default 5 ms where
its node has a core beyond its stages, else off).

Admission: the stages are this decoder's alone, so the driver keeps their books
(`admit`, from each stage's budget, weights and cache bytes per position, read once
at load): a generator that does not fit a stage's ``mem_limit`` is refused when made,
naming the stage, with no call to any actor; its first step then opens it on each
stage as it passes (`Job.spec`).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.code_version import check_failed_actor, check_same_code
from actors.connect import close_at_exit, ensure_ray, ray_usable
from actors.generation.channel import LINKS, DriverLink
from actors.generation.cores import AUTO, OS, check_option
from actors.generation.spin import check_spin_ms
from actors.generation.split import split_decoder
from actors.generation.stage import remote_class
from actors.options import RayOptions
from actors.reservation import bundles_for, cluster_has_gpus
from actors.runtime_env import default_runtime_env
from hetero_exec.errors import ActorError
from hetero_exec.genai.errors import CacheAdmissionError, GenaiError
from hetero_exec.providers import parse_provider

log = logging.getLogger(__name__)

#: session options that are the generator's on Ray, not the stage sessions'
_RAY_KEYS = {"ray_address", "ray_init", "runtime_env", "placement_strategy", "placement_timeout_s",
             "actor_start_timeout_s", "stage_num_cpus", "device_num_gpus", "max_restarts",
             "max_replays", "recovery_timeout_s"}


def stage_providers(providers: list[Any] | None, stages: int) -> list[list[Any]]:
    """Each stage's providers: the k-th device of ``providers`` (round robin when there
    are fewer devices than stages), and the cpu entries after it.

    >>> stage_providers(["sim-gpu:0", "sim-gpu:1", "cpu"], 2)
    [['sim-gpu:0', 'cpu'], ['sim-gpu:1', 'cpu']]
    >>> stage_providers(None, 2)
    [['cpu'], ['cpu']]
    """
    given = list(providers or ["cpu"])
    devices = [p for p in given if parse_provider(p).kind != "cpu"]
    cpus = [p for p in given if parse_provider(p).kind == "cpu"]
    if not devices:
        return [list(given) for _ in range(stages)]
    return [[devices[k % len(devices)], *cpus] for k in range(stages)]


class RayDecoder:
    def __init__(self, rewritten: Any, layout: Any, providers: list[Any] | None,
                 options: dict[str, Any]):
        options = dict(options)
        options.pop("executor", None)
        # how many layers each stage runs (split.layer_counts; default even)
        stage_layers = options.pop("stage_layers", None)
        if stage_layers is not None:
            if isinstance(stage_layers, (str, bytes)) or not hasattr(stage_layers, "__len__"):
                raise GenaiError(f"stage_layers must be a list of layer counts, one a stage, "
                                 f"got {stage_layers!r}")
            stage_layers = list(stage_layers)
        stages = options.pop("stages", None)
        if stages is None:
            stages = len(stage_layers) if stage_layers is not None else 2
        if isinstance(stages, bool) or not isinstance(stages, int):
            raise GenaiError(f"stages must be an int for generation on Ray, got {stages!r}")
        self.link = options.pop("stage_link", "socket")
        if self.link not in LINKS:
            raise GenaiError(f"stage_link must be one of {LINKS}, got {self.link!r}")
        try:
            self.cores_option = check_option(options.pop("stage_cores", None), stages)
        except ValueError as e:
            raise GenaiError(str(e)) from None
        self.cores: list[list[int]] = []  # what each stage runs on (`_pin`)
        self.threads: list[int] = []  # each stage's threads a run (`_share`)
        # the driver waits for tokens without preempting the stages (inbox.py)
        self.yield_to_stages = options.pop("yield_to_stages", False)
        if not isinstance(self.yield_to_stages, bool):
            raise GenaiError(f"yield_to_stages must be True or False, got "
                             f"{self.yield_to_stages!r}")
        # how long a stage's loop may poll for its next step before it sleeps (spin.py;
        # None: by its node's spare cores)
        try:
            self.spin_ms = check_spin_ms(options.pop("stage_spin_ms", None))
        except ValueError as e:
            raise GenaiError(str(e)) from None
        self.ring_id = uuid.uuid4().hex[:12]
        self.opts = RayOptions.parse({k: options.pop(k) for k in list(options) if k in _RAY_KEYS})
        self.layout = layout
        self.parts = split_decoder(rewritten, layout, stages, stage_layers)
        self.providers = stage_providers(providers, stages)
        self.devices = [str(parse_provider(p[0]).name) for p in self.providers]
        ensure_ray(self.opts, logical_gpus=True)
        self.lock = threading.RLock()
        self.closed = False
        self.replays = 0
        self.admitted: dict[str, list[dict[str, int]]] = {}  # gid -> bytes per stage, device
        self.books = threading.Lock()  # the admissions (not held through a recovery)
        emulated = cluster_has_gpus()
        self.bundles = bundles_for(self.devices, self.opts, emulated)
        self.pg = placement_group(self.bundles, strategy=self.opts.placement_strategy)
        try:
            try:
                ray.get(self.pg.ready(), timeout=self.opts.placement_timeout_s)
            except ray.exceptions.GetTimeoutError:
                raise ActorError(f"placement group for {stages} generation stage(s) (bundles "
                                 f"{self.bundles}) was not placed within "
                                 f"{self.opts.placement_timeout_s:g}s") from None
            self.boxes = [[ray.put(p)] for p in self.parts]
            self.actors = [self._new_actor(k, options) for k in range(stages)]
            self.incarnations = self._load(range(stages), self.opts.actor_start_timeout_s)
            self.figures = ray.get([a.admission.remote() for a in self.actors])
            self.sockets = self._connect()
            self._pin()
            self._share()
        except BaseException:
            self.close()
            raise
        close_at_exit(self)
        log.info("generation on %d stages: %s", stages,
                 ", ".join(f"stage#{p.index} layers {list(p.layers)} on {d}"
                           for p, d in zip(self.parts, self.devices)))

    def _new_actor(self, k: int, session_options: dict[str, Any]) -> Any:
        bundle = self.bundles[k]
        strategy = PlacementGroupSchedulingStrategy(placement_group=self.pg,
                                                    placement_group_bundle_index=k)
        runtime_env = self.opts.runtime_env if self.opts.runtime_env is not None \
            else default_runtime_env()
        return remote_class().options(
            num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
            max_restarts=self.opts.max_restarts, max_task_retries=0,
            scheduling_strategy=strategy, runtime_env=runtime_env or None,
        ).remote(k, len(self.parts), self.layout, self.providers[k], session_options)

    def _load(self, indices: Any, timeout: float) -> list[str]:
        refs = {k: self.actors[k].load.remote(self.boxes[k], self.ring_id, self.link)
                for k in indices}
        out = getattr(self, "incarnations", [""] * len(self.actors))
        for k, ref in refs.items():
            try:
                loaded = ray.get(ref, timeout=timeout)
            except ray.exceptions.RayTaskError as e:
                check_failed_actor(f"stage#{k} ({self.devices[k]})", self.actors[k])
                raise GenaiError(f"stage#{k} ({self.devices[k]}) failed to build: "
                                 f"{getattr(e, 'cause', e)}") from None
            check_same_code(f"stage#{k} ({self.devices[k]})",
                            loaded.get("code") if isinstance(loaded, dict) else None)
            out[k] = loaded["incarnation"]
        return out

    def _connect(self) -> list[bool]:
        """Tell every stage the ring and its successor's address; which hops are sockets."""
        self.addresses = ray.get([a.address.remote() for a in self.actors])
        sockets = ray.get([a.connect.remote(self.actors, self.addresses) for a in self.actors])
        if getattr(self, "inlet", None) is not None:
            self.inlet.close()
        node, address = self.addresses[0]
        self.inlet = DriverLink.connect(address) \
            if node == ray.get_runtime_context().get_node_id() else None
        return sockets

    def _by_node(self) -> dict[str, list[int]]:
        """The stages' indices by the node they run on (from their `address`es)."""
        on_node: dict[str, list[int]] = {}
        for k, (node, _address) in enumerate(self.addresses):
            on_node.setdefault(node, []).append(k)
        return on_node

    def _pin(self) -> None:
        """Each stage on its cores (``stage_cores``, `cores.py`): "auto" gives the stages
        sharing a node even runs of its cores, in stage order; a list names them."""
        option = self.cores_option
        if option is None or option == OS:
            return
        if option == AUTO:
            refs = {k: self.actors[k].pin.remote(run=(rank, len(ks)))
                    for ks in self._by_node().values() if len(ks) > 1
                    for rank, k in enumerate(ks)}
        else:
            refs = {k: a.pin.remote(cores=option[k]) for k, a in enumerate(self.actors)}
        self.cores = [[] for _ in self.actors]
        for k, ref in refs.items():
            try:
                self.cores[k] = ray.get(ref)
            except ray.exceptions.RayTaskError as e:
                raise GenaiError(str(getattr(e, "cause", e))) from None
        log.info("generation stages' cores: %s", self.cores)

    def _share(self) -> None:
        """Each stage's threads a run (`GenerationStage.share`): its share of its node's
        cores among the stages there, unless ``intra_op_num_threads`` names them."""
        sharing = {k: len(ks) for ks in self._by_node().values() for k in ks}
        turns = self.cores_option is None
        self.threads = ray.get([a.share.remote(sharing[k], self.spin_ms, turns)
                                for k, a in enumerate(self.actors)])
        log.info("generation stages' threads a run: %s", self.threads)

    def send_step(self, gid: str, epoch: int, job: Any) -> None:
        """Hand a group's step to stage 0: over the driver's socket to it where it can
        (`channel.DriverLink`), else by a Ray call."""
        carried = [{}] * len(job.pieces)
        inlet = self.inlet
        if inlet is None or not inlet.send(gid, epoch, job, carried):
            self.first.step.remote(gid, epoch, job, carried)

    def send_join(self, gid: str, join: Any) -> None:
        """Hand stage 0 a request joining ``gid``'s next decode step (continuous
        batching), the way `send_step` hands it a step."""
        inlet = self.inlet
        if inlet is None or not inlet.send_join(gid, join):
            self.first.join.remote(gid, join)

    # -- groups ---------------------------------------------------------------------------

    @property
    def first(self) -> Any:
        return self.actors[0]

    @property
    def last(self) -> Any:
        return self.actors[-1]

    def admit(self, gid: str, spec: Any) -> None:
        """Reserve ``gid``'s cache on every stage against its budget, or raise the first
        stage's CacheAdmissionError (nothing reserved). The stages are this decoder's
        alone, so the driver keeps their books; each stage allocates the cache when the
        group's first step gets there (`GenerationStage.open`). A group admitted already
        keeps its reservation."""
        with self.books:
            if gid in self.admitted:
                return
            need = [{name: spec.batch * spec.capacity * int(f["per_position"])
                     for name, f in figures.items()} for figures in self.figures]
            for k, (figures, wanted) in enumerate(zip(self.figures, need)):
                for name, nbytes in wanted.items():
                    budget = figures[name]["budget"]
                    if budget is None:
                        continue
                    held = int(figures[name]["weights"]) + sum(
                        other[k].get(name, 0) for other in self.admitted.values())
                    free = int(budget) - held
                    if nbytes > free:
                        raise CacheAdmissionError(
                            f"stage#{k} ({name})", nbytes, max(free, 0),
                            f"layers {list(self.parts[k].layers)} x 2 x batch {spec.batch} x "
                            f"capacity {spec.capacity}")
            self.admitted[gid] = need

    def release(self, gid: str) -> None:
        """Drop ``gid``'s reservation (closed, or ended by the ring)."""
        with self.books:
            self.admitted.pop(gid, None)

    def reserved(self) -> dict[str, int]:
        """Bytes reserved by the groups admitted, by stage and device, as a stage's
        CacheAdmissionError names it."""
        with self.books:
            out: dict[str, int] = {}
            for need in self.admitted.values():
                for k, wanted in enumerate(need):
                    for name, nbytes in wanted.items():
                        key = f"stage#{k} ({name})"
                        out[key] = out.get(key, 0) + nbytes
            return {k: v for k, v in out.items() if v}

    def open(self, gid: str, spec: Any, epoch: int) -> None:
        """Open an admitted group on every stage now (a replay, a resumed group); a
        fresh group opens with its first step instead (`Job.spec`)."""
        ray.get([a.open.remote(gid, spec, epoch) for a in self.actors])

    @property
    def pushing(self) -> bool:
        """Whether the last stage writes its tokens to a driver's socket (`inbox.py`):
        its link is on and it runs on the driver's node."""
        node, address = self.addresses[-1]
        return bool(address) and node == ray.get_runtime_context().get_node_id()

    def generator(self, model: Any, params: Any, capacity: int) -> Any:
        """A generator over this pipeline (what ``genai.Generator(model, params)`` is on
        ``executor="ray"``)."""
        from actors.generation.generator import RemoteGenerator

        if self.closed:
            raise GenaiError("the model's stage actors are closed")
        return RemoteGenerator(model, params, capacity)

    def halt_group(self, gid: str, epoch: int) -> None:
        """Halt ``gid``'s epochs before ``epoch`` on every stage (a rewind): a halt frame
        to stage 0, which each stage passes on (`GenerationStage.halt_ring`), else a Ray
        call to each."""
        inlet = self.inlet
        if inlet is not None and inlet.send_halt(gid, epoch, len(self.actors) - 1):
            return
        for a in self.actors:
            a.halt.remote(gid, epoch)

    def close_group(self, gid: str) -> None:
        """Free ``gid``'s cache on every stage: a close frame to stage 0, which each stage
        passes on (`GenerationStage.close_ring`), else a Ray call to each."""
        self.release(gid)
        if self.closed or not ray_usable():
            return
        inlet = self.inlet
        if inlet is not None and inlet.send_close(gid, len(self.actors) - 1):
            return
        for a in self.actors:
            try:
                a.close.remote(gid)
            except Exception:  # a dead actor: its groups went with it
                pass

    def stats(self) -> list[dict[str, Any]]:
        """Each stage's groups and cache bytes (the counters a released group zeroes)."""
        return ray.get([a.stats.remote() for a in self.actors])

    # -- faults -----------------------------------------------------------------------------

    def check(self, timeout: float = 5.0) -> bool:
        """Whether every stage answers with the incarnation it was loaded as."""
        try:
            now = ray.get([a.ping.remote() for a in self.actors], timeout=timeout)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError,
                ray.exceptions.ActorUnavailableError):
            return False
        return now == self.incarnations

    def recover(self, seen: list[str]) -> None:
        """After a fault (``seen``: the incarnations the caller ran under): wait for the
        stages to answer and load the restarted ones. Each group then replays itself
        when its generator next collects (it sees the new incarnations)."""
        with self.lock:
            if seen != self.incarnations:
                return  # another caller recovered already
            deadline = time.monotonic() + self.opts.recovery_timeout_s
            while True:
                try:
                    now = ray.get([a.ping.remote() for a in self.actors], timeout=5.0)
                    break
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError,
                        ray.exceptions.ActorUnavailableError) as e:
                    if time.monotonic() > deadline:
                        raise ActorError(f"a generation stage did not come back within "
                                         f"{self.opts.recovery_timeout_s:g}s: {e}") from None
                    time.sleep(0.2)
            lost = [k for k, inc in enumerate(now) if inc != self.incarnations[k]]
            log.warning("generation stage(s) %s restarted: their groups replay",
                        [f"stage#{k}" for k in lost])
            self.incarnations = list(self._load(lost, self.opts.recovery_timeout_s))
            self.sockets = self._connect()  # the survivors' links to the restarted ones too
            self._pin()
            self._share()
            self.replays += 1

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
            if getattr(self, "inlet", None) is not None:
                self.inlet.close()
            if not ray_usable():
                return
            for a in getattr(self, "actors", []):
                try:
                    ray.kill(a, no_restart=True)
                except Exception:
                    pass
            if getattr(self, "pg", None) is not None:
                try:
                    remove_placement_group(self.pg)
                except Exception:
                    pass
                self.pg = None
