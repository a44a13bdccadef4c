"""The generator against onnxruntime's greedy loop: three architectures by two exporters,
batch 1 and 4 (left-padded prompts of different lengths), on cpu and under mixed
placement on strict sim-gpu with a declined op in every layer."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import hetero_exec.genai as og
from tests.genai._ref import ARCHS, EXPORTERS, model_path, ort_greedy, prompts, seeded_sampling

NEW = 20
MIXED = [("sim-gpu", {"exclude_ops": ["Softmax"]}), "cpu"]


def _generate(model: og.Model, rows, new: int = NEW, **search) -> list[list[int]]:
    params = og.GeneratorParams(model)
    longest = max(len(r) for r in rows)
    params.set_search_options(batch_size=len(rows), max_length=longest + new, **search)
    gen = og.Generator(model, params)
    gen.append_tokens(rows)
    while not gen.is_done():
        gen.generate_next_token()
    return [list(gen.get_sequence(i)[len(r):]) for i, r in enumerate(rows)]


_models: dict = {}


def _model(arch: str, exporter: str, mixed: bool) -> og.Model:
    key = (arch, exporter, mixed)
    if key not in _models:
        opts = {"providers": MIXED, "hetero": True} if mixed else {}
        _models[key] = og.Model(model_path(arch, exporter), **opts)
    return _models[key]


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_onnxruntime_on_cpu(arch, exporter, batch):
    rows = prompts(batch)
    want = ort_greedy(model_path(arch, exporter), rows, NEW)
    assert _generate(_model(arch, exporter, False), rows) == want


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_onnxruntime_mixed_sim_gpu(arch, exporter, batch):
    model = _model(arch, exporter, True)
    sess = model.session
    assert sess.is_heterogeneous
    # the declined op is in every layer: each layer's attention crosses to cpu and back
    softmax_on = {seg.provider.kind for seg in sess.placement.segments
                  for n in seg.nodes if n.op_type == "Softmax"}
    assert softmax_on == {"cpu"}
    assert {p.kind for p in model.cache_providers.values()} == {"sim-gpu"}
    rows = prompts(batch, seed=1)
    assert _generate(model, rows) == ort_greedy(model_path(arch, exporter), rows, NEW)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_decode_widths_follow_the_context_not_max_length(arch):
    # max_length far above the 12 + 70 tokens: the steps run at widths 64 then 128
    # (generator.decode_width), each bound once, as programs; tokens stay onnxruntime's
    from hetero_exec.exec.program.run import Region

    model = _model(arch, "optimum", False)
    rows = prompts(2, seed=3)
    params = og.GeneratorParams(model)
    params.set_search_options(batch_size=2, max_length=600)
    gen = og.Generator(model, params)
    gen.append_tokens(rows)
    for _ in range(70):
        gen.generate_next_token()
    got = [list(gen.get_sequence(i)[len(r):]) for i, r in enumerate(rows)]
    want = ort_greedy(model_path(arch, "optimum"), rows, 70)
    assert [g[:len(w)] for g, w in zip(got, want)] == want
    assert sorted(gen._decode) == [64, 128]
    bound = [p for _, _, b in gen._runner.segments for p in b._bound.values()]
    assert any(all(isinstance(st.fn, Region) for st in p.steps) for p in bound)


#: records that read the cache where it lies (attention over it, the new positions
#: written into it): the only ones whose work may follow the context per head and dim
_CACHE_READERS = ("OP_ATTENTION", "OP_GQA", "OP_GQA_PAST", "OP_KV_APPEND")


def _decode_records(gen) -> dict[int, dict[str, tuple[str, int]]]:
    """By decode width: each program record's node name -> (op, elements it iterates)."""
    from hetero_exec.exec.program.record import codes
    from hetero_exec.exec.program.run import Region

    ops = {v: k for k, v in codes().items() if k.startswith("OP_")}
    _, plan, bound = gen._runner.segments[0]
    names = [name for name, _ in plan.input_slots]
    by_width = {}
    for sig, p in bound._bound.items():
        shapes = dict(zip(names, (s[0] if s else None for s in sig)))
        if shapes["input_ids"][1] != 1:
            continue  # a prompt
        records = {}
        for st in p.steps:
            assert isinstance(st.fn, Region), st
            prog = st.fn.program
            for r, node in zip(prog.records, prog.nodes):
                dims = r["dims"][:r["ndim"]]
                records[node.name] = (ops[int(r["op"])], int(np.prod(dims)) if len(dims) else 0)
        by_width[shapes["attention_mask"][1]] = records
    return by_width


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("arch", ARCHS)
def test_a_decode_step_does_no_per_head_work_over_the_context_outside_attention(arch, exporter):
    # the decode programs at widths 64 and 128: a record that iterates more at 128 either
    # reads the cache in place (attention records size their work by the cache they are
    # given, not by dims) or is mask-sized (batch x width); SDPA's exported scale
    # multiplied the whole key cache each step (B x H x D x width) until it folded
    model = _model(arch, exporter, False)
    params = og.GeneratorParams(model)
    params.set_search_options(batch_size=2, max_length=600)
    gen = og.Generator(model, params)
    gen.append_tokens(prompts(2, seed=3))
    for _ in range(70):
        gen.generate_next_token()
    by_width = _decode_records(gen)
    assert {64, 128} <= set(by_width)  # (the shared model may hold other widths bound)
    narrow, wide = by_width[64], by_width[128]
    assert narrow.keys() == wide.keys()
    assert {op for op, _ in wide.values()} & {"OP_ATTENTION", "OP_GQA"}  # over the cache
    grown = {name: wide[name] for name in wide if wide[name][1] > narrow[name][1]}
    assert {name: g for name, g in grown.items()
            if g[0] not in _CACHE_READERS and g[1] > 2 * 128} == {}


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_generators_of_one_model_share_its_bound_steps(arch):
    # three generators at the same shapes, stepped in turn: the second one's prompt binds
    # the prefill, the third replays it, and all share the decode steps bound by the
    # first; each keeps its own cache, so each gives onnxruntime's tokens
    model = og.Model(model_path(arch, "optimum"))
    path = model_path(arch, "optimum")
    rows = [prompts(2, seed=s) for s in (4, 5, 6)]
    gens = []
    for r in rows:
        params = og.GeneratorParams(model)
        params.set_search_options(batch_size=2, max_length=12 + NEW)
        gens.append(og.Generator(model, params))
        gens[-1].append_tokens(r)
    assert all(g._runner is model.step_runner for g in gens)
    while not all(g.is_done() for g in gens):
        for g in gens:
            if not g.is_done():
                g.generate_next_token()
    for g, r in zip(gens, rows):
        got = [list(g.get_sequence(i)[len(x):]) for i, x in enumerate(r)]
        assert got == ort_greedy(path, r, NEW)
    bound = model.step_runner.segments[0][2]._bound
    assert len(bound) >= 2  # the prompt's shapes and at least one decode width


def test_cache_stays_on_device_and_is_written_in_place():
    model = _model("llama", "optimum", True)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=40)
    gen = og.Generator(model, params)
    buffers = {k: id(v) for k, v in gen._caches.items()}
    dev = model.cache_providers["past_key_values.0.key"]
    before = dev.bytes_to_host
    gen.append_tokens(prompts(1)[0])
    for _ in range(5):
        gen.generate_next_token()
    assert {k: id(v) for k, v in gen._caches.items()} == buffers  # allocated once
    assert gen._caches["past_key_values.0.key"].shape[2] == 40  # at capacity
    cache_bytes = sum(c.nbytes for c in gen._caches.values())
    # what came back to the host: the seams at the declined Softmaxes and token ids, not
    # the cache
    moved = dev.bytes_to_host - before
    assert moved < 6 * cache_bytes
    got = np.asarray(dev.to_host(gen._caches["past_key_values.0.key"]))
    assert np.abs(got[:, :, :17]).sum() > 0 and np.abs(got[:, :, 17:]).sum() == 0


def test_seeded_sampling_reproducible():
    model = _model("gpt2", "optimum", False)
    rows = prompts(2)
    a = _generate(model, rows, do_sample=True, top_k=20, top_p=0.9, temperature=0.8,
                  random_seed=7)
    b = _generate(model, rows, do_sample=True, top_k=20, top_p=0.9, temperature=0.8,
                  random_seed=7)
    c = _generate(model, rows, do_sample=True, top_k=20, top_p=0.9, temperature=0.8,
                  random_seed=8)
    assert a == b and a != c
    assert all(0 <= t < 256 for row in a for t in row)
    # the rule, over onnxruntime's logits: the rows draw in turn from the seed's stream
    assert a == ort_greedy(model_path("gpt2", "optimum"), rows, NEW,
                           choose=seeded_sampling(7, top_k=20, top_p=0.9, temperature=0.8))
    # top_k=1 sampling is greedy
    greedy = ort_greedy(model_path("gpt2", "optimum"), rows, NEW)
    assert _generate(model, rows, do_sample=True, top_k=1, random_seed=3) == greedy


def test_top_k_keeps_sampled_tokens_among_the_k_best():
    model = _model("qwen2", "optimum", False)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=30, do_sample=True, top_k=3, random_seed=1)
    gen = og.Generator(model, params)
    gen.append_tokens(prompts(1)[0])
    for _ in range(10):
        logits = gen.get_logits()[0]
        gen.generate_next_token()
        assert gen.get_next_tokens()[0] in np.argsort(-logits)[:3]


def test_rewind_to_regenerates_the_same_tokens():
    model = _model("llama", "dynamo", False)
    row = prompts(1)[0]
    want = ort_greedy(model_path("llama", "dynamo"), [row], 12)[0]
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(row) + 12)
    gen = og.Generator(model, params)
    gen.append_tokens(row)
    for _ in range(8):
        gen.generate_next_token()
    gen.rewind_to(len(row) + 3)
    assert list(gen.get_sequence(0)) == row + want[:3]
    while not gen.is_done():
        gen.generate_next_token()
    assert list(gen.get_sequence(0)) == row + want


def test_eos_stops_a_row_and_the_others_go_on():
    model = og.Model(model_path("qwen2", "dynamo"))
    rows = prompts(3)
    free = ort_greedy(model_path("qwen2", "dynamo"), rows, NEW)
    eos = free[0][4]  # row 0 makes it at its 5th token
    model.eos_token_ids = [eos]
    want = ort_greedy(model_path("qwen2", "dynamo"), rows, NEW, eos=[eos])
    got = _generate(model, rows)
    assert got == want
    assert got[0][-1] == eos and len(got[0]) == free[0].index(eos) + 1


def test_min_length_holds_eos_back():
    model = og.Model(model_path("llama", "optimum"))
    row = prompts(1)[0]
    free = ort_greedy(model_path("llama", "optimum"), [row], NEW)[0]
    eos = free[2]
    model.eos_token_ids = [eos]
    short = _generate(model, [row])[0]
    assert short == free[:free.index(eos) + 1]
    held = _generate(model, [row], min_length=len(row) + 8)[0]
    assert len(held) >= 8 and eos not in held[:7]


def test_generate_one_call():
    model = _model("gpt2", "dynamo", False)
    rows = prompts(2)
    seqs = og.generate(model, rows, max_new_tokens=10)
    want = ort_greedy(model_path("gpt2", "dynamo"), rows, 10)
    assert [list(s[len(r):]) for s, r in zip(seqs, rows)] == want


# -- admission and bad input --------------------------------------------------------


def test_refused_generator_leaves_the_session_working():
    model = _model("llama", "optimum", True)  # sim-gpu's budget: an 80 GiB card
    params = og.GeneratorParams(model)
    params.set_search_options(batch_size=2048, max_length=1_000_000)
    with pytest.raises(og.CacheAdmissionError) as err:
        og.Generator(model, params)
    assert "sim-gpu:0" in str(err.value) and str(model.cache_bytes(2048, 1_000_000)["sim-gpu:0"]) \
        in str(err.value)
    assert model.reserved_bytes() == {}
    rows = prompts(1)
    assert _generate(model, rows, 5) == ort_greedy(model_path("llama", "optimum"), rows, 5)


def test_live_generators_count_against_the_budget():
    model = og.Model(model_path("gpt2", "optimum"),
                     providers=[("sim-gpu", {"exclude_ops": ["Softmax"]}), "cpu"], hetero=True)
    dev = next(iter(model.cache_providers.values()))
    one = model.cache_bytes(1, 64)[dev.name]
    dev.options.mem_limit = model._session_bytes(dev.name) + int(1.5 * one)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=64)
    first = og.Generator(model, params)
    with pytest.raises(og.CacheAdmissionError):
        og.Generator(model, params)
    first.close()
    assert model.reserved_bytes() == {}
    og.Generator(model, params).close()


def _bounded(path: str, device_budget: int) -> og.Model:
    """A model whose providers both have a budget: the session's own admission sizes the
    decoder (Range, computed Reshapes) from dim_bounds at build."""
    return og.Model(path, providers=[
        ("sim-gpu", {"exclude_ops": ["Softmax"], "mem_limit": device_budget}),
        ("cpu", {"mem_limit": 1 << 30})], hetero=True,
        dim_bounds={"batch": 4, "batch_size": 4, "sequence_length": 64,
                    "past_sequence_length": 64, "total_length": 128})


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("arch", ARCHS)
def test_a_provider_budget_admits_the_session_and_then_each_cache(arch, exporter):
    """Issue 23: a provider mem_limit refused every decoder at build (UnresolvedShapeError
    on a Range and on Reshapes). The session's admission counts no cache: the buffers are
    the generators', each admitted once at its capacity."""
    from hetero_exec.genai.rewrite import cache_input
    from hetero_exec.placement.sizes import shape_bounds

    model = _bounded(model_path(arch, exporter), 1 << 30)
    graph = model.session.placement.graph
    sb = shape_bounds(graph, model.session.options.dim_bounds)
    for e in model.layout.entries:
        if e.mode == "concat":
            assert sb.ceiling(cache_input(e.past))[e.axis] == 0
    rows = prompts(1, seed=2)
    assert _generate(model, rows, 5) == ort_greedy(model_path(arch, exporter), rows, 5)


def test_a_budget_given_at_build_admits_one_cache_and_refuses_the_next():
    path = model_path("llama", "optimum")
    probe = _bounded(path, 1 << 30)
    dev = next(iter(probe.cache_providers.values())).name
    budget = probe._session_bytes(dev) + int(1.5 * probe.cache_bytes(1, 64)[dev])
    model = _bounded(path, budget)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=64)
    first = og.Generator(model, params)
    with pytest.raises(og.CacheAdmissionError, match=dev):
        og.Generator(model, params)
    rows = prompts(1)
    first.append_tokens(rows[0])
    for _ in range(3):
        first.generate_next_token()
    assert list(first.get_sequence(0)[len(rows[0]):]) == ort_greedy(path, rows, 3)[0]


@pytest.fixture(scope="module")
def gen():
    model = _model("gpt2", "optimum", False)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=24, batch_size=2)
    g = og.Generator(model, params)
    return g


def test_bad_tokens_leave_the_generator_usable(gen):
    with pytest.raises(og.GenerationInputError, match="outside the vocabulary"):
        gen.append_tokens([[5, 300], [5, 6]])
    with pytest.raises(og.GenerationInputError, match="-1"):
        gen.append_tokens([[5, -1], [5, 6]])
    with pytest.raises(og.GenerationInputError, match="batch_size is 2"):
        gen.append_tokens([[5, 6, 7]])
    with pytest.raises(og.GenerationInputError, match="exceed max_length 24"):
        gen.append_tokens(np.ones((2, 30), np.int64))
    with pytest.raises(og.GenerationInputError, match="integers"):
        gen.append_tokens(np.ones((2, 3), np.float32))
    gen.append_tokens([[5, 6, 7], [8, 9]])
    while not gen.is_done():
        gen.generate_next_token()
    with pytest.raises(og.GenerationInputError, match="is_done"):
        gen.generate_next_token()
    assert len(gen.get_sequence(0)) == 24 and len(gen.get_sequence(1)) == 23


@pytest.mark.parametrize("arch", ARCHS)
def test_a_prompt_prefilled_in_chunks_gives_onnxruntimes_tokens(arch):
    """``chunk_size`` (onnxruntime-genai's prefill chunks): the prompt runs in runs of at
    most that many positions, the cache growing between them; a batch of several rows
    runs its prompt whole (onnxruntime-genai refuses chunks there)."""
    rows = prompts(1, seed=5, longest=11)
    want = ort_greedy(model_path(arch, "optimum"), rows, NEW)
    for chunk in (1, 4):
        assert _generate(_model(arch, "optimum", True), rows, chunk_size=chunk) == want
    rows = prompts(2, seed=5, longest=11)
    assert _generate(_model(arch, "optimum", False), rows, chunk_size=4) == \
        ort_greedy(model_path(arch, "optimum"), rows, NEW)


def test_bad_search_options():
    params = og.GeneratorParams(_model("gpt2", "optimum", False))
    with pytest.raises(og.SearchOptionError, match="unknown search option 'max_len'"):
        params.set_search_options(max_len=3)
    with pytest.raises(og.SearchOptionError, match="top_p"):
        params.set_search_options(top_p=1.5)
    with pytest.raises(og.SearchOptionError, match="temperature"):
        params.set_search_options(temperature=0)
    with pytest.raises(og.SearchOptionError, match="chunk_size must be >= 0"):
        params.set_search_options(chunk_size=-1)


def test_model_without_a_cache_names_what_was_looked_for(tmp_path):
    g = helper.make_graph([helper.make_node("Relu", ["input_ids"], ["logits"])], "g",
                          [helper.make_tensor_value_info("input_ids", TensorProto.FLOAT, [1, 2])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 2])])
    path = tmp_path / "plain.onnx"
    onnx.save(helper.make_model(g), str(path))
    with pytest.raises(og.CacheLayoutError, match="past_key_values.N.key"):
        og.Model(str(path))


def test_an_unknown_executor_is_refused_with_a_reason():
    # executor="ray" splits the decoder over stage actors (tests/ray/test_genai_ray.py)
    with pytest.raises(og.GenaiError, match="'local' or 'ray'"):
        og.Model(model_path("gpt2", "optimum"), executor="threads")
