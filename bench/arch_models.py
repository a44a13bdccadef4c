"""Real-architecture benchmark models, built with onnx.helper the way torch exports them.

Random weights (seeded), small sizes (each model is a few to a few tens of milliseconds
per batch-8 run on two cores), but the node patterns of real exports:

=================  =========================================================================
``mobilenetv2``    depthwise-separable CNN: 1x1 expand, depthwise 3x3, Relu6 as Clip, 1x1
                   project, residual Adds, BatchNormalization
``convnext``       ConvNeXt blocks: depthwise 7x7, channels-last LayerNorm, erf GELU, layer
                   scale; channels-first LayerNorm (always primitives, as HF writes it)
``vit``            patch-embedding Conv, cls token, LayerNorm, MHA as MatMul/Reshape/
                   Transpose/Softmax, erf GELU
``llama``          decoder: RMSNorm (Pow/ReduceMean/Add/Sqrt/Reciprocal/Mul), rotary
                   embedding (Slice/Neg/Concat/Mul/Add), SiLU as x*Sigmoid(x), grouped KV
                   heads (Unsqueeze/Expand/Reshape), causal mask Add, LM head
``swin``           windowed attention: window partition/reverse Reshape/Transpose, shifted
                   windows (roll as Slice+Concat) with their mask, relative position bias,
                   patch merging
``whisper``        two Conv1d + GELU, then pre-LN attention blocks (q scaled before QK^T)
=================  =========================================================================

Each comes in two spellings, as the two exporters write them (name suffix ``_ts`` and
``_dynamo``):

* ``ts``, the TorchScript exporter (``torch.onnx.export(..., dynamo=False)``) at opset
  14: LayerNorm and GELU as primitives, attention scaled by a Div after QK^T,
  BatchNormalization folded into the Conv in eval mode, shape arithmetic as
  Shape/Gather/Unsqueeze/Concat, reduction axes as attributes;
* ``dynamo``, the dynamo exporter (``torch.onnx.export(..., dynamo=True)``) at opset 18:
  LayerNormalization, GELU with its constant first (``Mul(0.5, .)``), attention as
  torchlib's SDPA decomposition (q and k^T each scaled by sqrt(scale)), BatchNormalization
  kept, Cast nodes around RMSNorm, Shape(start, end) slices, reduction axes as inputs.

>>> import onnx
>>> m = ARCH_MODELS["llama_ts"]()
>>> onnx.checker.check_model(m)
>>> sorted(arch_inputs("llama_ts", 2))
['input_ids']
>>> arch_inputs("mobilenetv2_dynamo", 2)["image"].shape
(2, 3, 128, 128)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx
from onnx import helper

from bench.models import FLOAT, INT64, GraphBuilder

INT64_MAX = np.iinfo(np.int64).max


@dataclass(frozen=True)
class Spelling:
    """How one exporter writes the same module."""

    name: str
    opset: int

    @property
    def dynamo(self) -> bool:
        return self.name == "dynamo"


TS = Spelling("ts", 14)
DYNAMO = Spelling("dynamo", 18)
SPELLINGS = {"ts": TS, "dynamo": DYNAMO}


# -- primitives, spelled per exporter ------------------------------------------------------


def _reduce_mean(b: GraphBuilder, x: str, axes: list[int], sp: Spelling, keepdims: int = 1) -> str:
    if sp.opset >= 18:  # axes became an input at opset 18
        return b.op("ReduceMean", [x, b.const(axes, "axes", np.int64)], keepdims=keepdims)
    return b.op("ReduceMean", [x], axes=axes, keepdims=keepdims)


def _scalar(b: GraphBuilder, v: float, name: str = "c") -> str:
    return b.const(np.float32(v), name)


def _layer_norm_primitives(b: GraphBuilder, x: str, axis: int, scale: str, bias: str, eps: float,
                           sp: Spelling, scale_first: bool = False) -> str:
    """(x - mean) / sqrt(var + eps) * scale + bias over ``axis``, node for node as torch
    writes it: ReduceMean, Sub, Pow, ReduceMean, Add, Sqrt, Div, Mul, Add."""
    mean = _reduce_mean(b, x, [axis], sp)
    d = b.op("Sub", [x, mean])
    var = _reduce_mean(b, b.op("Pow", [d, _scalar(b, 2.0, "two")]), [axis], sp)
    y = b.op("Div", [d, b.op("Sqrt", [b.op("Add", [var, _scalar(b, eps, "eps")])])])
    y = b.op("Mul", [scale, y] if scale_first else [y, scale])
    return b.op("Add", [y, bias])


def layer_norm(b: GraphBuilder, x: str, dim: int, eps: float, sp: Spelling) -> str:
    """nn.LayerNorm over the last axis: primitives (ts) or LayerNormalization (dynamo)."""
    scale = b.uniform((dim,), 0.8, 1.2, "ln_scale")
    bias = b.weight((dim,), 0.02, "ln_bias")
    if sp.dynamo:
        return b.op("LayerNormalization", [x, scale, bias], axis=-1, epsilon=eps)
    return _layer_norm_primitives(b, x, -1, scale, bias, eps, sp)


def layer_norm_channels(b: GraphBuilder, x: str, dim: int, eps: float, sp: Spelling) -> str:
    """HF ConvNeXt's channels-first LayerNorm on [N, C, H, W]: written out by hand in the
    module, so primitives in both spellings, with ``weight[:, None, None] * x``."""
    scale = b.uniform((dim, 1, 1), 0.8, 1.2, "lnc_scale")
    bias = b.weight((dim, 1, 1), 0.02, "lnc_bias")
    return _layer_norm_primitives(b, x, 1, scale, bias, eps, sp, scale_first=True)


def gelu(b: GraphBuilder, x: str, sp: Spelling) -> str:
    """Exact GELU, x * 0.5 * (1 + erf(x / sqrt 2)): torch's symbolic (ts) or torchlib's
    (dynamo: the 0.5 as the first operand of the last Mul)."""
    e = b.op("Erf", [b.op("Div", [x, _scalar(b, math.sqrt(2.0), "sqrt2")])])
    y = b.op("Mul", [x, b.op("Add", [e, _scalar(b, 1.0, "one")])])
    if sp.dynamo:
        return b.op("Mul", [_scalar(b, 0.5, "half"), y])
    return b.op("Mul", [y, _scalar(b, 0.5, "half")])


def linear(b: GraphBuilder, x: str, cin: int, cout: int, bias: bool = True,
           std: float | None = None) -> str:
    """nn.Linear on a 3-D input: MatMul by the [in, out] weight, then Add the bias."""
    y = b.op("MatMul", [x, b.weight((cin, cout), std or 1.0 / math.sqrt(cin), "lin_w")])
    return b.op("Add", [y, b.weight((cout,), 0.02, "lin_b")]) if bias else y


def gemm(b: GraphBuilder, x: str, cin: int, cout: int, out: str | None = None) -> str:
    """nn.Linear on a 2-D input: Gemm with transB (both exporters)."""
    w = b.weight((cout, cin), 1.0 / math.sqrt(cin), "fc_w")
    ins = [x, w, b.weight((cout,), 0.01, "fc_b")]
    if out is None:
        return b.op("Gemm", ins, transB=1)
    b.nodes.append(helper.make_node("Gemm", ins, [out], transB=1))
    return out


def dims(b: GraphBuilder, x: str, axes: tuple[int, ...], sp: Spelling) -> list[str]:
    """x.shape[axis] as 1-element int64 tensors: Shape/Gather/Unsqueeze (ts) or
    Shape(start, end) (dynamo)."""
    if sp.dynamo:
        return [b.op("Shape", [x], start=a, end=a + 1) for a in axes]
    shape = b.op("Shape", [x])
    zero = b.const([0], "axes", np.int64)
    return [b.op("Unsqueeze", [b.op("Gather", [shape, b.const(np.int64(a), "idx")], axis=0), zero])
            for a in axes]


def reshape(b: GraphBuilder, x: str, parts: list[str | int]) -> str:
    """Reshape to a target concatenated from dims (names) and constants (ints)."""
    pieces = [p if isinstance(p, str) else b.const([p], "dim", np.int64) for p in parts]
    return b.op("Reshape", [x, b.op("Concat", pieces, axis=0)])


# -- attention ---------------------------------------------------------------------------


def split_heads(b: GraphBuilder, x: str, ns: list[str], heads: int, dh: int) -> str:
    """[N, S, heads*dh] -> [N, heads, S, dh]."""
    return b.op("Transpose", [reshape(b, x, [*ns, heads, dh])], perm=[0, 2, 1, 3])


def merge_heads(b: GraphBuilder, ctx: str, ns: list[str], hidden: int) -> str:
    """[N, heads, S, dh] -> [N, S, hidden]."""
    return reshape(b, b.op("Transpose", [ctx], perm=[0, 2, 1, 3]), [*ns, hidden])


def sdpa(b: GraphBuilder, q: str, k: str, v: str, dh: int, sp: Spelling, mask: str | None = None,
         prescaled: bool = False) -> str:
    """softmax(q k^T / sqrt(dh) + mask) v on [N, heads, S, dh]: MatMul, Div, Add, Softmax,
    MatMul (ts; ``prescaled``: q already carries the scale, as Whisper's q_proj * scaling),
    or torchlib's decomposition (dynamo): q and k^T each multiplied by sqrt(1/sqrt(dh))."""
    kt = b.op("Transpose", [k], perm=[0, 1, 3, 2])
    if sp.dynamo and not prescaled:
        s = _scalar(b, math.sqrt(1.0 / math.sqrt(dh)), "sqrt_scale")
        scores = b.op("MatMul", [b.op("Mul", [q, s]), b.op("Mul", [kt, s])])
    else:
        scores = b.op("MatMul", [q, kt])
        if not prescaled:
            scores = b.op("Div", [scores, _scalar(b, math.sqrt(dh), "scale")])
    if mask is not None:
        scores = b.op("Add", [scores, mask])
    return b.op("MatMul", [b.op("Softmax", [scores], axis=-1), v])


def mha(b: GraphBuilder, x: str, hidden: int, heads: int, sp: Spelling, k_bias: bool = True,
        q_scale: bool = False) -> str:
    """Self-attention over [N, S, hidden] with separate q, k, v projections and output
    projection (HF ViT / Whisper)."""
    dh = hidden // heads
    ns = dims(b, x, (0, 1), sp)
    q = linear(b, x, hidden, hidden)
    if q_scale:
        q = b.op("Mul", [q, _scalar(b, dh ** -0.5, "scaling")])
    k = linear(b, x, hidden, hidden, bias=k_bias)
    v = linear(b, x, hidden, hidden)
    ctx = sdpa(b, split_heads(b, q, ns, heads, dh), split_heads(b, k, ns, heads, dh),
               split_heads(b, v, ns, heads, dh), dh, sp, prescaled=q_scale)
    return linear(b, merge_heads(b, ctx, ns, hidden), hidden, hidden)


def encoder_block(b: GraphBuilder, x: str, hidden: int, heads: int, ffn: int, eps: float,
                  sp: Spelling, k_bias: bool = True, q_scale: bool = False) -> str:
    """Pre-LN transformer block (ViT, Whisper encoder)."""
    x = b.op("Add", [x, mha(b, layer_norm(b, x, hidden, eps, sp), hidden, heads, sp, k_bias,
                            q_scale)])
    h = gelu(b, linear(b, layer_norm(b, x, hidden, eps, sp), hidden, ffn), sp)
    return b.op("Add", [x, linear(b, h, ffn, hidden)])


# -- MobileNetV2 --------------------------------------------------------------------------

MBV2_IMAGE = 128
#: (expansion t, channels c, repeats n, first stride s), torchvision's table
MBV2_CONFIG = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
               (6, 160, 3, 2), (6, 320, 1, 1))


def _conv_bn_act(b: GraphBuilder, x: str, cin: int, cout: int, k: int, stride: int, group: int,
                 relu6: bool, sp: Spelling) -> str:
    """Conv + BatchNorm (+ Relu6): ts folds the BN into the Conv's weights (eval-mode
    export); dynamo keeps a BatchNormalization node. Relu6 is Clip(0, 6)."""
    w = b.weight((cout, cin // group, k, k), math.sqrt(2.0 / (cin // group * k * k)), "conv_w")
    pad = (k - 1) // 2
    attrs = dict(kernel_shape=[k, k], strides=[stride, stride], pads=[pad] * 4, group=group)
    if sp.dynamo:
        y = b.op("Conv", [x, w], **attrs)
        y = b.op("BatchNormalization", [y, b.uniform((cout,), 0.5, 1.0, "bn_scale"),
                                        b.weight((cout,), 0.05, "bn_bias"),
                                        b.weight((cout,), 0.05, "bn_mean"),
                                        b.uniform((cout,), 0.8, 1.2, "bn_var")], epsilon=1e-5)
    else:
        y = b.op("Conv", [x, w, b.weight((cout,), 0.05, "conv_b")], **attrs)
    if relu6:
        y = b.op("Clip", [y, _scalar(b, 0.0, "min"), _scalar(b, 6.0, "max")])
    return y


def mobilenetv2(sp: Spelling = TS, seed: int = 0, width: float = 1.0,
                classes: int = 1000) -> onnx.ModelProto:
    """MobileNetV2 (torchvision's layout) on [N, 3, 128, 128]."""
    b = GraphBuilder(f"mobilenetv2_{sp.name}", seed)

    def ch(c: int) -> int:  # torchvision's _make_divisible(c * width, 8)
        return max(8, int(c * width + 4) // 8 * 8)

    cin = ch(32)
    x = _conv_bn_act(b, "image", 3, cin, 3, 2, 1, True, sp)
    for t, c, n, s in MBV2_CONFIG:
        cout = ch(c)
        for i in range(n):
            stride = s if i == 0 else 1
            hid = cin * t
            y = x
            if t != 1:
                y = _conv_bn_act(b, y, cin, hid, 1, 1, 1, True, sp)
            y = _conv_bn_act(b, y, hid, hid, 3, stride, hid, True, sp)
            y = _conv_bn_act(b, y, hid, cout, 1, 1, 1, False, sp)
            x = b.op("Add", [x, y]) if stride == 1 and cin == cout else y
            cin = cout
    x = _conv_bn_act(b, x, cin, 1280, 1, 1, 1, True, sp)
    x = b.op("Flatten", [b.op("GlobalAveragePool", [x])], axis=1)
    gemm(b, x, 1280, classes, out="logits")
    return b.model([helper.make_tensor_value_info("image", FLOAT, ["N", 3, MBV2_IMAGE, MBV2_IMAGE])],
                   [helper.make_tensor_value_info("logits", FLOAT, ["N", classes])], sp.opset)


# -- ConvNeXt -----------------------------------------------------------------------------

CONVNEXT_IMAGE = 128
CONVNEXT_DIMS = (40, 80, 160, 320)  # ConvNeXt-atto
CONVNEXT_DEPTHS = (2, 2, 4, 2)


def _convnext_block(b: GraphBuilder, x: str, dim: int, sp: Spelling) -> str:
    """HF ConvNextLayer: dwconv 7x7, permute to NHWC, LayerNorm, Linear 4x, GELU, Linear,
    layer scale, permute back, residual."""
    w = b.weight((dim, 1, 7, 7), math.sqrt(2.0 / 49), "dw_w")
    y = b.op("Conv", [x, w, b.weight((dim,), 0.02, "dw_b")], kernel_shape=[7, 7], pads=[3] * 4,
             group=dim)
    y = b.op("Transpose", [y], perm=[0, 2, 3, 1])
    y = layer_norm(b, y, dim, 1e-6, sp)
    y = linear(b, gelu(b, linear(b, y, dim, 4 * dim), sp), 4 * dim, dim)
    y = b.op("Mul", [b.uniform((dim,), 0.1, 0.5, "layer_scale"), y])
    return b.op("Add", [x, b.op("Transpose", [y], perm=[0, 3, 1, 2])])


def convnext(sp: Spelling = TS, seed: int = 0, classes: int = 1000) -> onnx.ModelProto:
    """ConvNeXt-atto (HF layout) on [N, 3, 128, 128]."""
    b = GraphBuilder(f"convnext_{sp.name}", seed)
    d0 = CONVNEXT_DIMS[0]
    x = b.op("Conv", ["image", b.weight((d0, 3, 4, 4), math.sqrt(2.0 / 48), "stem_w"),
                      b.weight((d0,), 0.02, "stem_b")], kernel_shape=[4, 4], strides=[4, 4])
    x = layer_norm_channels(b, x, d0, 1e-6, sp)
    cin = d0
    for i, (dim, depth) in enumerate(zip(CONVNEXT_DIMS, CONVNEXT_DEPTHS)):
        if i > 0:  # downsampling: channels-first LayerNorm, Conv 2x2 stride 2
            x = layer_norm_channels(b, x, cin, 1e-6, sp)
            x = b.op("Conv", [x, b.weight((dim, cin, 2, 2), math.sqrt(2.0 / (4 * cin)), "down_w"),
                              b.weight((dim,), 0.02, "down_b")], kernel_shape=[2, 2], strides=[2, 2])
        for _ in range(depth):
            x = _convnext_block(b, x, dim, sp)
        cin = dim
    x = layer_norm(b, _reduce_mean(b, x, [-2, -1], sp, keepdims=0), cin, 1e-6, sp)
    gemm(b, x, cin, classes, out="logits")
    return b.model([helper.make_tensor_value_info("image", FLOAT,
                                                  ["N", 3, CONVNEXT_IMAGE, CONVNEXT_IMAGE])],
                   [helper.make_tensor_value_info("logits", FLOAT, ["N", classes])], sp.opset)


# -- ViT ----------------------------------------------------------------------------------

VIT_IMAGE, VIT_PATCH, VIT_HIDDEN, VIT_HEADS, VIT_DEPTH = 128, 16, 192, 3, 6


def vit(sp: Spelling = TS, seed: int = 0, classes: int = 1000) -> onnx.ModelProto:
    """ViT-Tiny-like (HF ViTModel + classifier) on [N, 3, 128, 128]: 64 patches + cls."""
    b = GraphBuilder(f"vit_{sp.name}", seed)
    d, p = VIT_HIDDEN, VIT_PATCH
    tokens = (VIT_IMAGE // p) ** 2
    x = b.op("Conv", ["image", b.weight((d, 3, p, p), math.sqrt(1.0 / (3 * p * p)), "patch_w"),
                      b.weight((d,), 0.02, "patch_b")], kernel_shape=[p, p], strides=[p, p])
    (n,) = dims(b, x, (0,), sp)
    x = b.op("Transpose", [reshape(b, x, [n, d, -1])], perm=[0, 2, 1])  # flatten(2).transpose
    cls = b.op("Expand", [b.weight((1, 1, d), 0.02, "cls"), reshape_target(b, [n, 1, 1])])  # broadcast to [N, 1, d]
    x = b.op("Concat", [cls, x], axis=1)
    x = b.op("Add", [x, b.weight((1, tokens + 1, d), 0.02, "pos")])
    for _ in range(VIT_DEPTH):
        x = encoder_block(b, x, d, VIT_HEADS, 4 * d, 1e-12, sp)
    x = layer_norm(b, x, d, 1e-12, sp)
    first = b.op("Gather", [x, b.const(np.int64(0), "idx")], axis=1)  # the cls token
    gemm(b, first, d, classes, out="logits")
    return b.model([helper.make_tensor_value_info("image", FLOAT, ["N", 3, VIT_IMAGE, VIT_IMAGE])],
                   [helper.make_tensor_value_info("logits", FLOAT, ["N", classes])], sp.opset)


def reshape_target(b: GraphBuilder, parts: list[str | int]) -> str:
    pieces = [p if isinstance(p, str) else b.const([p], "dim", np.int64) for p in parts]
    return b.op("Concat", pieces, axis=0)


# -- Llama --------------------------------------------------------------------------------

LLAMA_VOCAB, LLAMA_HIDDEN, LLAMA_HEADS, LLAMA_KV_HEADS = 4096, 256, 8, 2
LLAMA_FFN, LLAMA_LAYERS, LLAMA_MAX_POS, LLAMA_SEQ = 688, 4, 512, 64


def rms_norm(b: GraphBuilder, x: str, dim: int, eps: float, sp: Spelling) -> str:
    """HF LlamaRMSNorm: x * rsqrt(mean(x^2) + eps) * weight, rsqrt as Sqrt + Reciprocal;
    dynamo keeps the module's float32 Casts."""
    if sp.dynamo:
        x = b.op("Cast", [x], to=FLOAT)
    var = _reduce_mean(b, b.op("Pow", [x, _scalar(b, 2.0, "two")]), [-1], sp)
    inv = b.op("Reciprocal", [b.op("Sqrt", [b.op("Add", [var, _scalar(b, eps, "eps")])])])
    y = b.op("Mul", [x, inv])
    if sp.dynamo:
        y = b.op("Cast", [y], to=FLOAT)
    return b.op("Mul", [b.uniform((dim,), 0.8, 1.2, "rms_w"), y])


def _rotate_half(b: GraphBuilder, x: str, dh: int) -> str:
    """cat(-x[..., dh/2:], x[..., :dh/2])."""
    axes = b.const([-1], "axes", np.int64)
    x1 = b.op("Slice", [x, b.const([0], "starts", np.int64), b.const([dh // 2], "ends", np.int64),
                        axes])
    x2 = b.op("Slice", [x, b.const([dh // 2], "starts", np.int64),
                        b.const([INT64_MAX], "ends", np.int64), axes])
    return b.op("Concat", [b.op("Neg", [x2]), x1], axis=-1)


def _rotary(b: GraphBuilder, x: str, cos: str, sin: str, dh: int) -> str:
    return b.op("Add", [b.op("Mul", [x, cos]), b.op("Mul", [_rotate_half(b, x, dh), sin])])


def _cos_sin(b: GraphBuilder, ids: str, dh: int, sp: Spelling) -> tuple[str, str]:
    """[1, 1, S, dh] cos and sin of positions 0..S-1 times the inverse frequencies."""
    (s,) = dims(b, ids, (1,), sp)
    seq = b.op("Squeeze", [s, b.const([0], "axes", np.int64)])
    pos = b.op("Cast", [b.op("Range", [b.const(np.int64(0), "start"), seq,
                                       b.const(np.int64(1), "delta")])], to=FLOAT)
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, dh, 2, dtype=np.float32) / dh))
    freqs = b.op("Mul", [b.op("Unsqueeze", [pos, b.const([1], "axes", np.int64)]),
                         b.const(inv_freq[None, :], "inv_freq")])  # [S, dh/2]
    emb = b.op("Concat", [freqs, freqs], axis=-1)
    axes01 = b.const([0, 1], "axes", np.int64)
    return (b.op("Unsqueeze", [b.op("Cos", [emb]), axes01]),
            b.op("Unsqueeze", [b.op("Sin", [emb]), axes01]))


def _repeat_kv(b: GraphBuilder, x: str, ns: list[str], kv: int, rep: int, dh: int) -> str:
    """HF repeat_kv: [N, kv, S, dh] -> [N, kv*rep, S, dh] through Unsqueeze/Expand/Reshape."""
    n, s = ns
    y = b.op("Unsqueeze", [x, b.const([2], "axes", np.int64)])
    y = b.op("Expand", [y, reshape_target(b, [n, kv, rep, s, dh])])
    return reshape(b, y, [n, kv * rep, s, dh])


def _causal_mask(b: GraphBuilder, s: str) -> str:
    """[S, S] slice of a constant upper-triangular float mask (0 below, float min above)."""
    m = np.triu(np.full((LLAMA_MAX_POS, LLAMA_MAX_POS), np.finfo(np.float32).min, np.float32), 1)
    zero = b.const([0, 0], "starts", np.int64)
    return b.op("Slice", [b.const(m, "causal"), zero, b.op("Concat", [s, s], axis=0),
                          b.const([0, 1], "axes", np.int64)])


def _llama_attention(b: GraphBuilder, x: str, cos: str, sin: str, mask: str, ns: list[str],
                     sp: Spelling) -> str:
    d, h, kv = LLAMA_HIDDEN, LLAMA_HEADS, LLAMA_KV_HEADS
    dh = d // h
    q = split_heads(b, linear(b, x, d, h * dh, bias=False), ns, h, dh)
    k = split_heads(b, linear(b, x, d, kv * dh, bias=False), ns, kv, dh)
    v = split_heads(b, linear(b, x, d, kv * dh, bias=False), ns, kv, dh)
    q, k = _rotary(b, q, cos, sin, dh), _rotary(b, k, cos, sin, dh)
    k, v = _repeat_kv(b, k, ns, kv, h // kv, dh), _repeat_kv(b, v, ns, kv, h // kv, dh)
    ctx = sdpa(b, q, k, v, dh, sp, mask=mask)
    return linear(b, merge_heads(b, ctx, ns, d), d, d, bias=False)


def _llama_mlp(b: GraphBuilder, x: str) -> str:
    gate = linear(b, x, LLAMA_HIDDEN, LLAMA_FFN, bias=False)
    silu = b.op("Mul", [gate, b.op("Sigmoid", [gate])])
    up = linear(b, x, LLAMA_HIDDEN, LLAMA_FFN, bias=False)
    return linear(b, b.op("Mul", [silu, up]), LLAMA_FFN, LLAMA_HIDDEN, bias=False)


def llama(sp: Spelling = TS, seed: int = 0) -> onnx.ModelProto:
    """A Llama-style decoder: input_ids int64 [N, S] -> logits [N, S, 4096]."""
    b = GraphBuilder(f"llama_{sp.name}", seed)
    d = LLAMA_HIDDEN
    x = b.op("Gather", [b.weight((LLAMA_VOCAB, d), 0.02, "embed"), "input_ids"], axis=0)
    ns = dims(b, "input_ids", (0, 1), sp)
    cos, sin = _cos_sin(b, "input_ids", d // LLAMA_HEADS, sp)
    mask = _causal_mask(b, ns[1])
    for _ in range(LLAMA_LAYERS):
        x = b.op("Add", [x, _llama_attention(b, rms_norm(b, x, d, 1e-6, sp), cos, sin, mask, ns,
                                             sp)])
        x = b.op("Add", [x, _llama_mlp(b, rms_norm(b, x, d, 1e-6, sp))])
    x = rms_norm(b, x, d, 1e-6, sp)
    b.nodes.append(helper.make_node("MatMul", [x, b.weight((d, LLAMA_VOCAB), 0.02, "lm_head")],
                                    ["logits"]))
    return b.model([helper.make_tensor_value_info("input_ids", INT64, ["N", "S"])],
                   [helper.make_tensor_value_info("logits", FLOAT, ["N", "S", LLAMA_VOCAB])],
                   sp.opset)


# -- Swin ---------------------------------------------------------------------------------

SWIN_IMAGE, SWIN_PATCH, SWIN_WINDOW = 112, 4, 7
SWIN_DIMS, SWIN_HEADS, SWIN_DEPTHS = (48, 96), (3, 6), (2, 2)


def _roll(b: GraphBuilder, x: str, shift: int, size: int) -> str:
    """torch.roll(x, (shift, shift), dims=(1, 2)) on [N, H, W, C]: Slice + Concat per axis."""
    for axis in (1, 2):
        k = shift % size
        ax = b.const([axis], "axes", np.int64)
        tail = b.op("Slice", [x, b.const([size - k], "starts", np.int64),
                              b.const([INT64_MAX], "ends", np.int64), ax])
        head = b.op("Slice", [x, b.const([0], "starts", np.int64),
                              b.const([size - k], "ends", np.int64), ax])
        x = b.op("Concat", [tail, head], axis=axis)
    return x


def _shift_mask(size: int, ws: int, shift: int) -> np.ndarray:
    """Swin's attention mask of the shifted windows: [nW, ws*ws, ws*ws], 0 or -100."""
    img = np.zeros((size, size), np.float32)
    cnt = 0
    for hs in (slice(0, -ws), slice(-ws, -shift), slice(-shift, None)):
        for wsl in (slice(0, -ws), slice(-ws, -shift), slice(-shift, None)):
            img[hs, wsl] = cnt
            cnt += 1
    n = size // ws
    win = img.reshape(n, ws, n, ws).transpose(0, 2, 1, 3).reshape(n * n, ws * ws)
    diff = win[:, None, :] - win[:, :, None]
    return np.where(diff != 0, -100.0, 0.0).astype(np.float32)


def _relative_bias(b: GraphBuilder, ws: int, heads: int) -> str:
    """[1, heads, ws*ws, ws*ws] from a learned table gathered by Swin's constant index."""
    coords = np.stack(np.meshgrid(np.arange(ws), np.arange(ws), indexing="ij")).reshape(2, -1)
    rel = (coords[:, :, None] - coords[:, None, :]).transpose(1, 2, 0) + (ws - 1)
    index = (rel[..., 0] * (2 * ws - 1) + rel[..., 1]).reshape(-1).astype(np.int64)
    table = b.weight(((2 * ws - 1) ** 2, heads), 0.02, "rel_table")
    bias = b.op("Gather", [table, b.const(index, "rel_index")], axis=0)
    bias = b.op("Transpose", [b.op("Reshape", [bias, b.const([ws * ws, ws * ws, -1], "shape",
                                                               np.int64)])], perm=[2, 0, 1])
    return b.op("Unsqueeze", [bias, b.const([0], "axes", np.int64)])


def _window_attention(b: GraphBuilder, x: str, dim: int, heads: int, size: int, shift: int,
                      sp: Spelling) -> str:
    """Window partition, attention per window (+ relative bias, + shift mask), reverse."""
    ws, n = SWIN_WINDOW, size // SWIN_WINDOW
    T, dh = ws * ws, dim // heads

    def const_shape(*s):
        return b.const(list(s), "shape", np.int64)

    if shift:
        x = _roll(b, x, -shift, size)
    w = b.op("Reshape", [x, const_shape(-1, n, ws, n, ws, dim)])
    w = b.op("Reshape", [b.op("Transpose", [w], perm=[0, 1, 3, 2, 4, 5]),
                         const_shape(-1, T, dim)])  # [N*nW, T, C]

    def heads_of(t):
        return b.op("Transpose", [b.op("Reshape", [t, const_shape(-1, T, heads, dh)])],
                    perm=[0, 2, 1, 3])

    q, k, v = (heads_of(linear(b, w, dim, dim)) for _ in range(3))
    mask = _relative_bias(b, ws, heads)
    if shift:  # bias [1, h, T, T] + mask [nW, 1, T, T], scores viewed [N, nW, h, T, T]
        mask = b.op("Add", [mask, b.const(_shift_mask(size, ws, shift)[:, None], "shift_mask")])
    kt = b.op("Transpose", [k], perm=[0, 1, 3, 2])
    if sp.dynamo:
        s = _scalar(b, math.sqrt(1.0 / math.sqrt(dh)), "sqrt_scale")
        scores = b.op("MatMul", [b.op("Mul", [q, s]), b.op("Mul", [kt, s])])
    else:
        scores = b.op("Div", [b.op("MatMul", [q, kt]), _scalar(b, math.sqrt(dh), "scale")])
    scores = b.op("Reshape", [scores, const_shape(-1, n * n, heads, T, T)])
    scores = b.op("Reshape", [b.op("Add", [scores, mask]), const_shape(-1, heads, T, T)])
    ctx = b.op("MatMul", [b.op("Softmax", [scores], axis=-1), v])
    ctx = b.op("Reshape", [b.op("Transpose", [ctx], perm=[0, 2, 1, 3]), const_shape(-1, T, dim)])
    y = linear(b, ctx, dim, dim)
    y = b.op("Reshape", [y, const_shape(-1, n, n, ws, ws, dim)])
    y = b.op("Reshape", [b.op("Transpose", [y], perm=[0, 1, 3, 2, 4, 5]),
                         const_shape(-1, size, size, dim)])
    if shift:
        y = _roll(b, y, shift, size)
    return y


def _swin_block(b: GraphBuilder, x: str, dim: int, heads: int, size: int, shift: int,
                sp: Spelling) -> str:
    """x [N, L, C]: LN, windowed attention, residual; LN, GELU MLP, residual."""
    h = b.op("Reshape", [layer_norm(b, x, dim, 1e-5, sp),
                         b.const([-1, size, size, dim], "shape", np.int64)])
    h = _window_attention(b, h, dim, heads, size, shift, sp)
    x = b.op("Add", [x, b.op("Reshape", [h, b.const([-1, size * size, dim], "shape", np.int64)])])
    m = linear(b, gelu(b, linear(b, layer_norm(b, x, dim, 1e-5, sp), dim, 4 * dim), sp),
               4 * dim, dim)
    return b.op("Add", [x, m])


def _patch_merge(b: GraphBuilder, x: str, dim: int, size: int, sp: Spelling) -> str:
    """[N, L, C] -> [N, L/4, 2C]: the four strided sub-grids concatenated, LN, Linear."""
    g = b.op("Reshape", [x, b.const([-1, size, size, dim], "shape", np.int64)])
    parts = []
    for dh_, dw_ in ((0, 0), (1, 0), (0, 1), (1, 1)):
        parts.append(b.op("Slice", [g, b.const([dh_, dw_], "starts", np.int64),
                                    b.const([INT64_MAX, INT64_MAX], "ends", np.int64),
                                    b.const([1, 2], "axes", np.int64),
                                    b.const([2, 2], "steps", np.int64)]))
    g = b.op("Reshape", [b.op("Concat", parts, axis=-1),
                         b.const([-1, (size // 2) ** 2, 4 * dim], "shape", np.int64)])
    return linear(b, layer_norm(b, g, 4 * dim, 1e-5, sp), 4 * dim, 2 * dim, bias=False)


def swin(sp: Spelling = TS, seed: int = 0, classes: int = 1000) -> onnx.ModelProto:
    """A two-stage Swin (window 7, shifted every second block) on [N, 3, 112, 112]."""
    b = GraphBuilder(f"swin_{sp.name}", seed)
    p, d0 = SWIN_PATCH, SWIN_DIMS[0]
    size = SWIN_IMAGE // p
    x = b.op("Conv", ["image", b.weight((d0, 3, p, p), math.sqrt(1.0 / (3 * p * p)), "patch_w"),
                      b.weight((d0,), 0.02, "patch_b")], kernel_shape=[p, p], strides=[p, p])
    (n,) = dims(b, x, (0,), sp)
    x = b.op("Transpose", [reshape(b, x, [n, d0, -1])], perm=[0, 2, 1])
    x = layer_norm(b, x, d0, 1e-5, sp)
    for i, (dim, heads, depth) in enumerate(zip(SWIN_DIMS, SWIN_HEADS, SWIN_DEPTHS)):
        if i > 0:
            x = _patch_merge(b, x, SWIN_DIMS[i - 1], size, sp)
            size //= 2
        for j in range(depth):
            x = _swin_block(b, x, dim, heads, size, SWIN_WINDOW // 2 if j % 2 else 0, sp)
    x = layer_norm(b, x, SWIN_DIMS[-1], 1e-5, sp)
    x = _reduce_mean(b, x, [1], sp, keepdims=0)
    gemm(b, x, SWIN_DIMS[-1], classes, out="logits")
    return b.model([helper.make_tensor_value_info("image", FLOAT, ["N", 3, SWIN_IMAGE, SWIN_IMAGE])],
                   [helper.make_tensor_value_info("logits", FLOAT, ["N", classes])], sp.opset)


# -- Whisper encoder ----------------------------------------------------------------------

WHISPER_MELS, WHISPER_FRAMES, WHISPER_HIDDEN, WHISPER_HEADS, WHISPER_LAYERS = 80, 300, 256, 4, 2


def whisper(sp: Spelling = TS, seed: int = 0) -> onnx.ModelProto:
    """A Whisper-style encoder: [N, 80, 300] log-mel -> [N, 150, 256]. Conv1d k3 + GELU,
    Conv1d k3 stride 2 + GELU, positions, pre-LN blocks (k_proj without bias, q scaled)."""
    b = GraphBuilder(f"whisper_{sp.name}", seed)
    d = WHISPER_HIDDEN
    x = b.op("Conv", ["input_features",
                      b.weight((d, WHISPER_MELS, 3), math.sqrt(2.0 / (3 * WHISPER_MELS)), "c1_w"),
                      b.weight((d,), 0.02, "c1_b")], kernel_shape=[3], pads=[1, 1])
    x = gelu(b, x, sp)
    x = b.op("Conv", [x, b.weight((d, d, 3), math.sqrt(2.0 / (3 * d)), "c2_w"),
                      b.weight((d,), 0.02, "c2_b")], kernel_shape=[3], pads=[1, 1], strides=[2])
    x = b.op("Transpose", [gelu(b, x, sp)], perm=[0, 2, 1])
    x = b.op("Add", [x, b.weight((WHISPER_FRAMES // 2, d), 0.02, "pos")])
    for _ in range(WHISPER_LAYERS):
        x = encoder_block(b, x, d, WHISPER_HEADS, 4 * d, 1e-5, sp, k_bias=False, q_scale=True)
    y = layer_norm(b, x, d, 1e-5, sp)
    b.nodes.append(helper.make_node("Identity", [y], ["last_hidden_state"]))
    return b.model([helper.make_tensor_value_info("input_features", FLOAT,
                                                  ["N", WHISPER_MELS, WHISPER_FRAMES])],
                   [helper.make_tensor_value_info("last_hidden_state", FLOAT,
                                                  ["N", WHISPER_FRAMES // 2, d])], sp.opset)


# -- the catalogue ------------------------------------------------------------------------

_ARCHS: dict[str, Callable[..., onnx.ModelProto]] = {
    "mobilenetv2": mobilenetv2, "convnext": convnext, "vit": vit, "llama": llama, "swin": swin,
    "whisper": whisper,
}


def _bind(build: Callable[..., onnx.ModelProto], sp: Spelling) -> Callable[..., onnx.ModelProto]:
    def model(seed: int = 0) -> onnx.ModelProto:
        return build(sp, seed)

    model.__name__ = f"{build.__name__}_{sp.name}"
    model.__doc__ = f"{build.__doc__} ({sp.name} spelling, opset {sp.opset})"
    return model


#: name -> builder(seed=0), e.g. "convnext_ts", "convnext_dynamo"
ARCH_MODELS: dict[str, Callable[..., onnx.ModelProto]] = {
    f"{arch}_{sp.name}": _bind(build, sp) for arch, build in _ARCHS.items()
    for sp in (TS, DYNAMO)
}

_IMAGE_SIZE = {"mobilenetv2": MBV2_IMAGE, "convnext": CONVNEXT_IMAGE, "vit": VIT_IMAGE,
               "swin": SWIN_IMAGE}


def arch_inputs(name: str, batch: int, seed: int = 0, seq: int = LLAMA_SEQ
                ) -> dict[str, np.ndarray]:
    """A feed for ``ARCH_MODELS[name]`` at ``batch`` (``seq`` tokens for llama)."""
    if name not in ARCH_MODELS:
        raise KeyError(f"unknown model {name!r}; known: {sorted(ARCH_MODELS)}")
    arch = name.rsplit("_", 1)[0]
    rng = np.random.default_rng(seed)
    if arch in _IMAGE_SIZE:
        s = _IMAGE_SIZE[arch]
        return {"image": rng.standard_normal((batch, 3, s, s), np.float32)}
    if arch == "llama":
        return {"input_ids": rng.integers(0, LLAMA_VOCAB, (batch, seq), dtype=np.int64)}
    return {"input_features": rng.standard_normal((batch, WHISPER_MELS, WHISPER_FRAMES),
                                                  np.float32)}
