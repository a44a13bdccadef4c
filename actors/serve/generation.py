"""The Serve deployment of a decoder: Triton's generate extension over one
`hetero_exec.genai.Model` a replica (`GenerativeModel`).

Every request gets its own Generator (`TokenStream`), admitted against the model's
cache budget before its first token; the replica's requests share the model (its
session, and its pipeline when it runs on stage actors). On stage actors
(``executor="ray"``), requests share running groups instead (`BatchedStream`:
continuous batching, `actors.generation.batcher`), a batcher for each set of search
options but the seed: a request takes a row another freed at the group's next step,
``batch_slots`` rows a group, and a sampling request draws from its own seed's stream
there, as alone; one longer than ``batch_max_length``, or a decoder the batcher cannot
take, gets its own Generator.
Steps run on the replica's pool, one step a job, so concurrent streams take turns
token by token (one thread for a model the replica runs itself, as its inference runs
are; 4 for one on stage actors). A request that ends, fails, or whose client goes away
closes its generator (or leaves its row), which returns its cache reservation. Uses
the public genai API (Model, GeneratorParams, Generator, Tokenizer), and the batcher
for stage actors.
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
#: distinct search options with a batcher of their own (more get a Generator a request)
MAX_BATCHERS = 8


def _no_batching(model: Any, slots: int) -> str:
    """Why ``model``'s greedy requests get a Generator each ("" when they share groups)."""
    if not slots:
        return "batch_slots=0"
    if getattr(model, "remote", None) is None:  # no Ray import for a replica-local model
        return "the model runs in the replica (continuous batching is the stage actors')"
    from actors.generation.batcher import unbatchable

    return unbatchable(model)


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


class BatchedStream:
    """One request in a `ContinuousBatcher`'s group: `TokenStream`'s interface. `start`
    waits for the first token, so a refusal (the group's admission) raises before any
    answer is sent."""

    def __init__(self, batcher: Any, prompt: list[int], max_tokens: int, eos: set[int],
                 seed: int = -1):
        self.batcher, self.prompt, self.max_tokens, self.eos = batcher, prompt, max_tokens, eos
        self.seed = seed
        self.made = 0
        self.finish_reason: str | None = None
        self.released = False
        self._req: Any = None
        self._tokens: Any = None
        self._first: int | None = None

    def start(self) -> None:
        if self.max_tokens == 0:
            self.finish_reason = "length"
            return
        self._req = self.batcher.submit(self.prompt, self.max_tokens, seed=self.seed)
        self._tokens = self._req.stream()
        self._first = next(self._tokens)

    def step(self) -> int:
        if self._first is not None:
            token, self._first = self._first, None
        else:
            token = next(self._tokens)
        self.made += 1
        if token in self.eos:
            self.finish_reason = "eos"
        elif self.made >= self.max_tokens:
            self.finish_reason = "length"
        return token

    def close(self) -> None:
        if self._req is not None and not self._req.done:
            self._req.cancel()  # its row goes to the next request


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

    def __init__(self, model: Any, batchers: dict[tuple, Any] | None = None):
        self.model = model
        self.batchers = batchers if batchers is not None else {}
        self.requests = self.tokens = self.active = self.refused = 0

    def stats(self, name: str) -> dict[str, Any]:
        out = {"model_stats": [{"name": name, "version": MODEL_VERSION,
                                "request_count": self.requests,
                                "generated_tokens": self.tokens}],
               "generation": {"active_streams": self.active, "refused": self.refused,
                              "reserved_bytes": reserved_bytes(self.model)}}
        if self.batchers:  # continuous batching: groups started, requests that joined one
            totals: dict[str, int] = {}
            for b in list(self.batchers.values()):
                for k, v in b.stats().items():
                    totals[k] = totals.get(k, 0) + v
            out["generation"]["batching"] = totals
        return out


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
            4 if self.model.remote is not None
            or self.model.session.options.executor == "ray" else 1)
        self.pool = concurrent.futures.ThreadPoolExecutor(runners,
                                                          thread_name_prefix="hetero-generate")
        self.batchers: dict[tuple, Any] = {}  # search options -> ContinuousBatcher
        self.counts = GenerationCounts(self.model, self.batchers)
        self.no_batching = _no_batching(self.model, spec.batch_slots)
        self.metadata = generation_metadata(self)
        log.info("serving decoder %s on %s (tokenizer: %s)", self.name,
                 ", ".join(self.model.providers), self.tokenizer is not None)

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
        batcher = self._batcher(prompt, req)
        if batcher is not None:
            stream: Any = BatchedStream(batcher, prompt, req.max_tokens,
                                        set(self.model.eos_token_ids or ()),
                                        int(req.search.get("random_seed", -1)))
            job = self.pool.submit(lambda: (stream.start(), stream)[1])
        else:
            job = self.pool.submit(opened, self.model, prompt, req.max_tokens, req.search)
        try:
            stream = await asyncio.wrap_future(job)
        except asyncio.CancelledError:  # the client went away while its stream opened
            job.add_done_callback(_close_if_opened)
            raise
        self.counts.active += 1
        return stream

    def reserved_bytes(self) -> dict[str, int]:
        return reserved_bytes(self.model)

    def _batcher(self, prompt: list[int], req: GenerateRequest) -> Any:
        """The running batcher for ``req``'s search options, or None when it gets a
        Generator of its own (see the module docstring)."""
        if self.no_batching or req.max_tokens == 0 \
                or len(prompt) + req.max_tokens > self.spec.batch_max_length:
            return None
        search = {k: v for k, v in req.search.items() if k != "random_seed"}  # a row's own
        key = tuple(sorted(search.items()))
        batcher = self.batchers.get(key)
        if batcher is None:
            if len(self.batchers) >= MAX_BATCHERS:
                return None
            from actors.generation.batcher import ContinuousBatcher

            batcher = self.batchers[key] = ContinuousBatcher(  # SearchOptionError here
                self.model, slots=self.spec.batch_slots,
                max_length=self.spec.batch_max_length, **search)
        return batcher

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
        for batcher in list(getattr(self, "batchers", {}).values()):
            batcher.close(timeout=2.0)
        pool = getattr(self, "pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        model = getattr(self, "model", None)
        if getattr(model, "remote", None) is not None:
            model.close()  # the stage actors and their placement group go with the replica


def reserved_bytes(model: Any) -> dict[str, int]:
    """Cache bytes reserved, by provider in process, by stage (named as a stage's
    CacheAdmissionError names it) on stage actors."""
    if model.remote is None:
        return model.reserved_bytes()
    return model.remote.reserved()


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
    if s is None:  # on stage actors
        placement: dict[str, Any] = {
            "providers": model.providers, "heterogeneous": False,
            "stages": [{"stage": f"stage#{p.index}", "layers": list(p.layers), "device": d}
                       for p, d in zip(model.remote.parts, model.remote.devices)]}
    else:
        placement = {"providers": s.get_providers(), "heterogeneous": s.is_heterogeneous,
                     "report": s.placement.report() if s.placement is not None else None}
    return {
        "name": server.name, "versions": [MODEL_VERSION], "platform": "hetero_exec_genai",
        "inputs": inputs, "outputs": outputs,
        "generation": {"type": model.type, "layers": model.layout.layers,
                       "vocab_size": model.vocab_size, "context_length": model.context_length,
                       "eos_token_ids": list(model.eos_token_ids or ()),
                       "tokenizer": text, "routes": ["generate", "generate_stream"],
                       "continuous_batching": server.no_batching or {
                           "slots": server.spec.batch_slots,
                           "max_length": server.spec.batch_max_length},
                       "cache_providers": sorted({p.name for p in model.cache_providers.values()}
                                                 or model.providers)},
        "placement": placement,
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
