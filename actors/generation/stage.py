"""GenerationStage: one stage of a decoder split over actors, holding, for every live
sequence group, the cache of its own layers.

A step message (`Job`) runs through the stages in a ring: stage 0 gets token ids, each
stage runs its layers and passes only the values later stages read (the hidden
states, a mask, rotary tables) straight to the next stage's actor; the last stage
samples, keeps the new ids for the driver (`tokens`, a long poll) and sends them to
stage 0 as the next step. The driver hands a group to the ring once; the decode loop
then runs between the actors. Every message carries its group's epoch: a rewind or a
replay starts a new one, and the messages of the old one still in flight are dropped.

Opening and admission: the driver admits a group against every stage's budget
(``mem_limit``; `admission` tells it the stage's figures) when the generator is made,
and hands the group's spec to the ring with its first step (`Job.spec`): each stage
allocates the group's cache for its layers when that step gets there, with no call of
its own (a Ray call to an actor busy with other groups' steps waits 5-20 ms on a
loaded host). Its groups' bytes are counted in `stats`.

The actor is an asyncio actor: a step's compute runs on its loop without awaiting (one
step at a time, in arrival order), and a driver's long poll for tokens waits between
steps. While a stage runs one group alone, its loop keeps polling for the next step a
little after each one before it sleeps (`spin.SpinWait`, ``stage_spin_ms``), so that
step does not start on a core that went idle.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from typing import Any, Callable, Sequence

import numpy as np
import ray

from actors.code_version import code_identity
from actors.generation.channel import LINKS, StageLink, socket_name
from actors.generation.cores import TurnCore, even_runs, pin_process, usable_cores
from actors.generation.group import GroupSpec, Job, Join, StageGroup
from actors.generation.inbox import PUSHED_LOGITS_BYTES, TokenOutlet
from actors.generation.runner import StageRunner
from actors.generation.spin import SpinWait, spin_cap_ms
from actors.generation.split import StagePart, send_again
from actors.remote_errors import SegmentRunError
from actors.stage import stage_threads
from hetero_exec.exec.chain import move_value
from hetero_exec.genai.layout import CacheLayout
from hetero_exec.genai.rewrite import CAPACITY, cache_input
from hetero_exec.genai.search import Sampler, SearchOptions
from hetero_exec.placement.sizes import weight_bytes
from hetero_exec.providers import parse_provider

log = logging.getLogger(__name__)

#: closed groups a stage remembers, so a step of theirs still in flight opens nothing
ENDED_KEPT = 4096


class GenerationStage:
    """Made remote by `remote_class`; constructed with small arguments only (so a
    restart needs nothing from the object store), then `load`ed with its stage."""

    def __init__(self, index: int, count: int, layout: CacheLayout, providers: Sequence[Any],
                 session_options: dict[str, Any]):
        self.index, self.count = index, count
        self.label = f"stage#{index}"
        self.layout = layout
        self.providers = list(providers)
        self.session_options = dict(session_options)
        self.incarnation = uuid.uuid4().hex
        self.part: StagePart | None = None
        self.runner: StageRunner | None = None
        self.groups: dict[str, StageGroup] = {}
        self.reserved: dict[str, int] = {}  # group -> bytes its cache holds here
        self.ended: dict[str, None] = {}  # groups the driver closed (the latest ENDED_KEPT)
        self.failures: dict[str, tuple[int, Any]] = {}  # the last stage's: groups that failed
        self.ring: list[Any] = []  # every stage's handle, by index
        # to the next stage (channel.py)
        self.link = StageLink(self.label, {"step": self.step, "join": self.join,
                                           "close": self.close_ring, "halt": self.halt_ring})
        self.changed = asyncio.Event()
        self.steps = 0
        self.pushed = 0  # token columns written to a driver's socket (inbox.py)
        self.step_s = 0.0  # seconds computing steps (the rest of a token's time is Ray)
        self.decodes, self.decode_s = 0, 0.0  # one-token steps only (no prompt, no replay)
        self.decode_rows = 0  # the rows those steps ran (a batcher's group: its wanted rows)
        self.positions = 0  # the positions the steps ran (a prompt's, a decode step's one)
        self.remade = 0  # steps that made again values too big to carry (`_with`)
        self.started_cores = usable_cores()  # the node's cores for its workers (before `pin`)
        self.pinned = False  # on cores of its own (`pin`)
        self.spin = SpinWait(0.0)  # the loop polling for the next step after one (`share`)
        self.turns = TurnCore()  # the stepping thread's core while it runs one group (`share`)

    # -- lifecycle ----------------------------------------------------------------------

    async def load(self, box: list[Any], ring_id: str = "", link: str = "socket"
                   ) -> dict[str, Any]:
        """Compile the stage from ``box[0]`` (a ref in a list: fetched here), unless
        loaded, and listen for steps (``link``: "socket" where the next stage shares
        the node, or "ray" calls only); returns this incarnation and the sources this
        actor runs (`code_version`: the driver checks them against its own)."""
        if link not in LINKS:
            raise ValueError(f"stage_link must be one of {LINKS}, got {link!r}")
        if self.part is None:
            part = await box[0]
            self._compile(part)
        self.link.enabled = self.link.enabled and link == "socket"
        await self.link.listen(socket_name(ring_id or "ring", self.index, self.incarnation))
        return {"incarnation": self.incarnation, "code": code_identity()}

    def code(self) -> dict[str, str]:
        """The sources this actor runs (`code_version.code_identity`)."""
        return code_identity()

    def _compile(self, part: StagePart) -> None:
        from hetero_exec.session import InferenceSession

        opts = dict(self.session_options)
        if opts.get("dim_bounds") is not None:
            opts["dim_bounds"] = {CAPACITY: 0, **opts["dim_bounds"]}
        # a provider's mem_limit is this stage's budget for its weights and the groups'
        # caches (admitted here, per group); the stage session is not sized by it (the
        # values carried in have symbolic sizes no dim_bounds names)
        providers, self.limits = [], {}
        for spec in self.providers:
            name, popts = (spec, {}) if isinstance(spec, str) else (spec[0], dict(spec[1]))
            limit = popts.pop("mem_limit", None)
            providers.append((name, popts) if popts or not isinstance(spec, str) else spec)
            if limit is not None:
                self.limits[parse_provider((name, popts)).name] = int(limit)
        self.session = InferenceSession(part.model, providers=providers or None, **opts)
        # what the step's carried values may leave out and this stage makes again (split.py)
        self.prelude = InferenceSession(part.prelude, providers=providers or None, **opts) \
            if part.prelude else None
        self.prelude_inputs = [i.name for i in self.prelude.get_inputs()] if self.prelude else []
        self.optional = set(part.optional)
        entries = {e.past: e for e in self.layout.entries}
        self.own = [entries[p] for p in part.entries]
        self.cache_providers = _cache_providers(self.session, self.own)
        resident = {(cache_input(e.past) if e.mode == "concat" else e.past): self.cache_providers[e.past]
                    for e in self.own}
        passthrough = {e.past for e in self.layout.entries if e.mode == "concat"}
        names = list(part.carried_out) + ([part.output] if part.output else [])
        self.runner = StageRunner(self.session._executor, resident, passthrough, names,
                                  self.session.options.intra_op_num_threads or None)
        shared = any(e.mode == "shared" for e in self.layout.entries)
        self.shared = shared
        self.fixed = bool(self.layout.attention_mask and (self.layout.position_ids or shared))
        self.part = part
        log.info("%s loaded: layers %s on %s", self.label, part.layers,
                 sorted({p.name for p in self.cache_providers.values()}))

    def address(self) -> list[str]:
        """[node id, socket address] ("" when this stage takes steps by Ray calls only)."""
        return [ray.get_runtime_context().get_node_id(), self.link.address]

    async def connect(self, ring: list[Any], addresses: list[list[str]] | None = None) -> bool:
        """Every stage's handle (by index) and, from their `address`es, the link to the
        next stage; returns whether that link is a socket."""
        self.ring = list(ring)
        nxt = (self.index + 1) % self.count
        node, address = addresses[nxt] if addresses else ("", "")
        return await self.link.connect(ray.get_runtime_context().get_node_id(), node, address)

    def pin(self, cores: Sequence[int] | None = None, run: tuple[int, int] | None = None
            ) -> list[int]:
        """Run this stage's process on ``cores``, or on the ``run[0]``-th of ``run[1]``
        even runs of the cores it started with (`cores.even_runs`: none where there are
        fewer cores than runs); returns the cores it runs on ([]: not pinned)."""
        if run is not None:
            runs = even_runs(self.started_cores, run[1])
            if runs is None:
                log.info("%s: %d core(s) for %d stages on this node: not pinned", self.label,
                         len(self.started_cores), run[1])
                return []
            cores = runs[run[0]]
        try:
            got = pin_process(cores or ())
            self.pinned = bool(got)
            return got
        except OSError as e:
            raise ValueError(f"{self.label} cannot run on cores {list(cores or ())} (this "
                             f"node's workers may use {self.started_cores}): {e}") from None

    def share(self, sharing: int, spin_ms: float | None = None, turns: bool = False) -> int:
        """How many threads a run of this stage splits its work over, now that the driver
        knows the ``sharing`` stages on this node: the session's ``intra_op_num_threads``
        when given; else this process's cores (pinned: its own) shared among those
        stages, at least one each, as onnxruntime's users size the pools of several
        sessions on one machine. Returns it. Also how long the stage polls for its next
        step after one (`spin.spin_cap_ms`: ``spin_ms``, or by default where the node
        has a core beyond its stages), and, with ``turns`` (the stages not pinned), where
        it does not poll and runs one thread, the core its steps run on while it runs
        one group alone (`cores.TurnCore`: the last of the node's cores). (Every stage
        splitting over all the node's cores oversubscribes them whenever the stages run
        at once; on a 2-core VM, where the tiny decoders split only their vocabulary
        product, one thread each against two: batch-1 time a token 0.975x, 9 of 15
        paired rounds, 4 groups 1.01x.)"""
        given = self.session.options.intra_op_num_threads
        over = 1 if self.pinned else max(int(sharing), 1)  # the stages its cores serve
        width = int(given) if given else int(stage_threads(-over) or 1)
        self.runner.threads = width
        if self.prelude is not None:
            self.prelude.options.intra_op_num_threads = width
        self.spin = SpinWait(spin_cap_ms(spin_ms, len(self.started_cores), sharing) / 1e3)
        self.turns.leave()
        cores = self.started_cores
        taking = turns and not self.pinned and sharing > 1 and self.spin.cap_s == 0 \
            and width == 1 and len(cores) > 1
        self.turns = TurnCore(cores[-1] if taking else None, cores)
        return width

    def ping(self) -> str:
        """This incarnation; "" while restarted and not loaded again."""
        return self.incarnation if self.part is not None else ""

    def info(self) -> dict[str, Any]:
        return {"stage": self.label, "pid": os.getpid(), "incarnation": self.incarnation,
                "node": ray.get_runtime_context().get_node_id(),
                "layers": list(self.part.layers) if self.part else [],
                "carried_in": list(self.part.carried_in) if self.part else [],
                "remade": list(self.part.remade) if self.part else [],
                "budget": self._budgets()}

    # -- groups -----------------------------------------------------------------------

    def admission(self) -> dict[str, dict[str, int | None]]:
        """What the driver admits groups against (`RayDecoder.admit`), per provider of
        this stage's cache: its budget (None: no ``mem_limit``), the bytes its weights
        hold there, and the bytes a cache takes there per row and position."""
        self._loaded()
        out: dict[str, dict[str, int | None]] = {}
        per = self._need(GroupSpec(1, 1, 0, np.zeros(1, dtype=np.int64)))
        for name, budget in self._budgets().items():
            out[name] = {"budget": budget, "weights": self._weights(name),
                         "per_position": per.get(name, 0)}
        return out

    def open(self, gid: str, spec: GroupSpec, epoch: int) -> None:
        """Allocate ``gid``'s cache for this stage's layers (a group already open keeps
        its cache). The driver admitted it first (`RayDecoder.admit`): a group opens at
        a stage when its first step gets there, its spec in the step (`Job.spec`)."""
        self._loaded()
        g = self.groups.get(gid)
        if g is not None and not g.caches:  # finished: its cache went; a new one comes
            self.close(gid, g.epoch)
            g = None
        if g is None:
            g = StageGroup(spec, self.own, list(self.layout.entries), self.cache_providers,
                           _zeros)
            self.groups[gid] = g
            self.reserved[gid] = sum(self._need(spec).values())
            self._notify()  # a long poll waiting for the group
            if self.index == self.count - 1:
                g.sampler = self._sampler(spec)
                address = self._driver_socket(spec)
                if address:
                    g.outlet = TokenOutlet.connect(address, self.label)
        g.epoch = max(g.epoch, epoch)

    def close(self, gid: str, epoch: int | None = None) -> None:
        """Free ``gid``'s cache and admission; without ``epoch`` (the driver closed the
        generator: cancelled, dropped) for good: a step of it still on its way opens
        nothing. With ``epoch`` (the last stage ending that epoch), only while the group
        is not open at a later one: the driver, told of the end first, may have opened
        it again."""
        g = self.groups.get(gid)
        if epoch is None:
            self.ended[gid] = None
            while len(self.ended) > ENDED_KEPT:
                del self.ended[next(iter(self.ended))]
        elif g is not None and g.epoch > epoch:
            return
        self.groups.pop(gid, None)
        self.reserved.pop(gid, None)
        if g is not None:
            g.free()
        self._notify()

    def close_ring(self, gid: str, epoch: int | None, until: int) -> None:
        """`close` here, then pass it on to the next stage while this one is before stage
        ``until`` (a close frame from the driver, or from the last stage ending a group:
        `channel.encode_close`)."""
        self.close(gid, epoch)
        if self.index < until and self.ring:
            self.link.send_close(self.ring[self.index + 1], gid, epoch, until)

    def join(self, gid: str, join: Join) -> bool:
        """Stage 0: queue ``join`` for ``gid``'s next decode step (continuous batching);
        False when the group is not open here."""
        g = self.groups.get(gid)
        if g is None or not g.caches or join.epoch < g.epoch:
            return False
        join.prompt = np.asarray(join.prompt, dtype=np.int64).reshape(-1)
        g.pending.append(join)
        return True

    def halt(self, gid: str, epoch: int) -> None:
        """Drop ``gid``'s messages of epochs before ``epoch`` (a rewind by the driver)."""
        g = self.groups.get(gid)
        if g is not None:
            g.epoch = max(g.epoch, epoch)

    def halt_ring(self, gid: str, epoch: int, until: int) -> None:
        """`halt` here, then pass it on to the next stage while this one is before stage
        ``until`` (a halt frame from the driver: `channel.encode_halt`)."""
        self.halt(gid, epoch)
        if self.index < until and self.ring:
            self.link.send_halt(self.ring[self.index + 1], gid, epoch, until)

    def stats(self) -> dict[str, Any]:
        return {"stage": self.label, "incarnation": self.incarnation, "groups": sum(1 for g in self.groups.values() if g.caches),
                "reserved_bytes": sum(self.reserved.values()),
                "cache_bytes": sum(g.cache_bytes for g in self.groups.values()),
                "steps": self.steps, "step_s": self.step_s,
                "sent_socket": self.link.sent_socket, "sent_ray": self.link.sent_ray,
                "pushed": self.pushed, "remade": self.remade, "cores": usable_cores(os.getpid()),
                "threads": self.runner.threads if self.runner is not None else None,
                "spin_ms": self.spin.cap_s * 1e3, "spun_s": self.spin.spun_s,
                "turn_core": self.turns.core, "turn_moves": self.turns.moves,
                "turn_thread": self.turns.tid,
                "decode_ms": self.decode_s / max(self.decodes, 1) * 1e3,
                "decodes": self.decodes, "decode_rows": self.decode_rows,
                "positions": self.positions}

    # -- the ring -----------------------------------------------------------------------

    def step(self, gid: str, epoch: int, job: Job, carried: list[dict[str, Any]]) -> None:
        self.spin.arrived()
        try:
            self._step(gid, epoch, job, carried)
        except Exception as e:  # a kernel's failure: the group's driver raises it, not waits
            # (the error names its node there; its traceback here only when asked for)
            log.warning("%s: a step of group %s failed: %s", self.label, gid, e)
            log.debug("%s: the failed step's traceback", self.label, exc_info=True)
            error = SegmentRunError(self.label, e)
            if self.index == self.count - 1:
                self.fail(gid, epoch, error)
            elif self.ring:  # (not yet connected: the driver's poll finds no progress)
                self.ring[-1].fail.remote(gid, epoch, error)
                self._tell_failed(gid, epoch)
        finally:
            if self.spin.cap_s > 0 or self.turns.core is not None:
                alone = sum(1 for g in self.groups.values() if g.caches) <= 1
                self.spin.done(alone)
                self.turns.update(alone)

    def fail(self, gid: str, epoch: int, error: Any) -> None:
        """The last stage: a step of ``gid``'s ``epoch`` failed on a stage (``error``, a
        `SegmentRunError`); the driver's next `tokens` or `logits` poll gets it."""
        g = self.groups.get(gid)
        if g is None:  # its first step failed before it got here: it never opened here
            self.failures[gid] = (epoch, error)
            while len(self.failures) > ENDED_KEPT:
                del self.failures[next(iter(self.failures))]
            self._notify()
        elif epoch >= g.epoch:
            g.error = (epoch, error)
            self._notify()
            if g.outlet is not None:
                g.outlet.send_failed(epoch)

    def _tell_failed(self, gid: str, epoch: int) -> None:
        """A stage before the last: tell the group's driver, when it shares this node,
        that a step of ``epoch`` failed (the group may not have reached the last stage,
        whose token socket would tell it)."""
        g = self.groups.get(gid)
        address = None if g is None else self._driver_socket(g.spec)
        outlet = TokenOutlet.connect(address, self.label) if address else None
        if outlet is not None:
            outlet.send_failed(epoch)
            outlet.close()

    def _driver_socket(self, spec: GroupSpec) -> str | None:
        """The group's driver's token socket (`inbox.py`) when this stage may write to
        it: the links are on and the driver shares this node."""
        if spec.inbox is None or not self.link.enabled \
                or spec.inbox[0] != ray.get_runtime_context().get_node_id():
            return None
        return spec.inbox[1]

    def _step(self, gid: str, epoch: int, job: Job, carried: list[dict[str, Any]]) -> None:
        if self.part is None:
            return  # sent to a restarted actor: the driver replays
        g = self.groups.get(gid)
        if job.spec is not None and (g is None or not g.caches) and gid not in self.ended:
            self.open(gid, job.spec, epoch)  # the group's first step here (of this epoch)
            g = self.groups[gid]
        if g is None or epoch < g.epoch or not g.caches:
            return  # a closed group's or an old epoch's
        g.epoch = g.live = epoch
        started = time.perf_counter()
        g.apply(job)
        if job.draws is not None and self.index == self.count - 1:
            g.sampler = self._sampler(g.spec)
            if g.spec.row_seeds is None:
                g.sampler.skip(job.draws, g.batch)
            else:  # each row past what it drew since its first token (the next is g.length)
                for row, (seed, first) in enumerate(g.spec.row_seeds):
                    g.sampler.reseed(row, seed, g.length - first)
            g.draws = job.draws
        if self.index == 0 and g.pending:
            self._admit_joins(g, epoch, job)
        n = len(job.pieces)
        outs: list[dict[str, Any]] = []
        joined: list[dict[str, Any]] = []
        if job.joins:
            extra = list(carried[n:]) + [{}] * (len(job.joins) - len(carried[n:]))  # stage 0: none
            for j, came in zip(job.joins, extra):
                joined.append(self._join_row(g, j, came) if j.ok else {})
                if j.ok and g.sampler is not None and g.sampler.row_rngs is not None:
                    g.sampler.reseed(j.row, j.seed)  # the request's own draws from its first token
        last: Any = None
        if job.pieces and job.pieces[0][0] > g.filled:  # the driver's to keep: never computed
            raise RuntimeError(f"a step from position {job.pieces[0][0]} of group {gid}, whose "
                               f"cache here holds {g.filled} positions")
        rows = job.rows if g.stops is not None else None  # (a batcher's group's only)
        if rows is not None and not 1 <= rows <= g.batch:
            raise ValueError(f"a step of rows [0, {rows}) of group {gid}, which has "
                             f"{g.batch} rows")
        for (p, t), came in zip(job.pieces, carried):
            feeds, came = self._with(g.feeds(self.layout, p, t, self.fixed, self.shared, rows),
                                     came)
            values = self.runner.run(feeds)
            g.computed(p, t)
            self.steps += 1
            self.positions += t - p
            if self.part.output:
                last = values[self.part.output]
            else:
                outs.append(self._sent(values, came))
        ran = g.batch if rows is None else rows
        if self.index < self.count - 1:
            self._count(job, time.perf_counter() - started, ran)
            self.link.send(self.ring[self.index + 1], gid, epoch, job, outs + joined)
            return
        self._choose(gid, g, epoch, last, job.logits, job.joins, rows)
        self._count(job, time.perf_counter() - started, ran)

    def _admit_joins(self, g: StageGroup, epoch: int, job: Job) -> None:
        """Stage 0: the pending joins go with this step when it is a decode step (each
        marked whether it fits); a replay's new epoch drops the older ones."""
        g.pending = [j for j in g.pending if j.epoch >= epoch]
        decode = job.rewind is None and len(job.pieces) == 1 \
            and job.pieces[0] == (job.at, job.at + 1) and job.at > 0
        if not decode or not g.pending:
            return
        taken, rows = [], set()
        for j in g.pending:
            j.at = job.at
            j.ok = j.row not in rows and g.fits(j, job.at)
            rows.add(j.row)
            taken.append(j)
            if j.ok and job.rows is not None:  # the step runs the joining row
                job.rows = max(job.rows, j.row + 1)
        g.pending = []
        job.joins = taken

    def _join_row(self, g: StageGroup, join: Join, came: dict[str, Any]) -> dict[str, Any]:
        """Take the join's row: its prompt but the last token run at batch 1 into a
        scratch cache, copied into the row's columns; returns what the next stage reads
        of that prefill (nothing from the last stage, nor for a one-token prompt)."""
        s = g.take_row(join)
        n = int(join.prompt.shape[0]) - 1
        if n == 0:
            return {}
        scratch = StageGroup(GroupSpec(1, n, g.spec.pad, np.zeros(1, dtype=np.int64)), self.own,
                             list(self.layout.entries), self.cache_providers,
                             _zeros)
        scratch.apply(Job(0, join.prompt[None, :n], [(0, n)]))
        feeds, came = self._with(scratch.feeds(self.layout, 0, n, False, self.shared), came)
        values = self.runner.run(feeds)
        self.steps += 1
        for e in self.own:
            dst, src = [join.row, slice(None), slice(None)], [0, slice(None), slice(None)]
            dst.insert(e.axis, slice(s, s + n))
            src.insert(e.axis, slice(0, n))
            g.caches[e.past][tuple(dst)] = scratch.caches[e.past][tuple(src)]
        scratch.free()
        if self.part.output:
            return {}
        return self._sent(values, came)

    def _with(self, feeds: dict[str, Any], came: dict[str, Any]
              ) -> tuple[dict[str, Any], dict[str, Any]]:
        """A step's feeds with what came with it, and what came: the values this stage
        makes again that the step left out (too big to send) made here first, from the
        feeds (the stage after may read them too)."""
        missing = [n for n in self.part.remade if n not in came]
        if missing:
            made = self.prelude.run(missing, {n: feeds[n] for n in self.prelude_inputs})
            self.remade += 1
            came = {**came, **dict(zip(missing, made))}
        return ({**feeds, **came} if came else feeds), came

    def _sent(self, values: dict[str, Any], came: dict[str, Any]) -> dict[str, Any]:
        """What the next stage gets of a step: the values this stage made that later
        stages read, on the host, and those it got from before that later ones read;
        of those later stages can make again, the small ones (`send_again`)."""
        where, optional = self.runner.where, self.optional
        out = {}
        others = 0
        for n in self.part.carried_out:
            if n not in optional:
                v = out[n] = move_value(values[n], where[n], None)
                others += v.nbytes
        for n in self.part.passed:
            if n not in optional:
                v = out[n] = came[n]
                others += v.nbytes
        for n in self.part.optional:
            v = values[n] if n in where else came.get(n)
            if v is not None and send_again(int(v.nbytes), others):
                out[n] = move_value(v, where[n], None) if n in where else v
        return out

    def _count(self, job: Job, seconds: float, rows: int) -> None:
        self.step_s += seconds
        if len(job.pieces) == 1 and job.pieces[0][1] - job.pieces[0][0] == 1:
            self.decodes += 1
            self.decode_s += seconds
            self.decode_rows += rows

    def _choose(self, gid: str, g: StageGroup, epoch: int, logits: Any, keep: bool = False,
                joins: list[Join] | None = None, rows: int | None = None) -> None:
        """The last stage: sample the next token, keep it for the driver, start the next
        step at stage 0 (or, when the group is done, free its cache everywhere); with
        ``keep``, first keep the logits on the host for the driver's `logits`, and push
        them (and every later step's: ``push_logits``) to its socket. ``rows``: the step
        ran rows [0, rows) only (the rest take padding)."""
        logits = logits[:, -1, :] if logits.ndim == 3 else logits
        host = None
        if keep:
            host = np.array(self.runner.output_provider.to_host(logits))
            g.logits = (epoch, host)
            self._notify()
            # a driver that asked once asks again: every later step's go to it too
            g.push_logits = g.outlet is not None and host.nbytes <= PUSHED_LOGITS_BYTES
            if g.done():  # asked at max_length or after every row's eos: nothing to sample
                self._push_logits(g, epoch, g.length, host)
                if g.frees_at_end():
                    self._finish(gid, g, epoch)
                return
        o = g.sampler.options
        chosen = g.sampler.choose(logits, g.banned(o.min_length, g.spec.eos, rows),
                                  g.history(rows) if o.repetition_penalty != 1.0 else None)
        if rows is not None and rows < g.batch:
            chosen = np.concatenate([chosen, np.full(g.batch - rows, g.spec.pad, np.int64)])
        at = g.take(chosen, np.asarray(g.spec.eos, dtype=np.int64))
        acks = [(at, j.key, j.row, j.ok) for j in joins or ()]
        g.acks.extend(acks)
        done = g.done()
        if not done:  # the next step first: the ring, not the driver, bounds a token
            self.link.send(self.ring[0], gid, epoch,
                           Job(at, g.ids[:, at:at + 1].copy(), [(at, at + 1)],
                               rows=g.live_rows(at)), [{}])
        if g.push_logits or host is not None:
            if host is None:
                host = np.array(self.runner.output_provider.to_host(logits))
            self._push_logits(g, epoch, at, host)
        if g.outlet is not None and g.outlet.send(epoch, at, g.ids[:, at:at + 1], done, acks):
            self.pushed += 1
        self._notify()
        if done and g.frees_at_end():  # (ended by eos: kept for the driver's next append)
            self._finish(gid, g, epoch)

    def _push_logits(self, g: StageGroup, epoch: int, column: int, host: np.ndarray) -> None:
        """To the driver's socket, before ``column``'s frame: the logits that chose it
        (too big ones stay here: the driver asks by `logits`)."""
        if g.outlet is not None:
            g.outlet.send_logits(epoch, column, host)

    def _finish(self, gid: str, g: StageGroup, epoch: int) -> None:
        g.free()  # the bookkeeping stays for the driver to read; the cache goes
        self.reserved.pop(gid, None)
        if self.count > 1:  # the earlier stages, in turn from stage 0
            self.link.send_close(self.ring[0], gid, epoch, self.count - 2)

    async def logits(self, gid: str, epoch: int, timeout: float = 1.0) -> dict[str, Any]:
        """The logits kept by a ``logits`` step of ``epoch`` once there (or after
        ``timeout``): ``{"logits": [batch, vocab] or None}``; ``{"freed": True}`` when
        the group's cache was freed (that step was dropped); ``{"missing": True}`` when
        the group is unknown here (a restarted actor)."""
        def ready(g: StageGroup) -> dict[str, Any] | None:
            if g.error is not None and g.error[0] == epoch:
                return {"error": g.error[1]}
            if g.logits is not None and g.logits[0] == epoch:
                return {"logits": g.logits[1]}
            if not g.caches:  # the ring had ended the group: the step was dropped
                return {"freed": True}
            return None

        return await self._long_poll(gid, epoch, ready, lambda g: {"logits": None}, timeout)

    async def tokens(self, gid: str, epoch: int, have: int, timeout: float = 1.0
                     ) -> dict[str, Any]:
        """The ids of positions ``have``.. once there are any (or after ``timeout``):
        ``{"epoch", "at", "ids", "done"}``; ``{"freed": True}`` when the ring had ended
        the group (its cache freed) before ``epoch`` ran: that step was dropped;
        ``{"missing": True}`` when the group is unknown here (a restarted actor)."""
        def ready(g: StageGroup) -> dict[str, Any] | None:
            if g.error is not None and g.error[0] == epoch:
                return {"error": g.error[1]}
            if not g.caches and g.live < epoch:
                return {"freed": True}
            if g.live == epoch and (g.length > have or g.done()):
                return {"epoch": g.live, "at": have, "ids": g.ids[:, have:g.length].copy(),
                        "done": g.done(), "acks": [a for a in g.acks if a[0] >= have]}
            return None

        def expired(g: StageGroup) -> dict[str, Any]:
            return {"epoch": g.live, "at": have, "ids": g.ids[:, have:have], "done": False}

        return await self._long_poll(gid, epoch, ready, expired, timeout)

    async def _long_poll(self, gid: str, epoch: int,
                         ready: Callable[[StageGroup], dict[str, Any] | None],
                         expired: Callable[[StageGroup], dict[str, Any]], timeout: float
                         ) -> dict[str, Any]:
        """``ready(group)`` once it answers (it is asked again at each change here), or
        ``expired(group)`` after ``timeout``; ``{"error": ...}`` when the step of
        ``epoch`` that would have opened the group failed on an earlier stage;
        ``{"missing": True}`` when ``gid`` is still unknown here then (not opened yet:
        its first step is on its way; or a restarted actor)."""
        if self.part is None:  # restarted, not loaded again: it holds no group, nor will
            return {"missing": True}  # until the driver recovers it (no need to wait)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            g = self.groups.get(gid)
            failed = self.failures.get(gid)
            if g is None and failed is not None and failed[0] == epoch:
                return {"error": failed[1]}
            if g is None and loop.time() >= deadline:
                return {"missing": True}
            reply = None if g is None else ready(g)
            if reply is not None:
                return reply
            left = deadline - loop.time()
            if left <= 0:
                return expired(g)
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), left)
            except asyncio.TimeoutError:
                pass

    # -- helpers ------------------------------------------------------------------------

    def _notify(self) -> None:
        self.changed.set()

    def _loaded(self) -> None:
        if self.part is None:
            from actors.remote_errors import StageNotLoaded

            raise StageNotLoaded(f"{self.label} was restarted and has no stage yet")

    def _sampler(self, spec: GroupSpec) -> Sampler:
        """The last stage's sampler for a group (a stream per row for a batcher's
        sampling group)."""
        prov = self.runner.output_provider
        seeds = None if spec.row_seeds is None else [s for s, _ in spec.row_seeds]
        return Sampler(SearchOptions(**spec.search), prov.xp, prov.to_host, prov.to_device,
                       row_seeds=seeds)

    def _need(self, spec: GroupSpec) -> dict[str, int]:
        need: dict[str, int] = {}
        for e in self.own:
            name = self.cache_providers[e.past].name
            need[name] = need.get(name, 0) + (spec.batch * e.kv_heads * spec.capacity
                                              * e.head_size * e.dtype.itemsize)
        return need

    def _weights(self, provider: str) -> int:
        """Bytes the stage's weights hold on ``provider``."""
        graph = self.session.placement.graph
        return sum(seg.mem_need if seg.mem_need is not None else weight_bytes(graph, seg.nodes)
                   for seg in self.session.placement.segments if seg.provider.name == provider)

    def _budgets(self) -> dict[str, int | None]:
        if self.part is None:
            return {}
        return {p.name: self.limits.get(p.name) for p in self.cache_providers.values()}


def _zeros(provider: Any, shape: tuple[int, ...], dtype: Any) -> Any:
    """A group's cache buffer, zeroed on its provider."""
    return provider.xp.zeros(shape, dtype=dtype)


def _cache_providers(session: Any, entries: list[Any]) -> dict[str, Any]:
    producer = {}
    for seg in session.placement.segments:
        for node in seg.nodes:
            for o in node.outputs:
                producer[o] = seg.provider
    out = {}
    for e in entries:
        prov = producer.get(e.present)
        if prov is None:
            raise ValueError(f"no segment of the stage computes the cache output {e.present!r}")
        out[e.past] = prov
    return out


_REMOTE: Any = None


def remote_class() -> Any:
    global _REMOTE
    if _REMOTE is None:
        _REMOTE = ray.remote(GenerationStage)
    return _REMOTE
