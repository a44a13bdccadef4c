"""Recurrent, signal, attention, string, ML, training, loss, random and image kernels
against onnx.reference, and against onnxruntime where the reference ignores a feature
(RNN sequence_lens, activations, clip)."""

from __future__ import annotations

import io

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tests.conftest import to_numpy
from tests.kernels._ref import ours, reference

RNG = np.random.default_rng(0)


def f32(*shape, lo=-1.0, hi=1.0):
    return RNG.uniform(lo, hi, shape).astype(np.float32)


def compare(want, got, rtol=1e-5, atol=1e-6):
    assert isinstance(got, tuple)
    assert len(got) >= len(want)
    for w, g in zip(want, got):
        g = to_numpy(g)
        assert isinstance(g, np.ndarray)
        if w.dtype.kind in "US":  # the reference sometimes returns numpy str arrays
            w = w.astype(object)
        assert g.dtype == w.dtype, (g.dtype, w.dtype)
        assert g.shape == w.shape, (g.shape, w.shape)
        if w.dtype.kind in "fV":
            np.testing.assert_allclose(
                g.astype(np.float64), w.astype(np.float64), rtol=rtol, atol=atol
            )
        elif w.dtype.kind in "OUS":
            assert g.astype(object).tolist() == w.astype(object).tolist()
        else:
            np.testing.assert_array_equal(g, w)


def check(
    xp, op, inputs, opset=21, domain="", n_outputs=1, rtol=1e-5, atol=1e-6, extra=None, **attrs
):
    want = reference(op, inputs, opset=opset, domain=domain, n_outputs=n_outputs, **attrs)
    got = ours(xp, op, inputs, opset=opset, domain=domain, **attrs, **(extra or {}))
    compare(want, got, rtol, atol)
    return got


def host_only(xp):
    if xp is not np:
        pytest.skip("host-only kernel")


def ort_run(op, inputs, n_out, opset, **attrs):
    ort = pytest.importorskip("onnxruntime")
    names = [f"x{i}" if v is not None else "" for i, v in enumerate(inputs)]
    outs = [f"y{i}" for i in range(n_out)]
    graph = helper.make_graph(
        [helper.make_node(op, names, outs, **attrs)],
        "g",
        [
            helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
            for n, v in zip(names, inputs)
            if v is not None
        ],
        [onnx.ValueInfoProto(name=o) for o in outs],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 9
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {n: v for n, v in zip(names, inputs) if v is not None})


# -- RNN / GRU / LSTM ---------------------------------------------------------------

GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}


def rnn_inputs(op, direction, layout, T=4, B=3, n_in=5, H=6, with_lens=False):
    D = 2 if direction == "bidirectional" else 1
    g = GATES[op]
    X = f32(T, B, n_in) if layout == 0 else f32(B, T, n_in)
    W, R, Bias = f32(D, g * H, n_in), f32(D, g * H, H), f32(D, 2 * g * H)
    lens = np.array([T, 1, T - 1][:B], dtype=np.int32) if with_lens else None
    h0 = f32(D, B, H) if layout == 0 else f32(B, D, H)
    ins = [X, W, R, Bias, lens, h0]
    if op == "LSTM":
        ins += [f32(*h0.shape), f32(D, 3 * H)]
    return ins, H


@pytest.mark.parametrize("op", ["RNN", "GRU", "LSTM"])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("layout", [0, 1])
def test_recurrent_vs_reference(xp, op, direction, layout):
    ins, H = rnn_inputs(op, direction, layout)
    n_out = 3 if op == "LSTM" else 2
    check(
        xp,
        op,
        ins,
        opset=14,
        n_outputs=n_out,
        rtol=1e-4,
        atol=1e-5,
        hidden_size=H,
        direction=direction,
        layout=layout,
    )


def test_recurrent_omitted_inputs(xp):
    X, W, R = f32(3, 2, 4), f32(1, 9, 4), f32(1, 9, 3)
    check(
        xp,
        "GRU",
        [X, W, R],
        opset=14,
        n_outputs=2,
        rtol=1e-4,
        atol=1e-5,
        hidden_size=3,
        linear_before_reset=1,
    )
    check(
        xp,
        "LSTM",
        [X, f32(1, 16, 4), f32(1, 16, 4)],
        opset=14,
        n_outputs=3,
        rtol=1e-4,
        atol=1e-5,
        hidden_size=4,
    )


def _vs_ort(xp, op, ins, layout, **attrs):
    if layout == 1:  # onnxruntime only runs layout 0: transpose around it
        ins0 = [
            np.swapaxes(v, 0, 1) if i in (0, 5, 6) and v is not None else v
            for i, v in enumerate(ins)
        ]
        want = ort_run(op, ins0, 3 if op == "LSTM" else 2, 14, layout=0, **attrs)
        want = [np.transpose(want[0], (2, 0, 1, 3))] + [np.swapaxes(w, 0, 1) for w in want[1:]]
    else:
        want = ort_run(op, ins, 3 if op == "LSTM" else 2, 14, layout=0, **attrs)
    got = ours(xp, op, ins, opset=14, layout=layout, **attrs)
    compare(want, got, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("op", ["RNN", "GRU", "LSTM"])
@pytest.mark.parametrize("direction,layout", [("forward", 0), ("reverse", 1), ("bidirectional", 0)])
def test_recurrent_sequence_lens_vs_ort(xp, op, direction, layout):
    ins, H = rnn_inputs(op, direction, layout, with_lens=True)
    _vs_ort(xp, op, ins, layout, hidden_size=H, direction=direction)


@pytest.mark.parametrize(
    "op,attrs",
    [
        ("RNN", dict(activations=["Relu", "Sigmoid"], direction="bidirectional")),
        ("RNN", dict(clip=0.5)),
        (
            "GRU",
            dict(
                activations=["HardSigmoid", "Softsign", "Sigmoid", "Tanh"],
                activation_alpha=[0.3, 0.2],
                activation_beta=[0.4, 0.5],
                direction="bidirectional",
            ),
        ),
        ("GRU", dict(linear_before_reset=1, clip=1.0)),
        ("LSTM", dict(input_forget=1)),
        (
            "LSTM",
            dict(
                activations=["Sigmoid", "Tanh", "Relu", "Sigmoid", "LeakyRelu", "Tanh"],
                activation_alpha=[0.1],
                direction="bidirectional",
            ),
        ),
    ],
)
def test_recurrent_options_vs_ort(xp, op, attrs):
    ins, H = rnn_inputs(op, attrs.get("direction", "forward"), 0, with_lens=True)
    _vs_ort(xp, op, ins, 0, hidden_size=H, **attrs)


# -- signal -------------------------------------------------------------------------


@pytest.mark.parametrize("complex_in", [False, True])
@pytest.mark.parametrize("onesided,inverse", [(0, 0), (1, 0), (0, 1)])
@pytest.mark.parametrize("length", [None, 6, 12])
def test_dft_opset20(xp, complex_in, onesided, inverse, length):
    if onesided and complex_in:
        pytest.skip("onesided needs a real input")
    x = f32(2, 8, 3, 2 if complex_in else 1)
    axis = np.array(1, dtype=np.int64)
    n = None if length is None else np.array(length, dtype=np.int64)
    check(
        xp, "DFT", [x, n, axis], opset=20, rtol=1e-4, atol=1e-5, onesided=onesided, inverse=inverse
    )
    check(
        xp,
        "DFT",
        [x, n, np.array(-2, dtype=np.int64)],
        opset=20,
        rtol=1e-4,
        atol=1e-5,
        onesided=onesided,
        inverse=inverse,
    )


def test_dft_opset17_and_irfft(xp):
    x = f32(3, 10, 1)
    check(xp, "DFT", [x], opset=17, rtol=1e-4, atol=1e-5, axis=1)
    check(xp, "DFT", [x.astype(np.float64)], opset=17, rtol=1e-10, atol=1e-10, axis=1, onesided=1)
    half = f32(3, 6, 4, 2)
    check(
        xp,
        "DFT",
        [half, None, np.array(1, dtype=np.int64)],
        opset=20,
        rtol=1e-4,
        atol=1e-5,
        onesided=1,
        inverse=1,
    )


@pytest.mark.parametrize("window", [False, True])
@pytest.mark.parametrize("onesided", [0, 1])
def test_stft(xp, window, onesided):
    sig = f32(2, 64, 1)
    step = np.array(8, dtype=np.int64)
    if window:
        ins = [sig, step, np.hanning(16).astype(np.float32)]
    else:
        ins = [sig, step, None, np.array(16, dtype=np.int64)]
    check(xp, "STFT", ins, opset=17, rtol=1e-4, atol=1e-5, onesided=onesided)


@pytest.mark.parametrize("op", ["HannWindow", "HammingWindow", "BlackmanWindow"])
@pytest.mark.parametrize("periodic", [0, 1])
@pytest.mark.parametrize("dtype", [TensorProto.FLOAT, TensorProto.DOUBLE])
def test_windows(xp, op, periodic, dtype):
    check(
        xp,
        op,
        [np.array(10, dtype=np.int64)],
        opset=17,
        rtol=1e-5,
        atol=1e-6,
        periodic=periodic,
        output_datatype=dtype,
    )


@pytest.mark.parametrize("args", [(8, 16, 8192, 0.0, 4096.0), (20, 512, 16000, 30.0, 7600.0)])
def test_mel_weight_matrix(xp, args):
    mel, dft, rate, lo, hi = args
    ins = [
        np.array(mel, np.int64),
        np.array(dft, np.int64),
        np.array(rate, np.int64),
        np.array(lo, np.float32),
        np.array(hi, np.float32),
    ]
    check(xp, "MelWeightMatrix", ins, opset=17)


# -- attention ------------------------------------------------------------------------


ATTN_CASES = {
    "mha": dict(q=(2, 3, 4, 8), k=(2, 3, 6, 8), v=(2, 3, 6, 5)),
    "gqa": dict(q=(1, 4, 3, 8), k=(1, 2, 5, 8), v=(1, 2, 5, 8)),
    "causal": dict(q=(2, 2, 4, 8), k=(2, 2, 4, 8), v=(2, 2, 4, 8), attrs=dict(is_causal=1)),
    "scaled_softcap": dict(
        q=(1, 2, 3, 4), k=(1, 2, 5, 4), v=(1, 2, 5, 4), attrs=dict(scale=0.3, softcap=2.0)
    ),
    "float_mask_padded": dict(
        q=(1, 2, 3, 4), k=(1, 2, 6, 4), v=(1, 2, 6, 4), mask=((3, 4), np.float32)
    ),
    "bool_mask": dict(
        q=(2, 2, 3, 4), k=(2, 2, 5, 4), v=(2, 2, 5, 4), mask=((2, 1, 3, 5), np.bool_)
    ),
    "bool_mask_causal": dict(
        q=(1, 2, 3, 4),
        k=(1, 2, 3, 4),
        v=(1, 2, 3, 4),
        mask=((3, 3), np.bool_),
        attrs=dict(is_causal=1),
    ),
}


@pytest.mark.parametrize("name", sorted(ATTN_CASES))
@pytest.mark.parametrize("mode", [0, 1, 2, 3])
def test_attention_4d(xp, name, mode):
    case = ATTN_CASES[name]
    if mode == 0 and "softcap" in case.get("attrs", {}):
        # onnx.reference exposes the softcapped scores in mode 0; the spec and the
        # schema's function body expose the raw QK product (what the kernel does)
        pytest.skip("onnx.reference deviates from the spec here")
    ins = [f32(*case["q"]), f32(*case["k"]), f32(*case["v"])]
    if "mask" in case:
        shape, dt = case["mask"]
        m = RNG.random(shape) > 0.3 if dt == np.bool_ else f32(*shape)
        ins.append(m)
    check(
        xp,
        "Attention",
        ins,
        opset=23,
        n_outputs=4,
        rtol=1e-5,
        atol=1e-6,
        extra=dict(num_outputs=4),
        qk_matmul_output_mode=mode,
        **case.get("attrs", {}),
    )


def test_attention_3d_with_past(xp):
    q, k, v = f32(2, 3, 4 * 6), f32(2, 3, 2 * 6), f32(2, 3, 2 * 5)
    pk, pv = f32(2, 2, 4, 6), f32(2, 2, 4, 5)
    check(
        xp,
        "Attention",
        [q, k, v, None, pk, pv],
        opset=23,
        n_outputs=3,
        rtol=1e-5,
        atol=1e-6,
        extra=dict(num_outputs=3),
        q_num_heads=4,
        kv_num_heads=2,
        is_causal=1,
    )


def test_attention_nonpad_and_window(xp):
    q, k, v = f32(2, 2, 3, 4), f32(2, 2, 8, 4), f32(2, 2, 8, 4)
    lens = np.array([5, 8], dtype=np.int64)
    check(
        xp,
        "Attention",
        [q, k, v, None, None, None, lens],
        opset=24,
        rtol=1e-5,
        atol=1e-6,
        is_causal=1,
    )
    check(
        xp,
        "Attention",
        [q, k, v, None, None, None, lens],
        opset=25,
        rtol=1e-5,
        atol=1e-6,
        is_causal=1,
        left_window_size=2,
    )
    q2 = f32(1, 2, 6, 4)
    check(
        xp,
        "Attention",
        [q2, f32(1, 2, 6, 4), f32(1, 2, 6, 4)],
        opset=25,
        rtol=1e-5,
        atol=1e-6,
        left_window_size=2,
        right_window_size=1,
    )


def test_attention_fp16_and_fully_masked(xp):
    ins = [
        f32(1, 2, 3, 8).astype(np.float16),
        f32(1, 2, 4, 8).astype(np.float16),
        f32(1, 2, 4, 8).astype(np.float16),
    ]
    check(xp, "Attention", ins, opset=23, rtol=1e-3, atol=1e-3, is_causal=1)
    mask = np.ones((3, 4), dtype=np.bool_)
    mask[1] = False  # row 1 attends nothing: zeros, not NaN
    got = check(
        xp, "Attention", [f32(1, 2, 3, 4), f32(1, 2, 4, 4), f32(1, 2, 4, 4), mask], opset=23
    )
    assert not np.isnan(to_numpy(got[0])).any()


@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("rot_dim", [0, 4])
@pytest.mark.parametrize("rank3", [False, True])
def test_rotary_embedding(xp, interleaved, rot_dim, rank3):
    B, H, S, D = 2, 3, 5, 8
    half = (rot_dim or D) // 2
    x = f32(B, S, H * D) if rank3 else f32(B, H, S, D)
    pos = RNG.integers(0, 10, (B, S)).astype(np.int64)
    attrs = dict(interleaved=interleaved, rotary_embedding_dim=rot_dim)
    if rank3:
        attrs["num_heads"] = H
    check(xp, "RotaryEmbedding", [x, f32(10, half), f32(10, half), pos], opset=23, **attrs)
    check(xp, "RotaryEmbedding", [x, f32(B, S, half), f32(B, S, half)], opset=23, **attrs)


def test_swiglu(xp):
    check(xp, "SwiGLU", [f32(3, 4), f32(3, 4)], opset=28)
    check(xp, "SwiGLU", [f32(3, 4), f32(3, 4)], opset=28, alpha=1.7)


@pytest.mark.parametrize("rule", ["linear", "gated", "delta", "gated_delta"])
def test_linear_attention(xp, rule):
    B, T, Hq, Hk, dk, dv = 2, 4, 4, 2, 3, 5
    ins = [
        f32(B, T, Hq * dk),
        f32(B, T, Hk * dk),
        f32(B, T, Hk * dv),
        f32(B, Hk, dk, dv),
        -RNG.random((B, T, Hk)).astype(np.float32) if "gated" in rule else None,
        RNG.random((B, T, Hk)).astype(np.float32) if "delta" in rule else None,
    ]
    check(
        xp,
        "LinearAttention",
        ins,
        opset=27,
        n_outputs=2,
        rtol=1e-4,
        atol=1e-5,
        q_num_heads=Hq,
        kv_num_heads=Hk,
        update_rule=rule,
    )


def test_flex_attention(xp):
    q, k, v = f32(1, 4, 3, 8), f32(1, 2, 5, 8), f32(1, 2, 5, 6)
    check(xp, "FlexAttention", [q, k, v], opset=1, domain="ai.onnx.preview", rtol=1e-5, atol=1e-6)
    check(
        xp,
        "FlexAttention",
        [q, k, v],
        opset=1,
        domain="ai.onnx.preview",
        rtol=1e-5,
        atol=1e-6,
        scale=0.2,
    )


def test_flex_attention_modifier_callable(xp):
    q, k, v = f32(1, 2, 3, 4), f32(1, 2, 3, 4), f32(1, 2, 3, 4)
    base = to_numpy(ours(xp, "FlexAttention", [q, k, v], opset=1, domain="ai.onnx.preview")[0])
    shifted = ours(
        xp,
        "FlexAttention",
        [q, k, v],
        opset=1,
        domain="ai.onnx.preview",
        score_mod=lambda s: s + 5.0,
    )[0]
    np.testing.assert_allclose(to_numpy(shifted), base, rtol=1e-5, atol=1e-6)


# -- strings --------------------------------------------------------------------------


def strs(*vals, shape=None):
    a = np.array(list(vals), dtype=object)
    return a.reshape(shape) if shape else a


def test_string_ops(xp):
    host_only(xp)
    check(np, "StringConcat", [strs("a", "bc"), strs("x", shape=(1,))], opset=20)
    check(np, "StringConcat", [strs("a", shape=()), strs("b", shape=())], opset=20)
    check(
        np,
        "RegexFullMatch",
        [strs("ab12", "x", "abc", shape=(3, 1))],
        opset=20,
        pattern=r"[a-z]+\d*",
    )
    for attrs in (dict(delimiter="."), dict(delimiter=".", maxsplit=1), dict(), dict(delimiter="")):
        check(
            np, "StringSplit", [strs("a.b.c", "", " x  y ", "q..r")], opset=20, n_outputs=2, **attrs
        )


@pytest.mark.parametrize(
    "attrs",
    [
        dict(case_change_action="LOWER"),
        dict(case_change_action="UPPER", stopwords=["monday"], is_case_sensitive=1),
        dict(case_change_action="NONE", stopwords=["Monday"], is_case_sensitive=1),
        dict(case_change_action="LOWER", stopwords=["MONDAY", "tuesday"]),
    ],
)
def test_string_normalizer(xp, attrs):
    host_only(xp)
    check(np, "StringNormalizer", [strs("Monday", "tuesday", "Wed")], opset=10, **attrs)
    check(np, "StringNormalizer", [strs("Monday", "tuesday", shape=(1, 2))], opset=10, **attrs)


# -- ai.onnx.ml -----------------------------------------------------------------------


def test_ml_simple(xp):
    host_only(xp)
    x = f32(3, 5)
    check(
        np, "ArrayFeatureExtractor", [x, np.array([0, 3], np.int64)], opset=1, domain="ai.onnx.ml"
    )
    check(
        np, "ArrayFeatureExtractor", [x[0], np.array([4], np.int64)], opset=1, domain="ai.onnx.ml"
    )
    check(np, "Binarizer", [x], opset=1, domain="ai.onnx.ml", threshold=0.25)


@pytest.mark.parametrize(
    "attrs,x",
    [
        (
            dict(keys_strings=["a", "b", "c"], values_int64s=[1, 2, 3], default_int64=-7),
            strs("a", "z", "c"),
        ),
        (
            dict(keys_int64s=[5, 1, 3], values_strings=["five", "one", "three"]),
            np.array([[1, 2], [5, 3]], np.int64),
        ),
        (
            dict(keys_floats=[0.5, -1.0], values_floats=[10.0, 20.0], default_float=3.0),
            np.array([0.5, 0.25, -1.0], np.float32),
        ),
        (
            dict(
                keys_tensor=helper.make_tensor("k", TensorProto.INT64, [3], [4, 2, 9]),
                values_tensor=helper.make_tensor("v", TensorProto.INT16, [3], [40, 20, 90]),
                default_tensor=helper.make_tensor("d", TensorProto.INT16, [1], [-1]),
            ),
            np.array([2, 3, 9], np.int64),
        ),
        (
            dict(
                keys_tensor=helper.make_tensor("k", TensorProto.STRING, [2], [b"x", b"y"]),
                values_tensor=helper.make_tensor("v", TensorProto.FLOAT, [2], [1.5, 2.5]),
                default_tensor=helper.make_tensor("d", TensorProto.FLOAT, [1], [0.25]),
            ),
            strs("y", "q"),
        ),
    ],
)
def test_label_encoder(xp, attrs, x):
    host_only(xp)
    want = reference("LabelEncoder", [x], opset=4, domain="ai.onnx.ml", **attrs)
    conv = {
        k: onnx.numpy_helper.to_array(v) if isinstance(v, onnx.TensorProto) else v
        for k, v in attrs.items()
    }
    if "keys_tensor" in conv and conv["keys_tensor"].dtype.kind in "OS":
        conv["keys_tensor"] = np.array(
            [s.decode() if isinstance(s, bytes) else s for s in conv["keys_tensor"]], dtype=object
        )
    got = ours(np, "LabelEncoder", [x], opset=4, domain="ai.onnx.ml", **conv)
    compare(want, got)


def _tree_attrs(agg=1, post=0):
    # two trees over 3 features; tree 1 has a set-membership node
    return dict(
        nodes_featureids=[0, 1, 2, 0],
        nodes_modes=np.array([0, 3, 6, 5], dtype=np.uint8),
        nodes_splits=np.array([0.0, 0.5, np.nan, 0.25], dtype=np.float32),
        nodes_truenodeids=[1, 0, 2, 3],
        nodes_trueleafs=[0, 1, 1, 1],
        nodes_falsenodeids=[1, 1, 3, 4],
        nodes_falseleafs=[1, 1, 0, 1],
        nodes_missing_value_tracks_true=[1, 0, 0, 0],
        membership_values=np.array([1.0, 2.0, np.nan], dtype=np.float32),
        leaf_targetids=[0, 1, 0, 1, 0],
        leaf_weights=np.array([1.0, 2.0, 3.0, 4.0, 5.0], dtype=np.float32),
        tree_roots=[0, 2],
        n_targets=2,
        aggregate_function=agg,
        post_transform=post,
    )


@pytest.mark.parametrize("agg", [0, 1, 2, 3])
def test_tree_ensemble(xp, agg):
    host_only(xp)
    X = np.array(
        [[-1, 0.7, 1], [0.5, 0.1, 2], [np.nan, 0.9, 3], [0.2, 0.6, 0.25]], dtype=np.float32
    )
    attrs = _tree_attrs(agg)
    as_tensors = {
        k: helper.make_tensor(
            k, TensorProto.UINT8 if v.dtype == np.uint8 else TensorProto.FLOAT, v.shape, v.tolist()
        )
        if isinstance(v, np.ndarray)
        else v
        for k, v in attrs.items()
    }
    want = reference("TreeEnsemble", [X], opset=5, domain="ai.onnx.ml", **as_tensors)
    compare(want, ours(np, "TreeEnsemble", [X], opset=5, domain="ai.onnx.ml", **attrs))


def test_tree_ensemble_post_transform(xp):
    host_only(xp)
    X = np.array([[-1, 0.7, 1], [0.5, 0.1, 2]], dtype=np.float32)
    raw = to_numpy(ours(np, "TreeEnsemble", [X], opset=5, domain="ai.onnx.ml", **_tree_attrs())[0])
    soft = to_numpy(
        ours(np, "TreeEnsemble", [X], opset=5, domain="ai.onnx.ml", **_tree_attrs(post=1))[0]
    )
    e = np.exp(raw - raw.max(1, keepdims=True))
    np.testing.assert_allclose(soft, e / e.sum(1, keepdims=True), rtol=1e-6)
    logi = to_numpy(
        ours(np, "TreeEnsemble", [X], opset=5, domain="ai.onnx.ml", **_tree_attrs(post=2))[0]
    )
    np.testing.assert_allclose(logi, 1 / (1 + np.exp(-raw)), rtol=1e-6)


@pytest.mark.parametrize("mode", ["TF", "IDF", "TFIDF"])
@pytest.mark.parametrize("grams", [(1, 1, 0), (2, 2, 0), (1, 2, 2), (1, 3, 1), (2, 3, 3)])
@pytest.mark.parametrize("strings", [False, True])
def test_tfidf_vectorizer(xp, mode, grams, strings):
    host_only(xp)
    mn, mx, skip = grams
    pool = [2, 3, 5, 4, 5, 6, 7, 8, 6, 7, 2, 3, 4, 5, 7]  # 5 unigrams, 2 bigrams... see counts
    counts = [0, 5, 9]  # 5 unigrams, 2 bigrams, 2 trigrams
    indexes = list(range(9))
    X = RNG.integers(2, 9, (3, 12)).astype(np.int32)
    X[:, 3:7] = [5, 6, 7, 8]
    attrs = dict(
        mode=mode,
        min_gram_length=mn,
        max_gram_length=mx,
        max_skip_count=skip,
        ngram_counts=counts,
        ngram_indexes=indexes,
        weights=[0.5 + i for i in range(9)],
    )
    if strings:
        X = np.array([[f"w{v}" for v in row] for row in X], dtype=object)
        attrs["pool_strings"] = [f"w{v}" for v in pool]
    else:
        attrs["pool_int64s"] = pool
    check(np, "TfIdfVectorizer", [X], opset=9, **attrs)
    check(np, "TfIdfVectorizer", [X[0]], opset=9, **attrs)


# -- training -----------------------------------------------------------------------

TRAINING = "ai.onnx.preview.training"


@pytest.mark.parametrize("t", [0, 3])
def test_optimizers(xp, t):
    r, tt = np.array(0.1, np.float32), np.array(t, np.int64)
    x1, g1, v1, h1 = f32(3), f32(3), f32(3), RNG.random(3).astype(np.float32)
    x2, g2, v2, h2 = f32(2, 2), f32(2, 2), f32(2, 2), RNG.random((2, 2)).astype(np.float32)
    kw = dict(opset=1, domain=TRAINING, rtol=1e-5, atol=1e-6)
    check(
        xp,
        "Adagrad",
        [r, tt, x1, x2, g1, g2, h1, h2],
        n_outputs=4,
        decay_factor=0.1,
        epsilon=1e-5,
        norm_coefficient=0.01,
        **kw,
    )
    adam = dict(
        alpha=0.9, beta=0.99, epsilon=1e-6, norm_coefficient=0.01, norm_coefficient_post=0.02
    )
    # onnx.reference promotes a single-tensor Adam's X to float64 when T > 0;
    # the spec keeps X's type
    want = [
        w.astype(np.float32)
        for w in reference(
            "Adam", [r, tt, x1, g1, v1, h1], opset=1, domain=TRAINING, n_outputs=3, **adam
        )
    ]
    compare(want, ours(xp, "Adam", [r, tt, x1, g1, v1, h1], opset=1, domain=TRAINING, **adam))
    for mode in ("standard", "nesterov"):
        check(
            xp,
            "Momentum",
            [r, tt, x1, x2, g1, g2, v1, v2],
            n_outputs=4,
            alpha=0.9,
            beta=0.5,
            mode=mode,
            norm_coefficient=0.01,
            **kw,
        )


# -- losses -------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("ignore", [None, 1, -2])
@pytest.mark.parametrize("shape", [(4, 3), (2, 3, 5, 2)])
def test_losses(xp, reduction, weighted, ignore, shape):
    N, C = shape[:2]
    x = f32(*shape)
    target = RNG.integers(0, C, (N,) + shape[2:]).astype(np.int64)
    if ignore is not None:
        target.reshape(-1)[::3] = ignore
    w = RNG.random(C).astype(np.float32) if weighted else None
    attrs = dict(reduction=reduction)
    if ignore is not None:
        attrs["ignore_index"] = ignore
    check(xp, "NegativeLogLikelihoodLoss", [x, target, w], opset=13, rtol=1e-5, atol=1e-6, **attrs)
    check(
        xp,
        "SoftmaxCrossEntropyLoss",
        [x, target, w],
        opset=13,
        n_outputs=2,
        rtol=1e-5,
        atol=1e-6,
        **attrs,
    )


# -- random ---------------------------------------------------------------------------


def test_random_generators(xp):
    u = to_numpy(ours(xp, "RandomUniform", [], opset=22, shape=[200, 50], low=-2.0, high=3.0)[0])
    assert u.dtype == np.float32 and u.shape == (200, 50)
    assert u.min() >= -2.0 and u.max() < 3.0 and abs(u.mean() - 0.5) < 0.1
    n = to_numpy(
        ours(
            xp,
            "RandomNormal",
            [],
            opset=22,
            shape=[20000],
            mean=1.0,
            scale=2.0,
            dtype=TensorProto.DOUBLE,
        )[0]
    )
    assert n.dtype == np.float64 and abs(n.mean() - 1.0) < 0.1 and abs(n.std() - 2.0) < 0.1
    like = to_numpy(ours(xp, "RandomNormalLike", [np.zeros((3, 4), np.float16)], opset=22)[0])
    assert like.dtype == np.float16 and like.shape == (3, 4)
    like = to_numpy(
        ours(
            xp,
            "RandomUniformLike",
            [np.zeros((3, 4), np.float32)],
            opset=22,
            dtype=TensorProto.DOUBLE,
        )[0]
    )
    assert like.dtype == np.float64
    a = to_numpy(ours(xp, "RandomUniform", [], opset=22, shape=[5], seed=3.0)[0])
    b = to_numpy(ours(xp, "RandomUniform", [], opset=22, shape=[5], seed=3.0)[0])
    np.testing.assert_array_equal(a, b)


def test_bernoulli_and_multinomial(xp):
    p = np.full((4000,), 0.3, dtype=np.float32)
    y = to_numpy(ours(xp, "Bernoulli", [p], opset=22)[0])
    assert y.dtype == np.float32 and set(np.unique(y)) <= {0.0, 1.0} and abs(y.mean() - 0.3) < 0.05
    y = to_numpy(
        ours(xp, "Bernoulli", [p.astype(np.float64)], opset=22, dtype=TensorProto.INT32, seed=1.0)[
            0
        ]
    )
    assert y.dtype == np.int32
    probs = np.array([[0.1, 0.2, 0.7], [0.9, 0.05, 0.05]], np.float32)
    s = to_numpy(ours(xp, "Multinomial", [np.log(probs)], opset=22, sample_size=20000, seed=2.0)[0])
    assert s.dtype == np.int32 and s.shape == (2, 20000)
    for row, pr in zip(s, probs):
        np.testing.assert_allclose(np.bincount(row, minlength=3) / row.size, pr, atol=0.02)
    s64 = to_numpy(ours(xp, "Multinomial", [np.log(probs)], opset=22, dtype=TensorProto.INT64)[0])
    assert s64.dtype == np.int64 and s64.shape == (2, 1)


# -- image --------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["PNG", "BMP"])
@pytest.mark.parametrize("pixel_format", ["RGB", "BGR", "Grayscale"])
def test_image_decoder(xp, fmt, pixel_format):
    host_only(xp)
    Image = pytest.importorskip("PIL.Image")
    img = Image.fromarray(RNG.integers(0, 256, (6, 5, 3)).astype(np.uint8), "RGB")
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    data = np.frombuffer(buf.getvalue(), dtype=np.uint8)
    check(np, "ImageDecoder", [data], opset=20, pixel_format=pixel_format)


def test_image_decoder_without_pillow(xp, monkeypatch):
    host_only(xp)
    import sys

    monkeypatch.setitem(sys.modules, "PIL", None)
    monkeypatch.setitem(sys.modules, "PIL.Image", None)
    with pytest.raises(ImportError, match="image"):
        ours(np, "ImageDecoder", [np.zeros(4, np.uint8)], opset=20)


def test_random_uniform_never_reaches_high(xp):
    """The draws lie in [low, high) in float32 too: a float64 draw within half a float32
    step of ``high`` rounds up to it. Four float32 steps wide, an eighth of the draws
    did, before the clamp."""
    high = 1.0 + 2.0 ** -21
    u = to_numpy(ours(xp, "RandomUniform", [], opset=22, shape=[100, 100], low=1.0,
                      high=high, seed=3.0)[0])
    assert u.dtype == np.float32 and u.min() >= 1.0 and u.max() < np.float32(high)
    assert len(np.unique(u)) == 4  # every float32 step below high is drawn
