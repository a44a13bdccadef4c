"""onnxruntime's greedy loop over the same decoder: each step's presents fed back as the
next step's pasts, left padding through the attention mask and positions (HF's rule:
cumsum(mask) - 1, padded positions 1). What the generator is checked against."""

from __future__ import annotations

import os

import numpy as np
import onnx
import onnxruntime as ort

from hetero_exec.genai.layout import discover

MODELS = os.path.join(os.path.dirname(__file__), "models")
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
               eos: list[int] = ()) -> list[list[int]]:
    """The generated tokens of each row (up to and including eos)."""
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
        nxt = res[0][:, -1].argmax(-1)
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
