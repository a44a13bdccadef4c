"""``Config``: a model folder's genai_config.json (onnxruntime-genai's builder writes
it), or one decoder ``.onnx`` file, with the providers to run it on."""

from __future__ import annotations

import json
import os
from typing import Any

from hetero_exec.genai.errors import GenaiError

#: onnxruntime-genai's provider names -> ours
_PROVIDERS = {"cuda": "gpu", "cpu": "cpu", "dml": None, "qnn": None, "webgpu": None,
              "openvino": None, "nvtensorrtrtx": None}


class Config:
    """>>> cfg = Config("folder"); cfg.clear_providers(); cfg.append_provider("cuda")  # doctest: +SKIP
    """

    def __init__(self, path: str | os.PathLike):
        path = os.fspath(path)
        self.path = path
        self.folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
        self.genai: dict[str, Any] = {}
        if os.path.isdir(path):
            cfg = os.path.join(path, "genai_config.json")
            if os.path.exists(cfg):
                with open(cfg) as f:
                    self.genai = json.load(f)
                name = self.decoder.get("filename", "model.onnx")
            else:
                onnx_files = sorted(p for p in os.listdir(path) if p.endswith(".onnx"))
                if len(onnx_files) != 1:
                    raise GenaiError(f"{path}: no genai_config.json and {len(onnx_files)} .onnx "
                                     "files (one decoder file expected)")
                name = onnx_files[0]
            self.model_file = os.path.join(path, name)
        elif os.path.isfile(path):
            self.model_file = path
        else:
            raise GenaiError(f"{path}: no such model folder or file")
        self.providers: list[Any] = self._configured_providers()

    @property
    def decoder(self) -> dict[str, Any]:
        return self.genai.get("model", {}).get("decoder", {})

    @property
    def search(self) -> dict[str, Any]:
        return dict(self.genai.get("search", {}))

    def _configured_providers(self) -> list[Any]:
        opts = self.decoder.get("session_options", {}).get("provider_options", [])
        out: list[Any] = []
        for entry in opts:
            for name, values in entry.items():
                out.append(_provider(name, values))
        return out

    def overlay(self, json_text: str) -> None:
        """Merge a JSON object into the configuration, as onnxruntime-genai's
        ``Config.overlay`` does (objects key by key, anything else replaced): its examples
        overlay ``{"search": {...}}`` before building the model. Provider options in it
        replace the providers, as genai_config.json's do when it is read."""
        try:
            value = json.loads(json_text)
        except (TypeError, ValueError) as e:
            raise GenaiError(f"Config.overlay takes a JSON object: {e}") from None
        if not isinstance(value, dict):
            raise GenaiError(f"Config.overlay takes a JSON object, got {type(value).__name__}")
        _merge(self.genai, value)
        given: Any = value
        for key in ("model", "decoder", "session_options"):
            given = given.get(key) if isinstance(given, dict) else None
        if isinstance(given, dict) and "provider_options" in given:
            self.providers = self._configured_providers()

    def clear_providers(self) -> None:
        self.providers = []

    def append_provider(self, name: str) -> None:
        self.providers.append(_provider(name, {}))

    def set_provider_option(self, provider: str, key: str, value: Any) -> None:
        want = _provider(provider, {})[0]
        for i, (name, opts) in enumerate(self.providers):
            if name == want:
                self.providers[i] = (name, {**opts, key: _option_value(value)})
                return
        self.providers.append((want, {key: _option_value(value)}))

    def names(self) -> dict[str, Any]:
        """genai_config.json's input/output names, flattened."""
        d = self.decoder
        sizes = {k: d[k] for k in ("head_size", "num_key_value_heads") if k in d}
        return {**d.get("inputs", {}), **d.get("outputs", {}), **sizes}

    def token_ids(self) -> tuple[list[int], int | None, int | None]:
        """(eos ids, pad id, bos id) from the config."""
        m = self.genai.get("model", {})
        eos = m.get("eos_token_id", [])
        eos = list(eos) if isinstance(eos, (list, tuple)) else [eos]
        pad = m.get("pad_token_id")
        if isinstance(pad, list):
            pad = pad[0] if pad else None
        return [int(e) for e in eos], pad, m.get("bos_token_id")


def _merge(into: dict[str, Any], value: dict[str, Any]) -> None:
    for key, v in value.items():
        if isinstance(v, dict) and isinstance(into.get(key), dict):
            _merge(into[key], v)
        else:
            into[key] = v


def _provider(name: str, values: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    low = name.lower()
    ours = _PROVIDERS.get(low, low)
    if ours is None:
        raise GenaiError(f"provider {name!r} is onnxruntime-genai's, not one of ours "
                         "(cpu, cuda/gpu, sim-gpu)")
    opts = {k: _option_value(v) for k, v in values.items() if k in ("device_id", "mem_limit",
                                                                   "exclude_ops", "strict")}
    return ours, opts


def _option_value(value: Any) -> Any:
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return value


def parse_layer_counts(text: str) -> list[int]:
    """``stage_layers`` written as text, as vLLM's ``VLLM_PP_LAYER_PARTITION`` and our
    command lines take it (``hetero-exec generate|serve --stage-layers 3,1``, ``serve run
    ... stage_layers=3,1``): the counts, commas or spaces between them; the generator on
    Ray checks them against the decoder (`actors.generation.split.layer_counts`).

    >>> parse_layer_counts("3,1"), parse_layer_counts(" 1 2, 1 ")
    ([3, 1], [1, 2, 1])
    >>> parse_layer_counts("3,x")
    Traceback (most recent call last):
    ...
    ValueError: expects layer counts such as 3,1, got '3,x'
    """
    try:
        return [int(t) for t in str(text).replace(",", " ").split()]
    except ValueError:
        raise ValueError(f"expects layer counts such as 3,1, got {text!r}") from None
