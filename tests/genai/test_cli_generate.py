"""``hetero-exec generate``: the tokens onnxruntime's greedy loop makes."""

from __future__ import annotations

import subprocess
import sys

from tests.genai._ref import model_path, ort_greedy


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
