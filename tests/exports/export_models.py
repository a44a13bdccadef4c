"""A test-only step, run by hand: export the tiny random-weight encoder-decoder models the
model suites run (``exports/*`` in tests/model_suites.py), and check the files in
(tests/exports/models/). Nothing here runs in CI.

Needs torch, transformers and onnxscript (the dynamo exporter's), e.g. in a separate
environment:

    python -m venv /tmp/exportenv && /tmp/exportenv/bin/pip install torch==2.13.0 \
        transformers onnxscript onnx
    /tmp/exportenv/bin/python tests/exports/export_models.py [ARCH ...]

Four architectures (BART, T5, Marian, Whisper), each by both of torch's exporters:
``<arch>_ts.onnx`` by the TorchScript exporter (``torch.onnx.export(..., dynamo=False)``,
opset 14: shape arithmetic as Shape/Gather/Unsqueeze/Concat beside the activations) and
``<arch>_dynamo.onnx`` by the dynamo exporter (opset 18). One full forward pass without a
cache: encoder inputs and ``decoder_input_ids`` in, ``logits`` out; batch and both
sequence lengths dynamic. Configs are tiny (d_model 32, two layers each side, vocabulary
128) so each file stays a few hundred KB.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "models")
VOCAB = 128
ARCHS = ("bart", "t5", "marian", "whisper")
#: Whisper's encoder takes exactly 2 * max_source_positions frames
WHISPER_MELS, WHISPER_POSITIONS = 16, 16


def hf_model(arch: str):
    import torch
    import transformers as tf

    torch.manual_seed(ARCHS.index(arch) + 1)
    small = dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
                 encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                 decoder_ffn_dim=64, max_position_embeddings=64, init_std=0.2,
                 pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
    if arch == "bart":
        model = tf.BartForConditionalGeneration(tf.BartConfig(**small))
    elif arch == "marian":
        model = tf.MarianMTModel(tf.MarianConfig(**small))
    elif arch == "t5":
        cfg = tf.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                          num_decoder_layers=2, num_heads=4, relative_attention_num_buckets=8,
                          relative_attention_max_distance=16, initializer_factor=1.0,
                          pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
        model = tf.T5ForConditionalGeneration(cfg)
        # torch's decomposition of T5's SDPA path fails with dynamic lengths ("cannot
        # view a tensor with shape [b, s, 4, 8] ... as (b, s, 32)"); eager attention exports
        model.set_attn_implementation("eager")
    else:
        small.pop("max_position_embeddings")
        cfg = tf.WhisperConfig(**small, num_mel_bins=WHISPER_MELS,
                               max_source_positions=WHISPER_POSITIONS, max_target_positions=64)
        model = tf.WhisperForConditionalGeneration(cfg)
    return model.eval()


def wrapper(arch: str, model):
    """A module whose forward takes the feeds positionally and returns the logits only."""
    import torch

    class Text(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids, attention_mask, decoder_input_ids):
            return self.m(input_ids=input_ids, attention_mask=attention_mask,
                          decoder_input_ids=decoder_input_ids, use_cache=False).logits

    class Speech(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_features, decoder_input_ids):
            # a mask made in the graph: without one, transformers checks position ids for
            # packed sequences with aten::diff, which the TorchScript exporter lacks
            mask = torch.ones_like(decoder_input_ids)
            return self.m(input_features=input_features, decoder_input_ids=decoder_input_ids,
                          decoder_attention_mask=mask, use_cache=False).logits

    # eval mode on the wrapper too: the dynamo exporter traces dropout from the top
    # module's mode (a wrapper left in training mode exports Dropout(training_mode=True))
    return (Speech(model) if arch == "whisper" else Text(model)).eval()


def sample_feeds(arch: str) -> dict:
    import torch

    dec = torch.randint(3, VOCAB, (2, 5))
    if arch == "whisper":
        return {"input_features": torch.randn(2, WHISPER_MELS, 2 * WHISPER_POSITIONS),
                "decoder_input_ids": dec}
    mask = torch.ones(2, 7, dtype=torch.int64)
    mask[1, 5:] = 0
    return {"input_ids": torch.randint(3, VOCAB, (2, 7)), "attention_mask": mask,
            "decoder_input_ids": dec}


def dynamic_axes(arch: str) -> dict:
    dec = {"decoder_input_ids": {0: "batch", 1: "decoder_sequence_length"},
           "logits": {0: "batch", 1: "decoder_sequence_length"}}
    if arch == "whisper":
        return {"input_features": {0: "batch"}, **dec}
    enc = {0: "batch", 1: "encoder_sequence_length"}
    return {"input_ids": enc, "attention_mask": enc, **dec}


def export_ts(arch: str, model) -> None:
    import torch

    feeds = sample_feeds(arch)
    torch.onnx.export(wrapper(arch, model), tuple(feeds.values()),
                      os.path.join(OUT, f"{arch}_ts.onnx"), dynamo=False, opset_version=14,
                      input_names=list(feeds), output_names=["logits"],
                      dynamic_axes=dynamic_axes(arch))


def export_dynamo(arch: str, model) -> None:
    import torch

    feeds = sample_feeds(arch)
    dims = {name: torch.export.Dim(name) for name in
            ("batch", "encoder_sequence_length", "decoder_sequence_length")}
    shapes = {name: {axis: dims[dim] for axis, dim in axes.items()}
              for name, axes in dynamic_axes(arch).items() if name in feeds}
    prog = torch.onnx.export(wrapper(arch, model), tuple(feeds.values()), dynamo=True,
                             input_names=list(feeds), output_names=["logits"],
                             dynamic_shapes=shapes, opset_version=18)
    path = os.path.join(OUT, f"{arch}_dynamo.onnx")
    prog.save(path)
    strip_metadata(path)


def strip_metadata(path: str) -> None:
    """Drop the per-node source locations and stack traces the dynamo exporter records
    (two thirds of a tiny model's file); the graph is unchanged."""
    import onnx

    model = onnx.load(path)
    for node in model.graph.node:
        del node.metadata_props[:]
        node.doc_string = ""
    onnx.save(model, path)


def main() -> None:
    os.makedirs(OUT, exist_ok=True)
    for arch in sys.argv[1:] or ARCHS:
        model = hf_model(arch)
        export_ts(arch, model)
        export_dynamo(arch, model)
        print("exported", arch)


if __name__ == "__main__":
    main()
