"""``Tokenizer.apply_chat_template`` and the tokenizer's ids, against onnxruntime-genai's
on one folder (`chat_folder`: the tiny Llama builder folder with a byte-level BPE
tokenizer trained here and a chat template in its tokenizer_config.json)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

import hetero_exec.genai as hg
from tests.genai._ref import GENAI_FOLDER, chat_folder

og = pytest.importorskip("onnxruntime_genai")
tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

TEMPLATES = {
    # ChatML with Qwen's whitespace control ({%- -%}), a default system prompt
    "chatml": """{%- for message in messages %}
    {%- if loop.first and message.role != 'system' %}
        {{- '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}""",
    # block tags on lines of their own: their newlines and indentation stay
    "blocks": """{% for message in messages %}
{% if message['role'] == 'system' %}
<<SYS>>{{ message['content'] }}<</SYS>>
{% else %}
  [{{ message['role'] }}] {{ message['content'] }}
{% endif %}
{% endfor %}
{% if add_generation_prompt %}
[assistant]
{% endif %}""",
    # special tokens, set, filters, tojson (quotes and non-ASCII kept)
    "tokens": """{{ bos_token }}{% set n = messages | length %}{% for m in messages %}\
{{ loop.index }}/{{ n }} {{ m | tojson }}
{% endfor %}{{ eos_token }}""",
    "tools": """{% if tools %}TOOLS: {% for t in tools %}{{ t.name }};{% endfor %}
{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}
{% endfor %}""",
}
MESSAGES = json.dumps([{"role": "system", "content": "Be brief."},
                       {"role": "user", "content": "What color is the sky?"},
                       {"role": "assistant", "content": "Blue."},
                       {"role": "user", "content": "Why \"blue\"? é"}])
TOOLS = json.dumps([{"name": "search"}, {"name": "calc"}])


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return chat_folder(tmp_path_factory.mktemp("chat_folder"))


@pytest.fixture(scope="module")
def tokenizers_pair(folder):
    return og.Tokenizer(og.Model(folder)), hg.Tokenizer(hg.Model(folder))


@pytest.mark.parametrize("generation_prompt", [True, False])
@pytest.mark.parametrize("name", [None, *TEMPLATES])
def test_chat_template_renders_as_onnxruntime_genai(tokenizers_pair, name, generation_prompt):
    ref, ours = tokenizers_pair
    kwargs = {"add_generation_prompt": generation_prompt}
    if name is not None:  # else the folder's own (tokenizer_config.json)
        kwargs["template_str"] = TEMPLATES[name]
    if name == "tools":
        kwargs["tools"] = TOOLS
    want = ref.apply_chat_template(MESSAGES, **kwargs)
    assert ours.apply_chat_template(MESSAGES, **kwargs) == want
    if name is None:
        assert want.endswith("<|assistant|>\n") == generation_prompt


def test_token_ids_as_onnxruntime_genai(tokenizers_pair):
    ref, ours = tokenizers_pair
    assert list(ours.eos_token_ids) == list(ref.eos_token_ids)
    assert (ours.bos_token_id, ours.pad_token_id) == (ref.bos_token_id, ref.pad_token_id)
    for text in ("<s>", "hello"):
        assert ours.to_token_id(text) == ref.to_token_id(text)
    assert list(ours.encode("hello world")) == list(ref.encode("hello world"))


def test_chat_template_errors_are_genai_errors(tokenizers_pair):
    _, ours = tokenizers_pair
    with pytest.raises(hg.GenaiError, match="messages is not JSON"):
        ours.apply_chat_template("[{'role': 'user'}]")
    with pytest.raises(hg.GenaiError, match="JSON list of objects"):
        ours.apply_chat_template('{"role": "user"}')
    refuse = "{{ raise_exception('only user turns') }}"
    with pytest.raises(hg.GenaiError, match="refused the messages: only user turns"):
        ours.apply_chat_template(MESSAGES, template_str=refuse)
    with pytest.raises(hg.GenaiError, match="does not render"):
        ours.apply_chat_template(MESSAGES, template_str="{% for m in messages %}")
    with pytest.raises(hg.GenaiError, match="not a token"):
        ours.to_token_id("no such token at all")
    plain = hg.Tokenizer(hg.Model(GENAI_FOLDER))  # its tokenizer_config has no template
    with pytest.raises(hg.GenaiError, match="has no chat template"):
        plain.apply_chat_template(MESSAGES)
    assert plain.apply_chat_template(MESSAGES, template_str=TEMPLATES["chatml"]).startswith(
        "<|im_start|>system\nBe brief.<|im_end|>\n")


def test_a_broken_tokenizer_folder_is_a_genai_error(folder, tmp_path):
    for name in ("genai_config.json", "model.onnx", "model.onnx.data", "tokenizer.json"):
        shutil.copy(os.path.join(folder, name), tmp_path / name)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    model = hg.Model(str(tmp_path))
    tok = hg.Tokenizer(model)  # encodes without its config; has no template from it
    assert list(tok.encode("hello world")) == list(hg.Tokenizer(hg.Model(folder)).encode(
        "hello world"))
    with pytest.raises(hg.GenaiError, match="has no chat template"):
        tok.apply_chat_template(MESSAGES)
    (tmp_path / "tokenizer.json").write_text('{"model": 3}')
    with pytest.raises(hg.GenaiError, match="tokenizer.json does not load"):
        hg.Tokenizer(model)
