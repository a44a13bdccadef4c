"""A test-only step, run by hand: export the tiny random-weight decoders the generator
tests use, and check the files in (tests/genai/models/). Nothing here runs in CI.

Needs torch, transformers (< 4.58 for optimum-onnx) and optimum-onnx in a separate
environment:

    python -m venv /tmp/exportenv && /tmp/exportenv/bin/pip install torch==2.13.0 \
        "transformers<4.58" optimum-onnx onnxscript onnx
    /tmp/exportenv/bin/python tests/genai/export_models.py

Three architectures (Llama with grouped-query attention, GPT-2, Qwen2) by two exporters
(and ``llama4``, a 4-layer Llama by Optimum alone, for splits over 3 and 4 stages):
Optimum's ``text-generation-with-past`` (``past_key_values.N.key`` in, ``present.N.key``
out) and torch's dynamo exporter over a wrapper that takes the cache as flat tensors
(``past_key_values_N_key`` in, ``present_N_key`` out: the second naming the generator
recognises). The onnxruntime-genai builder folder is made by ``export_genai_folder.py``.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "models")
VOCAB = 256


#: a deeper Llama, exported by Optimum only: enough layers for three or four stages
DEEP = {"llama4": 4}


def hf_model(arch: str):
    import torch
    import transformers as tf

    torch.manual_seed({"llama": 1, "gpt2": 2, "qwen2": 3, "llama4": 4}[arch])
    if arch in ("llama", "llama4"):
        cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=DEEP.get(arch, 2), num_attention_heads=4,
                             num_key_value_heads=2,
                             max_position_embeddings=1024, initializer_range=0.2,
                             bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
        model = tf.LlamaForCausalLM(cfg)
    elif arch == "gpt2":
        cfg = tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=1024,
                            initializer_range=0.2, bos_token_id=1, eos_token_id=2)
        model = tf.GPT2LMHeadModel(cfg)
    else:
        cfg = tf.Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=1024, initializer_range=0.2,
                             bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
        model = tf.Qwen2ForCausalLM(cfg)
    return model.eval()


def export_optimum(arch: str, hf_dir: str) -> None:
    from optimum.exporters.onnx import main_export

    with tempfile.TemporaryDirectory() as tmp:
        main_export(hf_dir, output=tmp, task="text-generation-with-past", do_validation=False)
        shutil.copy(os.path.join(tmp, "model.onnx"), os.path.join(OUT, f"{arch}_optimum.onnx"))


def export_dynamo(arch: str, model) -> None:
    import torch
    from transformers import DynamicCache

    cfg = model.config
    layers = cfg.num_hidden_layers
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    hidden = getattr(cfg, "hidden_size", None) or cfg.n_embd
    hd = hidden // heads

    class FlatCache(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids, attention_mask, position_ids, *past):
            cache = DynamicCache()
            for i in range(len(past) // 2):
                cache.update(past[2 * i], past[2 * i + 1], i)
            out = self.m(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids, past_key_values=cache, use_cache=True)
            presents = []
            for layer in out.past_key_values.layers:
                presents += [layer.keys, layer.values]
            return (out.logits, *presents)

    B, S, P = 2, 3, 5
    past = [torch.randn(B, kv, P, hd) for _ in range(2 * layers)]
    ids = torch.randint(0, VOCAB, (B, S))
    mask = torch.ones(B, P + S, dtype=torch.int64)
    pos = torch.arange(P, P + S)[None].expand(B, S)
    names_in = ["input_ids", "attention_mask", "position_ids"] + [
        f"past_key_values_{i}_{k}" for i in range(layers) for k in ("key", "value")]
    names_out = ["logits"] + [f"present_{i}_{k}" for i in range(layers) for k in ("key", "value")]
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("sequence_length")
    past_len, total = torch.export.Dim("past_sequence_length"), torch.export.Dim("total_length")
    shapes = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: total},
              "position_ids": {0: batch, 1: seq},
              "past": tuple({0: batch, 2: past_len} for _ in range(2 * layers))}
    prog = torch.onnx.export(FlatCache(model), (ids, mask, pos, *past), dynamo=True,
                             input_names=names_in, output_names=names_out,
                             dynamic_shapes=shapes, opset_version=18)
    prog.save(os.path.join(OUT, f"{arch}_dynamo.onnx"))


def main() -> None:
    os.makedirs(OUT, exist_ok=True)
    archs = sys.argv[1:] or ["llama", "gpt2", "qwen2"]
    for arch in archs:
        model = hf_model(arch)
        with tempfile.TemporaryDirectory() as hf_dir:
            model.save_pretrained(hf_dir)
            export_optimum(arch, hf_dir)
        if arch not in DEEP:
            export_dynamo(arch, model)
        print("exported", arch)


if __name__ == "__main__":
    main()
