"""``GeneratorParams`` and ``Generator``, shaped like onnxruntime-genai's.

A generator owns its cache: one buffer per layer and kind, allocated once at capacity
``max_length`` on the provider that runs that layer's attention, admitted before the
first token. A step feeds the new tokens, the mask and positions (host, a few bytes),
the buffers where they live and a zero-stride placeholder for each past input (read
only for its shape); the rewritten Concats write the new positions in place. Only the
chosen token ids come back to the host, and logits when asked for.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np

from hetero_exec.genai.errors import GenerationInputError
from hetero_exec.genai.model import DEFAULT_MAX_LENGTH, Model
from hetero_exec.genai.rewrite import PAST_LENGTH, cache_input
from hetero_exec.genai.search import Sampler, SearchOptions
from hetero_exec.genai.widths import (  # noqa: F401  (MIN_WIDTH..: public here before)
    MIN_WIDTH,
    WIDTHS_PER_DOUBLING,
    TokenRows,
    check_rows,
    decode_width,
    leading,
    right_aligned,
)
from hetero_exec.kernels.kv_cache import share_buffer

log = logging.getLogger(__name__)


class GeneratorParams:
    def __init__(self, model: Model):
        self.model = model
        self.search = SearchOptions()
        self.search.update(**model.search_defaults())

    def set_search_options(self, **options: Any) -> None:
        self.search.update(**options)

    def try_graph_capture_with_max_batch_size(self, max_batch_size: int) -> None:
        """onnxruntime-genai's (deprecated) call: every step here is bound already."""


class Generator(TokenRows):
    def __new__(cls, model: Model, params: GeneratorParams):
        if getattr(model, "remote", None) is not None:  # executor="ray": the stage actors'
            opts = params.search
            return model.remote.generator(model, params, opts.max_length or model.context_length
                                          or DEFAULT_MAX_LENGTH)
        return super().__new__(cls)

    def __init__(self, model: Model, params: GeneratorParams):
        self.model = model
        self.options = opts = SearchOptions(**vars(params.search))
        self.batch = opts.batch_size
        self.capacity = opts.max_length or model.context_length or DEFAULT_MAX_LENGTH
        layout = model.layout
        self._reservation = model.reserve(self.batch, self.capacity)  # before anything else
        try:
            self._caches = {}
            for e in layout.entries:
                prov = model.cache_providers[e.past]
                shape = [self.batch, e.kv_heads, e.head_size]
                shape.insert(e.axis, self.capacity)
                self._caches[e.past] = model.zeros(prov, tuple(shape), e.dtype)
                if e.mode == "shared":  # the attention op's past and present: one buffer
                    share_buffer(self._caches[e.past])
        except BaseException:
            model.release(self._reservation)
            raise
        self._closed = False
        self._runner = model.step_runner
        logits_prov = self._runner.output_provider
        self._sampler = Sampler(opts, logits_prov.xp, logits_prov.to_host, logits_prov.to_device)
        self._logits_provider = logits_prov
        pad = model.pad_token_id
        self._pad = int(pad if pad is not None else (model.eos_token_ids or [0])[0])
        self._ids = np.full((self.batch, self.capacity), self._pad, dtype=np.int64)
        self._mask = np.zeros((self.batch, self.capacity), dtype=np.int64)
        self._start = np.zeros(self.batch, dtype=np.int64)  # left padding per row
        self._end = np.full(self.batch, -1, dtype=np.int64)  # eos position + 1, -1: running
        self._length = 0  # tokens in the sequences (padding included)
        self._filled = 0  # positions in the cache
        self._logits: Any = None  # the last step's last-position logits, on its provider
        self._placeholders: dict[int, dict[str, Any]] = {}
        self._real = np.zeros(self.batch, dtype=np.int64)  # real (unmasked) tokens cached
        self._eos = np.asarray(model.eos_token_ids or [], dtype=np.int64)
        self._decode: dict[int, Any] = {}  # the fixed-shape decode steps, by width
        self._step_ids = np.zeros((self.batch, 1), dtype=np.int64)
        self._step_pos = np.zeros((self.batch, 1), dtype=np.int64)
        self._step_past = np.zeros((), dtype=np.int64)
        #: decode steps at a fixed shape need the positions and the mask as inputs (an
        #: attention op with a shared buffer reads the lengths from the mask's sums)
        shared = any(e.mode == "shared" for e in layout.entries)
        self._fixed = bool(layout.attention_mask and (layout.position_ids or shared))
        self._shared = shared  # the attention op's own buffer: it reads the lengths

    # -- tokens in -------------------------------------------------------------------

    def append_tokens(self, tokens: Any) -> None:
        """Feed tokens (a [batch, n] array, a list for batch 1, or a list of rows of
        different lengths on the first call, left-padded here) and compute their logits."""
        self._check_open()
        rows = self._rows(tokens)
        n = rows.shape[1]
        if self._length + n > self.capacity:
            raise GenerationInputError(
                f"{self._length} tokens so far + {n} new exceed max_length {self.capacity}")
        first = self._length == 0
        if self._filled < self._length:
            self._compute()  # a sampled token not yet run: its position comes first
        at = self._length
        self._ids[:, at:at + n] = rows
        self._mask[:, at:at + n] = 1
        if first and self.batch > 1:
            self._start = leading(rows, self._pad)
            for i, s in enumerate(self._start):
                self._mask[i, :s] = 0
        self._length += n
        self._end[:] = -1
        self._compute()

    def _rows(self, tokens: Any) -> np.ndarray:
        return check_rows(tokens, self.batch, self.model.vocab_size, self._pad, self._length == 0)

    # -- steps -----------------------------------------------------------------------

    def _compute(self) -> None:
        """Run the tokens not yet in the cache; keep the last position's logits."""
        p, t = self._filled, self._length
        for a, b in self._prefill_runs(p, t):
            if self._fixed and b - a == 1 and a > 0 and b == t:
                logits = self._decode_step(a)
            else:
                logits = self._runner.run(self._feeds(a, b))
            self._real += self._mask[:, a:b].sum(axis=1)
        self._logits = logits[:, -1, :] if logits.ndim == 3 else logits
        self._filled = t

    def _feeds(self, p: int, t: int) -> dict[str, Any]:
        """The feeds of positions [p, t) at their exact shapes (a prompt, a rewind)."""
        layout = self.model.layout
        ids, mask = self._ids[:, p:t], self._mask[:, :t]
        if self._right_aligned(p):
            ids, mask = right_aligned(ids, self._start)
        feeds: dict[str, Any] = {layout.input_ids: ids, PAST_LENGTH: np.array(p)}
        if layout.attention_mask:
            feeds[layout.attention_mask] = mask
        if layout.position_ids:  # HF's rule: cumsum(mask) - 1, padded positions 1
            pos = np.cumsum(mask, axis=1) - 1
            feeds[layout.position_ids] = np.where(mask[:, p:t] == 0, 1, pos[:, p:t])
        feeds.update(self._cache_feeds(p))
        return feeds

    def _decode_step(self, p: int) -> Any:
        """One new token at position p, at a fixed shape: the mask at a width w (the
        positions not filled yet masked out) and the past at w - 1, read from arrays
        this generator writes in place, so the step's plan is bound once per width and
        replayed. A shared buffer is read at capacity; a concatenated cache at the
        bucket holding p + 1 (`decode_width`), so a step's work follows the context,
        not max_length."""
        width = self.capacity if self._shared else decode_width(p + 1, self.capacity)
        step = self._decode.get(width)
        if step is None:
            layout = self.model.layout
            feeds: dict[str, Any] = {layout.input_ids: self._step_ids, PAST_LENGTH: self._step_past}
            if layout.attention_mask:
                feeds[layout.attention_mask] = self._mask[:, :width]
            if layout.position_ids:
                feeds[layout.position_ids] = self._step_pos
            feeds.update(self._cache_feeds(width - 1))
            step = self._decode[width] = self._runner.fixed(feeds)
        self._step_ids[:, 0] = self._ids[:, p]
        self._step_pos[:, 0] = self._real  # each row's real tokens before this one
        self._step_past[()] = p
        return step()

    def _cache_feeds(self, n: int) -> dict[str, Any]:
        """The buffers and the past placeholders at length ``n`` (made once per length:
        a decode step's is the same every step)."""
        feeds = self._placeholders.get(n)
        if feeds is None:
            feeds = {}
            for e in self.model.layout.entries:
                if e.mode == "shared":  # the buffer itself, at capacity
                    feeds[e.past] = self._caches[e.past]
                    continue
                shape = [self.batch, e.kv_heads, e.head_size]
                shape.insert(e.axis, n)
                feeds[e.past] = np.broadcast_to(np.zeros((), e.dtype), tuple(shape))
                feeds[cache_input(e.past)] = self._caches[e.past]
            if len(self._placeholders) > 4:
                self._placeholders.clear()
            self._placeholders[n] = feeds
        return feeds

    def generate_next_token(self) -> None:
        self._check_open()
        if self._length == 0:
            raise GenerationInputError("generate_next_token before append_tokens: no prompt")
        if self.is_done():
            raise GenerationInputError("generate_next_token after is_done(): every sequence "
                                       "has ended (eos or max_length)")
        if self._filled < self._length:
            self._compute()
        chosen = self._sampler.choose(self._logits, self._banned(),
                                      self._ids[:, :self._length])
        running = self._end < 0
        if not running.all():
            chosen[~running] = self._pad
        at = self._length
        self._ids[:, at] = chosen
        self._mask[:, at] = 1
        self._length += 1
        if self._eos.size:
            ended = running & (chosen[:, None] == self._eos).any(axis=1)
            self._end[ended] = at + 1

    def _banned(self) -> list[tuple[int, np.ndarray]] | None:
        """eos is not chosen before ``min_length`` (each row's own length)."""
        if not self.options.min_length or not self.model.eos_token_ids:
            return None
        short = (self._length - self._start) < self.options.min_length
        if not short.any():
            return None
        return [(e, short) for e in self.model.eos_token_ids]


    # -- tokens out ------------------------------------------------------------------


    def get_logits(self) -> np.ndarray:
        """The logits for the next token, [batch, vocab], on the host (the last token is
        run first when it has not been)."""
        if self._length and self._filled < self._length:
            self._compute()
        if self._logits is None:
            raise GenerationInputError("no logits yet: call append_tokens first")
        return np.asarray(self._logits_provider.to_host(self._logits))

    def rewind_to(self, new_length: int) -> None:
        """Keep the first ``new_length`` tokens; the cache's prefix stays valid."""
        self._check_open()
        if not 0 <= new_length <= self._length:
            raise GenerationInputError(f"rewind_to({new_length}): the sequences hold "
                                       f"{self._length} tokens")
        self._ids[:, new_length:self._length] = self._pad
        self._mask[:, new_length:self._length] = 0
        self._length = new_length
        self._filled = min(self._filled, max(new_length - 1, 0))
        self._real = self._mask[:, :self._filled].sum(axis=1)
        self._end = np.where(self._end > new_length, -1, self._end)
        self._logits = None
        if new_length == 0:
            self._start[:] = 0

    # -- lifetime ----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise GenerationInputError("the generator is closed")

    def close(self) -> None:
        """Free the cache and its admission (also when the generator is collected)."""
        if not self._closed:
            self._closed = True
            self._caches = {}
            self._placeholders = {}
            self._decode = {}
            self.model.release(self._reservation)

    def __enter__(self) -> "Generator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def generate(model: Model, input_ids: Sequence[Any] | np.ndarray, max_new_tokens: int = 64,
             **search: Any) -> list[np.ndarray]:
    """One call: the sequences (prompt + generated, up to eos) for each prompt row."""
    rows = input_ids if isinstance(input_ids, (list, tuple)) else np.asarray(input_ids)
    if isinstance(rows, np.ndarray) and rows.ndim == 1:
        rows = rows[None, :]
    batch = len(rows)
    longest = max(len(r) for r in rows)
    params = GeneratorParams(model)
    search.setdefault("max_length", longest + max_new_tokens)
    params.set_search_options(batch_size=batch, **search)
    with Generator(model, params) as gen:
        gen.append_tokens(rows if isinstance(rows, np.ndarray) else [list(r) for r in rows])
        while not gen.is_done() and gen._length < longest + max_new_tokens:
            gen.generate_next_token()
        return [gen.get_sequence(i) for i in range(batch)]
