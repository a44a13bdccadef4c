"""``Tokenizer.apply_chat_template``: a model folder's chat template (Jinja) over a
conversation, as onnxruntime-genai's tokenizer applies it.

The template is the call's ``template_str``, else tokenizer_config.json's
``chat_template`` (a string, or a list of named ones: "default"), else the folder's
chat_template.jinja (where newer exports keep it). It renders in Jinja's sandbox with
``tojson``, ``raise_exception`` and ``strftime_now``, and the special tokens
(``bos_token``, ``eos_token``...) as variables, as Hugging Face's tokenizers render it,
with one difference, onnxruntime-genai's: a block tag keeps the newline after it and the
indentation before it (Hugging Face sets Jinja's ``trim_blocks`` and ``lstrip_blocks``;
onnxruntime-genai 0.18 does not). Templates that place their whitespace with ``{%-`` and
``-%}``, as most models' do, come out the same either way. Jinja2 comes with
``pip install "hetero_exec[genai]"``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from hetero_exec.genai.errors import GenaiError

log = logging.getLogger(__name__)

#: tokenizer_config.json's special tokens a template may read
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                  "mask_token")


def read_tokenizer_config(folder: str) -> dict[str, Any]:
    """The folder's tokenizer_config.json (its special tokens and chat template), or {}
    when it has none or it is not readable JSON (logged: encoding needs none of it)."""
    path = os.path.join(folder, "tokenizer_config.json")
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            loaded = json.load(f)
    except (OSError, ValueError) as e:
        log.warning("%s is not readable JSON (%s): no chat template from it", path, e)
        return {}
    return loaded if isinstance(loaded, dict) else {}


def folder_template(folder: str, tokenizer_config: dict[str, Any] | None = None) -> str | None:
    """The folder's own chat template, or None."""
    if tokenizer_config is None:
        tokenizer_config = read_tokenizer_config(folder)
    given = tokenizer_config.get("chat_template")
    if isinstance(given, list):  # [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in given if isinstance(t, dict)}
        given = named.get("default")
    if isinstance(given, str) and given:
        return given
    path = os.path.join(folder, "chat_template.jinja")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    return None


def special_tokens(tokenizer_config: dict[str, Any]) -> dict[str, str]:
    """The special tokens' text (a token may be written as ``{"content": ...}``)."""
    out = {}
    for name in SPECIAL_TOKENS:
        value = tokenizer_config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


def render(template: str, messages: Any, tools: Any, add_generation_prompt: bool,
           tokens: dict[str, str]) -> str:
    """``template`` over ``messages`` (a JSON list of {"role", "content"} maps, or the
    list) and ``tools`` (JSON text, "" for none, or the list)."""
    try:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise GenaiError("apply_chat_template needs the jinja2 package: "
                         "pip install 'hetero_exec[genai]'") from None
    messages = _json("messages", messages)
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise GenaiError("apply_chat_template: messages must be a JSON list of objects such "
                         "as {\"role\": \"user\", \"content\": \"...\"}")
    tools = _json("tools", tools) if tools not in ("", None) else None

    def raise_exception(message: str) -> None:
        raise GenaiError(f"the chat template refused the messages: {message}")

    env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, sort_keys=False: \
        json.dumps(x, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
    try:
        return env.from_string(template).render(
            messages=messages, tools=tools, add_generation_prompt=bool(add_generation_prompt),
            **tokens)
    except jinja2.TemplateError as e:
        raise GenaiError(f"the chat template does not render: {e}") from None


def _json(what: str, value: Any) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError as e:
        raise GenaiError(f"apply_chat_template: {what} is not JSON: {e}") from None
