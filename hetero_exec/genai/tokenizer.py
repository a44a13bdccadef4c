"""``Tokenizer`` over a folder's tokenizer.json, with the optional ``tokenizers``
package (``pip install "hetero_exec[genai]"``); its chat template in chat_template.py."""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np

from hetero_exec.genai.chat_template import (
    folder_template,
    read_tokenizer_config,
    render,
    special_tokens,
)
from hetero_exec.genai.errors import GenaiError


class Tokenizer:
    def __init__(self, model: Any):
        folder = model.config.folder
        path = os.path.join(folder, "tokenizer.json")
        if not os.path.exists(path):
            raise GenaiError(f"{folder}: no tokenizer.json")
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError:
            raise GenaiError("Tokenizer needs the tokenizers package: "
                             "pip install 'hetero_exec[genai]'") from None
        try:
            self._tok = HFTokenizer.from_file(path)
        except Exception as e:  # the tokenizers package's own error, of no exported class
            raise GenaiError(f"{path} does not load: {e}") from None
        self._pad = model.pad_token_id
        self._folder = folder
        self._eos, self._bos = list(model.eos_token_ids), model.bos_token_id
        self._config = read_tokenizer_config(folder)

    @property
    def eos_token_ids(self) -> np.ndarray:
        return np.asarray(self._eos, dtype=np.int32)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    @property
    def pad_token_id(self) -> int | None:
        return self._pad

    def to_token_id(self, text: str) -> int:
        """The id of one token of the vocabulary."""
        found = self._tok.token_to_id(text)
        if found is None:
            raise GenaiError(f"{text!r} is not a token of {self._folder}'s tokenizer")
        return int(found)

    def apply_chat_template(self, messages: Any, *, template_str: str | None = None,
                            tools: Any = None, add_generation_prompt: bool = True) -> str:
        """The prompt text of a conversation (``messages``: a JSON list of
        {"role", "content"}, as onnxruntime-genai takes it) through ``template_str`` or the
        folder's chat template (`chat_template.render`)."""
        template = template_str or folder_template(self._folder, self._config)
        if template is None:
            raise GenaiError(f"{self._folder} has no chat template (tokenizer_config.json's "
                             "chat_template, or chat_template.jinja): give template_str")
        return render(template, messages, tools, add_generation_prompt,
                      special_tokens(self._config))

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text).ids, dtype=np.int32)

    def encode_batch(self, texts: Sequence[str]) -> np.ndarray:
        rows = [self._tok.encode(t).ids for t in texts]
        width = max(len(r) for r in rows)
        pad = 0 if self._pad is None else self._pad
        return np.asarray([[pad] * (width - len(r)) + r for r in rows], dtype=np.int32)

    def decode(self, tokens: Sequence[int]) -> str:
        return self._tok.decode([int(t) for t in tokens])

    def decode_batch(self, rows: Sequence[Sequence[int]]) -> list[str]:
        return [self.decode(r) for r in rows]

    def create_stream(self) -> "TokenizerStream":
        return TokenizerStream(self)


class TokenizerStream:
    """Decodes one token at a time, holding back bytes that do not yet make text."""

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self._ids: list[int] = []
        self._text = ""

    def decode(self, token: int) -> str:
        self._ids.append(int(token))
        text = self._tok.decode(self._ids)
        if text.endswith("\ufffd"):
            return ""
        new, self._text = text[len(self._text):], text
        return new
