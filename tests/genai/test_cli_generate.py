"""``hetero-exec generate``: the tokens onnxruntime's greedy loop makes; with ``--prompt``,
the text of onnxruntime-genai's tokens on the same folder."""

from __future__ import annotations

import subprocess
import sys

from tests.genai._ref import GENAI_FOLDER, chat_folder, genai_text, model_path, ort_greedy


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hetero_exec.cli", "generate", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_cli_generate_matches_onnxruntime():
    ids = [5, 17, 33, 8, 91, 120]
    out = subprocess.run([sys.executable, "-m", "hetero_exec.cli", "generate",
                          model_path("llama", "optimum"), "--prompt-ids", " ".join(map(str, ids)),
                          "--max-new-tokens", "8", "--providers", "sim-gpu,cpu", "--hetero"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = [int(t) for t in out.stdout.split()]
    assert got == ort_greedy(model_path("llama", "optimum"), [ids], 8)[0]
    assert "8 tokens in" in out.stderr


def test_cli_generate_bad_token_is_an_error():
    out = subprocess.run([sys.executable, "-m", "hetero_exec.cli", "generate",
                          model_path("gpt2", "optimum"), "--prompt-ids", "5 999"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "GenerationInputError" in out.stderr and "999" in out.stderr


def test_cli_generate_text_is_onnxruntime_genai_text():
    prompt = "t5 t17 t33 t8 t91 t120"
    out = _cli(GENAI_FOLDER, "--prompt", prompt, "--max-new-tokens", "8")
    assert out.returncode == 0, out.stderr
    assert out.stdout == genai_text(GENAI_FOLDER, prompt, 8) + "\n"
    assert "8 tokens in" in out.stderr


def test_cli_generate_refuses_bad_prompts_before_building_the_model():
    out = _cli(GENAI_FOLDER, "--prompt-ids", "5 6 x")
    assert out.returncode == 2
    assert "--prompt-ids: expects token ids such as \"5 6 7\", got '5 6 x'" in out.stderr
    out = _cli(GENAI_FOLDER, "--prompt", "t5", "--prompt-ids", "5")
    assert out.returncode == 2 and "not allowed with argument" in out.stderr
    out = _cli(model_path("llama", "optimum"), "--prompt", "t5 t6")  # no tokenizer.json there
    assert out.returncode == 2 and out.stdout == ""
    assert "GenaiError: --prompt needs a tokenizer.json beside the model" in out.stderr


def test_cli_chat_is_onnxruntime_genai_chat(tmp_path):
    """``--chat --system``: the folder's chat template over a system and a user turn, the
    way onnxruntime-genai's model-qa example makes its prompt, all of it onnxruntime-genai's
    here (its tokenizer, template, greedy loop and decoding)."""
    import json

    import pytest

    og = pytest.importorskip("onnxruntime_genai")
    folder = chat_folder(tmp_path)
    model = og.Model(folder)
    tok = og.Tokenizer(model)
    turns = [{"role": "system", "content": "You are brief."},
             {"role": "user", "content": "what color is the sky?"}]
    ids = tok.encode(tok.apply_chat_template(json.dumps(turns), add_generation_prompt=True))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + 12)
    gen = og.Generator(model, params)
    gen.append_tokens(ids)
    while not gen.is_done():
        gen.generate_next_token()
    want = tok.decode(gen.get_sequence(0)[len(ids):])
    assert want.strip()  # the tiny model's answer: text, not an immediate eos
    out = _cli(folder, "--prompt", "what color is the sky?", "--chat", "--system",
               "You are brief.", "--max-new-tokens", "12")
    assert out.returncode == 0, out.stderr
    assert out.stdout == want + "\n"


def test_cli_chat_options_are_checked_before_the_model():
    for args, why in ((["--prompt", "t5", "--chat"], "--chat needs the folder's chat template"),
                      (["--prompt-ids", "5", "--chat"], "--chat makes a chat template's prompt"),
                      (["--prompt", "t5", "--system", "hi"], "--system is a turn of a chat")):
        out = _cli(GENAI_FOLDER, *args)
        assert out.returncode == 2 and out.stdout == ""
        assert why in out.stderr and "tokens in" not in out.stderr
