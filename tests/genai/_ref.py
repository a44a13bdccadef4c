"""onnxruntime's greedy loop over the same decoder: each step's presents fed back as the
next step's pasts, left padding through the attention mask and positions (HF's rule:
cumsum(mask) - 1, padded positions 1). What the generator is checked against; with
`seeded_sampling`'s choice, its sampling too (top-k / top-p at a temperature, written
here from the rule, not from the generator's code)."""

from __future__ import annotations

import os
from typing import Callable

import numpy as np
import onnx
import onnxruntime as ort

from hetero_exec.genai.layout import discover

MODELS = os.path.join(os.path.dirname(__file__), "models")
#: onnxruntime-genai's builder folder of the tiny Llama, with a (tiny) tokenizer.json
GENAI_FOLDER = os.path.join(MODELS, "llama_genai")
ARCHS = ("llama", "gpt2", "qwen2")
EXPORTERS = ("optimum", "dynamo")
PAD = 0


def model_path(arch: str, exporter: str) -> str:
    return os.path.join(MODELS, f"{arch}_{exporter}.onnx")


def prompts(batch: int, seed: int = 0, longest: int = 12) -> list[list[int]]:
    """Prompts of different lengths (the batch's rows left-padded by the generator)."""
    rng = np.random.default_rng(seed)
    return [list(rng.integers(3, 256, longest - 3 * i)) for i in range(batch)]


def left_padded(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    width = max(len(r) for r in rows)
    ids = np.array([[PAD] * (width - len(r)) + list(r) for r in rows], np.int64)
    mask = np.array([[0] * (width - len(r)) + [1] * len(r) for r in rows], np.int64)
    return ids, mask


def ort_greedy(path: str, rows: list[list[int]], new_tokens: int,
               eos: list[int] = (), choose: Callable[[np.ndarray], np.ndarray] | None = None
               ) -> list[list[int]]:
    """The generated tokens of each row (up to and including eos); ``choose``: the ids
    from the last position's logits [batch, vocab] (argmax when None)."""
    so = ort.SessionOptions()
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    layout = discover(onnx.load(path))
    ids, mask = left_padded(rows)
    batch = ids.shape[0]
    past = {e.past: np.zeros((batch, e.kv_heads, 0, e.head_size), np.float32)
            for e in layout.entries}
    names = [layout.logits] + [e.present for e in layout.entries]
    out: list[list[int]] = [[] for _ in range(batch)]
    done = np.zeros(batch, bool)
    for _ in range(new_tokens):
        pos = np.cumsum(mask, 1) - 1
        pos = np.where(mask == 0, 1, pos)[:, -ids.shape[1]:]
        res = sess.run(names, {layout.input_ids: ids, layout.attention_mask: mask,
                               layout.position_ids: pos, **past})
        last = res[0][:, -1]
        nxt = last.argmax(-1) if choose is None else choose(last)
        nxt = np.where(done, PAD, nxt)
        for i in range(batch):
            if not done[i]:
                out[i].append(int(nxt[i]))
        done |= np.isin(nxt, list(eos))
        if done.all():
            break
        past = {e.past: r for e, r in zip(layout.entries, res[1:])}
        ids = nxt[:, None].astype(np.int64)
        mask = np.concatenate([mask, np.ones((batch, 1), np.int64)], 1)
    return out


def penalized(prompt: list[int], penalty: float) -> Callable[[np.ndarray], np.ndarray]:
    """Greedy under onnxruntime-genai's repetition penalty, for ``ort_greedy``'s
    ``choose`` on one row: each id so far (the prompt's and those chosen) has its logit
    divided by ``penalty`` when positive, multiplied by it when not."""
    seen = list(prompt)

    def choose(logits: np.ndarray) -> np.ndarray:
        row = logits[0].astype(np.float32)
        ids = np.unique(seen)
        row[ids] = np.where(row[ids] > 0, row[ids] / np.float32(penalty),
                            row[ids] * np.float32(penalty))
        seen.append(int(row.argmax()))
        return np.array([seen[-1]], np.int64)

    return choose


def seeded_sampling(seed: int, top_k: int = 50, top_p: float = 1.0,
                    temperature: float = 1.0) -> Callable[[np.ndarray], np.ndarray]:
    """The sampling rule `hetero_exec.genai.search` documents, for ``ort_greedy``'s
    ``choose``: the logits over the temperature, the top_k largest (ties: the lower id
    first), softmax, the smallest prefix whose probability reaches top_p, then one
    uniform number per row (the rows in turn) from ``numpy.random.default_rng(seed)``
    picks the first token whose cumulative probability passes it."""
    rng = np.random.default_rng(seed)

    def choose(logits: np.ndarray) -> np.ndarray:
        out = []
        for row in logits.astype(np.float32) / np.float32(temperature):
            order = np.argsort(-row, kind="stable")[:top_k or row.shape[0]]
            p = np.exp(row[order] - row[order[0]])
            p /= p.sum()
            if top_p < 1.0:
                p = np.where(np.cumsum(p) - p < top_p, p, 0.0)
                p /= p.sum()
            u = np.float32(rng.random())
            out.append(order[min(int((np.cumsum(p) < u).sum()), len(order) - 1)])
        return np.array(out, np.int64)

    return choose


def genai_alone(mod, model, rows: list[list[int]], new: int) -> list[list[int]]:
    """The new ids ``mod``'s generator (onnxruntime_genai's) makes from each row alone,
    greedy, ``new`` at most (fewer where it ends at eos, which it leaves out)."""
    out = []
    for row in rows:
        params = mod.GeneratorParams(model)
        params.set_search_options(max_length=len(row) + new)
        gen = mod.Generator(model, params)
        gen.append_tokens(np.asarray([row], np.int32))
        while not gen.is_done():
            gen.generate_next_token()
        out.append([int(t) for t in gen.get_sequence(0)[len(row):]])
        del gen
    return out


def token_counts(mod, model, rows: np.ndarray, **search) -> tuple[list[int], list[list[int]]]:
    """``token_count()`` after the prompt ``rows`` and after each token, and the
    sequences, from ``mod``'s generator (onnxruntime_genai's or ours, the same calls)."""
    params = mod.GeneratorParams(model)
    params.set_search_options(batch_size=rows.shape[0], **search)
    gen = mod.Generator(model, params)
    gen.append_tokens(rows)
    counts = [gen.token_count()]
    while not gen.is_done():
        gen.generate_next_token()
        counts.append(gen.token_count())
    return counts, [[int(t) for t in gen.get_sequence(i)] for i in range(rows.shape[0])]


def genai_text(folder: str, prompt: str, new: int) -> str:
    """onnxruntime-genai's greedy continuation of ``prompt`` as text: its tokens, the text
    through the folder's tokenizer.json read by the tokenizers package (onnxruntime-genai's
    own tokenizer does not read this tiny folder's)."""
    import pytest

    og = pytest.importorskip("onnxruntime_genai")
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    ids = tok.encode(prompt).ids
    return tok.decode(genai_alone(og, og.Model(folder), [ids], new)[0])


#: Phi-3's chat template shape: whitespace written into the strings
PHI_TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + "
                "'<|end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
                "{{ '<|assistant|>\\n' }}{% endif %}")
#: what `chat_folder`'s tokenizer is trained on: every character a test writes to it
CHAT_CORPUS = ("<|system|>\nYou are brief.<|end|>\n<|user|>\nhello world, what color is the "
               "sky?<|end|>\n<|assistant|>\nBlue.<|end|>\n")


def chat_folder(path) -> str:
    """``GENAI_FOLDER``'s model with a byte-level BPE tokenizer trained here on
    `CHAT_CORPUS` (under 256 ids: the tiny model's vocabulary; onnxruntime-genai reads it
    as a GPT-2 tokenizer, where it cannot read the folder's own) and `PHI_TEMPLATE` in
    its tokenizer_config.json."""
    import json
    import shutil

    import pytest

    tokenizers = pytest.importorskip("tokenizers")
    for name in ("genai_config.json", "model.onnx", "model.onnx.data"):
        shutil.copy(os.path.join(GENAI_FOLDER, name), os.path.join(path, name))
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=200,
                                             special_tokens=["<s>", "</s>", "<pad>"])
    tok.train_from_iterator([CHAT_CORPUS] * 10, trainer)
    assert tok.get_vocab_size() < 256
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "GPT2Tokenizer", "bos_token": "<s>", "eos_token": "</s>",
                   "pad_token": "<pad>", "chat_template": PHI_TEMPLATE}, f)
    return str(path)
