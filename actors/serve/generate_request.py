"""Triton's generate extension as data: a request's JSON in, response objects and
server-sent events out. No HTTP and no generator here (`actors.serve.generation` runs
the requests, `actors.serve.generate_routes` routes them).

A request is one JSON object: the prompt as ``input_ids`` (a flat list of token ids)
or ``text_input`` (text, where the model folder has a tokenizer), and the search
options either at the top level or in ``parameters`` (Triton's clients do both):
``max_tokens`` (new tokens at most, default 16), ``temperature``, ``top_k``,
``top_p``, ``do_sample``, ``min_length``, ``repetition_penalty``, ``random_seed``.
Every malformed request raises `ProtocolError` (400) naming what is wrong.

>>> req = parse_generate_request(b'{"input_ids": [5, 7], "parameters": {"max_tokens": 3}}')
>>> req.input_ids, req.max_tokens, req.search
([5, 7], 3, {})
>>> sse_event({"output_ids": [9]})
b'data: {"output_ids": [9]}\\n\\n'
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from actors.oip import ProtocolError

DEFAULT_MAX_TOKENS = 16  # vLLM's and Triton's vLLM backend's default
#: search options a request may set, and the JSON types each takes
SEARCH_OPTIONS: dict[str, tuple[type, ...]] = {
    "temperature": (int, float), "top_k": (int,), "top_p": (int, float), "do_sample": (bool,),
    "min_length": (int,), "repetition_penalty": (int, float), "random_seed": (int,),
}
#: random_seed's bound (exclusive)
MAX_SEED = 1 << 63
_PROMPT_KEYS = ("input_ids", "text_input")
_KNOWN = (*_PROMPT_KEYS, "parameters", "max_tokens", *SEARCH_OPTIONS)
SSE = "text/event-stream; charset=utf-8"


@dataclass
class GenerateRequest:
    """One generate request: its prompt (ids, or text to tokenize) and search options."""

    input_ids: list[int] | None
    text_input: str | None
    max_tokens: int = DEFAULT_MAX_TOKENS
    search: dict[str, Any] = field(default_factory=dict)


def parse_generate_request(body: bytes) -> GenerateRequest:
    """The request in ``body``, or ProtocolError (400) naming what is wrong.

    >>> parse_generate_request(b'{"input_ids": [1, -2]}')
    Traceback (most recent call last):
    ...
    actors.oip.ProtocolError: input_ids[1] is -2: token ids are integers >= 0
    """
    try:
        obj = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"the request body is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"the request must be a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(_KNOWN))
    if unknown:
        raise ProtocolError(f"unknown field(s) {', '.join(map(repr, unknown))}; a generate "
                            f"request has {', '.join(_KNOWN)}")
    params = obj.get("parameters", {})
    if not isinstance(params, dict):
        raise ProtocolError(f"parameters must be a JSON object, got {type(params).__name__}")
    options: dict[str, Any] = {}
    for key, value in [*((k, v) for k, v in obj.items() if k not in (*_PROMPT_KEYS, "parameters")),
                       *params.items()]:
        if key in options and options[key] != value:
            raise ProtocolError(f"{key!r} given twice (top level and parameters), differently")
        options[key] = value
    max_tokens = options.pop("max_tokens", DEFAULT_MAX_TOKENS)
    if not _is_int(max_tokens) or max_tokens < 0:
        raise ProtocolError(f"max_tokens must be an integer >= 0, got {max_tokens!r}")
    search = {}
    for key, value in options.items():
        kinds = SEARCH_OPTIONS.get(key)
        if kinds is None:
            raise ProtocolError(f"unknown parameter {key!r}; known: max_tokens, "
                                f"{', '.join(SEARCH_OPTIONS)}")
        if (bool not in kinds and isinstance(value, bool)) or not isinstance(value, kinds):
            raise ProtocolError(f"parameter {key!r} must be a JSON "
                                f"{' or '.join(k.__name__ for k in kinds)}, got {value!r}")
        search[key] = value
    seed = search.get("random_seed", -1)
    if not -1 <= seed < MAX_SEED:  # a request's stream travels between stages as an int64
        raise ProtocolError(f"random_seed must be -1 (a fresh seed) or in [0, 2**63), got {seed}")
    ids, text = obj.get("input_ids"), obj.get("text_input")
    if (ids is None) == (text is None):
        raise ProtocolError("a generate request needs one prompt: input_ids (token ids) or "
                            "text_input (text)")
    if text is not None and not isinstance(text, str):
        raise ProtocolError(f"text_input must be a string, got {type(text).__name__}")
    if ids is not None:
        ids = _token_ids(ids)
    return GenerateRequest(ids, text, int(max_tokens), search)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_ids(ids: Any) -> list[int]:
    if not isinstance(ids, list) or not ids:
        raise ProtocolError(f"input_ids must be a non-empty list of token ids, got {ids!r:.60}")
    for i, t in enumerate(ids):
        if not _is_int(t):
            raise ProtocolError(f"input_ids[{i}] is {t!r:.40}: input_ids is a flat list of "
                                "integer token ids (one sequence a request)")
        if t < 0:
            raise ProtocolError(f"input_ids[{i}] is {t}: token ids are integers >= 0")
    return ids


def sse_event(obj: Any) -> bytes:
    """One server-sent event carrying ``obj`` as its JSON data."""
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def parse_sse(stream: Any) -> Any:
    """The JSON objects of a server-sent event stream read line by line from ``stream``
    (a file-like HTTP response); what a client (the tests, the bench) reads.

    >>> import io
    >>> list(parse_sse(io.BytesIO(b'data: {"a": 1}\\n\\ndata: {"a": 2}\\n\\n')))
    [{'a': 1}, {'a': 2}]
    """
    data: list[bytes] = []
    for line in stream:
        line = line.rstrip(b"\r\n")
        if not line:
            if data:
                yield json.loads(b"\n".join(data))
                data = []
        elif line.startswith(b"data:"):
            data.append(line[5:].lstrip(b" "))
    if data:
        yield json.loads(b"\n".join(data))
