"""The generator's shape rules, shared by the in-process generator and the stage
actors of `executor="ray"` (Ray-free, no model): decode widths, token rows, and the
token bookkeeping both generators answer from (`TokenRows`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from hetero_exec.genai.errors import GenerationInputError

#: the narrowest decode width, and how many widths each doubling of the context has
MIN_WIDTH, WIDTHS_PER_DOUBLING = 64, 4


def decode_width(n: int, capacity: int) -> int:
    """The width a decode step of ``n`` positions runs at: n rounded up to a multiple of
    MIN_WIDTH, or of a quarter of n's power of two above that (at most a quarter more
    work than n, and few widths, each bound once), at most ``capacity``."""
    step = max(MIN_WIDTH, 1 << max(n.bit_length() - 1 - (WIDTHS_PER_DOUBLING.bit_length() - 1), 0))
    return min(capacity, -(-n // step) * step)


def leading(rows: np.ndarray, pad: int) -> np.ndarray:
    """Each row's count of leading pad ids (left padding), leaving one token at least."""
    not_pad = rows != pad
    first = np.where(not_pad.any(axis=1), not_pad.argmax(axis=1), rows.shape[1] - 1)
    return first.astype(np.int64)


def right_aligned(ids: np.ndarray, start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A left-padded first prompt (``start``: each row's leading padding) as an attention
    op keeping its own buffer reads one: onnxruntime's GroupQueryAttention takes row b's
    keys from cache position 0 to its length (the mask's sum), so each row's tokens go to
    its first columns, the padding after them; returns (ids, mask). Its cache then holds
    the token of column c at c - start[b], where every later step (the op's lengths
    read from the mask's sums) puts that row's next ones, as the row alone would."""
    n = ids.shape[1]
    out = np.empty_like(ids)
    mask = np.zeros(ids.shape, dtype=np.int64)
    for b, s in enumerate(start.tolist()):
        out[b, :n - s], out[b, n - s:] = ids[b, s:], ids[b, :s]
        mask[b, :n - s] = 1
    return out, mask


def check_rows(tokens: Any, batch: int, vocab: int | None, pad: int, first: bool) -> np.ndarray:
    """``tokens`` as a [batch, n] int64 array (rows of different lengths left-padded
    with ``pad`` on the ``first`` call), or GenerationInputError naming what is wrong."""
    if isinstance(tokens, (list, tuple)) and tokens and isinstance(tokens[0], (list, tuple, np.ndarray)):
        if first and len({len(r) for r in tokens}) > 1:
            width = max(len(r) for r in tokens)
            tokens = [[pad] * (width - len(r)) + list(r) for r in tokens]
    arr = np.asarray(tokens)
    if arr.ndim == 1:
        arr = arr[None, :]
    if arr.ndim != 2 or arr.shape[1] == 0:
        raise GenerationInputError(f"tokens must be [batch, n] ids with n >= 1, got shape "
                                   f"{list(arr.shape)}")
    if arr.dtype.kind not in "iu":
        raise GenerationInputError(f"token ids must be integers, got {arr.dtype}")
    if arr.shape[0] != batch:
        raise GenerationInputError(f"{arr.shape[0]} sequences given, the generator's "
                                   f"batch_size is {batch}")
    bad = (arr < 0) | (arr >= vocab) if vocab else arr < 0
    if bad.any():
        i, j = map(int, np.argwhere(bad)[0])
        raise GenerationInputError(f"token id {int(arr[i, j])} (sequence {i}, position {j}) "
                                   f"is outside the vocabulary [0, {vocab})")
    return arr.astype(np.int64)


def chunks(p: int, t: int, size: int) -> list[tuple[int, int]]:
    """Positions [p, t) in runs of at most ``size`` (0: one run), as a prompt is prefilled
    with the ``chunk_size`` search option.

    >>> chunks(0, 10, 4), chunks(3, 5, 0), chunks(0, 8, 4)
    ([(0, 4), (4, 8), (8, 10)], [(3, 5)], [(0, 4), (4, 8)])
    """
    if size <= 0 or t - p <= size:
        return [(p, t)]
    return [(a, min(a + size, t)) for a in range(p, t, size)]


class TokenRows:
    """What a generator answers from its token rows: ``_ids`` [batch, capacity], the
    ``_length`` filled, each row's first real position ``_start`` and its end ``_end``
    (-1 while it runs)."""

    _ids: np.ndarray
    options: Any  # SearchOptions
    _length: int
    _start: np.ndarray
    _end: np.ndarray
    capacity: int
    batch: int
    #: the decoder's attention op keeps its own cache buffer (it reads the lengths from
    #: the mask's sums), and its decode steps run at a fixed shape
    _shared: bool
    _fixed: bool

    def is_done(self) -> bool:
        return self._length >= self.capacity or bool((self._end >= 0).all())

    def _prefill_runs(self, p: int, t: int) -> list[tuple[int, int]]:
        """Positions [p, t) as the runs the ``chunk_size`` search option cuts them into; a
        batch of several rows runs whole (onnxruntime-genai refuses chunks there, and a
        chunk of only left padding for a row would leave it nothing to attend to). A
        left-padded first prompt of an attention op keeping its own buffer runs all but
        its last column right-aligned (`right_aligned`), then that column as a decode
        step: each row's last token at its own position, whose logits the step makes."""
        if self._right_aligned(p) and t - p > 1:
            return [(p, t - 1), (t - 1, t)]
        return chunks(p, t, self.options.chunk_size if self.batch == 1 else 0)

    def _right_aligned(self, p: int) -> bool:
        """Whether a run from ``p`` is a left-padded first prompt that an attention op
        keeping its own buffer reads right-aligned (`right_aligned`; onnxruntime-genai
        feeds it as it is, so there its padded rows make other tokens than alone)."""
        return self._shared and self._fixed and p == 0 and bool(self._start.any())

    def token_count(self) -> int:
        """The sequences' length so far, prompt and left padding included, as
        onnxruntime-genai's ``Generator.token_count`` (its model-qa example prints it after
        each answer) counts it: the eos that ends the last running row is not counted
        (onnxruntime-genai does not append it; `get_sequence` here keeps it)."""
        ended = self._end.size > 0 and bool((self._end >= 0).all())
        return int(self._length) - int(ended and int(self._end.max()) == self._length)

    def get_next_tokens(self) -> np.ndarray:
        return self._ids[:, self._length - 1].copy() if self._length else np.zeros(0, np.int64)

    def get_sequence(self, index: int) -> np.ndarray:
        if not 0 <= index < self.batch:
            raise GenerationInputError(f"sequence {index} of a batch of {self.batch}")
        end = self._end[index] if self._end[index] >= 0 else self._length
        return self._ids[index, self._start[index]:end].copy()
