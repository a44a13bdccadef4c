"""RemoteGenerator: `hetero_exec.genai.Generator`'s API over a `RayDecoder`.

The driver keeps the same bookkeeping as the in-process generator (ids, left padding,
eos per row, how much was computed) and hands the group to the ring once per
``append_tokens``; the stages then generate on their own up to eos or max_length, and
the driver only collects token ids: the columns the last stage pushed to its socket
(`inbox.py`), else a batch per long poll of the last stage (`stream` yields them as they
come). Nothing the driver does per token crosses to a stage; ``generate_next_token``
reads the next collected column. An append after generating is one step frame too:
the new epoch it carries makes each stage drop the group's run-ahead.

Closing (``close``, the end of a ``with`` block, or the generator being collected)
frees the group's cache on every stage; a group the ring ended at its capacity is freed
by the stages, and one ended by its rows' eos keeps its cache until closed, as the
in-process generator keeps its own: a chat's next turn, appended after the eos, runs
its own tokens only (a turn after a 320-token conversation on two stages took 25.5 ms to
its first token when the stages had freed the cache and ran it all again, against 12.3
in process).
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Iterator

import numpy as np
import ray

from actors.generation.group import GroupSpec, Job
from actors.generation.inbox import TokenInbox, inbox_name
from hetero_exec.errors import ActorError
from hetero_exec.genai.errors import GenerationInputError
from hetero_exec.genai.widths import TokenRows, check_rows, leading

log = logging.getLogger(__name__)

#: how long one long poll of the last stage waits for tokens before checking the stages
POLL_S = 1.0


class RemoteGenerator(TokenRows):
    batched = False  # a batcher's group (batcher.py) is not ended by its rows' eos

    def __init__(self, model: Any, params: Any, capacity: int):
        from hetero_exec.genai.search import SearchOptions

        self.model = model
        self.decoder = model.remote
        self.options = opts = SearchOptions(**vars(params.search))
        self.batch = opts.batch_size
        self.capacity = capacity
        pad = model.pad_token_id
        self._pad = int(pad if pad is not None else (model.eos_token_ids or [0])[0])
        self._ids = np.full((self.batch, self.capacity), self._pad, dtype=np.int64)
        self._start = np.zeros(self.batch, dtype=np.int64)
        self._end = np.full(self.batch, -1, dtype=np.int64)
        self._length = 0
        self._filled = 0  # as the in-process generator counts it
        self._draws = 0
        self._got = 0  # positions the ring has made and the driver has collected
        #: positions every stage's cache holds for the driver's tokens: a column collected
        #: says every stage ran the positions before it (a rewind's halt, sent by Ray
        #: calls across nodes, may pass a step still on its way and drop it there)
        self._settled = 0
        self._eos = np.asarray(model.eos_token_ids or [], dtype=np.int64)
        layout = model.layout  # (as the stages decide: `GenerationStage.fixed`)
        self._shared = any(e.mode == "shared" for e in layout.entries)
        self._fixed = bool(layout.attention_mask and (layout.position_ids or self._shared))
        self.gid = uuid.uuid4().hex[:16]
        self.epoch = 0
        self.replays = 0
        self.polls = 0  # Ray long polls of the last stage (its token socket brings the rest)
        self.logits_steps = 0  # steps sent to run the last token again for its logits
        #: the last `get_logits`' answer and the (epoch, length) it was for
        self._last_logits: tuple[tuple[int, int], np.ndarray] | None = None
        self._running = False  # the ring holds a live epoch of this group
        self._finished = False  # the ring ended it (eos, max_length): no step runs
        #: the stages freed the group's cache when the ring ended it (`StageGroup.
        #: frees_at_end`: at its capacity; one ended by eos keeps it for the next append)
        self._cache_freed = False
        self._closed = False
        self._seen = list(self.decoder.incarnations)
        # the last stage pushes each token column here when it runs on this node (inbox.py)
        self._inbox = TokenInbox.open(inbox_name(self.decoder.ring_id, self.gid),
                                      self.decoder.yield_to_stages) \
            if self.decoder.link == "socket" else None
        self._pushing = False
        self._fresh = True  # never sent: the first step opens the group on each stage
        self._opened = 0  # the epoch the stages' cache of the group was opened at
        try:
            self._open(self.epoch)  # admission: before any token, as in process
        except BaseException:
            self._close_inbox()
            raise

    def _spec(self) -> GroupSpec:
        inbox = None
        if self._inbox is not None:
            inbox = (ray.get_runtime_context().get_node_id(), self._inbox.address)
        return GroupSpec(self.batch, self.capacity, self._pad, self._start.copy(),
                         dict(vars(self.options)), tuple(int(e) for e in self._eos), inbox,
                         batched=self.batched)

    def _open(self, epoch: int) -> None:
        """Admit the group (the driver keeps the stages' books); a group that ran before
        (replayed, resumed after its end) opens on every stage now, a fresh one with its
        first step (`_send`: no Ray call waits behind the running groups' steps)."""
        spec = self._spec()
        self.decoder.admit(self.gid, spec)
        if not self._fresh:
            self.decoder.open(self.gid, spec, epoch)
        self._opened = epoch
        self._pushing = self._inbox is not None and self.decoder.pushing
        if self._pushing:
            self._inbox.ended = False  # a new connection waits to be accepted

    # -- tokens in -------------------------------------------------------------------

    def append_tokens(self, tokens: Any) -> None:
        self._check_open()
        rows = check_rows(tokens, self.batch, self.model.vocab_size, self._pad, self._length == 0)
        n = rows.shape[1]
        if self._length + n > self.capacity:
            raise GenerationInputError(
                f"{self._length} tokens so far + {n} new exceed max_length {self.capacity}")
        first = self._length == 0
        at = self._length
        if self._running and not self._finished and self._got <= at and self._pushing \
                and self._inbox is not None and not self._inbox.ended:
            self._take_pushed(wait=0.0)  # what the ring made meanwhile (see below)
        # the sampled token not yet run (at ``_filled``): the ring, running ahead, ran it
        # on every stage already when it sampled the token after it (collected: ``_got``
        # past ``at``); its cache entries are the ones a run now would write (the same
        # one-token step), so the stages keep them rather than run it again (a runner
        # pass on each stage: a chat turn on two stages took 1.7-1.8x the in-process
        # time to its first token with it). Not where a row had ended (its mask then
        # differs), nor after a rewind or the group's end.
        filled = at if self._running and not self._finished and self._got > at \
            and bool((self._end < 0).all()) else self._filled
        if not self._running and not self._fresh:  # rewound: from what every stage holds
            filled = min(filled, self._settled)
            if filled == 0 and not (self._finished and self._cache_freed):
                self._open(self.epoch + 1)  # its first step may not have got to every stage
        self._ids[:, at:at + n] = rows
        if first and self.batch > 1:
            self._start = leading(rows, self._pad)
        self._end[:] = -1
        if self._finished and self._cache_freed:  # all the tokens again
            self._length += n
            self._resume(ended=True)
            return
        pieces = []
        if filled < at:
            pieces.append((filled, at))  # the sampled token not yet run comes first
        pieces.extend(self._prefill_runs(at, at + n))
        lo = pieces[0][0]
        rewind = (at, filled)
        self._length += n
        self._filled = self._length
        self._send(Job(lo, self._ids[:, lo:self._length].copy(), pieces, rewind=rewind,
                       end=self._end.copy(), draws=self._draws,
                       start=self._start.copy() if first else None,
                       rows=self._rows_wanted(self._length)))

    def _send(self, job: Job) -> None:
        """Hand the group to the ring under a new epoch: each stage drops the group's
        older messages once this step has got there (nothing goes ahead of it: a
        stage runs the steps that came before it, as it would have anyway)."""
        self.epoch += 1
        if self._fresh:
            job.spec = self._spec()  # each stage opens the group when this step gets there
            self._fresh = False
        self.decoder.send_step(self.gid, self.epoch, job)
        self._running = True
        self._finished = self._cache_freed = False
        self._got = self._length

    # -- tokens out ----------------------------------------------------------------------

    def generate_next_token(self) -> None:
        self._check_open()
        if self._length == 0:
            raise GenerationInputError("generate_next_token before append_tokens: no prompt")
        if self.is_done():
            raise GenerationInputError("generate_next_token after is_done(): every sequence "
                                       "has ended (eos or max_length)")
        if not self._running:  # rewound: run again from what the stages' caches hold
            self._rerun()
        while self._got <= self._length:
            self._collect()
        chosen = self._ids[:, self._length].copy()
        running = self._end < 0
        at = self._length
        self._length += 1
        self._filled = self._length - 1
        self._draws += 1
        if self._eos.size:
            ended = running & (chosen[:, None] == self._eos).any(axis=1)
            self._end[ended] = at + 1

    def _collect(self) -> None:
        """Columns the last stage made since ``_got``; checks the stages when none came
        within a poll, and replays the group after a fault."""
        if self._seen != self.decoder.incarnations:
            self._replay()  # a stage restarted since this group last ran
        if self._pushing and self._inbox is not None and not self._inbox.ended \
                and self.epoch not in self._inbox.failed and self._take_pushed():
            return
        self.polls += 1
        try:
            got = ray.get(self.decoder.last.tokens.remote(self.gid, self.epoch, self._got, POLL_S),
                          timeout=POLL_S + 30)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError,
                ray.exceptions.ActorUnavailableError):
            got = {"missing": True}
        _raise_failed(got)
        if got.get("freed"):  # the ring had ended the group unseen: all the tokens again
            self._freed()
            return
        if got.get("missing") and self.decoder.check():
            return  # the group's first step has not reached the last stage yet
        if got.get("missing") or (got["ids"].shape[1] == 0 and not got["done"]
                                  and not self.decoder.check()):
            self.decoder.recover(self._seen)
            self._replay()
            return
        if got["epoch"] != self.epoch:
            return
        self._columns(got["ids"], got["done"], got.get("acks", ()))

    def _columns(self, ids: np.ndarray, done: bool, acks: Any = ()) -> None:
        for column, key, row, ok in acks:
            if column >= self._got:
                self._joined(column, key, row, ok)
        n = ids.shape[1]
        self._ids[:, self._got:self._got + n] = ids
        self._got += n
        self._settled = max(self._settled, self._got - 1)
        if done:
            self._finished = True
            self._cache_freed = self._ring_frees()
            if self._cache_freed:
                self.decoder.release(self.gid)  # the stages freed its cache
            if self._inbox is not None:
                self._inbox.release()  # no more waits: the thread's own policy again
            if self._got <= self._length:
                raise ActorError(f"group {self.gid}: the ring ended at position {self._got}")

    def _ring_frees(self, length: int | None = None) -> bool:
        """Whether the stages free the group's cache when the ring ends it at ``length``
        (the columns collected): as `StageGroup.frees_at_end` decides there."""
        return self.batched or (self._got if length is None else length) >= self.capacity

    def _joined(self, column: int, key: str, row: int, ok: bool) -> None:
        """A join (`batcher.py`) taken at ``column`` - 1: here, nothing (a plain generator
        sends none)."""

    def _rows_wanted(self, column: int) -> int | None:
        """How many leading rows a step making the token at ``column`` runs (None: all;
        a batcher's group runs only up to its last row still wanting a token)."""
        return None

    def _take_pushed(self, wait: float = POLL_S) -> bool:
        """The columns pushed since ``_got`` (every one that came, waiting up to ``wait``
        for the first); False when none follows on (a lost column, a silent socket, a
        step that failed on a stage): then the Ray poll answers, and finds the fault.

        An earlier epoch's last column (``done``) means the ring ended the group before
        this epoch's step got to the last stage (it runs ahead of the driver), freed its
        cache and dropped that step: the group runs all its tokens again."""
        deadline = time.monotonic() + wait
        while self.epoch not in self._inbox.failed:
            took = False
            for epoch, at, ids, done, acks in self._inbox.columns(
                    max(deadline - time.monotonic(), 0.0)):
                if self._finished:
                    continue
                if epoch != self.epoch:
                    if done and self._opened <= epoch < self.epoch \
                            and self._ring_frees(at + ids.shape[1]):
                        self._freed()
                        return True
                    continue  # an older epoch's run-ahead (or its eos: the cache stays)
                if at + ids.shape[1] <= self._got:
                    continue  # collected by a poll already
                if at != self._got:
                    return took  # a gap: the poll fills it from ``_got``
                self._columns(ids, done, acks)
                took = True
            if took or self._inbox.ended or time.monotonic() >= deadline:
                return took
        return False

    def _freed(self) -> None:
        """The ring ended the group unseen and freed its cache: all the tokens again."""
        self._finished = self._cache_freed = True
        self.decoder.release(self.gid)
        self._resume(ended=True)

    def _replay(self) -> None:
        """Open the group again where it was lost and run a prefill over the tokens so
        far (prompt and generated) through the ring; at most ``max_replays`` times."""
        self._seen = list(self.decoder.incarnations)
        self.replays += 1
        if self.replays > self.decoder.opts.max_replays:
            raise ActorError(f"group {self.gid} was replayed {self.replays - 1} times "
                             f"(max_replays={self.decoder.opts.max_replays})")
        self._resume()

    def _rerun(self) -> None:
        """After a rewind: the tokens the stages' caches do not hold, then on as before."""
        self._send(self._rerun_job(logits=False))
        self._filled = self._length

    def _rerun_job(self, logits: bool) -> Job:
        """The step running the tokens after what every stage's cache holds for them (at
        least the last, whose logits the step makes), as the in-process generator runs
        from its cache after a rewind: a chat's answer made again after `rewind_to` runs
        its last prompt token, not the conversation. All the tokens where the ring freed
        the cache, and for a left-padded first prompt that ran right-aligned (its cache
        positions are not its columns)."""
        n = self._length
        lo = min(self._settled, self._filled, n - 1)
        freed = self._finished and self._cache_freed
        if freed or self._right_aligned(0) or lo <= 0:
            return self._from_start(freed, logits)
        return Job(lo, self._ids[:, lo:n].copy(), self._prefill_runs(lo, n), rewind=(lo, lo),
                   end=self._end.copy(), draws=self._draws, logits=logits,
                   rows=self._rows_wanted(n))

    def _resume(self, ended: bool = False) -> None:
        """Run all the tokens so far through the ring under a new epoch. ``ended``: the
        stages freed the group's cache (it ended there), so the group opens again with
        this step, as a new one does (a Ray call to each stage cost a chat turn 4 ms of
        its 13 on two stages); else (a replay after a fault) it opens on each stage
        first."""
        self._send(self._from_start(ended))
        self._filled = self._length

    def _from_start(self, fresh: bool, logits: bool = False) -> Job:
        """The step running all the tokens so far. ``fresh``: the stages freed the group's
        cache, so this step opens it again on each stage; else each opens it now (a
        replay; or a first step halted before it got to every stage)."""
        n = self._length
        self._fresh = fresh
        self._settled = 0
        self._open(self.epoch + 1)
        return Job(0, self._ids[:, :n].copy(), self._prefill_runs(0, n), rewind=(0, 0),
                   end=self._end.copy(), draws=self._draws, start=self._start.copy(),
                   logits=logits, rows=self._rows_wanted(n))

    def stream(self) -> Iterator[np.ndarray]:
        """Each new token column ([batch] ids) as the pipeline makes it."""
        while not self.is_done():
            self.generate_next_token()
            yield self.get_next_tokens()

    def get_logits(self) -> np.ndarray:
        """The logits for the next token, [batch, vocab], on the host: once the live epoch
        has got through every stage (their caches hold the tokens before the last), the
        group runs its last token again through the ring (after a rewind or an end that
        freed the cache: all its tokens), and the last stage keeps the logits of that step for the driver
        before it samples and goes on as before (its sampler skips the earlier draws).
        From then on, where the last stage shares this node, it pushes every step's
        logits with its token (`inbox.py`): the next call takes those the ring ran ahead
        with, and runs nothing again. A call with nothing appended, generated or rewound
        since the last one answers what that one did."""
        self._check_open()
        if self._length == 0:
            raise GenerationInputError("no logits yet: call append_tokens first")
        # asked again with no token in or out since (an append or a rewind bumps the
        # epoch, a token the length): the same logits, not the last token run again
        if self._last_logits is not None and self._last_logits[0] == (self.epoch, self._length):
            return self._last_logits[1].copy()
        logits = self._run_for_logits()
        self._last_logits = ((self.epoch, self._length), logits.copy())
        return logits

    def _run_for_logits(self) -> np.ndarray:
        while True:
            if self._seen != self.decoder.incarnations:
                self._replay()
            live = self._running and not self._finished and not self.is_done()
            while live and self._got <= self._length and not self._finished:
                self._collect()  # the live epoch got through every stage: keep its cache
            n = self._length
            # pushed when the ring ran ahead with them (asked before), before their column:
            # here once that column is (a group the ring has ended included)
            kept = self._inbox.take_logits(self.epoch, n) if self._pushing \
                and self._inbox is not None and self._got > n else None
            if kept is not None:
                self._settled = max(self._settled, n)  # the logits of every stage's run
                return kept
            # ended by eos and not rewound since: every stage kept the group's cache
            ended_kept = self._running and self._finished and not self._cache_freed
            if (live and not self._finished) or ended_kept:  # run the last token again
                job = Job(n - 1, self._ids[:, n - 1:n].copy(), [(n - 1, n)], rewind=(n, n - 1),
                          end=self._end.copy(), draws=self._draws, logits=True)
            else:  # rewound, or ended and freed: from what the stages' caches hold
                job = self._rerun_job(logits=True)
            self._send(job)
            self.logits_steps += 1
            self._filled = n
            logits = self._pushed_logits(n)
            if logits is None:
                logits = self._polled_logits()
            if logits is not None:
                self._settled = max(self._settled, n)
                if self.is_done():  # the last stage ended the group again
                    self._finished, self._running = True, False
                    self._cache_freed = self._ring_frees(self._length)
                    if self._cache_freed:
                        self.decoder.release(self.gid)
                return logits

    def _pushed_logits(self, column: int) -> np.ndarray | None:
        """The logits of the step just sent, pushed by the last stage to this driver's
        socket (no Ray poll of a stage busy with steps); None: ask the last stage
        (`TokenInbox.wait_logits`)."""
        if not self._pushing or self._inbox is None or self._inbox.ended:
            return None
        return self._inbox.wait_logits(self.epoch, column, POLL_S)

    def _polled_logits(self) -> np.ndarray | None:
        """The logits the last stage kept for this epoch's step, by Ray long polls (not
        pushed: too big, or no token socket); None when the group must run again: the
        ring had ended it (all its tokens again), or a stage was lost (replayed)."""
        while True:
            self.polls += 1
            try:
                got = ray.get(self.decoder.last.logits.remote(self.gid, self.epoch, POLL_S),
                              timeout=POLL_S + 30)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError,
                    ray.exceptions.ActorUnavailableError):
                got = {"missing": True}
            _raise_failed(got)
            if got.get("logits") is not None:
                return got["logits"]
            if got.get("freed"):  # the ring had ended the group: all the tokens again
                self._finished = self._cache_freed = True
                return None
            if got.get("missing") or not self.decoder.check():
                self.decoder.recover(self._seen)
                return None  # replayed by the caller's next round, then asked again

    def rewind_to(self, new_length: int) -> None:
        self._check_open()
        if not 0 <= new_length <= self._length:
            raise GenerationInputError(f"rewind_to({new_length}): the sequences hold "
                                       f"{self._length} tokens")
        self._stop()
        self._ids[:, new_length:] = self._pad
        self._length = new_length
        self._filled = min(self._filled, max(new_length - 1, 0))
        self._settled = min(self._settled, new_length)
        self._end = np.where(self._end > new_length, -1, self._end)
        if new_length == 0:
            self._start[:] = 0

    def _stop(self) -> None:
        """Stop the ring's run-ahead (its later messages carry an older epoch)."""
        self.epoch += 1
        if self._running:
            self.decoder.halt_group(self.gid, self.epoch)
        self._running = False

    # -- lifetime ----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise GenerationInputError("the generator is closed")

    def close(self) -> None:
        """Free the group's cache and admission on every stage."""
        if not self._closed:
            self._closed = True
            self._running = False
            self._close_inbox()
            self.decoder.close_group(self.gid)

    def _close_inbox(self) -> None:
        if getattr(self, "_inbox", None) is not None:
            self._inbox.close()
            self._inbox = None

    def __enter__(self) -> "RemoteGenerator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _raise_failed(reply: dict[str, Any]) -> None:
    """A step of the live epoch failed on a stage: its error, as in process (the
    `SegmentRunError` carries the stage's original, a KernelError naming the node)."""
    carrier = reply.get("error")
    if carrier is not None:
        raise getattr(carrier, "error", carrier)
