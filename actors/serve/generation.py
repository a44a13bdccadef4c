"""The Serve deployment of a decoder: Triton's generate extension over one
`hetero_exec.genai.Model` a replica (`GenerativeModel`).

Every request gets its own Generator (`TokenStream`), admitted against the model's
cache budget before its first token; the replica's requests share the model (its
session, and its pipeline when it runs on stage actors). Steps run on the replica's
pool, one step a job, so concurrent streams take turns token by token (one thread
for a model the replica runs itself, as its inference runs are; 4 for one on stage
actors). A request that ends, fails, or whose client goes away closes its generator,
which returns its cache reservation. Uses the public genai API only (Model,
GeneratorParams, Generator, Tokenizer), so it serves what that API runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from typing import Any, AsyncIterator

from actors.oip import ProtocolError
from actors.serve.deployment import ServeSpec
from actors.serve.generate_request import GenerateRequest
from actors.serve.generate_routes import generate_route
from actors.serve.one_write import answer_in_one_write
from actors.serve.routes import MODEL_VERSION, Reply, respond

log = logging.getLogger(__name__)

#: prompt + max_tokens at most when the model names no context length (the cache is
#: allocated at that capacity: without a bound one request could take the host's memory)
UNCONFIGURED_MAX_LENGTH = 1 << 15


class TokenStream:
    """One request's generator: admitted and prefilled by `start`, stepped one token
    at a time, closed once (its lock keeps a close from racing a step on the pool)."""

    def __init__(self, model: Any, prompt: list[int], max_tokens: int, search: dict[str, Any]):
        import hetero_exec.genai as og

        params = og.GeneratorParams(model)
        params.set_search_options(**search, batch_size=1, max_length=len(prompt) + max_tokens)
        self.prompt, self.max_tokens = prompt, max_tokens
        self.eos = set(model.eos_token_ids or ())
        self.made = 0
        self.finish_reason: str | None = None
        self._lock = threading.Lock()
        self._gen = og.Generator(model, params)  # admission: CacheAdmissionError here
        self._closed = False
        self.released = False  # handed to the pool to close (`GenerativeModel.release`)

    def start(self) -> None:
        """The prompt's step (its ids checked against the vocabulary)."""
        with self._lock:
            self._gen.append_tokens([self.prompt])
            if self.max_tokens == 0:
                self.finish_reason = "length"

    def step(self) -> int:
        """The next token; sets `finish_reason` ("eos" or "length") with the last one."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the stream is closed")
            self._gen.generate_next_token()
            token = int(self._gen.get_next_tokens()[0])
            self.made += 1
            if token in self.eos:
                self.finish_reason = "eos"
            elif self.made >= self.max_tokens or self._gen.is_done():
                self.finish_reason = "length"
            return token

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._gen.close()


def opened(model: Any, prompt: list[int], max_tokens: int, search: dict[str, Any]) -> TokenStream:
    """A stream admitted and prefilled (one job on the pool), or closed and raised."""
    stream = TokenStream(model, prompt, max_tokens, search)
    try:
        stream.start()
    except BaseException:
        stream.close()
        raise
    return stream


def _close_if_opened(job: concurrent.futures.Future) -> None:
    if not job.cancelled() and job.exception() is None:
        job.result().close()


class GenerationCounts:
    """Requests and tokens answered, as the stats route reports them."""

    def __init__(self, model: Any):
        self.model = model
        self.requests = self.tokens = self.active = self.refused = 0

    def stats(self, name: str) -> dict[str, Any]:
        return {"model_stats": [{"name": name, "version": MODEL_VERSION,
                                 "request_count": self.requests,
                                 "generated_tokens": self.tokens}],
                "generation": {"active_streams": self.active, "refused": self.refused,
                               "reserved_bytes": self.model.reserved_bytes()}}


class GenerativeModel:
    """The Serve deployment of a decoder: the protocol's health, metadata and stats
    routes, ``/generate`` and ``/generate_stream``; ``/infer`` answers 400 naming them."""

    def __init__(self, spec: ServeSpec):
        import hetero_exec.genai as og

        answer_in_one_write()  # this replica's answers reach HAProxy whole or not at all
        self.spec, self.name = spec, spec.name
        opts = dict(spec.session_options)
        if spec.providers is not None:
            opts["providers"] = list(spec.providers)
        self.model = og.Model(spec.model, **opts)
        self.tokenizer, self.no_tokenizer = None, ""
        try:
            self.tokenizer = og.Tokenizer(self.model)
        except og.GenaiError as e:  # no tokenizer.json, or no tokenizers package
            self.no_tokenizer = str(e)
        runners = spec.max_concurrent_runs or (
            4 if self.model.session.options.executor == "ray" else 1)
        self.pool = concurrent.futures.ThreadPoolExecutor(runners,
                                                          thread_name_prefix="hetero-generate")
        self.counts = GenerationCounts(self.model)
        self.metadata = generation_metadata(self)
        log.info("serving decoder %s on %s (tokenizer: %s)", self.name,
                 ", ".join(self.model.session.get_providers()), self.tokenizer is not None)

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import Response

        answer = await respond(self, request)
        if not isinstance(answer, tuple):  # a stream, already a response
            return answer
        status, body, headers = answer
        return Response(body, status_code=status, headers=headers)

    async def infer(self, request: Any) -> Reply:
        raise ProtocolError(f"model {self.name!r} is a decoder served for generation: POST "
                            f"/v2/models/{self.name}/generate or /generate_stream", 400)

    # -- generation -------------------------------------------------------------------

    async def generate(self, request: Any, streaming: bool) -> Any:
        """``POST .../generate`` or ``.../generate_stream`` (`generate_routes`)."""
        return await generate_route(self, request, streaming)

    def prompt_ids(self, req: GenerateRequest) -> list[int]:
        if req.input_ids is not None:
            return req.input_ids
        if self.tokenizer is None:
            raise ProtocolError(f"text_input needs a tokenizer, and model {self.name!r} has "
                                f"none ({self.no_tokenizer}): send input_ids")
        ids = [int(t) for t in self.tokenizer.encode(req.text_input)]
        if not ids:
            raise ProtocolError("text_input encodes to no tokens")
        return ids

    async def open_stream(self, req: GenerateRequest) -> TokenStream:
        """A request's generator, admitted and prefilled on the pool (errors raise here,
        before any answer is sent)."""
        prompt = self.prompt_ids(req)
        limit = self.model.context_length or UNCONFIGURED_MAX_LENGTH
        if len(prompt) + req.max_tokens > limit:
            whose = ("the model's context length" if self.model.context_length else
                     "the longest sequence served for a model without genai_config.json's "
                     "context_length")
            raise ProtocolError(f"{len(prompt)} prompt tokens + max_tokens {req.max_tokens} "
                                f"exceed {whose} {limit}")
        job = self.pool.submit(opened, self.model, prompt, req.max_tokens, req.search)
        try:
            stream = await asyncio.wrap_future(job)
        except asyncio.CancelledError:  # the client went away while its stream opened
            job.add_done_callback(_close_if_opened)
            raise
        self.counts.active += 1
        return stream

    async def tokens(self, stream: TokenStream) -> AsyncIterator[int]:
        """The stream's tokens as they are made; its generator is closed when they end,
        fail, or the consumer stops (a client that went away)."""
        loop = asyncio.get_running_loop()
        try:
            while stream.finish_reason is None:
                token = await loop.run_in_executor(self.pool, stream.step)
                self.counts.tokens += 1
                yield token
            self.counts.requests += 1
        finally:
            self.release(stream)

    def release(self, stream: TokenStream) -> None:
        """Close ``stream`` on the pool, after any step of it still running there (a
        cancelled await does not stop the step it awaited); once."""
        if stream.released:
            return
        stream.released = True
        self.counts.active -= 1
        try:
            self.pool.submit(stream.close)
        except RuntimeError:  # the pool is shut down: the replica is going away
            stream.close()

    def response(self, stream: TokenStream, ids: list[int], text: str | None,
                 last: bool) -> dict[str, Any]:
        out: dict[str, Any] = {"model_name": self.name, "model_version": MODEL_VERSION,
                               "output_ids": ids}
        if text is not None:
            out["text_output"] = text
        if last:
            out["finish_reason"] = stream.finish_reason
        return out

    def __del__(self) -> None:
        pool = getattr(self, "pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


def generation_metadata(server: GenerativeModel) -> dict[str, Any]:
    """The protocol's model metadata of a decoder: its generate inputs and outputs, its
    cache layout and where it runs."""
    model, s = server.model, server.model.session
    text = server.tokenizer is not None
    inputs = [{"name": "input_ids", "datatype": "INT64", "shape": [-1]}]
    outputs = [{"name": "output_ids", "datatype": "INT64", "shape": [-1]}]
    if text:
        inputs.append({"name": "text_input", "datatype": "BYTES", "shape": [1]})
        outputs.append({"name": "text_output", "datatype": "BYTES", "shape": [1]})
    plan = s.placement
    return {
        "name": server.name, "versions": [MODEL_VERSION], "platform": "hetero_exec_genai",
        "inputs": inputs, "outputs": outputs,
        "generation": {"type": model.type, "layers": model.layout.layers,
                       "vocab_size": model.vocab_size, "context_length": model.context_length,
                       "eos_token_ids": list(model.eos_token_ids or ()),
                       "tokenizer": text, "routes": ["generate", "generate_stream"],
                       "cache_providers": sorted({p.name for p in model.cache_providers.values()})},
        "placement": {"providers": s.get_providers(), "heterogeneous": s.is_heterogeneous,
                      "report": plan.report() if plan is not None else None},
    }


def decoder_file(model: Any) -> str | None:
    """The decoder ``.onnx`` that ``model`` names, when it is one: a genai builder folder
    (genai_config.json), a folder of one ``.onnx``, or a file whose graph has a key/value
    cache the generator recognises (Optimum's or the dynamo exporter's names). None for
    anything else (bytes, a ModelProto, a model without a cache), which is served for
    inference only. Reads the graph without its external weights.
    """
    import os

    if not isinstance(model, (str, os.PathLike)):
        return None
    import onnx

    from hetero_exec.genai import Config
    from hetero_exec.genai.layout import discover

    try:
        config = Config(model)
        proto = onnx.load(config.model_file, load_external_data=False)
        discover(proto, os.path.basename(config.model_file), config.names())
    except Exception as e:  # unreadable or no cache: the inference path reports it
        log.debug("%s is not served as a decoder: %s", model, e)
        return None
    return config.model_file
