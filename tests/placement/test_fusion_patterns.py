"""The fusions of the exporters' spellings (hetero_exec/placement/fusions/): each fused
graph against the same graph unfused (``optimize=False``), which is checked against
onnxruntime; the fused op counts; and a negative case per family where an
intermediate is also read elsewhere (or the pattern is only close) and nothing fuses."""

from __future__ import annotations

import logging
import math

import numpy as np
import onnx
import pytest
from onnx import helper as h

from hetero_exec import InferenceSession
from tests.placement._models import F, assert_outputs, init, model, ort, rand, vi

RTOL, ATOL = 1e-4, 1e-5
INT64_MAX = 2**63 - 1


def ops_of(sess) -> list[str]:
    return [n.op_type for seg in sess.placement.segments for n in seg.nodes]


def check(m: onnx.ModelProto, feed: dict, counts: dict[str, int], total: int | None = None):
    """Fused against unfused (and unfused against onnxruntime); the fused ops counted."""
    fused = InferenceSession(m, providers=["cpu"])
    plain = InferenceSession(m, providers=["cpu"], optimize=False)
    ops = ops_of(fused)
    for op, n in counts.items():
        assert ops.count(op) == n, ops
    if total is not None:
        assert len(ops) == total, ops
    want = plain.run(None, feed)
    assert_outputs(want, ort(m, feed), RTOL, ATOL)
    assert_outputs(fused.run(None, feed), want, RTOL, ATOL)
    return fused


def const_node(name: str, value) -> onnx.NodeProto:
    return h.make_node("Constant", [], [name], value=onnx.numpy_helper.from_array(np.asarray(value), name))


# --- Conv + BatchNormalization + activation ---------------------------------------------------

X4 = [2, 4, 9, 9]
Y4 = [2, 8, 9, 9]


def conv_act(act: str, opset: int = 17, expose: str | None = None, residual: bool = False):
    """x -> Conv "conv" -> BN -> [Add(skip)] -> ``act`` -> y."""
    rng = np.random.default_rng(3)
    inits = [init("w", (rng.standard_normal((8, 4, 3, 3)) * 0.4).astype(np.float32)),
             init("cb", rng.normal(0, 0.3, 8).astype(np.float32)),
             init("s", rng.uniform(0.5, 1.5, 8).astype(np.float32)),
             init("b", rng.normal(0, 0.5, 8).astype(np.float32)),
             init("mu", rng.normal(0, 0.1, 8).astype(np.float32)),
             init("var", rng.uniform(0.5, 1.5, 8).astype(np.float32))]
    nodes = [h.make_node("Conv", ["x", "w", "cb"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             h.make_node("BatchNormalization", ["c", "s", "b", "mu", "var"], ["n"], name="bn")]
    inputs = [vi("x", F, X4)]
    last = "n"
    if residual:
        inputs.append(vi("skip", F, Y4))
        nodes.append(h.make_node("Add", ["n", "skip"], ["r"], name="add"))
        last = "r"
    if act == "clip_inputs":  # TorchScript's Relu6 at opset >= 11: Constant bounds
        nodes += [const_node("lo", np.float32(0)), const_node("hi", np.float32(6)),
                  h.make_node("Clip", [last, "lo", "hi"], ["y"])]
    elif act == "clip_attrs":  # opset < 11
        nodes.append(h.make_node("Clip", [last], ["y"], min=0.0, max=6.0))
    elif act == "clip_runtime_max":  # the bound is fed: not a constant, no fusion
        inputs.append(vi("cap", F, []))
        inits.append(init("zero", np.float32(0)))
        nodes.append(h.make_node("Clip", [last, "zero", "cap"], ["y"]))
    elif act == "relu_min":  # the dynamo exporter's relu6
        inits.append(init("six", np.float32(6)))
        nodes += [h.make_node("Relu", [last], ["rl"]), h.make_node("Min", ["rl", "six"], ["y"])]
    elif act == "hardsigmoid":
        nodes.append(h.make_node("HardSigmoid", [last], ["y"], alpha=0.25, beta=0.4))
    elif act == "hardswish":
        nodes.append(h.make_node("HardSwish", [last], ["y"]))
    elif act == "mul_hardsigmoid":
        nodes += [h.make_node("HardSigmoid", [last], ["g"], alpha=1 / 6, beta=0.5),
                  h.make_node("Mul", [last, "g"], ["y"])]
    elif act == "silu":
        nodes += [h.make_node("Sigmoid", [last], ["g"]), h.make_node("Mul", ["g", last], ["y"])]
    elif act == "gelu":
        nodes += _gelu_nodes(last, "y", "erf", inits)
    outputs = [vi("y", F, Y4)] + ([vi(expose, F, Y4)] if expose else [])
    return model(nodes, inputs, outputs, inits, opset=opset)


def _conv_feed(residual=False, cap=False):
    feed = {"x": rand(*X4, seed=1)}
    if residual:
        feed["skip"] = rand(*Y4, seed=2)
    if cap:
        feed["cap"] = np.array(0.7, np.float32)
    return feed


@pytest.mark.parametrize("act,opset", [
    ("clip_inputs", 13), ("clip_attrs", 10), ("relu_min", 17), ("hardsigmoid", 17),
    ("hardswish", 14), ("mul_hardsigmoid", 17), ("silu", 17), ("gelu", 17)])
def test_conv_bn_activation(act, opset):
    sess = check(conv_act(act, opset), _conv_feed(), {"FusedConv": 1}, total=1)
    node = sess.placement.segments[0].nodes[0]
    want = {"clip_inputs": "Clip", "clip_attrs": "Clip", "relu_min": "Clip", "hardsigmoid": "HardSigmoid",
            "hardswish": "HardSwish", "mul_hardsigmoid": "HardSwish", "silu": "SiLU",
            "gelu": "Gelu"}[act]
    assert node.attrs["activation"].s.decode() == want and node.name == "conv"


def test_conv_residual_silu():
    check(conv_act("silu", residual=True), _conv_feed(residual=True), {"FusedConv": 1}, total=1)


def test_conv_activation_not_fused_when_its_gate_is_read_elsewhere():
    sess = check(conv_act("silu", expose="g"), _conv_feed(), {"FusedConv": 0})
    assert sorted(ops_of(sess)) == ["Conv", "Mul", "Sigmoid"]  # BN folded, SiLU kept


def test_clip_with_a_fed_bound_is_not_fused():
    sess = check(conv_act("clip_runtime_max"), _conv_feed(cap=True), {"FusedConv": 0})
    assert sorted(ops_of(sess)) == ["Clip", "Conv"]


def test_matmul_bias_silu():
    rng = np.random.default_rng(4)
    inits = [init("w", rng.standard_normal((16, 12)).astype(np.float32) * 0.3),
             init("b", rng.standard_normal(12).astype(np.float32))]
    nodes = [h.make_node("MatMul", ["x", "w"], ["m"]), h.make_node("Add", ["m", "b"], ["a"]),
             h.make_node("Sigmoid", ["a"], ["g"]), h.make_node("Mul", ["a", "g"], ["y"])]
    m = model(nodes, [vi("x", F, [3, 5, 16])], [vi("y", F, [3, 5, 12])], inits)
    check(m, {"x": rand(3, 5, 16)}, {"FusedMatMul": 1}, total=1)


def _gelu_nodes(x: str, y: str, form: str, inits: list) -> list:
    """GELU of ``x`` as the exporters write it: "erf" (torch's nn.GELU), "tanh" (gelu_new),
    or opset 20's Gelu ("op20")."""
    if form == "op20":
        return [h.make_node("Gelu", [x], [y])]
    if form == "erf":
        inits += [init("r2", np.float32(1 / math.sqrt(2))), init("one", np.float32(1)),
                  init("half", np.float32(0.5))]
        return [h.make_node("Mul", [x, "r2"], ["gd"]), h.make_node("Erf", ["gd"], ["ge"]),
                h.make_node("Add", ["ge", "one"], ["ga"]), h.make_node("Mul", [x, "ga"], ["gm"]),
                h.make_node("Mul", ["gm", "half"], [y])]
    inits += [init("three", np.float32(3)), init("c", np.float32(0.044715)),
              init("k", np.float32(math.sqrt(2 / math.pi))), init("one", np.float32(1)),
              init("half", np.float32(0.5))]
    return [h.make_node("Pow", [x, "three"], ["gp"]), h.make_node("Mul", ["gp", "c"], ["gc"]),
            h.make_node("Add", [x, "gc"], ["gi"]), h.make_node("Mul", ["gi", "k"], ["gu"]),
            h.make_node("Tanh", ["gu"], ["gt"]), h.make_node("Mul", [x, "half"], ["gh"]),
            h.make_node("Add", ["gt", "one"], ["g1"]), h.make_node("Mul", ["gh", "g1"], [y])]


@pytest.mark.parametrize("form, want", [("erf", "Gelu"), ("tanh", "GeluTanh"), ("op20", "Gelu")])
def test_matmul_bias_gelu(form, want):
    """The MLP of ViT/BERT/ConvNeXt/Whisper: MatMul + bias + GELU -> one FusedMatMul whose
    activation is the GELU (after fusions/gelu.py made it a FusedGelu)."""
    rng = np.random.default_rng(5)
    inits = [init("w", rng.standard_normal((16, 24)).astype(np.float32) * 0.5),
             init("b", rng.standard_normal(24).astype(np.float32))]
    nodes = [h.make_node("MatMul", ["x", "w"], ["m"]), h.make_node("Add", ["m", "b"], ["a"])]
    nodes += _gelu_nodes("a", "y", form, inits)
    m = model(nodes, [vi("x", F, [3, 5, 16])], [vi("y", F, [3, 5, 24])], inits,
              opset=20 if form == "op20" else 17)
    sess = check(m, {"x": rand(3, 5, 16) * 2}, {"FusedMatMul": 1}, total=1)
    node = sess.placement.segments[0].nodes[0]
    assert node.attrs["activation"].s.decode() == want


def test_gelu_read_elsewhere_stays_apart_from_the_matmul():
    """The product is also an output: MatMul + bias fuse, the GELU stays a FusedGelu."""
    rng = np.random.default_rng(5)
    inits = [init("w", rng.standard_normal((16, 24)).astype(np.float32) * 0.5),
             init("b", rng.standard_normal(24).astype(np.float32))]
    nodes = [h.make_node("MatMul", ["x", "w"], ["m"]), h.make_node("Add", ["m", "b"], ["a"])]
    nodes += _gelu_nodes("a", "y", "erf", inits)
    m = model(nodes, [vi("x", F, [3, 5, 16])], [vi("y", F, [3, 5, 24]), vi("a", F, [3, 5, 24])],
              inits)
    check(m, {"x": rand(3, 5, 16)}, {"FusedMatMul": 1, "FusedGelu": 1}, total=2)


# --- LayerNorm / RMSNorm ---------------------------------------------------------------------

XS = [2, 5, 16]


def _reduce_mean(x: str, out: str, axes, opset: int, nodes: list, inits: list) -> None:
    if opset >= 18:
        name = f"{out}_axes"
        inits.append(init(name, np.array(axes, np.int64)))
        nodes.append(h.make_node("ReduceMean", [x, name], [out]))
    else:
        nodes.append(h.make_node("ReduceMean", [x], [out], axes=axes))


def _divide(num: str, s: str, how: str, out: str, nodes: list, inits: list) -> None:
    if how == "div":
        nodes.append(h.make_node("Div", [num, s], [out]))
    elif how == "recip":
        nodes += [h.make_node("Reciprocal", [s], [f"{out}_r"]), h.make_node("Mul", [num, f"{out}_r"], [out])]
    else:  # 1 / s, then a product
        inits.append(init(f"{out}_one", np.float32(1)))
        nodes += [h.make_node("Div", [f"{out}_one", s], [f"{out}_r"]),
                  h.make_node("Mul", [f"{out}_r", num], [out])]


def _eps(value: float, how: str, nodes: list, inits: list) -> str:
    if how == "constant":
        nodes.append(const_node("eps", np.float32(value)))
    else:
        inits.append(init("eps", np.float32(value)))
    return "eps"


def layer_norm(square="pow", divide="div", eps="init", opset=17, affine=True, axes=(-1,),
               expose: str | None = None):
    nodes, inits = [], []
    axes = list(axes)
    _reduce_mean("x", "m", axes, opset, nodes, inits)
    nodes.append(h.make_node("Sub", ["x", "m"], ["d"]))
    if square == "pow":
        inits.append(init("two", np.float32(2)))
        nodes.append(h.make_node("Pow", ["d", "two"], ["d2"]))
    else:
        nodes.append(h.make_node("Mul", ["d", "d"], ["d2"]))
    _reduce_mean("d2", "v", axes, opset, nodes, inits)
    nodes += [h.make_node("Add", ["v", _eps(1e-5, eps, nodes, inits)], ["ve"]),
              h.make_node("Sqrt", ["ve"], ["s"])]
    _divide("d", "s", divide, "n" if affine else "y", nodes, inits)
    if affine:
        rng = np.random.default_rng(6)
        if axes == [1]:  # channels first: gamma[:, None] * x
            shape = [XS[1], 1]
        else:
            shape = [XS[a] for a in axes] if len(axes) > 1 else [XS[-1]]
        inits += [init("gamma", rng.uniform(0.5, 1.5, shape).astype(np.float32)),
                  init("beta", rng.normal(0, 0.2, shape).astype(np.float32))]
        nodes += [h.make_node("Mul", ["n", "gamma"], ["g"]), h.make_node("Add", ["beta", "g"], ["y"])]
    outputs = [vi("y", F, XS)] + ([vi(expose, F, XS[:-len(axes)] + [1] * len(axes))] if expose else [])
    return model(nodes, [vi("x", F, XS)], outputs, inits, opset=opset)


def _x():
    return {"x": (rand(*XS, seed=5) * 3 + 1).astype(np.float32)}


@pytest.mark.parametrize("kw", [
    dict(square="pow", divide="div", eps="init", opset=13),
    dict(square="mul", divide="recip", eps="constant", opset=18),
    dict(square="pow", divide="one_over", eps="constant", opset=18, affine=False, axes=(2,)),
    dict(square="pow", divide="div", eps="init", opset=17, axes=(-2, -1)),
], ids=["torchscript", "mul-reciprocal-opset18", "no-affine-positive-axis", "two-axes"])
def test_layer_norm_chain(kw):
    sess = check(layer_norm(**kw), _x(), {"FusedLayerNorm": 1}, total=1)
    node = sess.placement.segments[0].nodes[0]
    assert node.attrs["axis"].i == -len(kw.get("axes", (-1,)))


def test_layer_norm_over_a_middle_axis():
    """ConvNeXt's channels-first LayerNorm: over axis 1, gamma and beta along it."""
    sess = check(layer_norm(axes=(1,), opset=13), _x(), {"FusedLayerNorm": 1}, total=1)
    assert list(sess.placement.segments[0].nodes[0].attrs["axes"].ints) == [-2]


def test_layer_norm_chain_kept_when_an_intermediate_is_an_output():
    check(layer_norm(expose="s"), _x(), {"FusedLayerNorm": 0, "FusedRMSNorm": 0, "Sqrt": 1})


def rms_norm(square="pow", divide="recip", weight_first=True, casts=False, opset=17,
             expose: str | None = None):
    """Llama/T5: [Cast] x^2 -> ReduceMean -> +eps -> Sqrt -> 1/. -> x * . [Cast] -> w * ."""
    nodes, inits = [], []
    x = "x"
    if casts:  # hidden_states.to(torch.float32) on a float32 model
        nodes.append(h.make_node("Cast", ["x"], ["xf"], to=F))
        x = "xf"
    if square == "pow":
        inits.append(init("two", np.float32(2)))
        nodes.append(h.make_node("Pow", [x, "two"], ["x2"]))
    else:
        nodes.append(h.make_node("Mul", [x, x], ["x2"]))
    _reduce_mean("x2", "v", [-1], opset, nodes, inits)
    nodes += [h.make_node("Add", ["v", _eps(1e-6, "constant", nodes, inits)], ["ve"]),
              h.make_node("Sqrt", ["ve"], ["s"])]
    _divide(x, "s", divide, "n", nodes, inits)
    if casts:
        nodes.append(h.make_node("Cast", ["n"], ["nc"], to=F))
    n = "nc" if casts else "n"
    inits.append(init("w", np.random.default_rng(7).uniform(0.5, 1.5, XS[-1]).astype(np.float32)))
    nodes.append(h.make_node("Mul", ["w", n] if weight_first else [n, "w"], ["y"]))
    outputs = [vi("y", F, XS)] + ([vi(expose, F, XS[:-1] + [1])] if expose else [])
    return model(nodes, [vi("x", F, XS)], outputs, inits, opset=opset)


@pytest.mark.parametrize("kw", [
    dict(square="pow", divide="recip", weight_first=True, casts=True, opset=18),
    dict(square="mul", divide="div", weight_first=False, opset=13),
    dict(square="pow", divide="one_over", weight_first=True, opset=17),
], ids=["llama-dynamo-casts", "mul-div", "one-over"])
def test_rms_norm_chain(kw):
    check(rms_norm(**kw), _x(), {"FusedRMSNorm": 1}, total=1)


def test_rms_norm_chain_kept_when_the_variance_is_an_output():
    check(rms_norm(expose="v"), _x(), {"FusedRMSNorm": 0, "ReduceMean": 1})


# --- GELU ---------------------------------------------------------------------------------------


def test_gelu_tanh_with_a_cube_of_products():
    inits = [init("c", np.float32(0.044715)), init("k", np.float32(math.sqrt(2 / math.pi))),
             init("one", np.float32(1)), init("half", np.float32(0.5))]
    nodes = [h.make_node("Mul", ["x", "x"], ["xx"]), h.make_node("Mul", ["xx", "x"], ["p"]),
             h.make_node("Mul", ["c", "p"], ["pc"]), h.make_node("Add", ["pc", "x"], ["inner"]),
             h.make_node("Mul", ["k", "inner"], ["u"]), h.make_node("Tanh", ["u"], ["t"]),
             h.make_node("Add", ["one", "t"], ["t1"]), h.make_node("Mul", ["x", "t1"], ["xt"]),
             h.make_node("Mul", ["half", "xt"], ["y"])]
    m = model(nodes, [vi("x", F, [4, 64])], [vi("y", F, [4, 64])], inits)
    check(m, {"x": rand(4, 64, seed=2) * 3}, {"FusedGelu": 1}, total=1)


def test_gelu_erf_with_constants_and_a_product():
    nodes = [const_node("r", np.float32(1 / math.sqrt(2))), const_node("one", np.float32(1)),
             const_node("half", np.float32(0.5)),
             h.make_node("Mul", ["x", "r"], ["d"]), h.make_node("Erf", ["d"], ["e"]),
             h.make_node("Add", ["e", "one"], ["a"]), h.make_node("Mul", ["x", "half"], ["xh"]),
             h.make_node("Mul", ["xh", "a"], ["y"])]
    m = model(nodes, [vi("x", F, [4, 64])], [vi("y", F, [4, 64])])
    check(m, {"x": rand(4, 64, seed=2) * 3}, {"FusedGelu": 1}, total=1)


# --- attention ----------------------------------------------------------------------------------

B, H, S, D = 2, 4, 6, 8


def attention(variant: str, b=B, heads=H, s=S, d=D, expose: str | None = None, axis=-1, opset=17):
    """Q, K, V [b, heads, s, d] (K/V [b, heads/2, s, d] for "gqa"), an additive mask
    [b, 1, 1, s]; scores -> Softmax(axis) -> @ V."""
    nodes, inits = [], []
    inputs = [vi("q", F, [b, heads, s, d]), vi("v", F, [b, heads, s, d])]
    scale = 1 / math.sqrt(d)
    q, k_t = "q", "kt"
    mask = True
    if variant == "pre_transposed":  # K already laid out (b, h, d, s)
        inputs.append(vi("kt", F, [b, heads, d, s]))
    elif variant == "dynamo":  # sqrt(scale) on Q and on K^T
        inputs.append(vi("k", F, [b, heads, s, d]))
        inits.append(init("sq", np.float32(math.sqrt(scale))))
        nodes += [h.make_node("Mul", ["q", "sq"], ["qs"]),
                  h.make_node("Transpose", ["k"], ["kt0"], perm=[0, 1, 3, 2]),
                  h.make_node("Mul", ["kt0", "sq"], ["kt"])]
        q = "qs"
    elif variant == "gqa":  # repeat_kv: Unsqueeze -> Expand -> Reshape of K and V
        g = 2
        kv = heads // g
        inputs = [vi("q", F, [b, heads, s, d]), vi("k", F, [b, kv, s, d]), vi("v0", F, [b, kv, s, d])]
        inits += [init("ax", np.array([2], np.int64)), init("ex", np.array([b, kv, g, s, d], np.int64)),
                  init("rs", np.array([b, heads, s, d], np.int64))]
        for src, out in (("k", "kr"), ("v0", "v")):
            nodes += [h.make_node("Unsqueeze", [src, "ax"], [f"{out}_u"]),
                      h.make_node("Expand", [f"{out}_u", "ex"], [f"{out}_e"]),
                      h.make_node("Reshape", [f"{out}_e", "rs"], [out])]
        nodes.append(h.make_node("Transpose", ["kr"], ["kt"], perm=[0, 1, 3, 2]))
    else:
        inputs.append(vi("k", F, [b, heads, s, d]))
        nodes.append(h.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]))
    nodes.append(h.make_node("MatMul", [q, k_t], ["qk"]))
    last = "qk"
    if variant in ("bert", "where", "gqa", "pre_transposed"):
        inits.append(init("sqrtd", np.float32(math.sqrt(d))))
        nodes.append(h.make_node("Div", ["qk", "sqrtd"], ["sc"]))
        last = "sc"
    elif variant == "no_mask":
        inits.append(init("scale", np.float32(scale)))
        nodes.append(h.make_node("Mul", ["scale", "qk"], ["sc"]))
        last = "sc"
        mask = False
    if variant == "where":  # GPT-2's causal mask
        inits += [init("causal", np.tril(np.ones((s, s), bool))[None, None]),
                  init("minf", np.float32(np.finfo(np.float32).min))]
        nodes.append(h.make_node("Where", ["causal", last, "minf"], ["w"]))
        last = "w"
    if mask:
        inputs.append(vi("mask", F, [b, 1, 1, s]))
        nodes.append(h.make_node("Add", [last, "mask"], ["masked"]))
        last = "masked"
    nodes += [h.make_node("Softmax", [last], ["p"], axis=axis), h.make_node("MatMul", ["p", "v"], ["y"])]
    outputs = [vi("y", F, [b, heads, s, d])] + ([vi(expose, F, [b, heads, s, s])] if expose else [])
    return model(nodes, inputs, outputs, inits, opset=opset)


def attention_feed(m: onnx.ModelProto) -> dict:
    feed = {}
    for i, v in enumerate(m.graph.input):
        shape = [d.dim_value for d in v.type.tensor_type.shape.dim]
        feed[v.name] = rand(*shape, seed=10 + i)
    if "mask" in feed:
        mask = np.zeros(feed["mask"].shape, np.float32)
        mask[1:, ..., -2:] = -10000.0  # later rows padded
        feed["mask"] = mask
    return feed


@pytest.mark.parametrize("variant", ["bert", "no_mask", "pre_transposed", "dynamo", "where", "gqa"])
def test_attention_chain(variant):
    m = attention(variant)
    sess = check(m, attention_feed(m), {"FusedAttention": 1}, total=1)
    node = sess.placement.segments[0].nodes[0]
    assert node.attrs["kv_groups"].i == (2 if variant == "gqa" else 1)
    assert node.attrs["k_transposed"].i == (1 if variant == "pre_transposed" else 0)


def test_attention_softmax_axis_of_opset_11():
    m = attention("bert", axis=3, opset=11)
    check(m, attention_feed(m), {"FusedAttention": 1}, total=1)


def test_attention_in_blocks_of_the_batch():
    """Scores over the block size run a batch slice at a time (the mask sliced with them)."""
    m = attention("bert", b=16, heads=2, s=160, d=8)
    check(m, attention_feed(m), {"FusedAttention": 1}, total=1)


@pytest.mark.parametrize("kw", [dict(expose="sc"), dict(axis=2)], ids=["exposed-scores", "softmax-axis-2"])
def test_attention_chain_kept(kw):
    m = attention("bert", **kw)
    check(m, attention_feed(m), {"FusedAttention": 0, "Softmax": 1})



def test_attention_scale_from_a_partly_symbolic_shape():
    """torch's SDPA export scales Q and K^T by sqrt(1 / sqrt(head size)), the head size read
    by Shape from a query whose batch and sequence are symbolic: the picked dim is static,
    so the scale folds and no Mul over the (cache-long) keys is left."""
    nodes = [h.make_node("Shape", ["q"], ["qs"]),
             const_node("lo", np.array([-1], np.int64)), const_node("hi", np.array([INT64_MAX], np.int64)),
             h.make_node("Slice", ["qs", "lo", "hi"], ["d"]),
             h.make_node("Cast", ["d"], ["df"], to=onnx.TensorProto.FLOAT),
             h.make_node("Sqrt", ["df"], ["sd"]),
             const_node("one", np.float32(1)),
             h.make_node("Div", ["one", "sd"], ["sc"]),
             h.make_node("Sqrt", ["sc"], ["ssc"]),
             h.make_node("Mul", ["q", "ssc"], ["qm"]),
             h.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             h.make_node("Mul", ["kt", "ssc"], ["ktm"]),
             h.make_node("MatMul", ["qm", "ktm"], ["qk"]),
             h.make_node("Add", ["qk", "mask"], ["masked"]),
             h.make_node("Softmax", ["masked"], ["p"], axis=-1),
             h.make_node("MatMul", ["p", "v"], ["y"])]
    qkv = ["batch", H, "seq", D]
    m = model(nodes, [vi("q", F, qkv), vi("k", F, ["batch", H, "total", D]),
                      vi("v", F, ["batch", H, "total", D]), vi("mask", F, ["batch", 1, 1, "total"])],
              [vi("y", F, qkv)], [])
    feed = {"q": rand(B, H, 1, D, seed=1), "k": rand(B, H, S, D, seed=2), "v": rand(B, H, S, D, seed=3),
            "mask": np.zeros((B, 1, 1, S), np.float32)}
    feed["mask"][1, ..., -2:] = -10000.0
    sess = check(m, feed, {"FusedAttention": 1, "Mul": 0})
    node = next(n for seg in sess.placement.segments for n in seg.nodes if n.op_type == "FusedAttention")
    assert node.attrs["scale"].f == pytest.approx(1 / math.sqrt(D))

# --- rotary embedding ---------------------------------------------------------------------------


def rotary(variant: str = "initializers", swapped: bool = False):
    """Llama's q * cos + rotate_half(q) * sin on q [2, 4, 6, 8], cos/sin [1, 1, 6, 8]."""
    nodes, inits = [], []
    half = D // 2
    if variant == "initializers":
        inits += [init("zero", np.array([0], np.int64)), init("h", np.array([half], np.int64)),
                  init("end", np.array([INT64_MAX], np.int64)), init("axis", np.array([-1], np.int64))]
    elif variant == "constants":
        nodes += [const_node("zero", np.array([0], np.int64)), const_node("h", np.array([half], np.int64)),
                  const_node("end", np.array([INT64_MAX], np.int64)), const_node("axis", np.array([3], np.int64))]
    else:  # x.shape[-1] // 2 as TorchScript writes it: Shape -> Gather -> Div -> Unsqueeze
        inits += [init("zero", np.array([0], np.int64)), init("end", np.array([INT64_MAX], np.int64)),
                  init("axis", np.array([-1], np.int64)), init("last", np.array(3, np.int64)),
                  init("two", np.array(2, np.int64)), init("ax0", np.array([0], np.int64))]
        nodes += [h.make_node("Shape", ["q"], ["shp"]), h.make_node("Gather", ["shp", "last"], ["dim"], axis=0),
                  h.make_node("Div", ["dim", "two"], ["hs"]), h.make_node("Unsqueeze", ["hs", "ax0"], ["h"])]
    nodes += [h.make_node("Slice", ["q", "zero", "h", "axis"], ["x1"]),
              h.make_node("Slice", ["q", "h", "end", "axis"], ["x2"]),
              h.make_node("Neg", ["x2"], ["nx2"]),
              h.make_node("Concat", ["x1", "nx2"] if swapped else ["nx2", "x1"], ["rh"], axis=-1),
              h.make_node("Mul", ["cos", "q"], ["a"]),
              h.make_node("Mul", ["rh", "sin"], ["bb"]),
              h.make_node("Add", ["bb", "a"], ["y"])]
    shape = [B, H, S, D]
    return model(nodes, [vi("q", F, shape), vi("cos", F, [1, 1, S, D]), vi("sin", F, [1, 1, S, D])],
                 [vi("y", F, shape)], inits)


def _rotary_feed():
    ang = np.arange(S)[:, None] * (1.0 / 10000 ** (np.arange(D // 2) / (D // 2)))[None]
    ang = np.concatenate([ang, ang], axis=-1)[None, None]
    return {"q": rand(B, H, S, D, seed=3), "cos": np.cos(ang).astype(np.float32),
            "sin": np.sin(ang).astype(np.float32)}


@pytest.mark.parametrize("variant", ["initializers", "constants", "shape_arithmetic"])
def test_rotary_rotate_half(variant):
    sess = check(rotary(variant), _rotary_feed(), {"FusedRotary": 1}, total=1)
    assert sess.placement.segments[0].nodes[0].attrs["split"].i == D // 2


def test_rotary_with_the_halves_swapped_is_not_rotate_half():
    check(rotary(swapped=True), _rotary_feed(), {"FusedRotary": 0, "Concat": 1})


# --- layout chains ------------------------------------------------------------------------------


def layout(chain: list[tuple[str, dict]], out_shape, expose: str | None = None):
    nodes, inits = [], []
    prev = "x"
    for i, (op, kw) in enumerate(chain):
        out = f"t{i}"
        ins = [prev]
        if op == "Reshape":
            inits.append(init(f"shape{i}", np.array(kw.pop("shape"), np.int64)))
            ins.append(f"shape{i}")
        nodes.append(h.make_node(op, ins, [out], **kw))
        prev = out
    nodes.append(h.make_node("Relu", [prev], ["y"]))
    outputs = [vi("y", F, out_shape)] + ([vi(expose, F, out_shape)] if expose else [])
    return model(nodes, [vi("x", F, [2, 3, 4])], outputs, inits)


#: x [2, 3, 4] -> chain -> Relu: (chain, the output's shape, the ops left)
LAYOUTS = {
    "transpose-inverse": ([("Transpose", {"perm": [1, 2, 0]}), ("Transpose", {"perm": [2, 0, 1]})],
                          [2, 3, 4], ["Relu"]),
    "transpose-merge": ([("Transpose", {"perm": [0, 2, 1]}), ("Transpose", {"perm": [2, 0, 1]})],
                        [3, 2, 4], ["Transpose", "Relu"]),
    "transpose-identity": ([("Transpose", {"perm": [0, 1, 2]})], [2, 3, 4], ["Relu"]),
    "reshape-reshape": ([("Reshape", {"shape": [6, 4]}), ("Reshape", {"shape": [4, -1]})],
                        [4, 6], ["Reshape", "Relu"]),
    "reshape-identity": ([("Reshape", {"shape": [2, 3, 4]})], [2, 3, 4], ["Relu"]),
    "cast-no-op": ([("Cast", {"to": F})], [2, 3, 4], ["Relu"]),
    "dropout": ([("Dropout", {})], [2, 3, 4], ["Relu"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_chain(name):
    chain, shape, left = LAYOUTS[name]
    sess = check(layout([(op, dict(kw)) for op, kw in chain], shape), {"x": rand(2, 3, 4)}, {})
    assert ops_of(sess) == left


@pytest.mark.parametrize("chain,shape,kw", [
    ([("Transpose", {"perm": [1, 2, 0]}), ("Transpose", {"perm": [2, 0, 1]})], [2, 3, 4], {"expose": "t1"}),
    ([("Reshape", {"shape": [6, 4]}), ("Reshape", {"shape": [0, 2, -1]})], [6, 2, 2], {}),
], ids=["exposed-result", "reshape-copies-a-dim"])
def test_layout_chain_kept(chain, shape, kw):
    sess = check(layout([(op, dict(k)) for op, k in chain], shape, **kw), {"x": rand(2, 3, 4)}, {})
    assert ops_of(sess) == [op for op, _ in chain] + ["Relu"]


# --- robustness ---------------------------------------------------------------------------------


def test_a_fusion_that_raises_is_skipped_alone(monkeypatch, caplog):
    """One matcher trips on a graph: its fusion is undone and skipped, the others' work
    (and the log) says so, and the session runs."""
    from hetero_exec.placement.fusions import gelu

    def odd(rw, erf):
        rw.add_const("debris", np.zeros(3, np.float32))  # half-done work must not survive
        raise ValueError("an odd graph")

    monkeypatch.setattr(gelu, "_gelu_erf", odd)
    inits = [init("sqrt2", np.float32(math.sqrt(2))), init("one", np.float32(1)),
             init("half", np.float32(0.5))]
    nodes = [h.make_node("Relu", ["x"], ["r"]),
             h.make_node("Div", ["r", "sqrt2"], ["d"]), h.make_node("Erf", ["d"], ["e"]),
             h.make_node("Add", ["e", "one"], ["a"]), h.make_node("Mul", ["r", "a"], ["m"]),
             h.make_node("Mul", ["m", "half"], ["g"]),
             h.make_node("Reshape", ["g", "s1"], ["rs1"]), h.make_node("Reshape", ["rs1", "s2"], ["y"])]
    inits += [init("s1", np.array([8, 8], np.int64)), init("s2", np.array([4, 16], np.int64))]
    m = model(nodes, [vi("x", F, [4, 16])], [vi("y", F, [4, 16])], inits)
    with caplog.at_level(logging.WARNING, logger="hetero_exec.placement.fusions"):
        sess = check(m, {"x": rand(4, 16)}, {"FusedGelu": 0, "Erf": 1, "Reshape": 1})
    assert "fuse_gelu" in caplog.text and "an odd graph" in caplog.text
    assert "debris" not in sess._build.graph.initializers


def test_attention_with_a_window_grouped_mask():
    """Swin: the shift mask added to the scores viewed (-1, nW, h, T, T)."""
    nw, heads, t, d = 4, 2, 5, 8
    rng = np.random.default_rng(8)
    inits = [init("sqrtd", np.float32(math.sqrt(d))),
             init("mask", np.where(rng.random((nw, 1, t, t)) < 0.3, -100.0, 0.0).astype(np.float32)),
             init("s5", np.array([-1, nw, heads, t, t], np.int64)),
             init("s4", np.array([-1, heads, t, t], np.int64))]
    nodes = [h.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             h.make_node("MatMul", ["q", "kt"], ["qk"]), h.make_node("Div", ["qk", "sqrtd"], ["sc"]),
             h.make_node("Reshape", ["sc", "s5"], ["s5v"]), h.make_node("Add", ["s5v", "mask"], ["m5"]),
             h.make_node("Reshape", ["m5", "s4"], ["m4"]), h.make_node("Softmax", ["m4"], ["p"], axis=-1),
             h.make_node("MatMul", ["p", "v"], ["y"])]
    shape = [2 * nw, heads, t, d]
    m = model(nodes, [vi(n, F, shape) for n in ("q", "k", "v")], [vi("y", F, shape)], inits)
    sess = check(m, attention_feed(m), {"FusedAttention": 1}, total=1)
    assert sess.placement.segments[0].nodes[0].attrs["mask_groups"].i == nw


def test_matmul_silu_without_a_bias():
    """Llama's gate projection: MatMul then x * Sigmoid(x)."""
    w = init("w", np.random.default_rng(9).standard_normal((16, 24)).astype(np.float32) * 0.3)
    nodes = [h.make_node("MatMul", ["x", "w"], ["g"]), h.make_node("Sigmoid", ["g"], ["sg"]),
             h.make_node("Mul", ["g", "sg"], ["y"])]
    m = model(nodes, [vi("x", F, [2, 5, 16])], [vi("y", F, [2, 5, 24])], [w])
    check(m, {"x": rand(2, 5, 16)}, {"FusedMatMul": 1}, total=1)


# --- where they fire in the real-architecture benchmark models -------------------------------

#: fused ops each architecture's export must get (both spellings); their GELUs end up
#: as the activation of the MLP's FusedMatMul (or of a FusedConv)
ARCH_FUSED = {
    "mobilenetv2": {"FusedConv"},
    "convnext": {"FusedLayerNorm", "FusedMatMul"},
    "vit": {"FusedMatMul", "FusedAttention"},
    "llama": {"FusedRMSNorm", "FusedRotary", "FusedAttention", "FusedMatMul"},
    "swin": {"FusedMatMul", "FusedAttention"},
    "whisper": {"FusedMatMul", "FusedAttention"},
}
GELU_ARCHS = {"convnext", "vit", "swin", "whisper"}


@pytest.mark.parametrize("arch", list(ARCH_FUSED))
@pytest.mark.parametrize("spelling", ["ts", "dynamo"])
def test_arch_models_get_their_fusions(arch, spelling):
    from bench.arch_models import ARCH_MODELS
    from hetero_exec.ir.load import load
    from hetero_exec.placement.fusions import fuse

    _, graph = load(ARCH_MODELS[f"{arch}_{spelling}"]())
    fuse(graph)
    ops = {n.op_type for n in graph.nodes}
    assert ARCH_FUSED[arch] <= ops, sorted(ops)
    acts = {n.attrs["activation"].s.decode() for n in graph.nodes if "activation" in n.attrs}
    if arch in GELU_ARCHS:
        assert "Gelu" in acts and "FusedGelu" not in ops, (sorted(ops), acts)
    if spelling == "ts" and arch != "mobilenetv2":  # no norm left written out
        assert "Sqrt" not in ops and "Erf" not in ops


# --- control-flow bodies ------------------------------------------------------------------------


def test_loop_body_is_fused_with_its_captured_weights():
    """The body's MatMul + Add(b) + Tanh read W and b from the outer graph: still constants."""
    from bench.models import loop_if

    m = loop_if(trips=5, width=16)
    sess = check(m, {"h0": rand(3, 16, seed=4)}, {"Loop": 1}, total=1)
    body = sess.placement.segments[0].nodes[0].subgraphs["body"]
    assert [n.op_type for n in body.nodes][:1] == ["FusedMatMul"]
    assert body.nodes[0].attrs["activation"].s == b"Tanh"
