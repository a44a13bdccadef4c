"""Triton's generate extension served from a decoder split over stage actors
(``executor="ray"``, two stages on sim-gpu:0 and sim-gpu:1, started by the replica):
requests share running groups (continuous batching, actors/generation/batcher.py),
driven over real HTTP on 127.0.0.1; tokens checked against onnxruntime's loop (greedy,
or drawing from each request's seed by the sampling rule)."""

from __future__ import annotations

import http.client
import json
import socket

import pytest

from actors.serve.generate_request import parse_sse
from tests.genai._ref import model_path, ort_greedy, prompts, seeded_sampling
from tests.ray.helpers import at_once, eventually, free_port, post_json, sse_stream

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

LLAMA = model_path("llama", "optimum")
ROUTE = "/stages/v2/models/stages"


@pytest.fixture(scope="module")
def server(ray_session):
    from ray import serve

    from actors.serve import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app(LLAMA, name="stages", num_cpus=0.25, executor="ray", stages=2,
                            providers=["sim-gpu:0", "sim-gpu:1"], batch_slots=2,
                            batch_max_length=64),
                  name="stages", route_prefix="/stages")
        yield port
    finally:
        serve.shutdown()
    # the replica started the stage actors: they and their placement group went with it
    assert eventually(lambda: not _stage_actors(), 60)


def _stage_actors() -> list:
    import ray

    return [a for a in ray._private.state.actors().values()
            if a["State"] != "DEAD" and a["ActorClassName"] == "GenerationStage"]


def _tokens(port: int, body: dict) -> list[int]:
    return [e["output_ids"][0] for e in sse_stream(port, f"{ROUTE}/generate_stream", body)]


def _generation(port: int) -> dict:
    status, body = post_json(port, f"{ROUTE}/stats", b"", method="GET")
    assert status == 200
    return body["generation"]


def _concurrently(port: int, bodies: list[dict]) -> list[list[int]]:
    return at_once(lambda i: _tokens(port, bodies[i]), len(bodies))


def test_concurrent_streams_share_groups_with_their_own_tokens(server):
    rows = [[int(t) for t in r] for r in prompts(3, seed=21)] + \
        [[int(t) for t in r] for r in prompts(3, seed=22)]
    news = [6, 14, 9, 11, 5, 8]
    want = [ort_greedy(LLAMA, [r], n)[0] for r, n in zip(rows, news)]
    got = _concurrently(server, [{"input_ids": r, "max_tokens": n} for r, n in zip(rows, news)])
    assert got == want
    batching = _generation(server)["batching"]
    # six streams, two rows a group, a group per stage: some joined a running group
    assert batching["groups"] >= 1 and batching["joins"] >= 1
    _, meta = post_json(server, f"{ROUTE}", b"", method="GET")
    assert meta["generation"]["continuous_batching"] == {"slots": 2, "max_length": 64}
    assert [s["device"] for s in meta["placement"]["stages"]] == ["sim-gpu:0", "sim-gpu:1"]
    assert len(_stage_actors()) == 2


def test_sampled_streams_share_groups_each_drawing_from_its_own_seed(server):
    rows = [[int(t) for t in r] for r in prompts(3, seed=25) + prompts(2, seed=26)] \
        + [[5, 6, 7, 8]]
    news, seeds = [7, 12, 5, 9, 6, 8], [31, 32, 33, 34, 35, 36]
    search = {"do_sample": True, "top_k": 8, "top_p": 0.95, "temperature": 0.7}
    before = _generation(server)["batching"]
    got = _concurrently(server, [{"input_ids": r, "max_tokens": n, "random_seed": s, **search}
                                 for r, n, s in zip(rows, news, seeds)])
    want = [ort_greedy(LLAMA, [r], n, choose=seeded_sampling(s, 8, 0.95, 0.7))[0]
            for r, n, s in zip(rows, news, seeds)]
    assert got == want
    after = _generation(server)["batching"]
    # the sampling options got a batcher of their own: six requests, two groups of two
    # rows start at once, the last two requests take rows freed in them
    assert after["groups"] > before["groups"] and after["joins"] > before["joins"]


def test_long_requests_get_a_generator_of_their_own(server):
    prompt = [int(t) for t in prompts(1, seed=23)[0]]
    before = _generation(server).get("batching")
    status, body = post_json(server, f"{ROUTE}/generate", {"input_ids": prompt, "max_tokens": 60})
    assert status == 200  # 12 + 60 tokens: more than a group holds (64)
    assert body["output_ids"] == ort_greedy(LLAMA, [prompt], 60)[0]
    assert _generation(server).get("batching") == before  # not through the batcher


def test_a_client_gone_mid_stream_frees_its_row(server):
    prompt = [int(t) for t in prompts(1, seed=24)[0]]
    conn = http.client.HTTPConnection("127.0.0.1", server, timeout=120)
    conn.request("POST", f"{ROUTE}/generate_stream",
                 json.dumps({"input_ids": prompt, "max_tokens": 50}).encode())
    sock = conn.sock
    r = conn.getresponse()
    assert r.status == 200
    events = parse_sse(r)
    assert [next(events)["output_ids"][0] for _ in range(2)] == ort_greedy(LLAMA, [prompt], 2)[0]
    sock.shutdown(socket.SHUT_RDWR)
    r.close()
    conn.close()
    assert eventually(lambda: _generation(server)["active_streams"] == 0, 60)
    status, body = post_json(server, f"{ROUTE}/generate", {"input_ids": prompt, "max_tokens": 4})
    assert status == 200 and body["output_ids"] == ort_greedy(LLAMA, [prompt], 4)[0]


def test_bad_requests_get_4xx_and_the_server_keeps_serving(server):
    status, body = post_json(server, f"{ROUTE}/generate", {"input_ids": [5, 10 ** 6], "max_tokens": 3})
    assert status == 400 and "vocabulary" in body["error"]
    status, body = post_json(server, f"{ROUTE}/generate", {"input_ids": [5, 6], "max_tokens": 3,
                                                       "temperature": -1.0})
    assert status == 400 and "temperature" in body["error"]
    prompt = [int(t) for t in prompts(1, seed=25)[0]]
    status, body = post_json(server, f"{ROUTE}/generate", {"input_ids": prompt, "max_tokens": 3})
    assert status == 200 and body["output_ids"] == ort_greedy(LLAMA, [prompt], 3)[0]
