"""One sequence group's state on one stage: the bookkeeping every stage keeps alike
(ids, mask, positions, how much is cached) and the cache buffers of this stage's own
layers, allocated once at the group's capacity.

The feeds follow the in-process generator exactly (`hetero_exec.genai.generator`):
a prompt or rewind runs at its exact shape, a one-token decode step at a fixed width
(`decode_width`) over arrays written in place, so each stage runs the same kernels on
the same shapes as the whole decoder does in process, and the tokens are the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from hetero_exec.genai.layout import CacheEntry
from hetero_exec.genai.rewrite import PAST_LENGTH, cache_input
from hetero_exec.genai.widths import decode_width, right_aligned
from hetero_exec.kernels.kv_cache import share_buffer


@dataclass
class GroupSpec:
    """What every stage is told when a group opens (a few hundred bytes)."""

    batch: int
    capacity: int
    pad: int
    start: np.ndarray  # left padding per row
    search: dict[str, Any] = field(default_factory=dict)  # SearchOptions' fields
    eos: tuple[int, ...] = ()
    #: (node id, address) of the driver's token socket (`inbox.py`), or None: it polls
    inbox: tuple[str, str] | None = None
    #: a batcher's group (batcher.py): it runs until its capacity or the driver closes
    #: it, not when every row has ended (a request may be joining a freed row)
    batched: bool = False
    #: a batcher's sampling group: each row's (seed, column of its first token), its
    #: request's own random stream (None: the rows draw from one, ``search``'s seed)
    row_seeds: tuple[tuple[int, int], ...] | None = None
    #: a batcher's group: each row's last column it needs a token for (-1: no request
    #: there); its decode steps run the rows up to the last one that still does, so a
    #: lone request in a group of 4 rows runs at batch 1 (None: every row, every step)
    row_stops: tuple[int, ...] | None = None


@dataclass
class Join:
    """A request taking row ``row`` of a running group (continuous batching). Stage 0
    sets ``at``, the group's next decode step, and ``ok``, whether the request fits
    there: its prompt then fills columns [at + 1 - len(prompt), at + 1) of the row (the
    columns before are masked out), the prompt but its last token is prefilled apart,
    at batch 1, into those columns, and the step at ``at`` runs the last prompt token
    with the other rows' tokens, so the request's first token comes with theirs."""

    row: int
    key: str
    prompt: np.ndarray  # int64 [n]
    max_new: int
    epoch: int = 0  # the group's epoch it was sent under (a replay drops it)
    at: int = -1
    ok: bool = False
    seed: int = -1  # the request's random stream, in a sampling group (-1: a fresh one)


@dataclass
class Job:
    """What a step message asks of every stage, in order: rewind the sequences to
    (length, filled) when given, write token columns ``ids`` from position ``at``, then
    run each piece [p, t) of positions. The last stage then samples the next token (and
keeps the logits it sampled from for the driver when ``logits`` is set);
    ``draws``, when given, is how many samples came before (a replay's sampler skips
    them) and ``end`` each row's eos position + 1 so far (-1: running)."""

    at: int
    ids: np.ndarray
    pieces: list[tuple[int, int]]
    rewind: tuple[int, int] | None = None
    draws: int | None = None
    end: np.ndarray | None = None
    start: np.ndarray | None = None  # the left padding, with a group's first prompt
    logits: bool = False  # the last stage keeps this step's logits for `get_logits`
    joins: list[Join] = field(default_factory=list)  # set by stage 0 (continuous batching)
    #: with a group's first step of an epoch: each stage opens the group when it gets there
    spec: GroupSpec | None = None
    #: a decode step of a batcher's group runs rows [0, rows) only (`GroupSpec.row_stops`;
    #: None: every row); set by the last stage, widened by stage 0 for the rows joining
    rows: int | None = None


class StageGroup:
    def __init__(self, spec: GroupSpec, entries: list[CacheEntry], all_entries: list[CacheEntry],
                 providers: dict[str, Any], zeros: Callable[..., Any]):
        self.spec = spec
        self.batch, self.capacity = spec.batch, spec.capacity
        self.entries = entries
        self.all_entries = all_entries
        self.caches: dict[str, Any] = {}
        for e in entries:
            shape = [self.batch, e.kv_heads, e.head_size]
            shape.insert(e.axis, self.capacity)
            self.caches[e.past] = zeros(providers[e.past], tuple(shape), e.dtype)
            if e.mode == "shared":
                share_buffer(self.caches[e.past])
        self.pending: list[Join] = []  # stage 0's: joins waiting for the next decode step
        self.acks: list[tuple[int, str, int, bool]] = []  # the last stage's: (column, key, row, ok)
        self.epoch = -1  # messages of epochs below are dropped
        self.live = -1  # the epoch of the last step run
        self.sampler: Any = None  # the last stage's
        self.outlet: Any = None  # the last stage's token socket to the driver (inbox.py)
        self.logits: tuple[int, np.ndarray] | None = None  # (epoch, [batch, vocab]) on request
        self.push_logits = False  # the last stage pushes each step's logits to the driver
        #: the last stage's: (epoch, SegmentRunError) when a step of that epoch failed on a stage
        self.error: tuple[int, Any] | None = None
        self.ids = np.full((self.batch, self.capacity), spec.pad, dtype=np.int64)
        self.mask = np.zeros((self.batch, self.capacity), dtype=np.int64)
        self.start = np.asarray(spec.start, dtype=np.int64)
        self.end = np.full(self.batch, -1, dtype=np.int64)
        self.length = 0
        self.filled = 0
        self.real = np.zeros(self.batch, dtype=np.int64)
        self.draws = 0
        #: each row's last column it needs a token for (`GroupSpec.row_stops`), or None
        # (a row's cache is a leading block only where the batch axis comes first)
        self.stops = None if spec.row_stops is None or any(e.axis == 0 for e in entries) \
            else np.asarray(spec.row_stops, dtype=np.int64).copy()
        self._placeholders: dict[tuple[int, int], dict[str, Any]] = {}
        self._decode: dict[tuple[int, int], dict[str, Any]] = {}
        self._step_ids = np.zeros((self.batch, 1), dtype=np.int64)
        self._step_pos = np.zeros((self.batch, 1), dtype=np.int64)
        self._step_past = np.zeros((), dtype=np.int64)

    @property
    def cache_bytes(self) -> int:
        return sum(int(getattr(c, "nbytes", 0)) for c in self.caches.values())

    def free(self) -> None:
        if self.outlet is not None:
            self.outlet.close()
            self.outlet = None
        self.caches = {}
        self._placeholders = {}
        self._decode = {}

    # -- bookkeeping ------------------------------------------------------------------

    def apply(self, job: Job) -> None:
        """The job's rewind and token columns (the mask: 1 but for the left padding)."""
        if job.rewind is not None:
            length, filled = job.rewind
            self.ids[:, length:self.length] = self.spec.pad
            self.mask[:, length:self.length] = 0
            self.length = length
            self.filled = min(self.filled, filled)
            self.real = self.mask[:, :self.filled].sum(axis=1)
            self.acks = [a for a in self.acks if a[0] < length]
        if job.start is not None:
            self.start = np.asarray(job.start, dtype=np.int64).copy()
        if job.end is not None:
            self.end = np.asarray(job.end, dtype=np.int64).copy()
        n = job.ids.shape[1]
        self.ids[:, job.at:job.at + n] = job.ids
        self.mask[:, job.at:job.at + n] = 1
        for i, s in enumerate(self.start):
            if job.at < s:
                self.mask[i, job.at:min(s, job.at + n)] = 0
        self.length = max(self.length, job.at + n)

    def fits(self, join: Join, at: int) -> bool:
        """Whether ``join`` can take its row at the decode step ``at`` (stage 0's check:
        its prompt ends at ``at`` and its new tokens end within the capacity)."""
        n = int(join.prompt.shape[0])
        return 0 <= join.row < self.batch and 0 < n <= at + 1 \
            and at + 1 + join.max_new <= self.capacity

    def take_row(self, join: Join) -> int:
        """Rewrite the join's row for its prompt (after `apply` wrote the step's column);
        returns the prompt's first column."""
        r, a, n = join.row, join.at, int(join.prompt.shape[0])
        s = a + 1 - n
        self.ids[r, :] = self.spec.pad
        self.ids[r, s:a + 1] = join.prompt
        self.mask[r, :] = 0
        self.mask[r, s:a + 1] = 1
        self.start[r] = s
        self.end[r] = -1
        self.real[r] = n - 1  # prefilled apart; the step at ``at`` runs the last one
        if self.stops is not None:  # its first token at ``at`` + 1
            self.stops[r] = a + join.max_new
        return s

    def live_rows(self, at: int) -> int | None:
        """How many leading rows the decode step after column ``at`` runs: up to the
        last row still wanting a token after ``at`` (not ended, not at its stop), at
        least one; None (every row) without `GroupSpec.row_stops`."""
        if self.stops is None:
            return None
        wanting = np.flatnonzero((self.end < 0) & (self.stops > at))
        return int(wanting[-1]) + 1 if wanting.size else 1

    def computed(self, p: int, t: int) -> None:
        self.real += self.mask[:, p] if t == p + 1 else self.mask[:, p:t].sum(axis=1)
        self.filled = t

    # -- feeds (as `Generator._feeds`, `_decode_step`, `_cache_feeds`) ---------------

    def feeds(self, layout: Any, p: int, t: int, fixed: bool, shared: bool,
              rows: int | None = None) -> dict[str, Any]:
        """Positions [p, t) of rows [0, ``rows``) (None: every row). The rows are leading
        views of the group's arrays: the cache is batch-major, so a row's cache is a
        contiguous block the step appends to in place."""
        r = self.batch if rows is None else rows
        # the bound decode step reads the mask at its bucket's width, so only a job's last
        # position may take it: a piece before other pieces of the job (a prompt's chunk)
        # would see their positions unmasked
        if fixed and t - p == 1 and p > 0 and t == self.length:
            return self._decode_feeds(layout, p, shared, r)
        ids, mask = self.ids[:r, p:t], self.mask[:r, :t]
        if shared and fixed and p == 0 and self.start.any():  # as `TokenRows._prefill_runs`
            ids, mask = right_aligned(ids, self.start[:r])
        feeds: dict[str, Any] = {layout.input_ids: ids, PAST_LENGTH: np.array(p)}
        if layout.attention_mask:
            feeds[layout.attention_mask] = mask
        if layout.position_ids:
            pos = np.cumsum(mask, axis=1) - 1
            feeds[layout.position_ids] = np.where(mask[:, p:t] == 0, 1, pos[:, p:t])
        feeds.update(self._cache_feeds(p, r))
        return feeds

    def _decode_feeds(self, layout: Any, p: int, shared: bool, rows: int) -> dict[str, Any]:
        width = self.capacity if shared else decode_width(p + 1, self.capacity)
        feeds = self._decode.get((width, rows))
        if feeds is None:
            feeds = {layout.input_ids: self._step_ids[:rows], PAST_LENGTH: self._step_past}
            if layout.attention_mask:
                feeds[layout.attention_mask] = self.mask[:rows, :width]
            if layout.position_ids:
                feeds[layout.position_ids] = self._step_pos[:rows]
            feeds.update(self._cache_feeds(width - 1, rows))
            self._decode[(width, rows)] = feeds
        self._step_ids[:, 0] = self.ids[:, p]
        self._step_pos[:, 0] = self.real
        self._step_past[()] = p
        return feeds

    def _cache_feeds(self, n: int, rows: int) -> dict[str, Any]:
        feeds = self._placeholders.get((n, rows))
        if feeds is None:
            feeds = {}
            for e in self.all_entries:
                if e.mode == "shared":
                    if e.past in self.caches:
                        feeds[e.past] = self._lead(self.caches[e.past], rows)
                    continue
                shape = [rows, e.kv_heads, e.head_size]
                shape.insert(e.axis, n)
                feeds[e.past] = np.broadcast_to(np.zeros((), e.dtype), tuple(shape))
                if e.past in self.caches:
                    feeds[cache_input(e.past)] = self._lead(self.caches[e.past], rows)
            if len(self._placeholders) > 4:
                self._placeholders.clear()
            self._placeholders[(n, rows)] = feeds
        return feeds

    def _lead(self, cache: Any, rows: int) -> Any:
        """The first ``rows`` rows of a cache buffer (the buffer itself for all: a shared
        one is known by its identity)."""
        return cache if rows == self.batch else cache[:rows]

    # -- the last stage's choice (as `Generator.generate_next_token`) ------------------

    def banned(self, min_length: int, eos: tuple[int, ...], rows: int | None = None
               ) -> list | None:
        if not min_length or not eos:
            return None
        short = ((self.length - self.start) < min_length)[:rows]
        if not short.any():
            return None
        return [(e, short) for e in eos]

    def history(self, rows: int | None = None) -> Any:
        """The ids each row's repetition penalty counts (of rows [0, ``rows``)): all so
        far, as the in-process generator (and onnxruntime-genai) count a left-padded
        batch's; a batcher's row from its request's first token (before it: padding, or
        an earlier request's)."""
        if not self.spec.batched:
            return self.ids[:rows, :self.length]
        return [self.ids[r, s:self.length] for r, s in enumerate(self.start[:rows])]

    def take(self, chosen: np.ndarray, eos: np.ndarray) -> int:
        """Write the chosen ids at the next position; returns that position."""
        # the rows still running, when one has ended (it takes padding); else None
        running = self.end < 0 if self.end.max() >= 0 else None
        if running is not None:
            chosen[~running] = self.spec.pad
        at = self.length
        self.ids[:, at] = chosen
        self.mask[:, at] = 1
        self.length += 1
        self.draws += 1
        if eos.size:
            ended = chosen == eos[0] if eos.size == 1 else (chosen[:, None] == eos).any(axis=1)
            if running is not None:
                ended &= running
            self.end[ended] = at + 1
        return at

    def frees_at_end(self) -> bool:
        """Whether the ring frees the group's cache when the group ends: at its capacity
        (nothing more fits), or a batcher's group (the batcher closes it). One ended by
        its rows' eos keeps it until the driver closes the generator, as the in-process
        generator keeps its own: a chat's next turn, appended after the eos, then runs
        its own tokens only, not the whole conversation again."""
        return self.spec.batched or self.length >= self.capacity

    def done(self) -> bool:
        if self.spec.batched:
            return self.length >= self.capacity
        return self.length >= self.capacity or bool(self.end.min() >= 0)
