"""Triton's generate extension on Serve: real apps on 127.0.0.1 (on the session's
``ray_session``) serving the tiny checked-in decoders, driven over HTTP by http.client
(the event stream parsed line by line as it comes). Tokens are checked against
onnxruntime's greedy loop (tests/genai/_ref.py), against onnxruntime-genai on the
builder folder (text in and out through its tokenizer), and against the in-process
generator; bad requests get a 4xx JSON error and a good request after each; a client
that goes away mid-stream frees its generator's cache reservation; a stream refused by
admission leaves the one running."""

from __future__ import annotations

import http.client
import json
import os
import socket

import numpy as np
import pytest

import hetero_exec.genai as hg
from actors.serve.generate_request import parse_sse
from tests.genai._ref import MODELS, model_path, ort_greedy, prompts
from tests.ray.helpers import at_once, eventually, free_port, post_json
from tests.ray.helpers import sse_stream as stream

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

CPU = 0.25  # what each replica reserves (the session's Ray may have 2 CPUs)
FOLDER = os.path.join(MODELS, "llama_genai")
LLAMA = model_path("llama", "optimum")
TIGHT = model_path("gpt2", "optimum")
TIGHT_PROVIDERS = [("sim-gpu", {"exclude_ops": ["Softmax"]}), "cpu"]
TIGHT_BOUNDS = {"batch": 4, "batch_size": 4, "sequence_length": 64,
                "past_sequence_length": 64, "total_length": 128}
TIGHT_TOKENS = 56  # the capacity of a stream the tight app admits one of (8 + 48)


def tight_budget() -> int:
    """A sim-gpu budget that holds the session and one cache of TIGHT_TOKENS, not two."""
    probe = hg.Model(TIGHT, providers=[("sim-gpu", {"exclude_ops": ["Softmax"],
                                                    "mem_limit": 1 << 30}), "cpu"],
                     hetero=True, dim_bounds=TIGHT_BOUNDS)
    params = hg.GeneratorParams(probe)
    params.set_search_options(max_length=1 << 22)  # refused: the error says what is free
    with pytest.raises(hg.CacheAdmissionError) as err:
        hg.Generator(probe, params)
    held = (1 << 30) - err.value.free  # the session's own bytes on the device
    one = probe.cache_bytes(1, TIGHT_TOKENS)[err.value.provider]
    return held + int(1.5 * one)


@pytest.fixture(scope="module")
def server(ray_session, tmp_path_factory):
    """Four apps on one Serve: the Optimum Llama at /llama (token ids only: no tokenizer
    beside it), the builder folder at /genai (its tokenizer: text in and out), the GPT-2
    with a device budget for one stream at /tight, and an MLP (not a decoder) at /mlp."""
    import onnx
    from ray import serve

    from actors.serve import build_app
    from tests.ray.models import mlp

    mlp_path = str(tmp_path_factory.mktemp("gen") / "mlp.onnx")
    onnx.save(mlp(8, layers=1), mlp_path)
    tight = [("sim-gpu", {"exclude_ops": ["Softmax"], "mem_limit": tight_budget()}), "cpu"]
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run_many([
            serve.RunTarget(build_app(LLAMA, name="llama", num_cpus=CPU), name="llama",
                            route_prefix="/llama"),
            serve.RunTarget(build_app(FOLDER, name="genai", num_cpus=CPU), name="genai",
                            route_prefix="/genai"),
            serve.RunTarget(build_app(TIGHT, tight, name="tight", hetero=True,
                                      dim_bounds=TIGHT_BOUNDS, num_cpus=CPU),
                            name="tight", route_prefix="/tight"),
            serve.RunTarget(build_app(mlp_path, name="mlp", num_cpus=CPU), name="mlp",
                            route_prefix="/mlp"),
        ])
        yield port
    finally:
        serve.shutdown()


def stats(port: int, app: str, counts: bool = False) -> dict:
    status, body = post_json(port, f"/{app}/v2/models/{app}/stats", b"", method="GET")
    assert status == 200
    return body["model_stats"][0] if counts else body["generation"]


def in_process(path: str, prompt: list[int], new: int) -> list[int]:
    model = hg.Model(path)
    return [int(t) for t in hg.generate(model, [prompt], new)[0][len(prompt):]]


# -- tokens ------------------------------------------------------------------------------


def test_generate_and_stream_match_onnxruntime_and_the_in_process_generator(server):
    prompt = [int(t) for t in prompts(1, seed=5)[0]]
    want = ort_greedy(LLAMA, [prompt], 12)[0]
    assert in_process(LLAMA, prompt, 12) == want
    status, body = post_json(server, "/llama/v2/models/llama/generate",
                        {"input_ids": prompt, "parameters": {"max_tokens": 12}})
    assert status == 200, body
    assert body["output_ids"] == want and body["finish_reason"] == "length"
    assert body["model_name"] == "llama" and "text_output" not in body  # no tokenizer
    events = stream(server, "/llama/v2/models/llama/generate_stream",
                    {"input_ids": prompt, "max_tokens": 12})
    assert [len(e["output_ids"]) for e in events] == [1] * 12  # one event a token
    assert [e["output_ids"][0] for e in events] == want
    assert [e.get("finish_reason") for e in events] == [None] * 11 + ["length"]


def test_search_parameters_reach_the_generator(server):
    """Sampling with a seed: the same tokens as the in-process generator with the same
    options (and not greedy's)."""
    prompt = [int(t) for t in prompts(1, seed=6)[0]]
    search = {"do_sample": True, "top_k": 20, "top_p": 0.9, "temperature": 1.5,
              "random_seed": 42}
    model = hg.Model(LLAMA)
    want = [int(t) for t in hg.generate(model, [prompt], 12, **search)[0][len(prompt):]]
    assert want != ort_greedy(LLAMA, [prompt], 12)[0]
    status, body = post_json(server, "/llama/v2/models/llama/generate",
                        {"input_ids": prompt, "max_tokens": 12, "parameters": search})
    assert status == 200 and body["output_ids"] == want
    events = stream(server, "/llama/v2/models/llama/generate_stream",
                    {"input_ids": prompt, "max_tokens": 12, **search})
    assert [e["output_ids"][0] for e in events] == want


def test_text_in_and_out_through_the_folders_tokenizer(server):
    og = pytest.importorskip("onnxruntime_genai")
    tok = hg.Tokenizer(hg.Model(FOLDER))
    text = "t5 t6 t7 t40 t41 t99"  # the tiny vocabulary: words t0..t255
    ids = [int(t) for t in tok.encode(text)]
    assert ids == [5, 6, 7, 40, 41, 99]
    ref = og.Model(FOLDER)
    params = og.GeneratorParams(ref)
    params.set_search_options(max_length=len(ids) + 10)
    gen = og.Generator(ref, params)
    gen.append_tokens(np.asarray([ids], np.int64))
    while not gen.is_done():
        gen.generate_next_token()
    want = [int(t) for t in gen.get_sequence(0)[len(ids):]]
    assert in_process(FOLDER, ids, 10) == want
    status, body = post_json(server, "/genai/v2/models/genai/generate",
                        {"text_input": text, "parameters": {"max_tokens": 10}})
    assert status == 200, body
    assert body["output_ids"] == want and body["text_output"] == tok.decode(want)
    events = stream(server, "/genai/v2/models/genai/generate_stream",
                    {"text_input": text, "max_tokens": 10})
    assert [t for e in events for t in e["output_ids"]] == want
    assert "".join(e["text_output"] for e in events) == tok.decode(want)
    assert events[-1]["finish_reason"] == ("eos" if want[-1] in ref_eos(FOLDER) else "length")
    status, meta = post_json(server, "/genai/v2/models/genai", b"", method="GET")
    assert meta["generation"]["tokenizer"] and meta["platform"] == "hetero_exec_genai"
    status, server_meta = post_json(server, "/genai/v2", b"", method="GET")
    assert "generate" in server_meta["extensions"]


def ref_eos(folder: str) -> list[int]:
    return hg.Config(folder).token_ids()[0]


def test_concurrent_streams_each_get_their_own_tokens(server):
    rows = [[int(t) for t in r] for r in prompts(4, seed=7)]
    want = [ort_greedy(LLAMA, [r], 16)[0] for r in rows]
    got = at_once(lambda i: [e["output_ids"][0] for e in stream(
        server, "/llama/v2/models/llama/generate_stream",
        {"input_ids": rows[i], "max_tokens": 16})], 4)
    assert got == want
    assert eventually(lambda: stats(server, "llama")["reserved_bytes"] == {}, 30)


# -- lifetime and admission --------------------------------------------------------------


def test_a_client_gone_mid_stream_frees_its_cache(server):
    prompt = [int(t) for t in prompts(1, seed=9)[0]]
    before = stats(server, "llama", counts=True)
    conn = http.client.HTTPConnection("127.0.0.1", server, timeout=120)
    conn.request("POST", "/llama/v2/models/llama/generate_stream",
                 json.dumps({"input_ids": prompt, "max_tokens": 20000}).encode())
    sock = conn.sock  # the response takes it when it says "connection: close"
    r = conn.getresponse()
    assert r.status == 200
    events = parse_sse(r)
    first = [next(events)["output_ids"][0] for _ in range(2)]
    assert first == ort_greedy(LLAMA, [prompt], 2)[0]
    held = stats(server, "llama")
    assert held["active_streams"] == 1 and sum(held["reserved_bytes"].values()) > 0
    sock.shutdown(socket.SHUT_RDWR)
    r.close()
    conn.close()  # gone, thousands of tokens early
    assert eventually(lambda: stats(server, "llama") == {
        "active_streams": 0, "refused": 0, "reserved_bytes": {}}, 60)
    after = stats(server, "llama", counts=True)  # stopped, not run to its end
    assert after["request_count"] == before["request_count"]
    assert after["generated_tokens"] - before["generated_tokens"] < 20000
    status, body = post_json(server, "/llama/v2/models/llama/generate",
                        {"input_ids": prompt, "max_tokens": 3})
    assert status == 200 and body["output_ids"] == ort_greedy(LLAMA, [prompt], 3)[0]


def test_a_stream_refused_by_admission_leaves_the_running_one(server):
    prompt = [int(t) for t in prompts(1, seed=11, longest=8)[0]]
    new = TIGHT_TOKENS - len(prompt)
    want = ort_greedy(TIGHT, [prompt], new)[0]
    url = "/tight/v2/models/tight/generate"
    conn = http.client.HTTPConnection("127.0.0.1", server, timeout=120)
    conn.request("POST", url + "_stream",
                 json.dumps({"input_ids": prompt, "max_tokens": new}).encode())
    r = conn.getresponse()
    events = parse_sse(r)
    got = [next(events)["output_ids"][0]]  # admitted and running
    status, body = post_json(server, url, {"input_ids": prompt, "max_tokens": new})
    assert status == 503 and "other streams hold the room" in body["error"]
    assert "sim-gpu:0" in body["error"]
    status, body = post_json(server, url, {"input_ids": prompt, "max_tokens": 4000})
    assert status == 400 and "ask for fewer tokens" in body["error"]  # never fits
    got += [e["output_ids"][0] for e in events]
    conn.close()
    assert got == want
    assert stats(server, "tight")["refused"] == 2
    assert eventually(lambda: stats(server, "tight")["reserved_bytes"] == {}, 30)
    status, body = post_json(server, url, {"input_ids": prompt, "max_tokens": 5})  # room again
    assert status == 200 and body["output_ids"] == want[:5]


# -- bad requests ------------------------------------------------------------------------

BAD = [
    ({"max_tokens": 3}, 400, "one prompt: input_ids"),
    ({"input_ids": [1, 2], "text_input": "x"}, 400, "one prompt"),
    ({"input_ids": "1 2 3"}, 400, "non-empty list of token ids"),
    ({"input_ids": []}, 400, "non-empty list"),
    ({"input_ids": [[1, 2]]}, 400, "flat list"),
    ({"input_ids": [1, 2.5]}, 400, "input_ids[1]"),
    ({"input_ids": [1, -2]}, 400, "input_ids[1] is -2"),
    ({"input_ids": [1, 99999]}, 400, "outside the vocabulary"),
    ({"input_ids": [1, 2], "max_tokens": -1}, 400, "max_tokens must be an integer >= 0"),
    ({"input_ids": [1, 2], "parameters": {"max_tokens": "5"}}, 400, "max_tokens"),
    ({"input_ids": [1, 2], "max_tokens": 2, "parameters": {"max_tokens": 3}}, 400, "twice"),
    ({"input_ids": [1, 2], "parameters": {"temperature": 0}}, 400, "temperature must be > 0"),
    ({"input_ids": [1, 2], "parameters": {"top_k": True}}, 400, "'top_k' must be"),
    ({"input_ids": [1, 2], "parameters": {"beams": 2}}, 400, "unknown parameter 'beams'"),
    ({"input_ids": [1, 2], "random_seed": 1 << 64}, 400, "random_seed must be -1"),
    ({"input_ids": [1, 2], "prompt": "x"}, 400, "unknown field(s) 'prompt'"),
    ({"input_ids": [1, 2], "parameters": [1]}, 400, "parameters must be a JSON object"),
    ({"text_input": "hi"}, 400, "text_input needs a tokenizer"),
    (b"{not json", 400, "not JSON"),
    (b"[1, 2]", 400, "must be a JSON object"),
]


@pytest.mark.parametrize("body,status,words", BAD, ids=[w for _, _, w in BAD])
def test_bad_request_is_named_and_the_server_keeps_serving(server, body, status, words):
    for route in ("generate", "generate_stream"):
        got, answer = post_json(server, f"/llama/v2/models/llama/{route}", body)
        assert got == status and words in answer["error"], answer
    got, answer = post_json(server, "/llama/v2/models/llama/generate",
                       {"input_ids": [3, 4, 5], "max_tokens": 2})
    assert got == 200 and answer["output_ids"] == ort_greedy(LLAMA, [[3, 4, 5]], 2)[0]


def test_wrong_route_model_or_method_and_the_inference_routes_beside(server):
    ok = {"input_ids": [3, 4], "max_tokens": 1}
    assert post_json(server, "/llama/v2/models/nope/generate", ok)[0] == 404
    assert post_json(server, "/llama/v2/models/llama/versions/2/generate", ok)[0] == 404
    assert post_json(server, "/llama/v2/models/llama/versions/1/generate", ok)[0] == 200
    assert post_json(server, "/llama/v2/models/llama/generate", b"", method="GET")[0] == 405
    status, body = post_json(server, "/llama/v2/models/llama/infer", {"inputs": []})
    assert status == 400 and "served for generation" in body["error"]
    status, body = post_json(server, "/mlp/v2/models/mlp/generate", ok)
    assert status == 400 and "not a decoder" in body["error"]
    status, body = post_json(server, "/genai/v2/models/genai/generate",
                        {"input_ids": [3, 4], "max_tokens": 2000})
    assert status == 400 and "context length 1024" in body["error"]
    status, body = post_json(server, "/llama/v2/models/llama/generate",
                        {"input_ids": [3, 4], "max_tokens": 1 << 40})  # no context length
    assert status == 400 and "exceed the longest sequence served" in body["error"]
    status, body = post_json(server, "/llama/v2/models/llama/generate",
                        {"input_ids": [3, 4], "max_tokens": 0})
    assert status == 200 and body["output_ids"] == [] and body["finish_reason"] == "length"
    assert post_json(server, "/llama/v2/health/ready", b"", method="GET") == (200, {"ready": True})
    status, meta = post_json(server, "/llama/v2/models/llama", b"", method="GET")
    assert [i["name"] for i in meta["inputs"]] == ["input_ids"]  # no tokenizer: no text
    assert meta["generation"]["layers"] == 2


# -- which models get the generate routes (no Ray needed) ---------------------------------


def test_build_app_serves_decoders_for_generation_and_the_rest_for_inference(tmp_path):
    import onnx

    from actors.serve import build_app
    from actors.serve.generation import GenerativeModel, decoder_file
    from tests.ray.models import mlp

    path = str(tmp_path / "mlp.onnx")
    onnx.save(mlp(8, layers=1), path)
    assert decoder_file(FOLDER) == os.path.join(FOLDER, "model.onnx")
    assert decoder_file(LLAMA) == LLAMA and decoder_file(path) is None
    assert decoder_file(open(LLAMA, "rb").read()) is None  # bytes: inference only

    def served(app):
        return app._bound_deployment.func_or_class.__name__

    assert served(build_app(FOLDER)) == "GenerativeModel"
    assert served(build_app(LLAMA, generate=False)) == "HeteroModel"
    assert served(build_app(path)) == "HeteroModel"
    with pytest.raises(ValueError, match="not a path to a decoder"):
        build_app(path, generate=True)
    assert served(build_app(LLAMA, name="x")) == GenerativeModel.__name__


# -- the command line ----------------------------------------------------------------------


def test_cli_serves_a_decoder_folder_through_haproxy():
    """``hetero-exec serve FOLDER`` (its own Ray, Serve's HAProxy ingress): the generate
    routes, text out, a stream through HAProxy read as it comes, a client gone mid-stream
    through HAProxy frees its cache, and a clean exit on SIGINT."""
    import signal
    import subprocess
    import sys
    import time

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    port = free_port()
    env = {**os.environ, "PYTHONPATH": root}
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_SERVE_ENABLE_HA_PROXY", None)
    proc = subprocess.Popen([sys.executable, "-m", "hetero_exec.cli", "serve", FOLDER,
                             "--name", "cli", "--port", str(port)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    app = "/v2/models/cli"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if post_json(port, app + "/ready", b"", method="GET")[0] == 200:
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.5)
        assert proc.poll() is None, proc.stdout.read()
        ids = [5, 6, 7, 40]
        want = in_process(FOLDER, ids, 6)
        events = stream(port, app + "/generate_stream", {"input_ids": ids, "max_tokens": 6})
        assert [e["output_ids"][0] for e in events] == want
        assert "".join(e["text_output"] for e in events) == hg.Tokenizer(
            hg.Model(FOLDER)).decode(want)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", app + "/generate_stream",
                     json.dumps({"input_ids": ids, "max_tokens": 1000}).encode())
        sock = conn.sock  # the response takes it when HAProxy, reloading, says "close"
        r = conn.getresponse()
        assert next(parse_sse(r))["output_ids"] == want[:1]
        sock.shutdown(socket.SHUT_RDWR)
        r.close()
        conn.close()

        def freed() -> bool:
            status, body = post_json(port, app + "/stats", b"", method="GET")
            return body["generation"]["active_streams"] == 0 and \
                body["generation"]["reserved_bytes"] == {}

        assert eventually(freed, 60)
        status, body = post_json(port, app + "/generate", {"input_ids": ids, "max_tokens": -1})
        assert status == 400 and "max_tokens" in body["error"]
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out[-2000:]
        assert "(/generate, /generate_stream)" in out and "shutting down" in out
        # its replica drained in seconds (connect.REPLICA_DRAIN_ENVS), not Serve's 30 s
        assert "failed to shut down" not in out, out[-2000:]
    finally:
        if proc.poll() is None:  # a failed check: stop it the clean way first
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
