"""String ops. String tensors are numpy object arrays of ``str`` and live on the host."""

from __future__ import annotations

import operator
import re

import numpy as np

from hetero_exec.kernels.registry import kernel

_HOST = "string tensors live on the host"


def _obj(values, shape) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out.reshape(shape)


def _as_str_list(x) -> list[str]:
    return [
        v.decode() if isinstance(v, bytes) else str(v)
        for v in np.asarray(x, dtype=object).reshape(-1)
    ]


_concat = np.frompyfunc(operator.add, 2, 1)


@kernel("StringConcat", since=20, host_only=_HOST)
def StringConcat(xp, X, Y):
    out = _concat(np.asarray(X, dtype=object), np.asarray(Y, dtype=object))
    return (np.asarray(out, dtype=object),)


@kernel("RegexFullMatch", since=20, host_only=_HOST)
def RegexFullMatch(xp, X, *, pattern=None):
    if pattern is None:
        raise ValueError("RegexFullMatch needs the pattern attribute")
    try:
        rx = re.compile(pattern)
    except re.error as e:
        raise ValueError(f"invalid regex pattern {pattern!r}: {e}") from e
    hits = [rx.fullmatch(s) is not None for s in _as_str_list(X)]
    return (np.array(hits, dtype=np.bool_).reshape(X.shape),)


@kernel("StringSplit", since=20, host_only=_HOST)
def StringSplit(xp, X, *, delimiter=None, maxsplit=None):
    sep = delimiter or None  # unspecified or "": split on runs of whitespace
    limit = -1 if maxsplit is None else int(maxsplit)
    parts = [s.split(sep, limit) for s in _as_str_list(X)]
    counts = np.array([len(p) for p in parts], dtype=np.int64).reshape(X.shape)
    width = max((len(p) for p in parts), default=0)
    flat = [w for p in parts for w in p + [""] * (width - len(p))]
    return (_obj(flat, tuple(X.shape) + (width,)), counts)


@kernel("StringNormalizer", since=10, host_only=_HOST)
def StringNormalizer(
    xp, X, *, case_change_action="NONE", is_case_sensitive=0, locale=None, stopwords=None
):
    if X.ndim == 2 and X.shape[0] != 1 or X.ndim not in (1, 2):
        raise ValueError(f"StringNormalizer input must be [C] or [1, C], got shape {list(X.shape)}")
    if case_change_action not in ("NONE", "LOWER", "UPPER"):
        raise ValueError(f"unknown case_change_action {case_change_action!r}")
    words = _as_str_list(X)
    if stopwords:
        if is_case_sensitive:
            stops = set(stopwords)
            words = [w for w in words if w not in stops]
        else:
            stops = {s.lower() for s in stopwords}
            words = [w for w in words if w.lower() not in stops]
    if case_change_action == "LOWER":
        words = [w.lower() for w in words]
    elif case_change_action == "UPPER":
        words = [w.upper() for w in words]
    if not words:
        words = [""]
    shape = (len(words),) if X.ndim == 1 else (1, len(words))
    return (_obj(words, shape),)
