"""The generator's cache ops (domain ``hetero_exec``): a decoder's growing
``Concat(past, new)`` rewritten to write only the new positions into a buffer allocated
once at capacity (`hetero_exec.genai.rewrite`). The buffer is the generator's state; the
kernel returns a view of its filled prefix, so no step copies the context.
"""

from __future__ import annotations

import weakref

from hetero_exec.kernels.fused import FUSED_DOMAIN
from hetero_exec.kernels.registry import kernel


class CacheCapacityError(ValueError):
    """Positions past the buffer's capacity (the generator checks before a step)."""


def _prefix(ndim: int, axis: int, index: slice) -> tuple:
    out = [slice(None)] * ndim
    out[axis] = index
    return tuple(out)


@kernel("KVAppend", since=1, domain=FUSED_DOMAIN, host_inputs=(2,))
def KVAppend(xp, cache, new, past_length, past=None, axis=-2):
    """``cache[..., p:p+s, :] = new``; returns the view ``cache[..., :n+s, :]`` where n is
    the length of ``past`` along ``axis`` (p itself when ``past`` is omitted).

    ``cache``: the capacity buffer (mutated in place); ``new``: this step's keys or
    values; ``past_length``: the filled positions p, a host scalar; ``past``: the
    decoder's past input as fed (a zero-stride placeholder), whose length is p for an
    exact step and the capacity less s for a fixed-shape decode step, where the
    positions past p are masked out by the attention mask."""
    axis = axis % cache.ndim
    p = int(past_length)
    s = new.shape[axis]
    n = p if past is None else past.shape[axis]
    if max(p, n) + s > cache.shape[axis]:
        raise CacheCapacityError(f"{max(p, n)} cached + {s} new positions exceed the cache's "
                                 f"capacity {cache.shape[axis]}")
    if new.shape[:axis] != cache.shape[:axis] or new.shape[axis + 1:] != cache.shape[axis + 1:]:
        raise CacheCapacityError(f"new entries {tuple(new.shape)} do not fit a cache of "
                                 f"{tuple(cache.shape)} along axis {axis}")
    cache[_prefix(cache.ndim, axis, slice(p, p + s))] = new
    return (cache[_prefix(cache.ndim, axis, slice(0, n + s))],)


@kernel("KVPrefix", since=1, domain=FUSED_DOMAIN)
def KVPrefix(xp, cache, past, axis=-2):
    """The past as the decoder was fed it, read from the buffer (a view of its first
    ``past.shape[axis]`` positions): for readers other than the cache's Concat and its
    shape reads."""
    axis = axis % cache.ndim
    return (cache[_prefix(cache.ndim, axis, slice(0, past.shape[axis]))],)


# -- buffers shared by past and present (onnxruntime-genai's buffer sharing) -----------

_SHARED: dict[int, weakref.ref] = {}


def share_buffer(buffer) -> None:
    """Mark ``buffer`` (a generator's cache, at capacity) as its owner's to write: an
    attention kernel fed it as its past writes the new positions into it and returns it
    as the present, as onnxruntime does when past and present are one buffer. Any other
    past is copied into a fresh present."""
    key = id(buffer)
    _SHARED[key] = weakref.ref(buffer, lambda _ref, key=key: _SHARED.pop(key, None))


def is_shared(buffer) -> bool:
    ref = _SHARED.get(id(buffer))
    return ref is not None and ref() is buffer
