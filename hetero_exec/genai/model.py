"""``Model``: a decoder rewritten to append its cache in place, one session over it, and
where each layer's cache lives. Generators share the session; their caches are
admitted against each provider's budget here (the ledger), before their first token.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import numpy as np
import onnx

from hetero_exec.genai.config import Config
from hetero_exec.genai.errors import CacheAdmissionError, GenaiError
from hetero_exec.genai.layout import CacheLayout, discover
from hetero_exec.genai.rewrite import CAPACITY, cache_input, rewrite
from hetero_exec.genai.runner import StepRunner
from hetero_exec.placement.sizes import weight_bytes

log = logging.getLogger(__name__)

#: max_length when neither the search options nor genai_config.json give one
DEFAULT_MAX_LENGTH = 1024


class Model:
    """>>> model = Model("folder_or_decoder.onnx", providers=["sim-gpu", "cpu"], hetero=True)  # doctest: +SKIP
    """

    def __init__(self, config_or_path: Config | str | os.PathLike, **session_options: Any):
        from hetero_exec.session import InferenceSession

        self.config = config_or_path if isinstance(config_or_path, Config) else Config(config_or_path)
        executor = session_options.get("executor", "local")
        if executor not in ("local", "ray"):
            raise GenaiError(f"executor must be 'local' or 'ray' for generation, got {executor!r}")
        providers = session_options.pop("providers", None) or self.config.providers or None
        proto = onnx.load(self.config.model_file)
        label = os.path.basename(self.config.model_file)
        self.layout: CacheLayout = discover(proto, label, self.config.names())
        self.eos_token_ids, self.pad_token_id, self.bos_token_id = self._token_ids()
        m = self.config.genai.get("model", {})
        self.vocab_size = int(m.get("vocab_size") or self.layout.vocab_size or 0) or None
        self.context_length = int(m.get("context_length") or 0) or None
        self._reserved: dict[str, int] = {}
        self._lock = threading.Lock()
        #: executor="ray": the decoder split over stage actors (actors/generation); the
        #: generators of this model then run there, each stage holding its layers' cache
        self.remote: Any = None
        if executor == "ray":
            from actors.generation.pipeline import RayDecoder  # the one lazy import of Ray here

            self.session = None
            self.cache_providers = {}
            self.remote = RayDecoder(rewrite(proto, self.layout), self.layout, providers,
                                     session_options)
            return
        if session_options.get("dim_bounds") is not None:
            # the cache buffers are the generators', admitted by `reserve` at their capacity;
            # the session's own admission (a provider's mem_limit) counts none of them
            session_options["dim_bounds"] = {CAPACITY: 0, **session_options["dim_bounds"]}
        self.session = InferenceSession(rewrite(proto, self.layout).SerializeToString(),
                                        providers=providers, **session_options)
        self.cache_providers = self._cache_providers()
        self._runner: StepRunner | None = None

    @property
    def step_runner(self) -> StepRunner:
        """The one step runner of this model's generators, so the plans it binds to a
        prompt's or a decode step's shapes serve every later generator too (a new
        generator's prefill replays a bound program instead of the Python steps)."""
        with self._lock:
            if self._runner is None:
                entries = self.layout.entries
                resident = {(cache_input(e.past) if e.mode == "concat" else e.past):
                            self.cache_providers[e.past] for e in entries}
                self._runner = StepRunner(self.session._executor, resident,
                                          {e.past for e in entries if e.mode == "concat"},
                                          self.layout.logits,
                                          self.session.options.intra_op_num_threads or None)
            return self._runner

    @property
    def type(self) -> str:
        return self.config.genai.get("model", {}).get("type", "decoder")

    @property
    def providers(self) -> list[str]:
        """Where it runs: its session's providers, or its stage actors' devices."""
        if self.remote is not None:
            return list(self.remote.devices)
        return list(self.session.get_providers())

    @property
    def device_type(self) -> str:
        return self.providers[0]

    def close(self) -> None:
        """Stop the stage actors of ``executor="ray"`` (nothing to do in process)."""
        if self.remote is not None:
            self.remote.close()

    def _token_ids(self) -> tuple[list[int], int | None, int | None]:
        eos, pad, bos = self.config.token_ids()
        if not eos:
            import json

            meta = os.path.join(self.config.folder, "config.json")  # an export's HF config
            if os.path.exists(meta):
                with open(meta) as f:
                    hf = json.load(f)
                e = hf.get("eos_token_id")
                eos = [] if e is None else list(e) if isinstance(e, list) else [int(e)]
                pad = hf.get("pad_token_id", pad)
                bos = hf.get("bos_token_id", bos)
        return eos, pad, bos

    def _cache_providers(self) -> dict[str, Any]:
        """Each cache entry's provider: the one running the node that grows it."""
        producer = {}
        for seg in self.session.placement.segments:
            for node in seg.nodes:
                for o in node.outputs:
                    producer[o] = seg.provider
        out = {}
        for e in self.layout.entries:
            prov = producer.get(e.present)
            if prov is None:
                raise GenaiError(f"no segment computes the cache output {e.present!r}")
            out[e.past] = prov
        return out

    # -- admission -----------------------------------------------------------------

    def cache_bytes(self, batch: int, capacity: int) -> dict[str, int]:
        """Bytes a generator's cache takes on each provider."""
        need: dict[str, int] = {}
        for e in self.layout.entries:
            prov = self.cache_providers[e.past]
            need[prov.name] = need.get(prov.name, 0) + (
                batch * e.kv_heads * capacity * e.head_size * e.dtype.itemsize)
        return need

    def reserve(self, batch: int, capacity: int) -> dict[str, int]:
        """Admit a cache of ``batch`` x ``capacity`` or raise CacheAdmissionError; the
        caller releases what it got (`release`)."""
        need = self.cache_bytes(batch, capacity)
        by_name = {p.name: p for p in self.cache_providers.values()}
        with self._lock:
            for name, nbytes in need.items():
                budget = by_name[name].mem_limit
                if budget is None:
                    continue
                free = budget - self._session_bytes(name) - self._reserved.get(name, 0)
                if nbytes > free:
                    raise CacheAdmissionError(
                        name, nbytes, max(free, 0),
                        f"{self.layout.layers} layers x 2 x batch {batch} x capacity {capacity}")
            for name, nbytes in need.items():
                self._reserved[name] = self._reserved.get(name, 0) + nbytes
        return need

    def release(self, reserved: dict[str, int]) -> None:
        with self._lock:
            for name, nbytes in reserved.items():
                self._reserved[name] = max(self._reserved.get(name, 0) - nbytes, 0)

    def reserved_bytes(self) -> dict[str, int]:
        with self._lock:
            return {k: v for k, v in self._reserved.items() if v}

    def _session_bytes(self, provider: str) -> int:
        """What the session holds on ``provider``: its segments' admitted need, else
        their weights."""
        total = 0
        graph = self.session.placement.graph
        for seg in self.session.placement.segments:
            if seg.provider.name == provider:
                total += seg.mem_need if seg.mem_need is not None else weight_bytes(graph, seg.nodes)
        return total

    def search_defaults(self) -> dict[str, Any]:
        from hetero_exec.genai.search import SearchOptions

        known = set(SearchOptions.__dataclass_fields__)
        return {k: v for k, v in self.config.search.items() if k in known}

    def zeros(self, provider: Any, shape: tuple, dtype: np.dtype) -> Any:
        return provider.xp.zeros(shape, dtype=dtype)
