"""The generator's cache ops (domain ``hetero_exec``): a decoder's growing
``Concat(past, new)`` rewritten to write only the new positions into a buffer allocated
once at capacity (`hetero_exec.genai.rewrite`). The buffer is the generator's state; the
kernel returns a view of its filled prefix, so no step copies the context.
"""

from __future__ import annotations

from hetero_exec.kernels.fused import FUSED_DOMAIN
from hetero_exec.kernels.registry import kernel


class CacheCapacityError(ValueError):
    """Positions past the buffer's capacity (the generator checks before a step)."""


def _prefix(ndim: int, axis: int, index: slice) -> tuple:
    out = [slice(None)] * ndim
    out[axis] = index
    return tuple(out)


@kernel("KVAppend", since=1, domain=FUSED_DOMAIN, host_inputs=(2,))
def KVAppend(xp, cache, new, past_length, axis=-2):
    """``cache[..., p:p+s, :] = new``; returns ``cache[..., :p+s, :]`` (a view).

    ``cache``: the capacity buffer (mutated in place); ``new``: this step's keys or
    values along ``axis``; ``past_length``: the filled positions, a host scalar."""
    axis = axis % cache.ndim
    p = int(past_length)
    s = new.shape[axis]
    if p + s > cache.shape[axis]:
        raise CacheCapacityError(f"{p} cached + {s} new positions exceed the cache's capacity "
                                 f"{cache.shape[axis]}")
    if new.shape[:axis] != cache.shape[:axis] or new.shape[axis + 1:] != cache.shape[axis + 1:]:
        raise CacheCapacityError(f"new entries {tuple(new.shape)} do not fit a cache of "
                                 f"{tuple(cache.shape)} along axis {axis}")
    cache[_prefix(cache.ndim, axis, slice(p, p + s))] = new
    return (cache[_prefix(cache.ndim, axis, slice(0, p + s))],)


@kernel("KVPrefix", since=1, domain=FUSED_DOMAIN, host_inputs=(1,))
def KVPrefix(xp, cache, past_length, axis=-2):
    """The filled prefix ``cache[..., :p, :]`` (a view): the past as a reader other than
    the cache's Concat and its shape reads sees it."""
    axis = axis % cache.ndim
    return (cache[_prefix(cache.ndim, axis, slice(0, int(past_length)))],)
