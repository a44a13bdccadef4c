"""Continuous batching on the stage ring (actors/generation/batcher.py): requests join a
running group in the rows others freed, at its next decode step. Each request's tokens
are checked against the in-process generator running it alone (itself checked against
onnxruntime in tests/genai)."""

from __future__ import annotations

import numpy as np
import pytest
import ray

import hetero_exec.genai as og
from actors.generation.batcher import ContinuousBatcher, wait_all
from tests.genai._ref import model_path, ort_greedy, penalized, seeded_sampling
from tests.ray.helpers import eventually

pytestmark = pytest.mark.ray

DEVICES = ["sim-gpu:0", "sim-gpu:1"]
#: (prompt length, new tokens): shorter and longer than what runs when they join
SHAPES = [(6, 5), (9, 12), (4, 7), (12, 9), (1, 6), (7, 10), (5, 4)]
SAMPLING = {"do_sample": True, "top_k": 20, "top_p": 0.9, "temperature": 0.8}

_local: dict = {}


def _local_model(arch: str) -> og.Model:
    if arch not in _local:
        _local[arch] = og.Model(model_path(arch, "optimum"), providers=["sim-gpu"])
    return _local[arch]


def _requests(seed: int, shapes=SHAPES) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    return [(rng.integers(3, 256, length).tolist(), new) for length, new in shapes]


def _alone(model: og.Model, prompt: list[int], new: int, **search) -> list[int]:
    params = og.GeneratorParams(model)
    params.set_search_options(batch_size=1, max_length=len(prompt) + new, **search)
    with og.Generator(model, params) as gen:
        gen.append_tokens([prompt])
        while not gen.is_done():
            gen.generate_next_token()
        return [int(t) for t in gen.get_sequence(0)[len(prompt):]]


def _cache_free(model: og.Model) -> bool:
    return all(s["groups"] == 0 and s["reserved_bytes"] == 0 and s["cache_bytes"] == 0
               for s in model.remote.stats())


@pytest.fixture(scope="module")
def llama(ray_session):
    model = og.Model(model_path("llama", "optimum"), executor="ray", stages=2, providers=DEVICES)
    yield model
    model.close()


def test_requests_join_a_running_group_with_the_tokens_they_get_alone(llama):
    reqs = _requests(1)
    sent = llama.remote.inlet.sent
    with ContinuousBatcher(llama, slots=2, max_length=64) as batcher:
        handles = [batcher.submit(p, n) for p, n in reqs]
        got = wait_all(handles)
        stats = batcher.stats()
    # the groups' first steps and the joins went over the driver's socket to stage 0
    assert llama.remote.inlet.sent - sent >= stats["groups"] + stats["joins"]
    assert got == [_alone(_local_model("llama"), p, n) for p, n in reqs]
    assert [len(g) for g in got] == [n for _, n in reqs]
    # two rows a group, a group per stage, seven requests: the first four start the two
    # groups, the others take freed rows
    assert stats["groups"] >= 2 and stats["joins"] >= 2
    joined = [(h.joined_at, len(p)) for h, (p, _) in zip(handles, reqs) if h.joined_at]
    assert len(joined) == stats["joins"]
    assert all(at >= n for at, n in joined)  # its prompt fits left of its first token
    assert got[0] == ort_greedy(model_path("llama", "optimum"), [reqs[0][0]], reqs[0][1])[0]
    assert eventually(lambda: _cache_free(llama))


def test_gpt2_and_requests_submitted_while_others_run(ray_session):
    model = og.Model(model_path("gpt2", "optimum"), executor="ray", stages=2, providers=DEVICES)
    try:
        reqs = _requests(2, [(5, 20), (8, 6), (3, 8), (10, 5), (2, 9)])
        with ContinuousBatcher(model, slots=2, max_length=48) as batcher:
            first = [batcher.submit(p, n) for p, n in reqs[:2]]
            stream = first[0].stream(timeout=60)
            early = [next(stream) for _ in range(3)]  # the group runs; then more come
            later = [batcher.submit(p, n) for p, n in reqs[2:]]
            got = wait_all(first + later)
            assert early == got[0][:3]
            assert batcher.stats()["joins"] >= 1
        assert got == [_alone(_local_model("gpt2"), p, n) for p, n in reqs]
        assert eventually(lambda: _cache_free(model))
    finally:
        model.close()


def test_eos_frees_a_row_for_the_next_request(llama):
    local = _local_model("llama")
    # an eos that only the first request makes (at its third token or later): the
    # second runs on, so its group does, and the third request takes the freed row
    for seed in range(3, 40):
        reqs = _requests(seed, [(6, 12), (8, 12), (5, 6), (7, 6)])
        free = [_alone(local, p, n) for p, n in reqs]
        others = {t for f in free[1:] for t in f}
        eos = next((t for i, t in enumerate(free[0]) if i >= 2 and t not in free[0][:i]
                    and t not in others), None)
        if eos is not None:
            break
    saved = (llama.eos_token_ids, local.eos_token_ids)
    llama.eos_token_ids = local.eos_token_ids = [eos]
    try:  # one group: the third request can only take a freed row
        with ContinuousBatcher(llama, slots=2, max_length=64, groups_in_flight=1) as batcher:
            handles = [batcher.submit(p, n) for p, n in reqs]
            got = wait_all(handles)
        want = [_alone(local, p, n) for p, n in reqs]
    finally:
        llama.eos_token_ids, local.eos_token_ids = saved
    assert got == want
    assert got[0][-1] == eos and len(got[0]) < 12  # ended at eos, before its max_new
    assert handles[2].joined_at is not None  # took the row eos freed
    assert eventually(lambda: _cache_free(llama))


def test_the_repetition_penalty_counts_a_request_own_tokens_only(llama):
    # a row's columns before its request's first token are left padding or an earlier
    # request's: the penalty must not count them (alone, a request has neither). With
    # the pad id a token the requests pick, counting the padding would change them.
    path = model_path("llama", "optimum")
    local = _local_model("llama")
    reqs = _requests(12)
    free = [_alone(local, p, n, repetition_penalty=1.8) for p, n in reqs]
    assert free[0] == ort_greedy(path, [reqs[0][0]], reqs[0][1],
                                 choose=penalized(reqs[0][0], 1.8))[0]
    pad = next(t for f in free for t in f if t not in {p[0] for p, _ in reqs})
    saved = llama.pad_token_id
    llama.pad_token_id = pad
    try:
        with ContinuousBatcher(llama, slots=2, max_length=64, repetition_penalty=1.8) as batcher:
            got = wait_all([batcher.submit(p, n) for p, n in reqs])
            assert batcher.stats()["joins"] >= 2
    finally:
        llama.pad_token_id = saved
    assert got == free
    assert eventually(lambda: _cache_free(llama))


def test_bad_requests_get_typed_errors_and_the_batcher_goes_on(llama):
    with pytest.raises(og.GenaiError, match='executor="ray"'):
        ContinuousBatcher(_local_model("llama"))
    with pytest.raises(og.GenaiError, match="slots must be a positive int"):
        ContinuousBatcher(llama, slots=0)
    with pytest.raises(og.GenaiError, match="groups_in_flight must be a positive int"):
        ContinuousBatcher(llama, groups_in_flight=-1)
    with ContinuousBatcher(llama, slots=2, max_length=32) as batcher:
        vocab = llama.vocab_size
        with pytest.raises(og.GenerationInputError, match="outside the vocabulary"):
            batcher.submit([5, vocab], 4)
        with pytest.raises(og.GenerationInputError, match="exceeds max_length 32"):
            batcher.submit(list(range(3, 30)), 8)
        with pytest.raises(og.GenerationInputError, match="max_new_tokens must be a positive"):
            batcher.submit([5, 6], 0)
        prompt, new = _requests(4, [(5, 6)])[0]
        assert batcher.submit(prompt, new).result(60) == _alone(_local_model("llama"), prompt, new)
    assert eventually(lambda: _cache_free(llama))


def test_closing_with_requests_queued_fails_them_and_frees_the_cache(llama):
    batcher = ContinuousBatcher(llama, slots=1, max_length=64)
    handles = [batcher.submit(p, 40) for p, _ in _requests(5, [(6, 0), (6, 0), (6, 0)])]
    next(handles[0].stream(timeout=60))  # the first group runs
    batcher.close()
    for h in handles:
        assert h.done
    assert any(isinstance(h.error, og.GenaiError) for h in handles)
    with pytest.raises(og.GenaiError, match="closed"):
        batcher.submit([5, 6], 2)
    assert eventually(lambda: _cache_free(llama))


def _sampled(path: str, prompt: list[int], new: int, seed: int, eos) -> list[int]:
    """onnxruntime's loop drawing from ``seed``'s stream by the sampling rule."""
    return ort_greedy(path, [prompt], new, list(eos), choose=seeded_sampling(seed, **{
        k: v for k, v in SAMPLING.items() if k != "do_sample"}))[0]


def test_sampled_requests_draw_from_their_own_seed_whatever_shares_their_group(llama):
    path = model_path("llama", "optimum")
    reqs = _requests(8)
    seeds = [None, 3, 4, None, 6, 7, 8]  # None: the batcher's random_seed
    with ContinuousBatcher(llama, slots=2, max_length=64, random_seed=5, **SAMPLING) as batcher:
        handles = [batcher.submit(p, n, seed=s) for (p, n), s in zip(reqs, seeds)]
        got = wait_all(handles)
        stats = batcher.stats()
        with pytest.raises(og.GenerationInputError, match="seed must be"):
            batcher.submit([5, 6], 2, seed=1.5)
    eos = llama.eos_token_ids or ()
    assert got == [_sampled(path, p, n, 5 if s is None else s, eos)
                   for (p, n), s in zip(reqs, seeds)]
    assert stats["joins"] >= 2  # rows taken mid-group draw from the new request's stream
    assert len({tuple(g) for g in got}) == len(got)
    assert eventually(lambda: _cache_free(llama))


@pytest.mark.parametrize("search", [{}, SAMPLING], ids=["greedy", "sampling"])
def test_a_stage_killed_mid_batching_loses_no_request(ray_session, search):
    path = model_path("llama", "optimum")
    model = og.Model(path, executor="ray", stages=2, providers=DEVICES, max_replays=2)
    try:
        reqs = _requests(6, [(6, 30), (9, 24), (4, 30), (7, 20), (5, 26), (8, 16)])
        seeds = list(range(20, 26))
        if search:  # each row's stream goes on past what it had drawn
            want = [_sampled(path, p, n, s, model.eos_token_ids or ())
                    for (p, n), s in zip(reqs, seeds)]
        else:
            want = [_alone(_local_model("llama"), p, n) for p, n in reqs]
        with ContinuousBatcher(model, slots=2, max_length=96, **search) as batcher:
            handles = [batcher.submit(p, n, seed=s) for (p, n), s in zip(reqs, seeds)]
            stream = handles[0].stream(timeout=60)
            for _ in range(4):
                next(stream)
            before = list(model.remote.incarnations)
            ray.kill(model.remote.actors[1], no_restart=False)  # Ray restarts it
            got = wait_all(handles)
            replays = batcher.stats()["replays"]
        assert got == want
        assert model.remote.incarnations[1] != before[1]
        assert 1 <= replays <= 2  # the group running at the kill went on from a prefill
        assert eventually(lambda: _cache_free(model))
    finally:
        model.close()


def test_a_request_too_long_to_join_starts_a_group_beside_the_aged_one(llama):
    # one group in flight, 40 tokens: once B ends, C (6 + 34) cannot fit in A's group
    # (it would end past 40), so a second group starts beside it rather than after it
    reqs = _requests(7, [(6, 30), (6, 4), (6, 34)])
    with ContinuousBatcher(llama, slots=2, max_length=40, groups_in_flight=1) as batcher:
        handles = [batcher.submit(p, n) for p, n in reqs]
        got = wait_all(handles)
        stats = batcher.stats()
    assert got == [_alone(_local_model("llama"), p, n) for p, n in reqs]
    # (B may have joined A's group, had the loop started it before B was queued)
    assert stats["groups"] == 2 and handles[2].joined_at is None
    assert eventually(lambda: _cache_free(llama))


def _decode_counts(model: og.Model) -> list[tuple[int, int]]:
    """Each stage's (decode steps, rows those steps ran) so far."""
    return [(s["decodes"], s["decode_rows"]) for s in model.remote.stats()]


def _since(before: list[tuple[int, int]], model: og.Model) -> list[tuple[int, int]]:
    return [(d - d0, r - r0) for (d, r), (d0, r0) in zip(_decode_counts(model), before)]


def test_a_group_runs_only_the_rows_still_wanting_tokens(llama):
    # a group of 4 rows: a lone request runs at batch 1; two requests run at 2 rows
    # until the second's last token, then at 1; the tokens are those each gets alone
    local = _local_model("llama")
    [lone] = _requests(9, [(6, 12)])
    pair = _requests(10, [(6, 12), (5, 4)])
    # (a group runs on after its last request until the batcher closes it: at 1 row)
    with ContinuousBatcher(llama, slots=4, max_length=64, groups_in_flight=1) as batcher:
        before = _decode_counts(llama)
        assert batcher.submit(*lone).result(60) == _alone(local, *lone)
        for decodes, rows in _since(before, llama):
            assert decodes >= 11 and rows == decodes  # tokens 2..12: one row a step
        before = _decode_counts(llama)
        with batcher._cond:  # queued together: they start one group (none joins later)
            handles = [batcher.submit(p, n) for p, n in pair]
        got = wait_all(handles)
        assert batcher.stats()["groups"] == 2 and batcher.stats()["joins"] == 0
        for decodes, rows in _since(before, llama):
            assert decodes >= 11 and rows - decodes == 3  # the second's tokens 2..4: 2 rows
    assert got == [_alone(local, p, n) for p, n in pair]
    assert eventually(lambda: _cache_free(llama))


def test_a_request_joining_above_the_rows_running_widens_the_step(llama):
    # A runs alone at 1 row once B (row 1) ends; C then joins row 1, and the step that
    # takes it runs 2 rows again: its tokens are those it gets alone
    local = _local_model("llama")
    reqs = _requests(11, [(6, 40), (5, 3), (4, 6)])
    with ContinuousBatcher(llama, slots=3, max_length=64, groups_in_flight=1) as batcher:
        a, b = batcher.submit(*reqs[0]), batcher.submit(*reqs[1])
        b.result(60)
        c = batcher.submit(*reqs[2])
        got = wait_all([a, b, c])
        assert batcher.stats()["joins"] == 1 and c.joined_at is not None
    assert got == [_alone(local, p, n) for p, n in reqs]
    assert eventually(lambda: _cache_free(llama))
