"""onnxruntime-genai's builder folder (tests/genai/models/llama_genai: the tiny Llama
through its model builder, fp32: GroupQueryAttention with a shared past/present
buffer, SkipSimplifiedLayerNormalization): the same tokens as onnxruntime-genai."""

from __future__ import annotations

import os

import numpy as np
import pytest

import hetero_exec.genai as hg
from tests.genai._ref import MODELS, genai_alone, token_counts

og = pytest.importorskip("onnxruntime_genai")  # a test dependency (pyproject's test extra)
FOLDER = os.path.join(MODELS, "llama_genai")


def _tokens(mod, model, rows: np.ndarray, new: int, **search) -> list[np.ndarray]:
    params = mod.GeneratorParams(model)
    params.set_search_options(max_length=rows.shape[1] + new, batch_size=rows.shape[0], **search)
    gen = mod.Generator(model, params)
    gen.append_tokens(rows)
    while not gen.is_done():
        gen.generate_next_token()
    return [np.asarray(gen.get_sequence(i)) for i in range(rows.shape[0])]


@pytest.fixture(scope="module")
def reference():
    return og.Model(FOLDER)


@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("batch", [1, 3])
def test_builder_folder_matches_onnxruntime_genai(reference, mixed, batch):
    opts = {"providers": ["sim-gpu", "cpu"], "hetero": True} if mixed else {}
    ours = hg.Model(FOLDER, **opts)
    assert {e.mode for e in ours.layout.entries} == {"shared"}
    assert ours.eos_token_ids == [2] and ours.pad_token_id == 0 and ours.vocab_size == 256
    rows = np.random.default_rng(batch).integers(3, 256, (batch, 20)).astype(np.int32)
    want = _tokens(og, reference, rows, 24)
    got = _tokens(hg, ours, rows, 24)
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("mixed", [False, True])
def test_left_padded_rows_make_what_each_makes_alone(reference, mixed):
    """Rows of different lengths, left-padded: the builder's GroupQueryAttention takes
    each row's keys from cache position 0, so the prompt runs right-aligned and each row
    makes what onnxruntime-genai makes from it alone. (onnxruntime-genai's own padded
    batch feeds the padding as it is: its padded rows make other tokens.)"""
    opts = {"providers": ["sim-gpu", "cpu"], "hetero": True} if mixed else {}
    ours = hg.Model(FOLDER, **opts)
    rng = np.random.default_rng(21)
    rows = [rng.integers(3, 256, n).tolist() for n in (12, 5, 9, 1)]
    want = genai_alone(og, reference, rows, 16)
    params = hg.GeneratorParams(ours)
    params.set_search_options(max_length=12 + 16, batch_size=len(rows))
    gen = hg.Generator(ours, params)
    gen.append_tokens(rows)
    while not gen.is_done():
        gen.generate_next_token()
    for i, (row, w) in enumerate(zip(rows, want)):
        got = [int(t) for t in gen.get_sequence(i)[len(row):]]
        assert got[:len(w)] == w and len(got) - len(w) in (0, 1), i  # (its eos: ours keeps it)


def test_shared_buffer_is_written_in_place():
    ours = hg.Model(FOLDER)
    params = hg.GeneratorParams(ours)
    params.set_search_options(max_length=40)
    gen = hg.Generator(ours, params)
    buf = gen._caches["past_key_values.0.key"]
    gen.append_tokens(np.arange(3, 13)[None])
    gen.generate_next_token()
    gen.generate_next_token()
    assert gen._caches["past_key_values.0.key"] is buf and buf.shape[2] == 40
    assert np.abs(buf[:, :, :11]).sum() > 0 and np.abs(buf[:, :, 12:]).sum() == 0


def test_config_providers():
    cfg = hg.Config(FOLDER)
    assert cfg.providers == []
    cfg.append_provider("cuda")
    cfg.set_provider_option("cuda", "device_id", "1")
    assert cfg.providers == [("gpu", {"device_id": 1})]
    cfg.clear_providers()
    cfg.append_provider("cpu")
    model = hg.Model(cfg)
    assert model.session.get_providers() == ["cpu"]
    with pytest.raises(hg.GenaiError, match="dml"):
        cfg.append_provider("dml")


def test_tokenizer_round_trip():
    pytest.importorskip("tokenizers")
    model = hg.Model(FOLDER)
    tok = hg.Tokenizer(model)
    ids = tok.encode("t5 t6 t7")
    assert list(ids) == [5, 6, 7]
    assert tok.decode(ids) == "t5 t6 t7"
    stream = tok.create_stream()
    assert "".join(stream.decode(t) for t in ids).split() == ["t5", "t6", "t7"]


def test_overlay_and_token_count_as_onnxruntime_genai(reference):
    """model-qa.py's calls: ``Config.overlay('{"search": ...}')`` before the model, and
    ``Generator.token_count()`` after the answer."""
    import json

    prompt = np.arange(3, 23, dtype=np.int32)[None]
    got, want = [], []
    for mod, out in ((og, want), (hg, got)):
        config = mod.Config(FOLDER)  # max_length from the overlay only
        config.overlay(json.dumps({"search": {"max_length": 30}}))
        out.extend(token_counts(mod, mod.Model(config), prompt))
    assert got == want and want[0] == list(range(20, 31))


def test_overlay_refuses_what_is_not_a_json_object():
    config = hg.Config(FOLDER)
    for bad, why in (("[1]", "got list"), ("{", "takes a JSON object")):
        with pytest.raises(hg.GenaiError, match=why):
            config.overlay(bad)
    config.overlay('{"model": {"decoder": {"session_options": {"provider_options": '
                   '[{"cuda": {"device_id": "1"}}]}}}}')
    assert config.providers == [("gpu", {"device_id": 1})]


@pytest.mark.parametrize("rows, max_length", [
    ([34], 40),      # the row's eos ends it: onnxruntime-genai does not count that eos
    ([34, 34], 40),  # both rows' eos on the same step
    ([34, 1], 35),   # one row ends at eos, the other runs on to max_length
    ([1], 30),       # max_length ends it
])
def test_token_count_as_onnxruntime_genai(reference, rows, max_length):
    ours = hg.Model(FOLDER)
    prompt = np.stack([np.random.default_rng(s).integers(3, 256, 12)
                       for s in rows]).astype(np.int32)
    counts = {mod: token_counts(mod, model, prompt, max_length=max_length)[0]
              for mod, model in ((og, reference), (hg, ours))}
    assert counts[hg] == counts[og]
    if max_length == 40:  # these prompts end at their eos, which is not counted
        assert counts[og][-1] == counts[og][-2] < max_length


@pytest.mark.parametrize("chunk", [1, 5])
def test_chunked_prefill_as_onnxruntime_genai(reference, chunk):
    """``chunk_size``, as onnxruntime-genai's examples pass it (set_search_options): the
    builder folder's shared buffer filled a chunk at a time gives its tokens."""
    rows = np.random.default_rng(7).integers(3, 256, (1, 21)).astype(np.int32)
    want = _tokens(og, reference, rows, 16, chunk_size=chunk)
    got = _tokens(hg, hg.Model(FOLDER, providers=["sim-gpu"]), rows, 16, chunk_size=chunk)
    np.testing.assert_array_equal(got[0], want[0])
