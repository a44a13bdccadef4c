"""Generation on executor="ray": the decoder split over two stage actors (sim-gpu:0 and
sim-gpu:1), each holding its layers' cache per group, the decode loop between the
actors. Tokens are checked against the in-process generator (itself checked against
onnxruntime in tests/genai), under several groups in flight, admission refusals,
cancellation and a stage actor killed mid-generation."""

from __future__ import annotations

import pytest
import ray

import hetero_exec.genai as og
from tests.genai._ref import (
    GENAI_FOLDER,
    genai_alone,
    genai_text,
    model_path,
    ort_greedy,
    prompts,
    token_counts,
)
from tests.ray.helpers import eventually

pytestmark = pytest.mark.ray

DEVICES = ["sim-gpu:0", "sim-gpu:1"]
NEW = 8


def _start(model: og.Model, rows, new: int = NEW, **search):
    params = og.GeneratorParams(model)
    params.set_search_options(batch_size=len(rows), max_length=max(map(len, rows)) + new, **search)
    gen = og.Generator(model, params)
    gen.append_tokens(rows)
    return gen


def _finish(gen, rows) -> list[list[int]]:
    while not gen.is_done():
        gen.generate_next_token()
    return [[int(t) for t in gen.get_sequence(i)[len(r):]] for i, r in enumerate(rows)]


def _generate(model: og.Model, rows, new: int = NEW, **search) -> list[list[int]]:
    with _start(model, rows, new, **search) as gen:
        return _finish(gen, rows)


def _cache_free(model: og.Model) -> bool:
    """No cache on any stage, nothing reserved in the driver's books."""
    return not model.remote.reserved() and all(
        s["groups"] == 0 and s["reserved_bytes"] == 0 and s["cache_bytes"] == 0
        for s in model.remote.stats())


_local: dict = {}


def _local_model(arch: str) -> og.Model:
    if arch not in _local:
        _local[arch] = og.Model(model_path(arch, "optimum"), providers=["sim-gpu"])
    return _local[arch]


def _side_by_side(model: og.Model, rows, new: int, made: int) -> tuple:
    """The in-process generator and ``model``'s (a Llama on the stages), each started on
    ``rows`` and ``made`` tokens on."""
    gens = (_start(_local_model("llama"), rows, new), _start(model, rows, new))
    for gen in gens:
        for _ in range(made):
            gen.generate_next_token()
    return gens


@pytest.fixture(scope="module")
def llama(ray_session):
    model = og.Model(model_path("llama", "optimum"), executor="ray", stages=2, providers=DEVICES)
    yield model
    model.close()


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
def test_tokens_equal_the_in_process_generator_on_two_stages(ray_session, arch):
    # GPT-2's stages poll for their next step after one (spin.py) whatever the node's cores;
    # Qwen2's stay where the OS puts them (no turn core: cores.TurnCore)
    spin = {"stage_spin_ms": 5} if arch == "gpt2" else {}
    placed = {"stage_cores": "os"} if arch == "qwen2" else {}
    model = og.Model(model_path(arch, "optimum"), executor="ray", stages=2, providers=DEVICES,
                     **spin, **placed)
    try:
        info = ray.get([a.info.remote() for a in model.remote.actors])
        assert [i["layers"] for i in info] == [[0], [1]]  # one layer each
        # only activations cross the cut: no cache name among what stage#1 receives
        assert not [n for n in info[1]["carried_in"] if "past" in n or "present" in n]
        assert model.remote.sockets == [True, True]  # one node: the ring's hops are sockets
        for batch in (1, 3):
            rows = prompts(batch, seed=batch)
            want = _generate(_local_model(arch), rows)
            assert _generate(model, rows) == want
        stats = model.remote.stats()
        assert all(s["sent_socket"] > 0 and s["sent_ray"] == 0 for s in stats)
        assert stats[-1]["pushed"] > 0  # the tokens came over the driver's socket (inbox.py)
        # by default a stage polls for its next step after one where its node has a core
        # to spare beyond its stages (spin.py)
        assert all(s["spin_ms"] == (5.0 if spin or len(s["cores"]) > 2 else 0.0) for s in stats)
        assert all((s["spun_s"] > 0) == (s["spin_ms"] > 0) for s in stats)
        if spin or placed:  # polling, or told to stay: never moved to a turn core
            assert [s["turn_core"] for s in stats] == [None, None]
        assert want[0] == ort_greedy(model_path(arch, "optimum"), rows, NEW)[0]
        assert eventually(lambda: _cache_free(model))
    finally:
        model.close()


def test_a_dynamo_export_and_sampling_with_a_seed(ray_session):
    model = og.Model(model_path("gpt2", "dynamo"), executor="ray", stages=2, providers=DEVICES)
    local = og.Model(model_path("gpt2", "dynamo"), providers=["sim-gpu"])
    try:
        rows = prompts(2, seed=5)
        assert _generate(model, rows) == _generate(local, rows)
        search = {"do_sample": True, "top_k": 20, "temperature": 0.8, "random_seed": 7}
        assert _generate(model, rows, **search) == _generate(local, rows, **search)
    finally:
        model.close()


def test_streaming_rewind_and_append_follow_the_in_process_generator(llama):
    rows = prompts(1, seed=11)
    local = _start(_local_model("llama"), rows, new=20)
    remote = _start(llama, rows, new=20)
    streamed = []
    for column in remote.stream():
        streamed.append(int(column[0]))
        if len(streamed) == 4:
            break
    for _ in range(4):
        local.generate_next_token()
    assert streamed == [int(t) for t in local.get_sequence(0)[len(rows[0]):]]
    for gen in (local, remote):  # rewind two tokens, append three of ours, go on
        gen.rewind_to(len(rows[0]) + 2)
        gen.append_tokens([[5, 6, 7]])
    assert _finish(remote, rows) == _finish(local, rows)
    remote.close()
    assert eventually(lambda: _cache_free(llama))


def test_an_answer_made_again_after_a_rewind_runs_from_the_stages_cache(llama):
    """A chat's "make the answer again": rewind to the prompt's end, then get_logits and
    generate. The stages keep the prompt's cache, as the in-process generator does: the
    ring runs the last prompt token again, not the prompt (before: the whole prompt, after
    a Ray call to each stage). Sampling goes on with the draws made so far, on both."""
    import numpy as np

    rows = prompts(2, seed=14)
    for search in ({}, {"do_sample": True, "top_k": 5, "random_seed": 4}):
        gens = (_start(_local_model("llama"), rows, 24, **search),
                _start(llama, rows, 24, **search))
        for gen in gens:
            for _ in range(6):
                gen.generate_next_token()
        gens[1].rewind_to(len(rows[0]))  # before the ring runs ahead to its capacity (its
        # end there frees the cache: then all the tokens run again)
        ran = [s["positions"] - s["decodes"] for s in llama.remote.stats()]
        logits, tokens = [], []
        for gen in reversed(gens):
            gen.rewind_to(len(rows[0]))
            logits.append(np.array(gen.get_logits()))
            tokens.append(_finish(gen, rows))
            gen.close()
        np.testing.assert_allclose(logits[0], logits[1], rtol=1e-5, atol=1e-5)
        assert tokens[0] == tokens[1]
        # one-position steps only since (the ring's decode steps, and the rerun)
        assert [s["positions"] - s["decodes"] - r
                for s, r in zip(llama.remote.stats(), ran)] == [0, 0]
    assert eventually(lambda: _cache_free(llama))


def test_a_rewind_halts_the_ring_by_one_frame(llama):
    import time

    rows = prompts(1, seed=12)
    local, remote = _side_by_side(llama, rows, new=300, made=3)
    sent = llama.remote.inlet.sent
    for gen in (local, remote):
        gen.rewind_to(len(rows[0]) + 1)
    assert llama.remote.inlet.sent == sent + 1  # to stage 0, which passes it on

    def stopped() -> bool:
        before = [s["steps"] for s in llama.remote.stats()]
        time.sleep(0.3)
        return before == [s["steps"] for s in llama.remote.stats()]

    # the ring stops running ahead (but for the steps on their way): it did not run on
    # to max_length, which would have ended the group and freed its cache
    assert eventually(stopped)
    assert [s["groups"] for s in llama.remote.stats()] == [1, 1]
    for gen in (local, remote):
        gen.append_tokens([[5, 6]])
    assert _finish(remote, rows) == _finish(local, rows)
    remote.close()
    assert eventually(lambda: _cache_free(llama))


def test_a_prompt_prefilled_in_chunks_follows_onnxruntime(llama):
    """``chunk_size``: the prompt goes round the ring as pieces of at most that many
    positions in one step; a one-position piece before the job's last runs at its exact
    shape (the bound decode step would see the later pieces' positions unmasked)."""
    rows = prompts(1, seed=13)
    want = ort_greedy(model_path("llama", "optimum"), rows, NEW)
    for chunk in (1, 5):
        assert _generate(llama, rows, chunk_size=chunk) == want


def test_an_append_after_generating_follows_a_fresh_prompt_on_the_builder_folder(ray_session):
    """Tokens appended after generating, on the builder folder (a shared cache buffer)
    over two stages: what follows is what onnxruntime-genai makes from the whole
    sequence as a fresh prompt. The step that runs the last sampled token, sent with the
    appended ones, once took the bound decode step, whose mask showed it the appended
    positions (and the ring's run-ahead tokens in the buffer there): 8 of 30 such runs
    went wrong, by how far the ring had run ahead."""
    import numpy as np

    genai = pytest.importorskip("onnxruntime_genai")
    reference = genai.Model(GENAI_FOLDER)
    model = og.Model(GENAI_FOLDER, executor="ray", stages=2, providers=DEVICES)
    try:
        for k in [1, 2, 3, 4, 5, 6] * 2:
            params = og.GeneratorParams(model)
            params.set_search_options(max_length=40)
            with og.Generator(model, params) as gen:
                gen.append_tokens([[5, 6, 7, 8, 9, 10, 11, 12]])
                for _ in range(k):
                    gen.generate_next_token()
                gen.append_tokens([[5, 6, 7]])
                while not gen.is_done():
                    gen.generate_next_token()
                ours = [int(t) for t in gen.get_sequence(0)]
            params = genai.GeneratorParams(reference)
            params.set_search_options(max_length=40)
            fresh = genai.Generator(reference, params)
            fresh.append_tokens(np.asarray([ours[:8 + k + 3]], np.int32))
            while not fresh.is_done():
                fresh.generate_next_token()
            want = [int(t) for t in fresh.get_sequence(0)]
            del fresh
            # onnxruntime-genai leaves out the eos that ends the sequence; ours keeps it
            assert ours[:len(want)] == want and len(ours) - len(want) in (0, 1), k
    finally:
        model.close()


def _logits_along(model: og.Model, rows, steps: list[int], new: int = 6, **search):
    """get_logits after the prompt and after each count of tokens in ``steps`` (the
    last: after is_done), then the tokens."""
    import numpy as np

    got = []
    with _start(model, rows, new, **search) as gen:
        got.append(np.array(gen.get_logits()))
        made = 0
        for k in steps:
            while made < k and not gen.is_done():
                gen.generate_next_token()
                made += 1
            got.append(np.array(gen.get_logits()))
        return got, _finish(gen, rows)


def test_get_logits_follows_the_in_process_generator(llama):
    import numpy as np

    with pytest.raises(og.GenerationInputError, match="no logits yet"):
        params = og.GeneratorParams(llama)
        params.set_search_options(batch_size=1, max_length=8)
        with og.Generator(llama, params) as gen:
            gen.get_logits()
    rows = prompts(2, seed=17)
    for search in ({}, {"do_sample": True, "top_k": 5, "random_seed": 3}):
        want, want_tokens = _logits_along(_local_model("llama"), rows, [1, 3, 6], **search)
        got, tokens = _logits_along(llama, rows, [1, 3, 6], **search)
        assert tokens == want_tokens  # asking for logits changes no token
        assert [g.shape for g in got] == [w.shape for w in want]
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    after_rewind = []  # a rewind halts the ring: the logits come from all the tokens again
    for model in (_local_model("llama"), llama):
        with _start(model, rows) as gen:
            for _ in range(3):
                gen.generate_next_token()
            gen.rewind_to(len(rows[0]) + 1)
            after_rewind.append(np.array(gen.get_logits()))
            after_rewind.append(_finish(gen, rows))
    np.testing.assert_allclose(after_rewind[2], after_rewind[0], rtol=1e-5, atol=1e-5)
    assert after_rewind[3] == after_rewind[1]
    assert eventually(lambda: _cache_free(llama))


def test_get_logits_each_token_takes_the_logits_the_ring_ran_ahead_with(llama):
    # scoring: get_logits after every token. The first call runs the last token again
    # on the ring; from then on the last stage pushes every step's logits with its
    # token, so no call runs anything again nor polls a stage by Ray
    import numpy as np

    rows = prompts(2, seed=23)
    for search in ({}, {"do_sample": True, "top_k": 5, "random_seed": 9}):
        want, want_tokens = _logits_along(_local_model("llama"), rows, list(range(1, 10)),
                                          new=10, **search)
        with _start(llama, rows, 10, **search) as gen:
            got = [np.array(gen.get_logits())]
            # up to the last token's logits, which come after the ring ended the group (at
            # its capacity: it ran ahead)
            for _ in range(9):
                gen.generate_next_token()
                got.append(np.array(gen.get_logits()))
                # asked again before the next token: the same, nothing run again
                np.testing.assert_array_equal(gen.get_logits(), got[-1])
            assert gen.logits_steps == 1 and gen.polls == 0, (gen.logits_steps, gen.polls)
            tokens = _finish(gen, rows)
        assert tokens == want_tokens
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    assert eventually(lambda: _cache_free(llama))


def test_pushed_logits_come_before_their_column_and_a_bad_frame_is_refused():
    import struct
    import uuid

    import msgpack
    import numpy as np

    from actors.generation.inbox import PUSHED_LOGITS_BYTES, TokenInbox, TokenOutlet, inbox_name

    inbox = TokenInbox.open(inbox_name("test", uuid.uuid4().hex))
    try:
        outlet = TokenOutlet.connect(inbox.address, "test")
        logits = np.arange(8, dtype=np.float32).reshape(2, 4)
        assert outlet.send_logits(2, 9, logits * 0)  # an older epoch's: dropped when 3's come
        assert outlet.send_logits(3, 9, logits)
        assert outlet.send(3, 9, np.array([[5], [6]], np.int64), False)
        # the wait for the logits keeps the column that came with them for `columns`
        np.testing.assert_array_equal(inbox.wait_logits(3, 9, 5.0), logits)
        [(epoch, at, ids, done, _)] = inbox.columns(0.0)
        assert (epoch, at, ids.tolist(), done) == (3, 9, [[5], [6]], False)
        assert inbox.take_logits(2, 9) is None
        # too big to push: a None in their place ends the wait (the driver asks the stage)
        assert outlet.send_logits(3, 10, np.zeros((1, PUSHED_LOGITS_BYTES // 4 + 1), np.float32))
        assert inbox.wait_logits(3, 10, 30.0) is None and (3, 10) not in inbox.logits
        # the group's last column first: the ring ended it and dropped that step
        assert outlet.send(3, 11, np.array([[1], [2]], np.int64), True)
        assert inbox.wait_logits(3, 12, 30.0) is None
        assert [c[1] for c in inbox.columns(0.0)] == [11]
        # ids where logits go: that connection is dropped, as any malformed frame
        body = msgpack.packb(["logits", 3, 12, ["int64", [1, 1], b"\0" * 8]], use_bin_type=True)
        outlet.sock.setblocking(True)
        outlet.sock.sendall(struct.pack("<I", len(body)) + body)
        assert inbox.wait_logits(3, 12, 30.0) is None and inbox.ended and not inbox.conns
        outlet.close()
    finally:
        inbox.close()


def test_a_group_ended_by_eos_keeps_its_cache_for_the_next_append(llama):
    """A generator whose rows all reached eos keeps its cache on the stages until it is
    closed, as the in-process generator keeps its own: get_logits then runs the eos
    alone (one position on each stage) for the in-process logits (asked again, nothing
    runs), and a chat's next
    turn, appended after it, runs its own 8 tokens only, not the conversation again, and
    makes the in-process generator's tokens."""
    import numpy as np

    local = _local_model("llama")
    rows = prompts(1, seed=41)
    made = _generate(local, rows, 24)[0]
    eos = next(t for i, t in enumerate(made) if i >= 3 and t not in made[:i])
    turn = [[t + 1 for t in rows[0][:8]]]
    saved = (llama.eos_token_ids, local.eos_token_ids)
    llama.eos_token_ids = local.eos_token_ids = [eos]
    try:
        got, logits = [], []
        for model in (local, llama):
            with _start(model, rows, 64) as gen:
                first = _finish(gen, rows)[0]
                assert first[-1] == eos
                if model is llama:
                    stats = llama.remote.stats()
                    assert all(s["groups"] == 1 and s["cache_bytes"] > 0 for s in stats)
                    ran = [s["positions"] for s in stats]
                logits.append(np.array(gen.get_logits()))
                if model is llama:  # the eos alone
                    stats = llama.remote.stats()
                    assert [s["positions"] - r for s, r in zip(stats, ran)] == [1, 1]
                    # asked again: the same logits, nothing run (it ran all the tokens)
                    np.testing.assert_array_equal(gen.get_logits(), logits[-1])
                    assert [s["positions"] for s in llama.remote.stats()] == \
                        [s["positions"] for s in stats]
                    ran = [s["positions"] - s["decodes"] for s in stats]
                gen.append_tokens(turn)
                gen.generate_next_token()
                if model is llama:  # the turn's 8 (and the one-position decode steps the
                    # ring ran ahead with)
                    assert [s["positions"] - s["decodes"] - r
                            for s, r in zip(llama.remote.stats(), ran)] == [8, 8]
                got.append(first + _finish(gen, rows)[0][len(first):])
    finally:
        llama.eos_token_ids, local.eos_token_ids = saved
    np.testing.assert_allclose(logits[1], logits[0], rtol=1e-4, atol=1e-4)
    assert got[1] == got[0]
    assert eventually(lambda: _cache_free(llama))  # closed: freed


def test_groups_in_flight_share_the_pipeline_and_free_their_caches(llama):
    groups = [prompts(b, seed=20 + i) for i, b in enumerate((1, 2, 1, 3))]
    # long enough that no group ends before the last one starts (the ring runs ahead)
    new = 200
    want = [_generate(_local_model("llama"), rows, new) for rows in groups]
    gens = [_start(llama, rows, new) for rows in groups]
    # each stage opens a group when its first step gets there
    assert eventually(lambda: [s["groups"] for s in llama.remote.stats()] == [4, 4])
    assert all(s["reserved_bytes"] > 0 for s in llama.remote.stats())
    assert sorted(llama.remote.reserved()) == ["stage#0 (sim-gpu:0)", "stage#1 (sim-gpu:1)"]
    while not all(g.is_done() for g in gens):  # round robin: the ring runs them all
        for g in gens:
            if not g.is_done():
                g.generate_next_token()
    assert [[[int(t) for t in g.get_sequence(i)[len(r):]] for i, r in enumerate(rows)]
            for g, rows in zip(gens, groups)] == want
    assert eventually(lambda: _cache_free(llama))  # finished: freed by the stages


def test_a_mask_too_big_to_send_is_made_again_on_the_next_stage(llama):
    # stage#1 reads the expanded attention mask, [batch, 1, steps, positions]: a decode
    # step's (a row) goes with the step; a long prompt's (its square) is made again
    # there from the feeds (split.py, StagePart.prelude)
    info = ray.get(llama.remote.actors[1].info.remote())
    assert info["remade"]  # the mask (and what else it can make from the feeds alone)
    rows = [prompts(1, seed=61)[0] * 43]  # 516 tokens: 516 x 516 booleans, 260 KiB, more
    # than the hidden states and rotary tables it goes with (516 x 96 floats, 194 KiB)

    def generate(model: og.Model) -> list[list[int]]:
        params = og.GeneratorParams(model)
        params.set_search_options(batch_size=1, max_length=len(rows[0]) + 8)
        with og.Generator(model, params) as gen:
            gen.append_tokens(rows)
            for _ in range(6):
                gen.generate_next_token()
            return [[int(t) for t in gen.get_sequence(i)[len(r):]] for i, r in enumerate(rows)]

    before = llama.remote.stats()[1]
    assert generate(llama) == generate(_local_model("llama"))
    after = llama.remote.stats()[1]
    # the prompt's step only: every decode step after it (the ring ran at least 5) carried it
    assert after["remade"] - before["remade"] == 1


def test_a_cancelled_or_abandoned_group_frees_its_cache(llama):
    rows = prompts(2, seed=3)
    gen = _start(llama, rows, new=400)
    gen.generate_next_token()
    assert all(s["groups"] == 1 and s["cache_bytes"] > 0 for s in llama.remote.stats())
    sent = llama.remote.inlet.sent
    gen.close()  # cancelled mid-generation
    assert eventually(lambda: _cache_free(llama))
    # a close frame to stage 0, passed on to stage 1: no Ray call to a busy stage
    assert llama.remote.inlet.sent == sent + 1
    gen = _start(llama, rows, new=400)
    gen.generate_next_token()
    del gen  # abandoned: collected, its caches go
    assert eventually(lambda: _cache_free(llama))


def test_a_group_opens_on_the_stages_with_its_first_step(llama):
    # admitted by the driver when made (its books), allocated on each stage when the
    # first step gets there: no Ray call to a stage busy with other groups' steps
    rows = prompts(1, seed=31)
    params = og.GeneratorParams(llama)
    params.set_search_options(batch_size=1, max_length=len(rows[0]) + 40)
    with og.Generator(llama, params) as gen:
        assert sum(llama.remote.reserved().values()) > 0
        assert [s["groups"] for s in llama.remote.stats()] == [0, 0]
        gen.append_tokens(rows)
        gen.generate_next_token()
        assert [s["groups"] for s in llama.remote.stats()] == [1, 1]
        assert llama.remote.inlet is not None and llama.remote.inlet.sent >= 1  # not a Ray call
    assert eventually(lambda: _cache_free(llama))
    # closed while its first step is still on its way: no stage keeps a cache for it
    for _ in range(5):
        gen = og.Generator(llama, params)
        gen.append_tokens(rows)
        gen.close()
    assert eventually(lambda: _cache_free(llama))
    # and the pipeline goes on
    assert _generate(llama, rows, new=8) == _generate(_local_model("llama"), rows, new=8)


def test_a_rewind_after_the_ring_ended_the_group_unseen_runs_all_the_tokens_again(llama):
    # the ring runs ahead of the driver: by the time the driver rewinds, the stages may
    # have ended the group and freed its cache; the rewound step is then dropped there,
    # and the driver, told so by its poll, runs all the tokens again (it used to wait)
    rows = prompts(1, seed=32)
    local = _start(_local_model("llama"), rows, new=6)
    remote = _start(llama, rows, new=6)
    remote.generate_next_token()
    assert eventually(lambda: [s["groups"] for s in llama.remote.stats()] == [0, 0])  # ended
    for gen in (local, remote):
        gen.generate_next_token()
        gen.rewind_to(len(rows[0]) + 1)
        gen.append_tokens([[9, 4]])
    assert _finish(remote, rows) == _finish(local, rows)
    remote.close()
    assert eventually(lambda: _cache_free(llama))


def test_an_append_after_the_ring_ended_the_group_unseen_is_told_by_the_token_socket(
        llama, monkeypatch):
    # an append after generating hands the ring a new epoch with no Ray call: where the
    # ring had ended the group meanwhile (run ahead to max_length, its cache freed), the
    # last column of the earlier epoch, pushed to the driver's socket, tells it so, and
    # it runs all the tokens again; no poll of the last stage is made (were the socket
    # silent, a poll after POLL_S would answer)
    import actors.generation.generator as remote_generator

    monkeypatch.setattr(remote_generator, "POLL_S", 60.0)
    rows = prompts(1, seed=33)
    local = _start(_local_model("llama"), rows, new=6)
    remote = _start(llama, rows, new=6)
    for gen in (local, remote):
        gen.generate_next_token()
    assert eventually(lambda: [s["groups"] for s in llama.remote.stats()] == [0, 0])  # ended
    for gen in (local, remote):
        gen.append_tokens([[9, 4]])
    assert _finish(remote, rows) == _finish(local, rows)
    assert remote._pushing and remote.polls == 0
    # and an append to a group the ring still runs takes its tokens from the socket too
    with _start(llama, rows, new=24) as gen:
        local = _start(_local_model("llama"), rows, new=24)
        for g in (local, gen):
            for _ in range(4):
                g.generate_next_token()
            g.append_tokens([[7, 3, 5]])
        assert _finish(gen, rows) == _finish(local, rows)
        assert gen.polls == 0
    assert eventually(lambda: _cache_free(llama))


def test_an_append_keeps_the_step_the_ring_ran_ahead(llama, monkeypatch):
    # the driver's last sampled token was run on every stage already (the ring ran
    # ahead and sampled the tokens after it): the append's step starts at the appended
    # tokens, keeping the stages' cache of it, and the tokens follow the in-process
    # generator (which runs that token again)
    rows = prompts(1, seed=35)
    local, remote = _side_by_side(llama, rows, new=300, made=3)
    before = llama.remote.stats()[-1]["steps"]
    assert eventually(lambda: llama.remote.stats()[-1]["steps"] >= before + 2)
    pieces = []
    send = llama.remote.send_step
    monkeypatch.setattr(llama.remote, "send_step",
                        lambda gid, epoch, job: (pieces.append(job.pieces), send(gid, epoch, job)))
    at = remote._length
    for gen in (local, remote):
        gen.append_tokens([[9, 4]])
        for _ in range(6):
            gen.generate_next_token()
    assert pieces == [[(at, at + 2)]]
    assert [int(t) for t in remote.get_sequence(0)] == [int(t) for t in local.get_sequence(0)]
    remote.close()
    assert eventually(lambda: _cache_free(llama))


def test_a_step_past_what_a_stage_holds_is_refused_not_run(llama):
    # a step whose first position the stage's cache of the group does not reach (the
    # driver's bookkeeping gone wrong) fails with the stage's error, rather than running
    # over a cache with a hole in it
    import numpy as np

    from actors.generation.group import Job

    rows = prompts(1, seed=36)
    with _start(llama, rows, new=300) as gen:
        gen.generate_next_token()
        at = gen._length
        gen._stop()  # the ring halted at the driver's next epoch
        job = Job(at + 4, np.array([[5]], dtype=np.int64), [(at + 4, at + 5)],
                  rewind=(at + 5, at), end=np.array([-1]))
        llama.remote.send_step(gen.gid, gen.epoch, job)
        got = ray.get(llama.remote.last.tokens.remote(gen.gid, gen.epoch, 0, 30.0))
        assert "error" in got and "holds" in str(got["error"]), got
    assert eventually(lambda: _cache_free(llama))


def test_a_next_turn_after_an_eos_opens_the_group_again_with_its_first_step(llama, monkeypatch):
    # a chat's next turn: the group ended at an eos the driver saw, and the stages freed
    # its cache; the append runs all the tokens again, the group opening on each stage
    # when that step gets there (no Ray call to each stage first), as in process
    rows = prompts(1, seed=34)
    made = _generate(_local_model("llama"), rows, new=8)[0]
    eos = next(t for k, t in enumerate(made) if k >= 2 and t not in made[:k])
    for m in (llama, _local_model("llama")):
        monkeypatch.setattr(m, "eos_token_ids", [eos])

    def no_call(*args):
        raise AssertionError("the group was opened by a Ray call to each stage")

    monkeypatch.setattr(llama.remote, "open", no_call)
    gens = [_start(m, rows, new=24) for m in (_local_model("llama"), llama)]
    for gen in gens:
        while not gen.is_done():
            gen.generate_next_token()
    assert gens[1]._finished and [int(t) for t in gens[1].get_sequence(0)][-1] == eos
    for gen in gens:
        gen.append_tokens([[9, 4]])
    local, remote = (_finish(gen, rows) for gen in gens)
    assert remote == local
    gens[1].close()
    assert eventually(lambda: _cache_free(llama))


def test_a_refused_group_names_its_stage_and_leaves_the_others_running(ray_session):
    # a budget on stage#1's device only: stage#0 admits the big group, stage#1 refuses
    # it, and what stage#0 admitted is released
    budget = ["sim-gpu:0", ("sim-gpu", {"device_id": 1, "mem_limit": 4 << 20})]
    model = og.Model(model_path("llama", "optimum"), executor="ray", stages=2, providers=budget)
    try:
        rows = prompts(1, seed=9)
        running = _start(model, rows)
        running.generate_next_token()
        params = og.GeneratorParams(model)
        params.set_search_options(batch_size=8, max_length=100_000)
        with pytest.raises(og.CacheAdmissionError, match=r"stage#1 \(sim-gpu:1\)") as refused:
            og.Generator(model, params)
        assert refused.value.needed > refused.value.free
        assert _finish(running, rows) == _generate(_local_model("llama"), rows)
        assert eventually(lambda: _cache_free(model))  # nothing left of the refused group
    finally:
        model.close()


@pytest.mark.parametrize("killed", [0, 1])  # the ring's middle; the stage the driver polls
def test_a_stage_killed_mid_generation_is_replayed_with_the_same_tokens(ray_session, killed):
    model = og.Model(model_path("llama", "optimum"), executor="ray", stages=2, providers=DEVICES,
                     max_replays=2, stage_cores="auto")
    try:
        groups = [prompts(b, seed=40 + b) for b in (1, 2, 3)]
        # long enough that the ring (running ahead of the driver) is mid-way at the kill
        want = [_generate(_local_model("llama"), rows, new=60) for rows in groups]
        gens = [_start(model, rows, new=60) for rows in groups]
        for g in gens:
            for _ in range(3):
                g.generate_next_token()
        before = list(model.remote.incarnations)
        ray.kill(model.remote.actors[killed], no_restart=False)  # Ray restarts it
        got = [_finish(g, rows) for g, rows in zip(gens, groups)]
        assert got == want
        assert model.remote.incarnations[killed] != before[killed]
        assert model.remote.incarnations[1 - killed] == before[1 - killed]
        assert model.remote.sockets == [True, True]  # the survivor's link to the new actor too
        assert all(1 <= g.replays <= 2 for g in gens)
        assert model.remote.stats()[1]["pushed"] > 0  # a new last stage pushes again
        if _runs(2) is not None:  # the restarted actor's process is on its cores again
            assert [_allowed(p) for p in _stage_pids(model)] == _runs(2)
        assert eventually(lambda: _cache_free(model))
    finally:
        model.close()


def test_a_restarted_stage_answers_a_poll_at_once_that_it_holds_nothing(ray_session):
    """A restarted stage actor, not loaded again, answers a driver's long poll with
    "missing" at once (the driver then recovers it) rather than after the poll's
    timeout, which it would wait for a group whose first step may be on its way."""
    model = og.Model(model_path("llama", "optimum"), executor="ray", stages=2, providers=DEVICES)
    try:
        last = model.remote.actors[1]
        ray.kill(last, no_restart=False)  # Ray restarts it; nothing loads it again here
        assert eventually(lambda: _ping(last) == "", timeout=60)
        # a 120 s poll: answered within 20 s, or the get times out and the test fails
        assert ray.get(last.tokens.remote("g", 1, 0, 120.0), timeout=20) == {"missing": True}
        assert ray.get(last.logits.remote("g", 1, 120.0), timeout=20) == {"missing": True}
    finally:
        model.close()


def _ping(actor) -> str | None:
    try:
        return ray.get(actor.ping.remote(), timeout=5)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError,
            ray.exceptions.ActorUnavailableError):
        return None


def test_three_node_cluster_runs_the_stages_on_two_nodes():
    """In its own process (tests/ray/genai_multinode_main.py): a Cluster needs its own Ray."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-m", "tests.ray.genai_multinode_main"], cwd=root,
                          env={**os.environ, "PYTHONPATH": root}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["nodes"] == 3
    assert report["stage_nodes"] == 2 and report["on_head"] == 0  # one stage per GPU node
    assert report["match"] is True
    assert report["batcher_match"] is True and report["batcher_joins"] >= 1
    # all "nodes" are this host, but the link is chosen by node id: Ray calls, not sockets
    assert report["sockets"] == [False, False]
    assert all(s["sent_ray"] > 0 and s["sent_socket"] == 0 and s["pushed"] == 0
               for s in report["stats"])  # the driver on the head node: tokens by polls
    assert all(s["groups"] == 0 and s["reserved_bytes"] == 0 for s in report["stats"])
    nodes = report["deep_nodes"]  # stages 0 and 2 on sim-gpu:0's node, stage 1 on the other
    assert nodes[0] == nodes[2] != nodes[1] and report["deep_match"] is True
    assert report["deep_sockets"] == [False, False, True]  # stage 2 -> stage 0: one node


def test_the_ray_call_link_gives_the_same_tokens(ray_session):
    """stage_link="ray": every hop of the ring a Ray actor call (the path across nodes,
    and the fallback when a socket is down)."""
    with pytest.raises(og.GenaiError, match="stage_link must be one of"):
        og.Model(model_path("gpt2", "optimum"), executor="ray", stages=2, providers=DEVICES,
                 stage_link="pipe")
    model = og.Model(model_path("gpt2", "optimum"), executor="ray", stages=2, providers=DEVICES,
                     stage_link="ray")
    try:
        assert model.remote.sockets == [False, False]
        rows = prompts(2, seed=6)
        assert _generate(model, rows) == _generate(_local_model("gpt2"), rows)
        assert all(s["sent_ray"] > 0 and s["sent_socket"] == 0 and s["pushed"] == 0
                   for s in model.remote.stats())  # the tokens by polls too
        # a rewind's halt goes to each stage by a Ray call here, and may pass the step of
        # an append still on its way: the steps after it start from what every stage
        # is known to hold, and the tokens are the in-process generator's
        import numpy as np

        made, logits = [], []
        for m in (_local_model("gpt2"), model):
            with _start(m, rows, new=24) as gen:
                for _ in range(3):
                    gen.generate_next_token()
                gen.rewind_to(len(rows[0]) + 1)
                gen.append_tokens([[5, 6, 7], [8, 9, 10]])
                gen.rewind_to(len(rows[0]) + 3)  # at once: the append's step on its way
                gen.append_tokens([[11], [12]])
                logits.append(np.array(gen.get_logits()))
                for _ in range(2):
                    gen.generate_next_token()
                gen.rewind_to(len(rows[0]))  # the answer made again from the prompt
                made.append(_finish(gen, rows))
        np.testing.assert_allclose(logits[1], logits[0], rtol=1e-5, atol=1e-5)
        assert made[1] == made[0]
        assert eventually(lambda: _cache_free(model))
    finally:
        model.close()


def test_a_token_socket_lost_mid_generation_leaves_the_polls(llama):
    rows = prompts(2, seed=17)
    want = _generate(_local_model("llama"), rows, new=40)
    with _start(llama, rows, new=40) as gen:
        for _ in range(3):
            gen.generate_next_token()
        assert gen._pushing
        for conn in list(gen._inbox.conns):  # the driver's end goes: the stage's next write fails
            gen._inbox._drop(conn, ended=True)
        assert _finish(gen, rows) == want
    assert eventually(lambda: _cache_free(llama))


def test_a_malformed_token_frame_drops_that_connection_only():
    import socket
    import struct
    import uuid

    import numpy as np

    from actors.generation.inbox import TokenInbox, TokenOutlet, inbox_name

    inbox = TokenInbox.open(inbox_name("test", uuid.uuid4().hex))
    try:
        for frame in (struct.pack("<I", 3) + b"\x93\x01\x02",  # a list of 3, not 5
                      struct.pack("<I", 18) + b"not msgpack at all",
                      struct.pack("<I", 1 << 31)):  # over the limit
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(inbox.address)
                s.sendall(frame)
                assert inbox.columns(1.0) == [] and inbox.ended and not inbox.conns
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(inbox.address)
            s.sendall(struct.pack("<I", 12) + b"\x92\xa6failed\xa3two")  # ["failed", "two"]
            assert inbox.columns(1.0) == [] and inbox.ended and not inbox.failed
        outlet = TokenOutlet.connect(inbox.address, "test")
        assert outlet.send(3, 7, np.array([[5], [6]], dtype=np.int64), True, [(7, "k", 1, True)])
        [(epoch, at, ids, done, acks)] = inbox.columns(5.0)
        assert (epoch, at, ids.tolist(), done) == (3, 7, [[5], [6]], True)
        assert acks == [(7, "k", 1, True)]
        # a failure notice ends a wait with no column, and names its epoch
        assert outlet.send_failed(4)
        assert inbox.columns(30.0) == [] and inbox.failed == {4} and not inbox.ended
        outlet.close()
    finally:
        inbox.close()


def _policy(tid: int) -> int:
    """A thread's scheduling policy, as the kernel reports it (/proc stat field 41)."""
    import os

    with open(f"/proc/{os.getpid()}/task/{tid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[38])


@pytest.mark.skipif(not hasattr(__import__("os"), "SCHED_BATCH"), reason="Linux's policies")
def test_a_driver_waiting_for_tokens_does_not_preempt_the_stages():
    """yield_to_stages: while it blocks for a token frame the reading thread is
    SCHED_BATCH (woken, it waits for a free core instead of preempting a stage), and it
    stays so between its waits until every yielding inbox that waited on it has let go
    (its group done, or closed); a thread with a policy of its own keeps it, and an
    inbox that does not yield (the default) leaves the policy alone."""
    import os
    import threading
    import uuid

    import numpy as np

    from actors.generation.inbox import TokenInbox, TokenOutlet, inbox_name

    for own, yielding in ((None, True), (os.SCHED_IDLE, True), (None, False)):
        inboxes = [TokenInbox.open(inbox_name("test", uuid.uuid4().hex), yielding=yielding)
                   for _ in range(2)]
        outlets = [TokenOutlet.connect(i.address, "test") for i in inboxes]
        seen: dict[str, object] = {}
        go = [threading.Event() for _ in range(3)]

        def reader() -> None:
            if own is not None:
                os.sched_setscheduler(0, own, os.sched_param(0))
            tid = threading.get_native_id()
            seen["tid"] = tid
            seen["got"] = [inboxes[0].columns(10.0)]
            seen["between"] = _policy(tid)
            go[0].wait(10)
            seen["got"].append(inboxes[1].columns(10.0))
            go[1].wait(10)
            seen["one released"] = _policy(tid)
            go[2].wait(10)
            seen["both released"] = _policy(tid)

        t = threading.Thread(target=reader)
        try:
            t.start()
            assert eventually(lambda: "tid" in seen)
            held = own if own is not None else os.SCHED_BATCH if yielding else os.SCHED_OTHER
            eventually(lambda: _policy(seen["tid"]) == held, 2.0)  # in its blocking select
            waiting = _policy(seen["tid"])
            assert outlets[0].send(1, 0, np.array([[4]], dtype=np.int64), False)
            assert eventually(lambda: "between" in seen)
            assert outlets[1].send(1, 0, np.array([[5]], dtype=np.int64), True)
            go[0].set()
            assert eventually(lambda: len(seen["got"]) == 2)
            inboxes[0].release()  # its group done
            go[1].set()
            assert eventually(lambda: "one released" in seen)
            inboxes[1].close()
            go[2].set()
            t.join(10)
            assert [[(e, a, i.tolist()) for e, a, i, _, _ in g] for g in seen["got"]] == \
                [[(1, 0, [[4]])], [(1, 0, [[5]])]]
            assert (waiting, seen["between"], seen["one released"]) == (held, held, held)
            assert seen["both released"] == (own if own is not None else os.SCHED_OTHER)
        finally:
            for e in go:
                e.set()
            t.join(10)
            for o in outlets:
                o.close()
            for i in inboxes:
                i.close()


def test_a_malformed_frame_on_a_stage_socket_drops_that_connection_only(llama):
    import socket
    import struct

    _, address = ray.get(llama.remote.actors[1].address.remote())
    assert address.startswith("\0")  # abstract namespace: no file left behind
    frames = [struct.pack("<I", 3) + b"\x93\x01\x02",  # a list of 3, not a step's 12
              struct.pack("<I", 18) + b"not msgpack at all",
              struct.pack("<I", 1 << 31)]  # a length over the limit
    for frame in frames:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(address)
            s.sendall(frame)
            assert s.recv(1) == b""  # the stage closed it
    rows = prompts(1, seed=13)
    assert _generate(llama, rows) == _generate(_local_model("llama"), rows)


def _allowed(pid: int, tid: int | None = None) -> list[int]:
    """The cores the OS lets ``pid`` (or its thread ``tid``) run on (Cpus_allowed_list)."""
    with open(f"/proc/{pid}/task/{tid}/status" if tid else f"/proc/{pid}/status") as f:
        line = next(ln for ln in f if ln.startswith("Cpus_allowed_list:"))
    out: list[int] = []
    for part in line.split(":", 1)[1].strip().split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def _stage_pids(model: og.Model) -> list[int]:
    return [i["pid"] for i in ray.get([a.info.remote() for a in model.remote.actors])]


def _runs(n: int) -> list[list[int]] | None:
    """What stage_cores="auto" gives n stages on this host: even runs of its cores."""
    import os

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < n:
        return None
    width = len(cores) // n
    return [cores[i * width:(i + 1) * width] for i in range(n)]


def test_stage_cores_pin_each_stage_process_to_its_own_cores(ray_session):
    """stage_cores="auto": the stages on one node get even runs of its cores (read back
    from the OS); a list names each stage's; tokens are those of the in-process
    generator either way."""
    import os

    rows = prompts(2, seed=71)
    want = _generate(_local_model("llama"), rows)
    model = og.Model(model_path("llama", "optimum"), executor="ray", stages=2, providers=DEVICES,
                     stage_cores="auto", yield_to_stages=True)
    try:
        with _start(model, rows) as gen:
            assert gen._inbox.yielding  # the option reaches the generator's token socket
        runs = _runs(2)
        pids = _stage_pids(model)
        if runs is None:  # a one-core host: nothing to cut
            assert model.remote.cores == [[], []]
        else:
            assert [_allowed(p) for p in pids] == runs == model.remote.cores
            assert [s["cores"] for s in model.remote.stats()] == runs
            assert model.remote.threads == [len(r) for r in runs]  # its own cores, all
        assert _generate(model, rows) == want
    finally:
        model.close()
    last = sorted(os.sched_getaffinity(0))[-1]
    model = og.Model(model_path("llama", "optimum"), executor="ray", stages=2, providers=DEVICES,
                     stage_cores=[[last], [0]])
    try:
        assert [_allowed(p) for p in _stage_pids(model)] == [[last], [0]]
        assert model.remote.threads == [1, 1]
        assert _generate(model, rows) == want
    finally:
        model.close()


def test_the_stages_on_a_node_share_its_cores_for_their_threads(ray_session):
    """Unless ``intra_op_num_threads`` names a count, the stages on one node divide its
    cores among their runs (at least one thread each); a count given is every stage's.
    On a node with no core beyond its stages, a stage running one group alone steps on
    the node's last core, as the other does, and on all of them while two groups are in
    flight (`cores.TurnCore`); its process's other threads stay where they were."""
    import os

    cores = sorted(os.sched_getaffinity(0))
    n = len(cores)
    model = og.Model(model_path("gpt2", "optimum"), executor="ray", stages=2, providers=DEVICES)
    try:
        assert model.remote.threads == [max(1, n // 2)] * 2
        assert [s["threads"] for s in model.remote.stats()] == model.remote.threads
        rows = prompts(1, seed=76)
        assert _generate(model, rows) == _generate(_local_model("gpt2"), rows)
        stats, pids = model.remote.stats(), _stage_pids(model)
        if n != 2:  # one core: nowhere to move; more: each stage polls instead (spin.py)
            assert [s["turn_core"] for s in stats] == [None, None]
            return
        assert [s["turn_core"] for s in stats] == [cores[-1]] * 2
        assert [_allowed(p, s["turn_thread"]) for p, s in zip(pids, stats)] == [[cores[-1]]] * 2
        assert [_allowed(p) for p in pids] == [cores] * 2
        moved = [s["turn_moves"] for s in stats]
        assert min(moved) >= 1
        groups = [prompts(1, seed=77), prompts(2, seed=78)]
        gens = [_start(model, r, new=200) for r in groups]  # both in flight: a step apart
        try:
            assert eventually(lambda: all(
                _allowed(p, s["turn_thread"]) == cores
                for p, s in zip(pids, model.remote.stats())), timeout=5)
            want = [_generate(_local_model("gpt2"), r, 200) for r in groups]
            assert [_finish(g, r) for g, r in zip(gens, groups)] == want
        finally:
            for g in gens:
                g.close()
        # alone again: back on the turn core
        assert _generate(model, rows) == _generate(_local_model("gpt2"), rows)
        stats = model.remote.stats()
        assert [_allowed(p, s["turn_thread"]) for p, s in zip(pids, stats)] == [[cores[-1]]] * 2
        assert all(s["turn_moves"] > m for s, m in zip(stats, moved))
    finally:
        model.close()
    model = og.Model(model_path("gpt2", "optimum"), executor="ray", stages=2, providers=DEVICES,
                     intra_op_num_threads=3)
    try:
        assert model.remote.threads == [3, 3]
        rows = prompts(1, seed=75)
        assert _generate(model, rows) == _generate(_local_model("gpt2"), rows)
        # three threads a run: not moved (they would share one core)
        assert [s["turn_core"] for s in model.remote.stats()] == [None, None]
    finally:
        model.close()


_PIN_ONE = """
import os
from actors.generation.cores import pin_process
from hetero_exec.kernels._cores import cores
before = cores()
pin_process([sorted(os.sched_getaffinity(0))[0]])
print(before, cores())
"""


def test_a_pinned_stage_process_splits_its_runs_over_its_own_cores_only():
    """`cores.pin_process` makes the splits count the cores left (they keep the mask
    read before otherwise). In a child process: the tests' own keeps its cores."""
    import os
    import subprocess
    import sys

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: nothing fewer to pin to")
    env = {k: v for k, v in os.environ.items() if k != "HETERO_EXEC_INTRA_OP_THREADS"}
    out = subprocess.run([sys.executable, "-c", _PIN_ONE], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    before, after = map(int, out.stdout.split())
    assert before == len(os.sched_getaffinity(0)) and after == 1


def _generation_actors() -> int:
    """GenerationStage actors not DEAD, from the GCS (as tests/ray/helpers.py reads it)."""
    from ray._private import state

    return sum(1 for a in state.actors().values()
               if a["ActorClassName"].endswith("GenerationStage") and a["State"] != "DEAD")


@pytest.mark.parametrize("option, error", [
    ({"stage_cores": [[0]]}, "names 1 core list"),
    ({"stage_cores": "all"}, "must be None, 'auto', 'os' or a list"),
    ({"stage_cores": [[0], []]}, r"stage_cores\[1\] must be a non-empty list"),
    ({"stage_cores": [[0], [4096]]}, r"stage#1 cannot run on cores \[4096\]"),
    ({"yield_to_stages": "yes"}, "yield_to_stages must be True or False"),
    ({"stage_spin_ms": -1}, r"stage_spin_ms must be a number of milliseconds from 0 \(off\)"),
    ({"stage_spin_ms": "5"}, "stage_spin_ms must be a number"),
])
def test_bad_pinning_options_are_refused_and_leave_no_actor(ray_session, option, error):
    before = _generation_actors()
    with pytest.raises(og.GenaiError, match=error):
        og.Model(model_path("llama", "optimum"), executor="ray", stages=2, providers=DEVICES,
                 **option)
    assert eventually(lambda: _generation_actors() == before)


def test_more_stages_than_layers_is_refused_before_any_actor_starts(ray_session):
    with pytest.raises(og.GenaiError, match="stages=3: the decoder has 2 layers"):
        og.Model(model_path("llama", "optimum"), executor="ray", stages=3, providers=DEVICES)


@pytest.mark.parametrize("option,error", [
    ({"stage_layers": [1, 2]}, r"stage_layers=\[1, 2\] adds up to 3 layers; the decoder has 2"),
    ({"stage_layers": [2, 0]}, r"stage_layers=\[2, 0\]: each stage runs a whole number of "
                               "layers, at least 1"),
    ({"stage_layers": [1.0, 1]}, "each stage runs a whole number of layers"),
    ({"stage_layers": [1, 1], "stages": 3}, r"stage_layers=\[1, 1\] names 2 stage\(s\), for "
                                            "stages=3"),
    ({"stage_layers": "1,1"}, "stage_layers must be a list of layer counts"),
    ({"stage_layers": [1, 1, 1]}, "stages=3: the decoder has 2 layers"),
])
def test_bad_stage_layers_are_refused_before_any_actor_starts(ray_session, option, error):
    before = _generation_actors()
    with pytest.raises(og.GenaiError, match=error):
        og.Model(model_path("llama", "optimum"), executor="ray", providers=DEVICES, **option)
    assert _generation_actors() == before


def test_a_stage_that_fails_to_build_names_itself_and_leaves_no_actor(ray_session):
    before = _generation_actors()
    with pytest.raises(og.GenaiError, match=r"stage#\d \(sim-gpu:\d\) failed to build"):
        og.Model(model_path("llama", "optimum"), executor="ray", stages=2, providers=DEVICES,
                 no_such_option=1)
    assert eventually(lambda: _generation_actors() == before)


def test_builder_folder_on_two_stages_counts_and_left_pads_as_onnxruntime_genai(ray_session):
    """The builder folder (GroupQueryAttention, a shared cache buffer) split over two
    stages:
    - ``token_count()`` (onnxruntime-genai's model-qa prints it) step by step as
      onnxruntime-genai counts: two rows that end at their eos on the same step, whose
      eos it does not count;
    - rows of different lengths: each stage runs the left-padded prompt right-aligned
      (the op takes each row's keys from cache position 0), so each row makes what
      onnxruntime-genai makes from it alone."""
    import numpy as np

    genai = pytest.importorskip("onnxruntime_genai")
    reference = genai.Model(GENAI_FOLDER)
    model = og.Model(GENAI_FOLDER, executor="ray", stages=2, providers=DEVICES)
    try:
        rows = np.stack([np.random.default_rng(34).integers(3, 256, 12)] * 2).astype(np.int32)
        counts = {mod: token_counts(mod, m, rows, max_length=40)[0]
                  for mod, m in ((genai, reference), (og, model))}
        rng = np.random.default_rng(35)
        padded = [rng.integers(3, 256, n).tolist() for n in (11, 4, 8)]
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=11 + 14, batch_size=3)
        with og.Generator(model, params) as gen:
            gen.append_tokens(padded)
            while not gen.is_done():
                gen.generate_next_token()
            got = [[int(t) for t in gen.get_sequence(i)[len(r):]] for i, r in enumerate(padded)]
    finally:
        model.close()
    assert counts[og] == counts[genai] and counts[og][-1] == counts[og][-2] < 40
    for g, w in zip(got, genai_alone(genai, reference, padded, 14)):
        assert g[:len(w)] == w and len(g) - len(w) in (0, 1)  # (its eos: ours keeps it)


def test_cli_generates_on_two_stages(ray_session, capsys):
    """``hetero-exec generate --executor ray --stages 2``: token ids, on the session's Ray
    (the command's own `main`), and text through onnxruntime-genai's builder folder's
    tokenizer in its own process (its own Ray, started and stopped by the command)."""
    import subprocess
    import sys

    from hetero_exec.cli import main

    ids = [5, 17, 33, 8, 91, 120]
    assert main(["generate", model_path("llama", "optimum"), "--prompt-ids",
                 " ".join(map(str, ids)), "--max-new-tokens", "8", "--executor", "ray",
                 "--stages", "2", "--providers", "sim-gpu:0,sim-gpu:1"]) == 0
    out, err = capsys.readouterr()
    assert [int(t) for t in out.split()] == ort_greedy(model_path("llama", "optimum"), [ids], 8)[0]
    assert "8 tokens in" in err and "2 stage actors on sim-gpu:0, sim-gpu:1" in err
    # text in, through the folder's tokenizer, and the new text streamed out as it comes
    prompt = "t5 t17 t33 t8 t91 t120"
    done = subprocess.run([sys.executable, "-m", "hetero_exec.cli", "generate", GENAI_FOLDER,
                           "--prompt", prompt, "--max-new-tokens", "8", "--executor", "ray",
                           "--stages", "2", "--providers", "sim-gpu:0,sim-gpu:1"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == genai_text(GENAI_FOLDER, prompt, 8) + "\n"
    assert "2 stage actors on sim-gpu:0, sim-gpu:1" in done.stderr


def test_a_deeper_decoder_over_three_and_four_stages_and_split_unevenly(ray_session):
    # Llama's rotary tables are made before layer 0 and read by every layer: stage 1
    # passes them on to stage 2 and 3 unchanged, beside the residual stream it makes.
    # Three stages share 4 layers as vLLM does (the extra one not on the last stage);
    # stage_layers names an uneven split (3 layers on stage 0, 1 on stage 1)
    from actors.generation.batcher import ContinuousBatcher, wait_all

    path = model_path("llama4", "optimum")
    rows = prompts(2, seed=41)
    want = ort_greedy(path, rows, NEW)
    for stages, layers, split in ((3, None, [[0], [1, 2], [3]]), (4, None, [[0], [1], [2], [3]]),
                                  (None, [3, 1], [[0, 1, 2], [3]])):
        model = og.Model(path, executor="ray", providers=DEVICES,
                         **({"stages": stages} if stages else {"stage_layers": layers}))
        try:
            info = [ray.get(a.info.remote()) for a in model.remote.actors]
            assert [i["layers"] for i in info] == split
            assert _generate(model, rows) == want
            if stages == 3:  # rows joining a running group: their prefill passes them on too
                reqs = [(r, n) for r, n in zip(prompts(4, seed=42), (3, 12, 6, 4))]
                with ContinuousBatcher(model, slots=2, max_length=40,
                                       groups_in_flight=1) as batcher:
                    got = wait_all([batcher.submit(p, n) for p, n in reqs])
                    assert batcher.stats()["joins"] >= 1
                assert got == [ort_greedy(path, [p], n)[0] for p, n in reqs]
            assert eventually(lambda: _cache_free(model))
        finally:
            model.close()


def test_a_step_that_fails_on_a_stage_raises_its_error_and_the_model_goes_on(ray_session):
    # GPT-2 has 1024 positions: a 1030-token prompt fails in stage 0's position
    # embedding (as in process: KernelError naming the node), not a ring that waits
    from hetero_exec.errors import KernelError

    path = model_path("gpt2", "optimum")
    model = og.Model(path, executor="ray", stages=2, providers=DEVICES)
    try:
        with pytest.raises(KernelError, match="wpe/Gather.*out of bounds"):
            _generate(model, [[5] * 1030], new=4)
        # stage 0 tells the driver over its token socket (the group never got to the
        # last stage, whose socket would): it asks for the error at once, not after a
        # poll's wait; so does a later step's failure, from the last stage too
        gen = _start(model, [[5] * 1000], new=40)
        gen.generate_next_token()
        with pytest.raises(KernelError, match="wpe/Gather.*out of bounds"):
            gen.append_tokens([[6] * 30])
            gen.generate_next_token()
        assert gen._pushing and gen.epoch in gen._inbox.failed
        gen.close()
        fresh = og.GeneratorParams(model)
        fresh.set_search_options(batch_size=1, max_length=1040)
        with og.Generator(model, fresh) as gen:
            with pytest.raises(KernelError, match="wpe/Gather.*out of bounds"):
                gen.append_tokens([[5] * 1030])
                gen.generate_next_token()
            assert gen._pushing and gen._inbox.failed == {gen.epoch}
        rows = prompts(1, seed=43)
        assert _generate(model, rows) == ort_greedy(path, rows, NEW)
        assert eventually(lambda: _cache_free(model))
    finally:
        model.close()
