"""``Tokenizer`` over a folder's tokenizer.json, with the optional ``tokenizers``
package (``pip install "hetero_exec[genai]"``)."""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np

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
        self._tok = HFTokenizer.from_file(path)
        self._pad = model.pad_token_id

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
