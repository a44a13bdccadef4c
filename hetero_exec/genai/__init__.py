"""Text generation shaped like onnxruntime-genai's Python API: ``Config``, ``Model``,
``GeneratorParams``, ``Generator``, ``Tokenizer`` and a one-call ``generate``.

>>> import hetero_exec.genai as og  # doctest: +SKIP
>>> model = og.Model("decoder.onnx", providers=["sim-gpu", "cpu"], hetero=True)  # doctest: +SKIP
>>> params = og.GeneratorParams(model); params.set_search_options(max_length=96)  # doctest: +SKIP
>>> gen = og.Generator(model, params); gen.append_tokens(prompt_ids)  # doctest: +SKIP
>>> while not gen.is_done(): gen.generate_next_token()  # doctest: +SKIP
"""

from hetero_exec.genai.config import Config
from hetero_exec.genai.errors import (
    CacheAdmissionError,
    CacheLayoutError,
    GenaiError,
    GenerationInputError,
    SearchOptionError,
)
from hetero_exec.genai.generator import Generator, GeneratorParams, generate
from hetero_exec.genai.model import Model
from hetero_exec.genai.tokenizer import Tokenizer, TokenizerStream

__all__ = ["Config", "Model", "GeneratorParams", "Generator", "Tokenizer", "TokenizerStream",
           "generate", "GenaiError", "CacheLayoutError", "CacheAdmissionError",
           "GenerationInputError", "SearchOptionError"]
