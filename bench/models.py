"""Benchmark models built with onnx.helper: no downloads, seeded float32 weights.

Each builder returns an ``onnx.ModelProto`` with a symbolic batch dimension ``N``
(and a symbolic sequence ``S`` for the text models). The transformer graphs spell
their shape arithmetic the way ``torch.onnx.export`` does (Shape, Gather, Unsqueeze,
Concat feeding Reshape), so that arithmetic runs at inference time like in real exports.

>>> import onnx
>>> m = MODELS["mlp"]()
>>> onnx.checker.check_model(m)
>>> sorted(inputs("mlp", 2))
['x']
>>> inputs("bert", 2, seq=16)["input_ids"].shape
(2, 16)
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
FLOAT = TensorProto.FLOAT
INT64 = TensorProto.INT64

# text-model sizes (shared by the builders and inputs())
HIDDEN, HEADS = 256, 4
BERT_VOCAB, BERT_MAX_POS, BERT_FFN = 8192, 512, 1024
GPT2_VOCAB, GPT2_MAX_POS = 8192, 512
SEQ = 128
MLP_WIDTH = 1024


class GraphBuilder:
    """Nodes and seeded initializers, with fresh value names: just enough for the builders."""

    def __init__(self, name: str, seed: int = 0):
        self.name = name
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._count: dict[str, int] = {}

    def fresh(self, base: str) -> str:
        n = self._count.get(base, 0)
        self._count[base] = n + 1
        return f"{base}_{n}"

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, **attrs) -> str | list[str]:
        """Add a node; returns its output name (a list when ``n_out`` > 1)."""
        outs = [self.fresh(op_type.lower()) for _ in range(n_out)]
        node = helper.make_node(op_type, inputs, outs, name=self.fresh(op_type), **attrs)
        self.nodes.append(node)
        return outs[0] if n_out == 1 else outs

    def const(self, value, name: str = "c", dtype=None) -> str:
        arr = np.asarray(value, dtype=dtype)
        if arr.dtype == np.float64:
            arr = arr.astype(np.float32)
        full = self.fresh(name)
        self.inits.append(numpy_helper.from_array(arr, full))
        return full

    def weight(self, shape: tuple[int, ...], std: float, name: str = "w") -> str:
        return self.const(self.rng.normal(0.0, std, shape).astype(np.float32), name)

    def uniform(self, shape: tuple[int, ...], lo: float, hi: float, name: str) -> str:
        return self.const(self.rng.uniform(lo, hi, shape).astype(np.float32), name)

    def model(self, inputs: list[onnx.ValueInfoProto], outputs: list[onnx.ValueInfoProto],
              opset: int = OPSET) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, self.name, inputs, outputs, self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                                  producer_name="hetero_exec.bench")
        model.ir_version = 8  # readable by every onnxruntime we test against
        return model


# -- MLP -------------------------------------------------------------------------------


def mlp(seed: int = 0, width: int = MLP_WIDTH, layers: int = 4) -> onnx.ModelProto:
    """``layers`` dense layers of ``width`` with Relu between: Gemm, then MatMul+Add alternately."""
    b = GraphBuilder("mlp", seed)
    x = "x"
    for i in range(layers):
        w_std = math.sqrt(2.0 / width)
        if i % 2 == 0:  # Gemm with a [out, in] weight, as torch exports nn.Linear
            x = b.op("Gemm", [x, b.weight((width, width), w_std), b.weight((width,), 0.01, "b")],
                     transB=1)
        else:
            x = b.op("Add", [b.op("MatMul", [x, b.weight((width, width), w_std)]),
                             b.weight((width,), 0.01, "b")])
        if i < layers - 1:
            x = b.op("Relu", [x])
    b.nodes.append(helper.make_node("Identity", [x], ["y"]))
    return b.model([helper.make_tensor_value_info("x", FLOAT, ["N", width])],
                   [helper.make_tensor_value_info("y", FLOAT, ["N", width])])


# -- ResNet-18 -------------------------------------------------------------------------


def _conv_bn(b: GraphBuilder, x: str, cin: int, cout: int, k: int, stride: int,
             relu: bool) -> str:
    w = b.weight((cout, cin, k, k), math.sqrt(2.0 / (cin * k * k)), "conv_w")
    pad = k // 2
    y = b.op("Conv", [x, w], kernel_shape=[k, k], strides=[stride, stride],
             pads=[pad, pad, pad, pad])
    y = b.op("BatchNormalization", [y, b.uniform((cout,), 0.5, 1.0, "bn_scale"),
                                    b.weight((cout,), 0.05, "bn_bias"),
                                    b.weight((cout,), 0.05, "bn_mean"),
                                    b.uniform((cout,), 0.8, 1.2, "bn_var")], epsilon=1e-5)
    return b.op("Relu", [y]) if relu else y


def _basic_block(b: GraphBuilder, x: str, cin: int, cout: int, stride: int) -> str:
    y = _conv_bn(b, x, cin, cout, 3, stride, relu=True)
    y = _conv_bn(b, y, cout, cout, 3, 1, relu=False)
    shortcut = x
    if stride != 1 or cin != cout:  # strided 1x1 downsample on the shortcut
        shortcut = _conv_bn(b, x, cin, cout, 1, stride, relu=False)
    return b.op("Relu", [b.op("Add", [y, shortcut])])


def resnet18(seed: int = 0, classes: int = 1000) -> onnx.ModelProto:
    """ResNet-18 on [N, 3, 224, 224]; BatchNormalization nodes kept (not folded into Conv)."""
    b = GraphBuilder("resnet18", seed)
    x = _conv_bn(b, "image", 3, 64, 7, 2, relu=True)
    x = b.op("MaxPool", [x], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        x = _basic_block(b, x, cin, cout, stride)
        x = _basic_block(b, x, cout, cout, 1)
        cin = cout
    x = b.op("Flatten", [b.op("GlobalAveragePool", [x])], axis=1)
    fc_w = b.weight((classes, 512), math.sqrt(1.0 / 512), "fc_w")
    b.nodes.append(helper.make_node("Gemm", [x, fc_w, b.weight((classes,), 0.01, "fc_b")],
                                    ["logits"], transB=1))
    return b.model([helper.make_tensor_value_info("image", FLOAT, ["N", 3, 224, 224])],
                   [helper.make_tensor_value_info("logits", FLOAT, ["N", classes])])


# -- transformer pieces, exported the torch way ------------------------------------------


def _dims(b: GraphBuilder, x: str, axes: tuple[int, ...]) -> list[str]:
    """Shape(x)[axis] for each axis, as 1-element int64 tensors (Shape, Gather, Unsqueeze)."""
    shape = b.op("Shape", [x])
    zero = b.const([0], "axes")
    return [b.op("Unsqueeze", [b.op("Gather", [shape, b.const(np.int64(a), "idx")], axis=0), zero])
            for a in axes]


def _split_heads(b: GraphBuilder, x: str, heads: int, perm: list[int]) -> str:
    """[N, S, H] -> [N, heads, S, H/heads] (or the key's [N, heads, dh, S] through ``perm``)."""
    n, s = _dims(b, x, (0, 1))
    shape = b.op("Concat", [n, s, b.const([heads], "heads"), b.const([HIDDEN // heads], "dh")],
                 axis=0)
    return b.op("Transpose", [b.op("Reshape", [x, shape])], perm=perm)


def _merge_heads(b: GraphBuilder, ctx: str, like: str) -> str:
    """[N, heads, S, dh] -> [N, S, H], the target shape taken from ``like`` ([N, S, H])."""
    n, s = _dims(b, like, (0, 1))
    shape = b.op("Concat", [n, s, b.const([HIDDEN], "hidden")], axis=0)
    return b.op("Reshape", [b.op("Transpose", [ctx], perm=[0, 2, 1, 3]), shape])


def _linear(b: GraphBuilder, x: str, cin: int, cout: int, std: float = 0.02) -> str:
    """MatMul by a [in, out] weight, then Add the bias (torch's export of nn.Linear on 3-D)."""
    return b.op("Add", [b.op("MatMul", [x, b.weight((cin, cout), std)]),
                        b.weight((cout,), 0.02, "bias")])


def _layer_norm(b: GraphBuilder, x: str, eps: float) -> str:
    return b.op("LayerNormalization", [x, b.uniform((HIDDEN,), 0.8, 1.2, "ln_scale"),
                                       b.weight((HIDDEN,), 0.02, "ln_bias")],
                axis=-1, epsilon=eps)


def _positions(b: GraphBuilder, ids: str, table: str) -> str:
    """Position embeddings for ids [N, S]: Gather(table, Range(0, S)) -> [S, H]."""
    shape = b.op("Shape", [ids])
    seq = b.op("Gather", [shape, b.const(np.int64(1), "idx")], axis=0)
    pos = b.op("Range", [b.const(np.int64(0), "start"), seq, b.const(np.int64(1), "delta")])
    return b.op("Gather", [table, pos], axis=0)


def _attention(b: GraphBuilder, q: str, k: str, v: str, like: str, masked) -> str:
    """Scaled dot-product attention; ``masked(scores)`` applies the model's mask."""
    scores = b.op("MatMul", [_split_heads(b, q, HEADS, [0, 2, 1, 3]),
                             _split_heads(b, k, HEADS, [0, 2, 3, 1])])
    scores = b.op("Div", [scores, b.const(np.float32(math.sqrt(HIDDEN // HEADS)), "scale")])
    probs = b.op("Softmax", [masked(scores)], axis=-1)
    ctx = b.op("MatMul", [probs, _split_heads(b, v, HEADS, [0, 2, 1, 3])])
    return _merge_heads(b, ctx, like)


# -- BERT ------------------------------------------------------------------------------


def _gelu_erf(b: GraphBuilder, x: str) -> str:
    """x * 0.5 * (1 + erf(x / sqrt 2)), node for node as torch exports nn.GELU()."""
    e = b.op("Erf", [b.op("Div", [x, b.const(np.float32(math.sqrt(2.0)), "sqrt2")])])
    y = b.op("Mul", [x, b.op("Add", [e, b.const(np.float32(1.0), "one")])])
    return b.op("Mul", [y, b.const(np.float32(0.5), "half")])


def bert(seed: int = 0, layers: int = 4) -> onnx.ModelProto:
    """A BERT encoder: inputs input_ids and attention_mask (int64 [N, S]), output [N, S, 256]."""
    b = GraphBuilder("bert", seed)
    word = b.weight((BERT_VOCAB, HIDDEN), 0.02, "word_emb")
    pos_table = b.weight((BERT_MAX_POS, HIDDEN), 0.02, "pos_emb")
    x = b.op("Add", [b.op("Gather", [word, "input_ids"], axis=0),
                     _positions(b, "input_ids", pos_table)])
    x = b.op("Add", [x, b.weight((HIDDEN,), 0.02, "type_emb")])  # token type 0 everywhere
    x = _layer_norm(b, x, 1e-12)
    # extended mask: (1 - mask[:, None, None, :]) * -10000, added to the scores
    m = b.op("Cast", [b.op("Unsqueeze", ["attention_mask", b.const([1, 2], "axes")])], to=FLOAT)
    m = b.op("Mul", [b.op("Sub", [b.const(np.float32(1.0), "one"), m]),
                     b.const(np.float32(-10000.0), "neg")])
    for _ in range(layers):
        q, k, v = (_linear(b, x, HIDDEN, HIDDEN) for _ in range(3))
        att = _attention(b, q, k, v, x, lambda s: b.op("Add", [s, m]))
        x = _layer_norm(b, b.op("Add", [_linear(b, att, HIDDEN, HIDDEN), x]), 1e-12)
        h = _gelu_erf(b, _linear(b, x, HIDDEN, BERT_FFN))
        x = _layer_norm(b, b.op("Add", [_linear(b, h, BERT_FFN, HIDDEN), x]), 1e-12)
    b.nodes.append(helper.make_node("Identity", [x], ["last_hidden_state"]))
    return b.model([helper.make_tensor_value_info("input_ids", INT64, ["N", "S"]),
                    helper.make_tensor_value_info("attention_mask", INT64, ["N", "S"])],
                   [helper.make_tensor_value_info("last_hidden_state", FLOAT, ["N", "S", HIDDEN])])


# -- GPT-2 -----------------------------------------------------------------------------


def _gelu_tanh(b: GraphBuilder, x: str) -> str:
    """0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3))), as torch exports gelu_new."""
    cube = b.op("Pow", [x, b.const(np.float32(3.0), "three")])
    inner = b.op("Add", [x, b.op("Mul", [cube, b.const(np.float32(0.044715), "c")])])
    t = b.op("Tanh", [b.op("Mul", [inner, b.const(np.float32(math.sqrt(2.0 / math.pi)), "k")])])
    y = b.op("Mul", [b.op("Mul", [x, b.const(np.float32(0.5), "half")]),
                     b.op("Add", [t, b.const(np.float32(1.0), "one")])])
    return y


def _causal(b: GraphBuilder, like: str, buffer: str, scores: str) -> str:
    """Where(bias[:, :, :S, :S], scores, min): HF GPT-2's causal mask, sliced by sequence length."""
    (s,) = _dims(b, like, (1,))
    zero = b.const([0], "zero")
    axes = b.const([2, 3], "axes")
    ends = b.op("Concat", [s, s], axis=0)
    mask = b.op("Slice", [buffer, b.op("Concat", [zero, zero], axis=0), ends, axes])
    return b.op("Where", [mask, scores, b.const(np.float32(np.finfo(np.float32).min), "minf")])


def gpt2(seed: int = 0, layers: int = 4) -> onnx.ModelProto:
    """A GPT-2 decoder: input_ids int64 [N, S] -> logits [N, S, 8192] (opset 18)."""
    b = GraphBuilder("gpt2", seed)
    wte = b.weight((GPT2_VOCAB, HIDDEN), 0.02, "wte")
    wpe = b.weight((GPT2_MAX_POS, HIDDEN), 0.01, "wpe")
    buffer = b.const(np.tril(np.ones((GPT2_MAX_POS, GPT2_MAX_POS), bool))[None, None], "bias")
    x = b.op("Add", [b.op("Gather", [wte, "input_ids"], axis=0), _positions(b, "input_ids", wpe)])
    split = b.const([HIDDEN] * 3, "split")
    for _ in range(layers):
        h = _layer_norm(b, x, 1e-5)
        q, k, v = b.op("Split", [_linear(b, h, HIDDEN, 3 * HIDDEN), split], n_out=3, axis=2)
        att = _attention(b, q, k, v, h, lambda s: _causal(b, h, buffer, s))
        x = b.op("Add", [x, _linear(b, att, HIDDEN, HIDDEN)])
        h = _gelu_tanh(b, _linear(b, _layer_norm(b, x, 1e-5), HIDDEN, 4 * HIDDEN))
        x = b.op("Add", [x, _linear(b, h, 4 * HIDDEN, HIDDEN)])
    x = _layer_norm(b, x, 1e-5)
    head = b.op("Transpose", [wte], perm=[1, 0])  # tied LM head: folds at load
    b.nodes.append(helper.make_node("MatMul", [x, head], ["logits"]))
    return b.model([helper.make_tensor_value_info("input_ids", INT64, ["N", "S"])],
                   [helper.make_tensor_value_info("logits", FLOAT, ["N", "S", GPT2_VOCAB])],
                   opset=18)


# -- per-node overhead -----------------------------------------------------------------


def tiny_ops(n: int = 1000, width: int = 16) -> onnx.ModelProto:
    """A chain of ``n`` element-wise ops (Add, Mul, Relu in turn) on a [1, width] tensor.

    >>> len(tiny_ops(7).graph.node)
    7
    """
    b = GraphBuilder("tiny_ops")
    add = b.const(np.full((width,), 0.5, np.float32), "add")
    mul = b.const(np.full((width,), 0.999, np.float32), "mul") if n > 1 else None
    x = "x"
    for i in range(n):
        kind = i % 3
        out = "y" if i == n - 1 else b.fresh("t")
        if kind == 0:
            b.nodes.append(helper.make_node("Add", [x, add], [out]))
        elif kind == 1:
            b.nodes.append(helper.make_node("Mul", [x, mul], [out]))
        else:
            b.nodes.append(helper.make_node("Relu", [x], [out]))
        x = out
    return b.model([helper.make_tensor_value_info("x", FLOAT, [1, width])],
                   [helper.make_tensor_value_info("y", FLOAT, [1, width])])


def loop_if(trips: int = 64, width: int = 64, seed: int = 0) -> onnx.ModelProto:
    """A Loop of ``trips`` iterations over a small body with an If inside (a recurrent
    cell): h <- tanh(h W + b); then Relu(h) if sum(h) > 0 else -h; the per-step sums are
    the scan output. Input h0 [N, width], outputs the last h and the sums [trips, N].

    >>> [n.op_type for n in loop_if(4).graph.node]
    ['Loop']
    """
    rng = np.random.default_rng(seed)
    w = numpy_helper.from_array((rng.standard_normal((width, width)) / math.sqrt(width))
                                .astype(np.float32), "W")
    b = numpy_helper.from_array(rng.normal(0, 0.1, width).astype(np.float32), "b")
    zero = numpy_helper.from_array(np.float32(0), "zero")
    hv = helper.make_tensor_value_info
    then_g = helper.make_graph([helper.make_node("Relu", ["t"], ["then_h"])], "then", [],
                               [hv("then_h", FLOAT, ["N", width])])
    else_g = helper.make_graph([helper.make_node("Neg", ["t"], ["else_h"])], "else", [],
                               [hv("else_h", FLOAT, ["N", width])])
    body = helper.make_graph(
        [helper.make_node("MatMul", ["h_in", "W"], ["m"]),
         helper.make_node("Add", ["m", "b"], ["a"]),
         helper.make_node("Tanh", ["a"], ["t"]),
         helper.make_node("ReduceSum", ["t"], ["total"], keepdims=0),
         helper.make_node("Greater", ["total", "zero"], ["pos"]),
         helper.make_node("If", ["pos"], ["h_out"], then_branch=then_g, else_branch=else_g),
         helper.make_node("ReduceSum", ["h_out", "last"], ["step_sum"], keepdims=0),
         helper.make_node("Identity", ["cond_in"], ["cond_out"])],
        "body",
        [hv("i", INT64, []), hv("cond_in", TensorProto.BOOL, []), hv("h_in", FLOAT, ["N", width])],
        [hv("cond_out", TensorProto.BOOL, []), hv("h_out", FLOAT, ["N", width]),
         hv("step_sum", FLOAT, ["N"])])
    last = numpy_helper.from_array(np.array([1], np.int64), "last")
    trip = numpy_helper.from_array(np.array(trips, np.int64), "trips")
    node = helper.make_node("Loop", ["trips", "", "h0"], ["h", "sums"], body=body)
    graph = helper.make_graph([node], "loop_if", [hv("h0", FLOAT, ["N", width])],
                              [hv("h", FLOAT, ["N", width]), hv("sums", FLOAT, [trips, "N"])],
                              [w, b, zero, last, trip])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="hetero_exec.bench")
    model.ir_version = 8
    return model


MODELS: dict[str, Callable[..., onnx.ModelProto]] = {
    "mlp": mlp, "resnet18": resnet18, "bert": bert, "gpt2": gpt2,
}


def inputs(name: str, batch: int, seed: int = 0, seq: int = SEQ) -> dict[str, np.ndarray]:
    """A feed for ``MODELS[name]`` at ``batch`` (``seq`` tokens for the text models)."""
    rng = np.random.default_rng(seed)
    if name == "mlp":
        return {"x": rng.standard_normal((batch, MLP_WIDTH), np.float32)}
    if name == "resnet18":
        return {"image": rng.standard_normal((batch, 3, 224, 224), np.float32)}
    if name == "bert":
        ids = rng.integers(0, BERT_VOCAB, (batch, seq), dtype=np.int64)
        mask = np.ones((batch, seq), np.int64)
        for i in range(1, batch):  # later rows padded at the end, as a batched tokenizer does
            mask[i, seq - (i * seq) // (2 * batch):] = 0
        return {"input_ids": ids, "attention_mask": mask}
    if name == "gpt2":
        return {"input_ids": rng.integers(0, GPT2_VOCAB, (batch, seq), dtype=np.int64)}
    raise KeyError(f"unknown model {name!r}; known: {sorted(MODELS)}")
