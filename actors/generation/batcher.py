"""ContinuousBatcher: requests sharing the rows of a running group on the stage ring
(continuous batching, as vLLM's scheduler admits a request at its next step).

A group has ``slots`` rows. The first requests start it (left-padded to the longest
prompt); when a request ends (eos or its ``max_new_tokens``), its row is free, and the
next queued request joins the running group there: the driver sends a `Join` to stage
0 (over stage 0's socket on its node, as the group's steps go), which takes it at the
group's next decode step ``at`` when it fits (its prompt ends at ``at`` and its new
tokens end within the capacity). Every stage then rewrites that
row for the prompt (the columns before it masked out, as left padding is), prefills the
prompt but its last token at batch 1 into the row's columns of its own layers' cache,
and the step at ``at`` runs the last prompt token with the other rows' tokens: the
request's first token comes with theirs (that one step also carries its prefill).
The last stage acknowledges each join with the column it took (or refused it); a
refused or unacknowledged request waits for the next group. A group closes when no row
has a request and none waits to join; the next requests start a new one. Up to
``groups_in_flight`` groups run at once (default one per stage, so each stage has one
to work on while the next stage works on another), and a request that no running group
can ever fit (their position plus its new tokens past the capacity) starts one beside
them while they drain. A group's position only grows: rows that join late run at its
width (their masked columns still cost attention work) until it drains.

A decode step runs only the rows up to the last one still wanting a token: each row's
stop (its request's last column) goes to the stages with the group's spec and with each
join, and the last stage sets the next step's rows (`Job.rows`; stage 0 widens it for
the rows joining). A lone request in a group of 4 rows runs at batch 1, and a group
narrows as its higher rows end (on two stages, tiny Llama, one request at a time in 4
rows: 6.0-7.5 ms a token against 7.1-8.8 when every row ran, and 11-13 ms to the first
token against 14-18).

Each request's tokens are those of a generator running it alone (the masked columns
add nothing to attention; only the sum's order may differ, as in a left-padded batch).
A sampling batcher (``do_sample``) gives each row its own random stream, the request's
seed (its own, else the batcher's ``random_seed``, else a fresh one), restarted when a
request takes the row: a seeded request draws what it draws alone, whatever shares its
group. A stage restart replays the group as a generator's (`RemoteGenerator._replay`),
joined rows included (each row's stream past what it drew); joins not yet acknowledged
wait for the next group.

Only decoders whose cache the rewrite appends to (Concat -> KVAppend) with an attention
mask input: an attention op keeping its own buffer (GroupQueryAttention) reads each
row's length from the mask's sum and cannot have a row start later.
"""

from __future__ import annotations

import collections
import logging
import secrets
import threading
import time
import uuid
from typing import Any, Iterator, Sequence

import numpy as np

from actors.generation.generator import RemoteGenerator
from actors.generation.group import Join
from hetero_exec.errors import ActorError
from hetero_exec.genai.errors import GenaiError, GenerationInputError
from hetero_exec.genai.widths import check_rows

log = logging.getLogger(__name__)


def unbatchable(model: Any) -> str:
    """Why ``model``'s requests cannot share groups ("" when they can)."""
    if getattr(model, "remote", None) is None:
        return "continuous batching runs on the stage actors: build the model with " \
               "executor=\"ray\""
    if any(e.mode == "shared" for e in model.layout.entries):
        return "continuous batching needs a cache the rewrite appends to (Concat -> " \
               "KVAppend); this decoder's attention op keeps its own buffer and reads each " \
               "row's length from the mask"
    if not model.layout.attention_mask:
        return "continuous batching needs an attention_mask input (a row that joins later " \
               "masks the columns before its prompt)"
    return ""


class BatchRequest:
    """One submitted prompt: its generated ids as they come (`stream`, `result`)."""

    def __init__(self, prompt: np.ndarray, max_new: int, seed: int = -1):
        self.key = uuid.uuid4().hex[:16]
        self.prompt = prompt
        self.max_new = max_new
        self.seed = seed  # its random stream, in a sampling batcher
        self.tokens: list[int] = []
        self.joined_at: int | None = None  # the column of its first token, when it joined
        self.error: BaseException | None = None
        self.done = False
        self.cancelled = False
        self._cond = threading.Condition()

    def cancel(self) -> None:
        """Stop it (its caller went away): its row is freed at the group's next column,
        or it leaves the queue."""
        with self._cond:
            self.cancelled = True
        if not self.done:
            self._finish(GenaiError(f"request {self.key} was cancelled"))

    def _push(self, token: int) -> None:
        with self._cond:
            self.tokens.append(token)
            self._cond.notify_all()

    def _finish(self, error: BaseException | None = None) -> None:
        with self._cond:
            self.done, self.error = True, error
            self._cond.notify_all()

    def stream(self, timeout: float | None = None) -> Iterator[int]:
        """Each generated id as it comes; raises the request's error, or TimeoutError when
        ``timeout`` seconds pass without one."""
        i = 0
        while True:
            with self._cond:
                if not self._cond.wait_for(lambda: len(self.tokens) > i or self.done, timeout):
                    raise TimeoutError(f"no token of request {self.key} within {timeout} s")
                new, done, error = self.tokens[i:], self.done, self.error
            yield from new
            i += len(new)
            if done and i >= len(self.tokens):
                if error is not None:
                    raise error
                return

    def result(self, timeout: float | None = None) -> list[int]:
        """The generated ids (eos included when it came), once the request ends."""
        return list(self.stream(timeout))


class _BatchGroup(RemoteGenerator):
    """A group whose rows the batcher hands out; learns of joins from the acks."""

    batched = True

    def __init__(self, batcher: "ContinuousBatcher", params: Any, seeds: list[int], first: int,
                 stops: list[int]):
        self.batcher = batcher
        self.seeds = list(seeds)  # each row's random stream (a sampling batcher's)
        self.first = np.full(batcher.slots, first, dtype=np.int64)  # each row's first token column
        self.stops = list(stops)  # each row's last token's column (-1: no request)
        super().__init__(batcher.model, params, batcher.capacity)  # opens: after _spec's fields
        self.rows: list[BatchRequest | None] = [None] * self.batch
        self.joining: dict[str, tuple[BatchRequest, int, int]] = {}  # key: (request, row, epoch)
        self.prompt_length = 0
        self.seen = 0  # columns handed to the requests
        self.failed: BaseException | None = None

    def _joined(self, column: int, key: str, row: int, ok: bool) -> None:
        entry = self.joining.pop(key, None)
        if entry is None:
            return
        req = entry[0]
        if not ok:
            self.batcher._requeue(req, refused=self.gid)
            return
        n = int(req.prompt.shape[0])
        s = column - n
        self._ids[row, :] = self._pad
        self._ids[row, s:column] = req.prompt
        self._start[row] = s
        self._end[row] = -1
        self.rows[row] = req
        self.first[row] = column
        self.stops[row] = column + req.max_new - 1
        self.seeds[row] = req.seed
        req.joined_at = column
        self.batcher.joins += 1

    def _rows_wanted(self, column: int) -> int | None:
        wanting = [r for r, stop in enumerate(self.stops) if stop >= column and self._end[r] < 0]
        return wanting[-1] + 1 if wanting else 1

    def _spec(self) -> Any:
        spec = super()._spec()
        spec.row_stops = tuple(int(s) for s in self.stops)  # the stages run the rows wanted
        if self.batcher.sampling:  # a replay's, too: each row past what it drew
            spec.row_seeds = tuple((int(s), int(f)) for s, f in zip(self.seeds, self.first))
        return spec

    def collect(self) -> None:
        """At least one more column (or the group's end)."""
        want = self._got + 1
        while self._got < want and not self._finished:
            self._collect()
        # every collected column is the caller's, as after generate_next_token: a replay
        # runs them all and goes on from the next
        self._length = self._got
        self._filled = self._got - 1
        self._draws = self._got - self.prompt_length


class ContinuousBatcher:
    """Requests sharing running groups of ``slots`` rows on a model's stage actors
    (``executor="ray"``); see the module docstring. ``search``: the groups' search
    options (greedy unless ``do_sample``; ``random_seed``: each request's unless it
    brings its own)."""

    def __init__(self, model: Any, slots: int = 4, max_length: int | None = None,
                 groups_in_flight: int | None = None, **search: Any):
        from hetero_exec.genai.generator import GeneratorParams
        from hetero_exec.genai.model import DEFAULT_MAX_LENGTH

        why = unbatchable(model)
        if why:
            raise GenaiError(why)
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise GenaiError(f"slots must be a positive int, got {slots!r}")
        self.model = model
        self.slots = slots
        #: one group per stage keeps every stage busy (stage 1 on one while stage 0 on another)
        self.groups_in_flight = len(model.remote.actors) if groups_in_flight is None \
            else groups_in_flight
        if isinstance(self.groups_in_flight, bool) or not isinstance(self.groups_in_flight, int) \
                or self.groups_in_flight < 1:
            raise GenaiError(f"groups_in_flight must be a positive int, got {groups_in_flight!r}")
        self.params = GeneratorParams(model)
        self.params.set_search_options(**search, batch_size=slots)
        if max_length is not None:
            self.params.set_search_options(max_length=max_length)
        self.capacity = int(self.params.search.max_length or model.context_length
                            or DEFAULT_MAX_LENGTH)
        self.params.set_search_options(max_length=self.capacity)
        self.eos = set(int(e) for e in (model.eos_token_ids or []))
        self.sampling = bool(self.params.search.do_sample)
        self.groups = self.joins = self.refused = self.replays = 0
        self._queue: collections.deque[BatchRequest] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._groups: list[_BatchGroup] = []
        self._thread = threading.Thread(target=self._run, name="hetero-exec-batcher", daemon=True)
        self._thread.start()

    # -- requests ------------------------------------------------------------------------

    def submit(self, prompt: Sequence[int] | np.ndarray, max_new_tokens: int,
               seed: int | None = None) -> BatchRequest:
        """Queue one prompt (ids); its tokens come on the returned request. ``seed``: its
        random stream in a sampling batcher (None or -1: the batcher's ``random_seed``,
        or a fresh one)."""
        if self._closed:
            raise GenaiError("the batcher is closed")
        row = check_rows(np.asarray(prompt).reshape(1, -1) if np.ndim(prompt) <= 1 else prompt,
                         1, self.model.vocab_size, 0, True)[0]
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
                or max_new_tokens < 1:
            raise GenerationInputError(f"max_new_tokens must be a positive int, got "
                                       f"{max_new_tokens!r}")
        if row.shape[0] + max_new_tokens > self.capacity:
            raise GenerationInputError(f"a prompt of {row.shape[0]} tokens + {max_new_tokens} "
                                       f"new exceeds max_length {self.capacity}")
        req = BatchRequest(row, max_new_tokens, self._seed(seed))
        with self._cond:
            self._queue.append(req)
            self._cond.notify_all()
        return req

    def _seed(self, seed: int | None) -> int:
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))
                                 or not -1 <= seed < 1 << 63):
            raise GenerationInputError(f"seed must be an int in [-1, 2**63), got {seed!r}")
        if not self.sampling:
            return -1
        if seed is None or seed < 0:
            seed = self.params.search.random_seed
        # a fresh stream is still a seeded one: a replay after a stage restart redraws it
        return int(seed) if seed >= 0 else secrets.randbits(63)

    def _requeue(self, req: BatchRequest, refused: str = "") -> None:
        """Back to the front: it starts the next group (``refused``: the group that had
        no room for it, not asked again)."""
        if refused:
            self.refused += 1
            req.refused_by = refused  # type: ignore[attr-defined]
        with self._cond:
            self._queue.appendleft(req)

    # -- the loop ------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._groups or self._closed)
                if self._closed:
                    break
                start = self._should_start()
            try:
                while start:  # every group that can start now, before waiting on any
                    self._start_group()
                    with self._cond:
                        start = not self._closed and self._should_start()
                for g in list(self._groups):
                    self._advance(g)
            except BaseException as e:  # noqa: BLE001 - the requests get it; the loop goes on
                log.warning("a batched group failed: %s", e)
                for g in [g for g in self._groups if g.failed is not None]:
                    self._drop(g, g.failed)  # (a group that failed to start told its requests)
        self._fail_all(GenaiError("the batcher was closed"))

    def _should_start(self) -> bool:
        """Whether the next queued request starts a new group; call under ``_cond``."""
        return bool(self._queue) and not self._joinable() and (
            len(self._groups) < self.groups_in_flight
            # every running group is too far along for the next request ever to fit: a
            # new one starts beside them while they drain
            or (len(self._groups) < 2 * self.groups_in_flight and self._aged()))

    def _head(self) -> BatchRequest | None:
        """The first queued request not cancelled (the cancelled ones before it leave);
        call under ``_cond``."""
        while self._queue and self._queue[0].cancelled:
            self._queue.popleft()
        return self._queue[0] if self._queue else None

    def _free_rows(self, g: _BatchGroup) -> list[int]:
        """``g``'s rows with no request and none joining."""
        taken = {row for _req, row, _e in g.joining.values()}
        return [r for r in range(self.slots) if g.rows[r] is None and r not in taken]

    def _joinable(self) -> bool:
        """Whether a running group has a row free for the next queued request."""
        req = self._head()
        if req is None:
            return True  # nothing to start a group for
        return any(self._free_rows(g) and self._fits(g, req) for g in self._groups)

    def _aged(self) -> bool:
        req = self._queue[0]
        return all(g._got + req.max_new > self.capacity for g in self._groups)

    def _fits(self, g: _BatchGroup, req: BatchRequest) -> bool:
        return getattr(req, "refused_by", "") != g.gid and not g._finished \
            and int(req.prompt.shape[0]) <= g._got and g._got + req.max_new <= self.capacity

    def _start_group(self) -> None:
        with self._cond:
            take = [self._queue.popleft() for _ in range(min(self.slots, len(self._queue)))]
        take = [r for r in take if not r.cancelled]
        if not take:
            return
        seeds = [r.seed for r in take] + [0] * (self.slots - len(take))  # spare rows: unread
        first = max(int(r.prompt.shape[0]) for r in take)  # the group's first token column
        stops = [first + r.max_new - 1 for r in take] + [-1] * (self.slots - len(take))
        try:
            g = _BatchGroup(self, self.params, seeds, first, stops)
        except BaseException as e:
            for req in take:
                req._finish(e)
            raise
        self._groups.append(g)
        self.groups += 1
        rows = [list(r.prompt) for r in take]
        rows += [rows[0]] * (self.slots - len(rows))  # spare rows run a copy, unread
        g.append_tokens(rows)
        g.prompt_length = g.seen = g._got
        for i, req in enumerate(take):
            g.rows[i] = req

    def _advance(self, g: _BatchGroup) -> None:
        """One more column of ``g`` to its requests, free rows to the queue; the group
        closes when it ended or no request is left in it."""
        try:
            g.collect()
        except BaseException as e:  # noqa: BLE001
            g.failed = e
            raise
        for c in range(g.seen, g._got):
            self._dispatch(g, c)
        g.seen = g._got
        for key, (req, _row, epoch) in list(g.joining.items()):
            if epoch < g.epoch:  # a replay dropped it at stage 0
                del g.joining[key]
                self._requeue(req)
        if not g._finished:
            self._fill(g)
        busy = any(r is not None for r in g.rows) or g.joining
        if g._finished or not busy:
            for req, _row, _epoch in g.joining.values():
                self._requeue(req)
            g.joining.clear()
            self._drop(g, ActorError(f"group {g.gid} ended at position {g._got} before "
                                     "the request's last token"))  # admission prevents it

    def _drop(self, g: _BatchGroup, error: BaseException | None) -> None:
        """Close ``g``: its requests still running get ``error``."""
        for req in [r for r in g.rows if r is not None] + [j[0] for j in g.joining.values()]:
            req._finish(error)
        g.rows = [None] * self.slots
        g.joining.clear()
        if g in self._groups:
            self._groups.remove(g)
        self.replays += g.replays
        g.close()

    def _dispatch(self, g: _BatchGroup, column: int) -> None:
        for r, req in enumerate(g.rows):
            if req is not None and req.cancelled:
                g.rows[r] = None  # free for the next request
                continue
            if req is None or column < g.first[r]:
                continue
            token = int(g._ids[r, column])
            req._push(token)
            if token in self.eos or len(req.tokens) >= req.max_new:
                req._finish()
                g.rows[r] = None

    def _fill(self, g: _BatchGroup) -> None:
        """Free rows to the queued requests that can join this group now (in order)."""
        free = self._free_rows(g)
        while free:
            with self._cond:
                req = self._head()
                if req is None or not self._fits(g, req):
                    return  # the next group's (FIFO: nothing overtakes it)
                self._queue.popleft()
            row = free.pop(0)
            g.joining[req.key] = (req, row, g.epoch)
            g.decoder.send_join(g.gid, Join(row, req.key, req.prompt, req.max_new,
                                            epoch=g.epoch, seed=req.seed))

    # -- lifetime ------------------------------------------------------------------------

    def _fail_all(self, error: BaseException) -> None:
        with self._cond:
            queued, self._queue = list(self._queue), collections.deque()
        for req in queued:
            req._finish(error)

    def stats(self) -> dict[str, int]:
        """Groups started, requests that joined a running group, joins refused there,
        and the replays of finished groups after a stage restart."""
        return {"groups": self.groups, "joins": self.joins, "refused": self.refused,
                "replays": self.replays}

    def close(self, timeout: float = 30.0) -> None:
        """Stop: the running groups' caches are freed, unfinished requests get GenaiError."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)
        for g in list(self._groups):
            self._drop(g, GenaiError("the batcher was closed"))
        self._fail_all(GenaiError("the batcher was closed"))

    def __enter__(self) -> "ContinuousBatcher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def wait_all(requests: Sequence[BatchRequest], timeout: float = 120.0) -> list[list[int]]:
    """Every request's ids (a helper for scripts and the benchmark)."""
    deadline = time.monotonic() + timeout
    return [r.result(max(deadline - time.monotonic(), 0.001)) for r in requests]
