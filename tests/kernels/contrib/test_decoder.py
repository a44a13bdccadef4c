"""A one-layer Llama-style decoder written as onnxruntime-genai's model builder writes its
fp32 models: SimplifiedLayerNormalization, SkipSimplifiedLayerNormalization,
GroupQueryAttention with rotary caches, seqlens_k and total_sequence_length computed from
the attention mask in the graph, past/present key and value as graph inputs and outputs.
A prompt then decode steps, each step's presents fed back as the next past, on cpu and
strict sim-gpu, against onnxruntime step by step."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper as h
from onnx import numpy_helper as nh

import hetero_exec

V, HID, N, NKV, HEAD, FF, MAXPOS = 50, 64, 4, 2, 16, 96, 128
RNG = np.random.default_rng(31)


def _w(name, *shape, scale=0.1):
    return nh.from_array((RNG.standard_normal(shape) * scale).astype(np.float32), name)


def _decoder(packed: bool) -> bytes:
    inv = 1.0 / (10000 ** (np.arange(0, HEAD, 2) / HEAD))
    ang = np.arange(MAXPOS)[:, None] * inv[None, :]
    inits = [_w("embed", V, HID, scale=1.0), _w("ln1", HID), _w("ln2", HID), _w("lnf", HID),
             _w("wo", N * HEAD, HID), _w("wg", HID, FF), _w("wu", HID, FF), _w("wd", FF, HID),
             _w("lm", HID, V), nh.from_array(np.cos(ang).astype(np.float32), "cos"),
             nh.from_array(np.sin(ang).astype(np.float32), "sin"),
             nh.from_array(np.array([1], np.int64), "axis1"),
             nh.from_array(np.array(1, np.int64), "one_i"),
             nh.from_array(np.array(1, np.int64), "idx1")]
    if packed:
        inits.append(_w("wqkv", HID, (N + 2 * NKV) * HEAD))
        proj = [h.make_node("MatMul", ["n1", "wqkv"], ["qkv"])]
        attn_in = ["qkv", "", ""]
    else:
        inits += [_w("wq", HID, N * HEAD), _w("wk", HID, NKV * HEAD), _w("wv", HID, NKV * HEAD)]
        proj = [h.make_node("MatMul", ["n1", w], [o]) for w, o in
                (("wq", "q"), ("wk", "k"), ("wv", "v"))]
        attn_in = ["q", "k", "v"]
    ms = "com.microsoft"
    nodes = [
        h.make_node("Gather", ["embed", "input_ids"], ["x"]),
        h.make_node("SimplifiedLayerNormalization", ["x", "ln1"], ["n1"], epsilon=1e-6),
        *proj,
        # seqlens_k = sum(mask) - 1, total_sequence_length = mask.shape[1], as the builder does
        h.make_node("ReduceSum", ["attention_mask", "axis1"], ["msum"]),
        h.make_node("Sub", ["msum", "one_i"], ["msub"]),
        h.make_node("Cast", ["msub"], ["seqlens_k"], to=TP.INT32),
        h.make_node("Shape", ["attention_mask"], ["mshape"]),
        h.make_node("Gather", ["mshape", "idx1"], ["tot64"], axis=0),
        h.make_node("Cast", ["tot64"], ["total"], to=TP.INT32),
        h.make_node("GroupQueryAttention",
                    attn_in + ["past_key_values.0.key", "past_key_values.0.value", "seqlens_k",
                               "total", "cos", "sin"],
                    ["attn", "present.0.key", "present.0.value"], domain=ms, num_heads=N,
                    kv_num_heads=NKV, do_rotary=1, rotary_interleaved=0, scale=HEAD ** -0.5),
        h.make_node("MatMul", ["attn", "wo"], ["o"]),
        h.make_node("SkipSimplifiedLayerNormalization", ["o", "x", "ln2"],
                    ["n2", "", "", "resid"], domain=ms, epsilon=1e-6),
        h.make_node("MatMul", ["n2", "wg"], ["g"]), h.make_node("Sigmoid", ["g"], ["gs"]),
        h.make_node("Mul", ["g", "gs"], ["silu"]), h.make_node("MatMul", ["n2", "wu"], ["u"]),
        h.make_node("Mul", ["silu", "u"], ["gu"]), h.make_node("MatMul", ["gu", "wd"], ["d"]),
        h.make_node("SkipSimplifiedLayerNormalization", ["d", "resid", "lnf"], ["nf"], domain=ms,
                    epsilon=1e-6),
        h.make_node("MatMul", ["nf", "lm"], ["logits"]),
    ]
    cache = ["batch", NKV, "past", HEAD]
    g = h.make_graph(
        nodes, "decoder",
        [h.make_tensor_value_info("input_ids", TP.INT64, ["batch", "seq"]),
         h.make_tensor_value_info("attention_mask", TP.INT64, ["batch", "total"]),
         h.make_tensor_value_info("past_key_values.0.key", TP.FLOAT, cache),
         h.make_tensor_value_info("past_key_values.0.value", TP.FLOAT, cache)],
        [h.make_tensor_value_info("logits", TP.FLOAT, ["batch", "seq", V]),
         h.make_tensor_value_info("present.0.key", TP.FLOAT, ["batch", NKV, "total", HEAD]),
         h.make_tensor_value_info("present.0.value", TP.FLOAT, ["batch", NKV, "total", HEAD])],
        initializer=inits)
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 17), h.make_opsetid(ms, 1)])
    model.ir_version = 9
    return model.SerializeToString()


@pytest.mark.parametrize("packed", [False, True])
def test_prompt_then_decode(packed):
    model = _decoder(packed)
    theirs = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    ours = {p: hetero_exec.InferenceSession(model, providers=[p], **o)
            for p, o in (("cpu", {}), ("sim-gpu", {"require_gpu": True}))}
    batch, prompt = 2, 6
    ids = RNG.integers(0, V, (batch, prompt)).astype(np.int64)
    empty = np.zeros((batch, NKV, 0, HEAD), np.float32)
    feeds = {"input_ids": ids, "attention_mask": np.ones((batch, prompt), np.int64),
             "past_key_values.0.key": empty, "past_key_values.0.value": empty}
    pasts = {p: (empty, empty) for p in ours}
    for step in range(4):
        want = theirs.run(None, feeds)
        for p, sess in ours.items():
            f = dict(feeds)
            f["past_key_values.0.key"], f["past_key_values.0.value"] = pasts[p]
            got = sess.run(None, f)
            for name, w, g in zip(("logits", "present.key", "present.value"), want, got):
                assert g.shape == w.shape, (p, step, name)
                np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4,
                                           err_msg=f"{p} step {step} {name}")
            pasts[p] = (got[1], got[2])
        total = feeds["attention_mask"].shape[1] + 1
        nxt = want[0][:, -1].argmax(-1).reshape(batch, 1).astype(np.int64)
        feeds = {"input_ids": nxt, "attention_mask": np.ones((batch, total), np.int64),
                 "past_key_values.0.key": want[1], "past_key_values.0.value": want[2]}


def test_decoder_on_ray_stages_mixed(ray_session):
    """The same decoder on the Ray executor, cpu and sim-gpu stages mixed: the contrib
    kernels run inside the stage actors."""
    model = _decoder(False)
    theirs = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    batch, prompt = 1, 5
    ids = RNG.integers(0, V, (batch, prompt)).astype(np.int64)
    empty = np.zeros((batch, NKV, 0, HEAD), np.float32)
    feeds = {"input_ids": ids, "attention_mask": np.ones((batch, prompt), np.int64),
             "past_key_values.0.key": empty, "past_key_values.0.value": empty}
    # the MLP's Sigmoid kept off the GPU: cpu and sim-gpu segments
    gpu_opts = {"exclude_ops": ["Sigmoid"]}
    with hetero_exec.InferenceSession(model, providers=["sim-gpu", "cpu"],
                                      provider_options=[gpu_opts, {}], hetero=True,
                                      executor="ray") as sess:
        assert len(sess.placement.segments) >= 2
        for step in range(2):
            want = theirs.run(None, feeds)
            got = sess.run(None, feeds)
            for w, g in zip(want, got):
                np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4, err_msg=f"step {step}")
            nxt = want[0][:, -1].argmax(-1).reshape(batch, 1).astype(np.int64)
            feeds = {"input_ids": nxt,
                     "attention_mask": np.ones((batch, prompt + step + 1), np.int64),
                     "past_key_values.0.key": want[1], "past_key_values.0.value": want[2]}
