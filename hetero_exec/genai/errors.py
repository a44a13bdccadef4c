"""The generator's errors: each names what is wrong; the model and session stay usable."""

from __future__ import annotations

from typing import Sequence

from hetero_exec.errors import HeteroExecError, InputError, MemoryAdmissionError


class GenaiError(HeteroExecError):
    """Base class of the generator's errors."""


class CacheLayoutError(GenaiError):
    """The model's cache inputs and outputs could not be recognised."""

    def __init__(self, model: str, detail: str, looked_for: Sequence[str]):
        self.looked_for = list(looked_for)
        super().__init__(f"{model}: {detail}; looked for cache inputs named "
                         f"{', '.join(self.looked_for)} (a rank-4 input read by a Concat whose "
                         f"output is a graph output, or genai_config.json's names)")


class GenerationInputError(GenaiError, InputError):
    """Bad tokens or a bad call order: out-of-vocabulary ids, a prompt past max_length,
    a batch other than batch_size, a step after is_done()."""


class SearchOptionError(GenaiError, ValueError):
    """An unknown or out-of-range search option."""


class CacheAdmissionError(MemoryAdmissionError, GenaiError):
    """A generator's cache does not fit its provider's budget (refused before the first
    token; the session keeps serving other generators)."""

    def __init__(self, provider: str, needed: int, free: int, detail: str):
        self.provider, self.needed, self.free = provider, needed, free
        GenaiError.__init__(self, f"generator cache refused on {provider}: needs {needed} B, "
                                  f"{free} B free of its budget ({detail})")

    def __reduce__(self):  # picklable across processes like the other errors
        return (_cache_admission, (self.provider, self.needed, self.free, str(self)))


def _cache_admission(provider: str, needed: int, free: int, message: str) -> CacheAdmissionError:
    err = CacheAdmissionError.__new__(CacheAdmissionError)
    err.provider, err.needed, err.free = provider, needed, free
    Exception.__init__(err, message)
    return err
