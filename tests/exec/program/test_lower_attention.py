"""GroupQueryAttention lowered into a bound program with its past and present distinct
(onnxruntime's own layout: a past fed each step, a present returned), against
onnxruntime: an OP_GQA_PAST record makes each present from its past (the row's valid
positions, zeros after the new ones) and OP_GQA appends and attends in place. Batches
whose rows have different lengths, rotary on and off, a local window, fewer kv heads
than heads; every case asserts that no step was left in Python."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

import hetero_exec as hx
from hetero_exec.errors import KernelError
from hetero_exec.exec.program.run import Region
from hetero_exec.kernels.native import library
from tests._models import assert_outputs
from tests.kernels.contrib._ort import one_node, run_ort, with_output_shapes
from tests.kernels.contrib.test_attention import _valid_rows

pytestmark = pytest.mark.skipif(not library.available(), reason="no C library in this tree")

RNG = np.random.default_rng(25)
LLAMA = Path(__file__).parents[2] / "genai" / "models" / "llama_genai" / "model.onnx"


def _r(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def _caches(max_pos, rd):
    inv = 1.0 / (10000 ** (np.arange(0, rd, 2) / rd))
    ang = np.arange(max_pos)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def _gqa(B, S, N, Nkv, H, seqlens, total, past_cap, packed=False, rotary=False, rd=None,
         **attrs):
    """(model, feeds) of one GroupQueryAttention node, total_sequence_length and the rotary
    caches constants (as the builder's graph makes them: a program's records take them)."""
    if packed:
        q, k, v = _r(B, S, (N + 2 * Nkv) * H), None, None
    else:
        q, k, v = _r(B, S, N * H), _r(B, S, Nkv * H), _r(B, S, Nkv * H)
    pk = pv = None  # past_cap None: no past inputs at all
    if past_cap is not None:
        pk, pv = _r(B, Nkv, past_cap, H), _r(B, Nkv, past_cap, H)
    cos = sin = None
    if rotary:
        cos, sin = _caches(64, rd or H)
        attrs.update(do_rotary=1)
    inputs = [q, k, v, pk, pv, np.array(seqlens, np.int32), np.array([total], np.int32),
              cos, sin]
    return one_node("GroupQueryAttention", inputs, n_outputs=3, num_heads=N, kv_num_heads=Nkv,
                    initializers=(6, 7, 8), out_types=[np.float32] * 3, **attrs)


def _records(sess) -> tuple[list[str], set[int]]:
    """(the op types the bound plans run in Python, the record kinds of their programs)."""
    python, ops = [], set()
    for seg in sess._executor.segments:
        for plan in seg.bound._bound.values():
            for st in plan.steps:
                if isinstance(st.fn, Region):
                    ops.update(int(op) for op in st.fn.program.records["op"])
                else:
                    python.append(st.node.op_type)
    return python, ops


def check(model: bytes, feeds: dict, rows=None, runs: int = 4) -> hx.InferenceSession:
    want = run_ort(model, feeds)
    sess = hx.InferenceSession(with_output_shapes(model, want), providers=["cpu"])
    for _ in range(runs):  # the second run binds and lowers, the later ones run the program
        got = sess.run(None, feeds)
        if rows is not None:
            got = [rows(i, np.asarray(g)) for i, g in enumerate(got)]
            assert_outputs(got, [rows(i, w) for i, w in enumerate(want)], 1e-4, 1e-5)
        else:
            assert_outputs(got, want, 1e-4, 1e-5)
    python, ops = _records(sess)
    assert python == [] and library.constant("OP_GQA_PAST") in ops
    return sess


@pytest.mark.parametrize("rotary", [False, True])
def test_decode_rows_of_different_lengths_in_a_longer_past(rotary):
    """One token per row at past lengths 3, 6 and 1 of a past of 9 positions (> total 7):
    each present keeps its row's past, the new token, then zeros; then other lengths at
    the same shapes (the program's present buffer rewritten, no position left stale)."""
    model, feeds = _gqa(3, 1, 6, 2, 16, [6, 6, 6], 7, past_cap=9, rotary=rotary)
    sess = check(model, feeds)
    for lens in ([3, 6, 1], [0, 2, 5]):
        f = dict(feeds, x5=np.array(lens, np.int32))
        assert_outputs(sess.run(None, f), run_ort(model, f), 1e-4, 1e-5)


def test_decode_past_one_short_of_total_heads_equal_kv_heads():
    """The genai builder's shape: a past of total - 1 positions, present of total."""
    check(*_gqa(2, 1, 3, 3, 8, [5, 2], 6, past_cap=5))


@pytest.mark.parametrize("packed", [False, True])
def test_subsequent_prompt_interleaved_rotary(packed):
    """A chunk of 3 tokens after 4 cached ones in a past of 8 (onnxruntime takes a later
    chunk of more than one token at batch 1 only)."""
    check(*_gqa(1, 3, 4, 1, 16, [6], 7, past_cap=8, packed=packed, rotary=True,
                rotary_interleaved=1))


@pytest.mark.parametrize("H", [16, 32, 24])
def test_decode_over_a_long_past(H):
    """Rows of 150 and 37 positions: the scores go VW keys at a time where a head is whole
    vectors (16 and 32 floats), four at a time otherwise (24), and the tails after them."""
    check(*_gqa(2, 1, 4, 2, H, [149, 36], 150, past_cap=160))


def test_local_window_softcap_scale():
    check(*_gqa(2, 1, 4, 2, 8, [9, 4], 10, past_cap=12, local_window_size=3, softcap=2.0,
                scale=0.3))


@pytest.mark.parametrize("rotary", [False, True])
@pytest.mark.parametrize("past_cap", [0, None])
def test_first_prompt_over_an_empty_past(rotary, past_cap):
    """A right-padded first prompt (rows of 5, 3 and 1 tokens) with an empty past, or
    with no past inputs at all (the presents made from nothing)."""
    seqlens, S = [4, 2, 0], 5
    check(*_gqa(3, S, 4, 2, 16, seqlens, S, past_cap=past_cap, rotary=rotary),
          rows=_valid_rows(seqlens, S, S))


def test_lengths_past_the_past_are_a_kernel_error_and_the_session_goes_on():
    model, feeds = _gqa(1, 1, 4, 2, 8, [5], 6, past_cap=5)
    sess = check(model, feeds)
    bad = dict(feeds, x5=np.array([7], np.int32))  # a past of 7 of a past of 5 positions
    with pytest.raises(KernelError, match="capacity"):
        sess.run(None, bad)
    assert_outputs(sess.run(None, feeds), run_ort(model, feeds), 1e-4, 1e-5)


def test_genai_builder_llama_decode_step_is_one_program():
    """tests/genai's Llama (onnxruntime-genai's builder: GroupQueryAttention per layer, a
    past fed and a present returned) runs a decode step of two rows as one program, as
    onnxruntime computes it."""
    import onnxruntime as ort

    data = onnx.load(LLAMA).SerializeToString()
    theirs = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    ours = hx.InferenceSession(data, providers=["cpu"])
    config = json.loads((LLAMA.parent / "genai_config.json").read_text())["model"]["decoder"]
    layers, heads, head = (config[k] for k in ("num_hidden_layers", "num_key_value_heads",
                                                "head_size"))
    P = 11
    feeds = {"input_ids": np.array([[7], [3]], np.int64),
             "attention_mask": np.ones((2, P + 1), np.int64)}
    for i in range(layers):
        for kv in ("key", "value"):
            feeds[f"past_key_values.{i}.{kv}"] = _r(2, heads, P, head)
    for _ in range(3):  # the same shapes thrice: bound and lowered, then the program
        assert_outputs(ours.run(None, feeds), theirs.run(None, feeds), 1e-4, 1e-4)
    python, ops = _records(ours)
    assert python == [] and library.constant("OP_GQA_PAST") in ops
