"""Choosing the next token on the provider that computed the logits: greedy argmax, or
top-k / top-p sampling at a temperature. Only the chosen ids come to the host.

Sampling draws one uniform number per sequence from a seeded NumPy generator on the
host and inverts the kept tokens' cumulative distribution on the device: the same seed
gives the same tokens on every provider. A batch draws its rows' numbers from one
generator, or, given ``row_seeds``, each row from its own (continuous batching: a
request's draws are then those it makes alone, whatever shares its group).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Sequence

import numpy as np

from hetero_exec.genai.errors import SearchOptionError


@dataclass
class SearchOptions:
    max_length: int = 0  # 0: the model's (genai_config.json) or the prompt + 128
    batch_size: int = 1
    do_sample: bool = False
    top_k: int = 50
    top_p: float = 1.0
    temperature: float = 1.0
    random_seed: int = -1  # -1: a fresh seed
    min_length: int = 0
    repetition_penalty: float = 1.0
    num_beams: int = 1
    past_present_share_buffer: bool = True
    num_return_sequences: int = 1
    early_stopping: bool = True
    length_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    diversity_penalty: float = 0.0
    #: a prompt (or any append) runs at most this many positions a run, as
    #: onnxruntime-genai's prefill chunks: a long prompt's activations stay bounded
    #: (0: all at once). The tokens are the same either way.
    chunk_size: int = 0

    def update(self, **options: Any) -> None:
        """All or nothing: a refused option leaves the options as they were."""
        known = {f.name for f in fields(self)}
        trial = SearchOptions(**vars(self))
        for name, value in options.items():
            if name not in known:
                raise SearchOptionError(f"unknown search option {name!r}; known: "
                                        f"{', '.join(sorted(known))}")
            setattr(trial, name, _coerce(name, value, getattr(self, name)))
        trial.check()
        vars(self).update(vars(trial))

    def check(self) -> None:
        if self.batch_size < 1:
            raise SearchOptionError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.max_length < 0 or self.min_length < 0:
            raise SearchOptionError("max_length and min_length must be >= 0")
        if self.top_k < 0:
            raise SearchOptionError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise SearchOptionError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.temperature <= 0.0:
            raise SearchOptionError(f"temperature must be > 0, got {self.temperature}")
        if self.num_beams != 1:
            raise SearchOptionError("beam search (num_beams > 1) is not supported; use "
                                    "greedy or sampling")
        if self.repetition_penalty <= 0.0:
            raise SearchOptionError("repetition_penalty must be > 0")
        if self.chunk_size < 0:
            raise SearchOptionError(f"chunk_size must be >= 0 (0: no chunks), got "
                                    f"{self.chunk_size}")


def _coerce(name: str, value: Any, current: Any) -> Any:
    try:
        if isinstance(current, bool):
            if not isinstance(value, (bool, int, np.bool_)):
                raise TypeError
            return bool(value)
        if isinstance(current, int):
            if float(value) != int(value):
                raise TypeError
            return int(value)
        return float(value)
    except (TypeError, ValueError):
        raise SearchOptionError(f"search option {name!r} must be a {type(current).__name__}, "
                                f"got {value!r}") from None


class Sampler:
    """Picks one token per row from the last position's logits, on ``xp``."""

    def __init__(self, options: SearchOptions, xp: Any, to_host: Any, to_device: Any,
                 row_seeds: Sequence[int] | None = None):
        self.options = options
        self.xp = xp
        self.to_host = to_host
        self.to_device = to_device
        self.rng = _rng(options.random_seed)
        #: a random stream per row, or None: the batch's rows draw in turn from ``rng``
        self.row_rngs = None if row_seeds is None else [_rng(int(s)) for s in row_seeds]

    def reseed(self, row: int, seed: int, drawn: int = 0) -> None:
        """Row ``row`` draws from a new stream of ``seed``, past its first ``drawn``
        numbers (a request taking the row; a replay's row that had drawn them)."""
        if self.row_rngs is None:
            raise ValueError("reseed needs a sampler with a random stream per row")
        self.row_rngs[row] = _rng(seed)
        if drawn > 0 and self.options.do_sample:
            self.row_rngs[row].random(drawn)

    def skip(self, draws: int, rows: int) -> None:
        """Past the numbers ``draws`` earlier steps of ``rows`` rows took from the one
        stream (a replay's sampler; a stream per row is `reseed`'s)."""
        if self.options.do_sample and draws > 0:
            self.rng.random(draws * rows)  # a step's rows draw in turn: the same numbers

    def _uniform(self, rows: int) -> np.ndarray:
        if self.row_rngs is None:
            return self.rng.random((rows, 1))
        # the leading rows' streams (a batcher's step may run only those still wanted)
        return np.array([[g.random()] for g in self.row_rngs[:rows]])

    def choose(self, logits: Any, banned: np.ndarray | None = None,
               history: Any = None) -> np.ndarray:
        """``logits``: [batch, vocab] on the provider; ``banned``: token ids whose logit
        is -inf for the rows flagged in it ([batch] bools per id: eos before min_length);
        ``history``: [batch, length] host ids for the repetition penalty."""
        xp, o = self.xp, self.options
        if banned is not None or o.repetition_penalty != 1.0 or o.do_sample:
            logits = logits.astype(xp.float32, copy=True)
        if o.repetition_penalty != 1.0 and history is not None:
            for row, ids in enumerate(history):
                idx = self.to_device(np.unique(ids).astype(np.int64))
                vals = logits[row][idx]
                logits[row, idx] = xp.where(vals > 0, vals / o.repetition_penalty,
                                            vals * o.repetition_penalty)
        if banned is not None:
            for token, rows in banned:
                if rows.any():
                    logits[self.to_device(np.flatnonzero(rows)), token] = -np.inf
        if not o.do_sample:
            return np.asarray(self.to_host(xp.argmax(logits, axis=-1)), dtype=np.int64)
        return self._sample(logits)

    def _sample(self, logits: Any) -> np.ndarray:
        xp, o = self.xp, self.options
        logits = logits / o.temperature
        vocab = logits.shape[-1]
        k = vocab if o.top_k <= 0 else min(o.top_k, vocab)
        order = xp.argsort(-logits, axis=-1)[:, :k]  # stable: ties keep the lower id first
        top = xp.take_along_axis(logits, order, axis=-1)
        top = top - top[:, :1]
        probs = xp.exp(top)
        probs = probs / probs.sum(axis=-1, keepdims=True)
        if o.top_p < 1.0:
            cum = xp.cumsum(probs, axis=-1)
            keep = (cum - probs) < o.top_p  # the smallest prefix reaching top_p
            probs = xp.where(keep, probs, 0.0)
            probs = probs / probs.sum(axis=-1, keepdims=True)
        cum = xp.cumsum(probs, axis=-1)
        u = self.to_device(self._uniform(logits.shape[0]).astype(np.float32))
        pick = xp.minimum((cum < u).sum(axis=-1), k - 1)
        chosen = xp.take_along_axis(order, pick[:, None], axis=-1)[:, 0]
        return np.asarray(self.to_host(chosen), dtype=np.int64)


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(None if seed < 0 else seed)
