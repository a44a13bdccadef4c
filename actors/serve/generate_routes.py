"""Triton's generate extension's routes: ``POST /v2/models/{name}/generate`` (one JSON
answer with every new token) and ``/generate_stream`` (server-sent events, one a token,
the last with its ``finish_reason``: "eos" or "length").

Everything that can be refused is refused before the first byte of the answer, as a
JSON ``{"error": ...}`` (`respond` in `actors.serve.routes`): a malformed
request or bad search option 400, a model that is not a decoder 400, a cache that
cannot fit this model's budget even alone 400, one that does not fit now (others hold
the room) 503. A fault after a stream began is its last event, ``{"error": ...}``, as
Triton sends it.

An exchange::

    POST /v2/models/tiny/generate_stream  {"input_ids": [5, 7], "max_tokens": 2}
    data: {"model_name": "tiny", "model_version": "1", "output_ids": [31]}

    data: {"model_name": "tiny", "model_version": "1", "output_ids": [9], "finish_reason": "length"}

"""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator

from actors.oip import JSON, ProtocolError
from actors.serve.generate_request import SSE, parse_generate_request, sse_event
from actors.serve.routes import Reply, read_body

log = logging.getLogger(__name__)


async def generate_route(server: Any, request: Any, streaming: bool) -> Any:
    """``/generate`` (a Reply) or ``/generate_stream`` (a streaming response) of
    ``server`` (a `GenerativeModel`)."""
    from hetero_exec.genai import CacheAdmissionError, SearchOptionError

    req = parse_generate_request(await read_body(request, server.spec.max_request_bytes))
    try:
        stream = await server.open_stream(req)
    except SearchOptionError as e:
        raise ProtocolError(str(e), 400) from None
    except CacheAdmissionError as e:
        server.counts.refused += 1
        held = server.reserved_bytes().get(e.provider, 0)
        if e.needed > e.free + held:  # would not fit with every other stream gone
            raise ProtocolError(f"{e}: ask for fewer tokens (max_tokens), or a shorter "
                                "prompt", 400) from None
        raise ProtocolError(f"{e}: other streams hold the room; retry later", 503) from None
    if streaming:
        from starlette.responses import StreamingResponse

        return StreamingResponse(_events(server, stream), media_type=SSE,
                                 headers={"cache-control": "no-cache"})
    return await _whole(server, stream)


async def _whole(server: Any, stream: Any) -> Reply:
    import json

    tokens = server.tokens(stream)
    try:
        ids = [t async for t in tokens]
    finally:  # also when the request is cancelled (its client went away)
        await tokens.aclose()
        server.release(stream)
    text = server.tokenizer.decode(ids) if server.tokenizer is not None else None
    body = server.response(stream, ids, text, last=True)
    return 200, json.dumps(body).encode(), {"content-type": JSON}


async def _events(server: Any, stream: Any) -> AsyncIterator[bytes]:
    """One event a token; a fault after the first is the stream's last event. When the
    client goes away the response stops iterating (or its task is cancelled), and
    `server.tokens`'s own cleanup closes the generator."""
    pieces = server.tokenizer.create_stream() if server.tokenizer is not None else None
    tokens = server.tokens(stream)
    try:
        if stream.finish_reason is not None:  # max_tokens 0: one event, no token
            yield sse_event(server.response(stream, [], "" if pieces else None, last=True))
        async for token in tokens:
            text = pieces.decode(token) if pieces is not None else None
            yield sse_event(server.response(stream, [token], text,
                                            last=stream.finish_reason is not None))
    except Exception as e:  # the status is sent: the error is the last event
        log.exception("generate_stream failed after its first event")
        yield sse_event({"error": f"{type(e).__name__}: {e}"})
    finally:
        await tokens.aclose()
        server.release(stream)
