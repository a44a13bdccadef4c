"""float16 nodes computed in float32 on the host, stored in float16 (onnxruntime's cpu).

onnxruntime's cpu provider has few float16 kernels: it runs a float16 model by casting
each node's float16 inputs to float32 around its float32 kernel, so every node rounds
once, at its output. numpy's float16 arithmetic rounds at every step of a reduction, a
product or a normalisation instead (and its half loops are slow). So a node whose op
accumulates (`FLOAT32_OPS`) and that reads float16 tensors, compiled for numpy, gets
its kernel wrapped here: float16 inputs are upcast (constants once, at compile time, so
the kernel's own ``specialize`` hook sees a float32 weight and packs it as it would for
a float32 model), the kernel runs in float32, and the outputs the graph declares
float16 are cast back. Element-wise ops round once either way; they are wrapped for
speed (numpy's float16 loops are slow). Devices keep their float16 kernels (CuPy computes float16 with float32
accumulation).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from hetero_exec.kernels.registry import KnownInput

HALF = np.dtype(np.float16)
F32 = np.dtype(np.float32)

#: ops whose kernels accumulate or chain several roundings (any domain). Softmax and
#: LogSoftmax are left out: the onnx node suite's float16 attention case, whose expected
#: values round inside the softmax, then misses by one float16 ulp
FLOAT32_OPS = frozenset({
    "MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum", "FusedMatMul", "FusedGemm",
    "FusedConv", "LayerNormalization", "BatchNormalization",
    "InstanceNormalization", "GroupNormalization", "RMSNormalization", "LpNormalization",
    "MeanVarianceNormalization", "LRN", "SimplifiedLayerNormalization",
    "SkipLayerNormalization", "SkipSimplifiedLayerNormalization", "EmbedLayerNormalization",
    "ReduceMean", "ReduceSum", "ReduceSumSquare", "ReduceL1", "ReduceL2", "ReduceLogSum",
    "ReduceLogSumExp", "ReduceProd", "AveragePool", "GlobalAveragePool", "LpPool",
    "GlobalLpPool", "CumSum", "Attention", "MultiHeadAttention", "GroupQueryAttention",
    "RotaryEmbedding", "Gelu", "FastGelu", "BiasGelu", "QuickGelu", "Mish", "Softplus",
    "Resize", "LSTM", "GRU", "RNN",
    # element-wise: the same single rounding either way, but numpy's float16 loops run
    # several times slower than a cast, a float32 loop and a cast back (bert: -40%)
    "Add", "Sub", "Mul", "Div", "Pow", "Sqrt", "Reciprocal", "Exp", "Log", "Erf", "Tanh",
    "Sigmoid", "Relu", "Neg", "Abs", "Where", "Max", "Min", "Clip",
})


def cast(a: Any, dtype: np.dtype) -> Any:
    """``a.astype(dtype)`` between float16 and float32; large contiguous arrays through
    native/half.c (numpy's own conversion is a scalar loop, 20-150x slower)."""
    from hetero_exec.kernels.native.row_kernels import convert_half

    out = convert_half(a, dtype) if type(a) is np.ndarray else None
    return a.astype(dtype) if out is None else out


def half_inputs(xp, node: Any, known: Sequence[KnownInput]) -> tuple[int, ...]:
    """Positions of the float16 inputs of a node that computes in float32 here."""
    if xp is not np or node.op_type not in FLOAT32_OPS:
        return ()
    return tuple(i for i, k in enumerate(known)
                 if k.dtype is not None and np.dtype(k.dtype) == HALF)


def upcast_known(known: Sequence[KnownInput], positions: Sequence[int]) -> list[KnownInput]:
    """What the kernel's hook sees: the float16 inputs as float32 (constants converted)."""
    out = list(known)
    for p in positions:
        k = known[p]
        value = None if k.value is None else np.asarray(k.value, dtype=F32)
        out[p] = KnownInput(k.shape, F32, value, k.overridable)
    return out


def float32_compute(fn: Callable, positions: Sequence[int], known: Sequence[KnownInput],
                    upcast: Sequence[KnownInput], out_dtypes: Sequence[Any]) -> Callable:
    """``fn`` (a float32 kernel) on float16 inputs: constants served from their float32
    copies, the others cast each run; outputs declared float16 (or undeclared float32
    ones) cast back."""
    pos = frozenset(positions)
    # position -> [the constant seen, its float32 copy]; a provider may hand the plan its
    # own copy of an initializer: the first run's array is then the one served
    copies = {p: [None if known[p].overridable else known[p].value, upcast[p].value]
              for p in positions if known[p].value is not None}
    fed = {p: known[p].overridable for p in copies}
    back = [dt is None or np.dtype(dt) == HALF for dt in out_dtypes]

    def as_float32(p: int, a: Any) -> Any:
        if a is None or a.dtype != HALF:
            return a
        entry = copies.get(p)
        if entry is not None:
            if entry[0] is None and not fed[p]:
                entry[0] = a
            if a is entry[0] or (fed[p] and a is known[p].value):
                return entry[1]
        return cast(a, F32)

    def float16_node(xp, *args, **kwargs):
        args = [as_float32(i, a) if i in pos else a for i, a in enumerate(args)]
        outs = fn(xp, *args, **kwargs)
        return tuple(cast(o, HALF)
                     if (i >= len(back) or back[i]) and getattr(o, "dtype", None) == F32
                     else o for i, o in enumerate(outs))

    float16_node.__name__ = f"{getattr(fn, '__name__', 'kernel')}_float32"
    return float16_node
