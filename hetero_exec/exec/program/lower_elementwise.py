"""Element-wise steps as records: unary, binary (numpy's broadcasting), Where, Cast,
Identity. The records take float32 for the arithmetic; integer types for what shape and
mask arithmetic does (+ - * max min, comparisons); bool for logic."""

from __future__ import annotations

import numpy as np

from hetero_exec.exec.program.place import NotLowered
from hetero_exec.exec.program.registry import lowers
from hetero_exec.kernels.fused import FUSED_DOMAIN

F32 = np.dtype(np.float32)
INTS = (np.dtype(np.int64), np.dtype(np.int32))
BOOL = np.dtype(np.bool_)

#: op -> (unary code, the input types it takes)
UNARY = {"Neg": ("U_NEG", (F32, *INTS)), "Abs": ("U_ABS", (F32, *INTS)),
         "Sqrt": ("U_SQRT", (F32,)), "Reciprocal": ("U_RECIP", (F32,)), "Exp": ("U_EXP", (F32,)),
         "Log": ("U_LOG", (F32,)), "Sigmoid": ("U_SIGMOID", (F32,)), "Tanh": ("U_TANH", (F32,)),
         "Cos": ("U_COS", (F32,)), "Sin": ("U_SIN", (F32,)), "Erf": ("U_ERF", (F32,)),
         "Relu": ("U_RELU", (F32,)), "Floor": ("U_FLOOR", (F32,)), "Ceil": ("U_CEIL", (F32,)),
         "Softplus": ("U_SOFTPLUS", (F32,)), "IsNaN": ("U_ISNAN", (F32,)),
         "Not": ("U_NOT", (BOOL,))}

#: op -> (binary code, the input types it takes)
BINARY = {"Add": ("B_ADD", (F32, *INTS)), "Sub": ("B_SUB", (F32, *INTS)),
          "Mul": ("B_MUL", (F32, *INTS)), "Div": ("B_DIV", (F32,)), "Pow": ("B_POW", (F32,)),
          "Max": ("B_MAX", (F32, *INTS)), "Min": ("B_MIN", (F32, *INTS)),
          "Equal": ("B_EQ", (F32, *INTS, BOOL)), "Less": ("B_LT", (F32, *INTS)),
          "LessOrEqual": ("B_LE", (F32, *INTS)), "Greater": ("B_GT", (F32, *INTS)),
          "GreaterOrEqual": ("B_GE", (F32, *INTS)), "And": ("B_AND", (BOOL,)),
          "Or": ("B_OR", (BOOL,)), "Xor": ("B_XOR", (BOOL,))}


def _takes(place, types) -> None:
    if place is None or place.dtype not in types:
        raise NotLowered(f"element type {None if place is None else place.dtype}")


#: above this many values the unary functions libm computes one value at a time lose
#: to numpy's vectorised loops: those steps stay numpy's
LARGE = 1 << 14
#: unary codes act.c computes a vector at a time (the fused epilogues' functions)
SIMD_ACT = {"U_TANH": "ACT_TANH", "U_SIGMOID": "ACT_SIGMOID", "U_GELU": "ACT_GELU",
            "U_GELU_TANH": "ACT_GELU_TANH", "U_ERF": "ACT_ERF"}
_SCALAR = {"U_EXP", "U_LOG", "U_COS", "U_SIN", "U_ERF", "U_SOFTPLUS"}


def apply_unary(b, code: str, out, x) -> None:
    """out = code(x): act.c's vector loops on a contiguous float32 value of any size (a
    decode step's GELU over 256 values took 3 us in libm's tanhf, one value at a time),
    the record's own loop otherwise."""
    if out.dtype == F32:
        act = SIMD_ACT.get(code)
        if act is not None and out.contiguous and out.size:
            b.elementwise("OP_COPY", 0, out, [x])
            cols = out.shape[-1] if out.shape else 1
            b.emit("OP_BIAS_ACT", tensors=[out, None], p=[out.size // cols, cols, b.codes[act]],
                   parts=b.parts(out.size // cols, 8.0 * out.size))
            return
        if out.size > LARGE and code in _SCALAR:
            raise NotLowered(f"{code} over {out.size} values")
    b.elementwise("OP_UNARY", b.codes[code], out, [x])


@lowers(*UNARY)
def unary(b, st, ins, outs):
    code, types = UNARY[st.node.op_type]
    x = ins[0]
    _takes(x, types)
    out = b.like(outs[0], [x])
    apply_unary(b, code, out, x)
    return [out]


@lowers("IsInf")
def is_inf(b, st, ins, outs):
    if not (st.kwargs.get("detect_negative", 1) and st.kwargs.get("detect_positive", 1)):
        raise NotLowered("IsInf of one sign")
    _takes(ins[0], (F32,))
    out = b.like(outs[0])
    b.elementwise("OP_UNARY", b.codes["U_ISINF"], out, [ins[0]])
    return [out]


@lowers("Gelu")
@lowers("FusedGelu", domain=FUSED_DOMAIN)
def gelu(b, st, ins, outs):
    _takes(ins[0], (F32,))
    approximate = st.kwargs.get("approximate", "none")
    code = {"none": "U_GELU", "tanh": "U_GELU_TANH"}.get(approximate)
    if code is None:
        raise NotLowered(f"Gelu approximate={approximate!r}")
    out = b.like(outs[0], [ins[0]])
    apply_unary(b, code, out, ins[0])
    return [out]


@lowers(*BINARY)
def binary(b, st, ins, outs):
    code, types = BINARY[st.node.op_type]
    if len(ins) == 1 and st.node.op_type in ("Max", "Min"):
        return [ins[0]]
    if len(ins) != 2:
        raise NotLowered(f"{st.node.op_type} of {len(ins)} inputs")
    x, y = ins
    _takes(x, types)
    _takes(y, (x.dtype,))
    out = b.like(outs[0], [x, y])
    b.elementwise("OP_BINARY", b.codes[code], out, [x, y])
    return [out]


@lowers("Where")
def where(b, st, ins, outs):
    cond, x, y = ins
    _takes(cond, (BOOL,))
    if x is None or y is None or x.dtype != y.dtype or x.dtype != outs[0].dtype:
        raise NotLowered("Where of mixed types")
    out = b.like(outs[0], [x, y, cond])
    b.elementwise("OP_WHERE", 0, out, [cond, x, y])
    return [out]


_CASTABLE = (F32, np.dtype(np.float64), *INTS, np.dtype(np.int8), np.dtype(np.uint8), BOOL)


@lowers("Cast")
def cast(b, st, ins, outs):
    x = ins[0]
    _takes(x, _CASTABLE)
    if outs[0].dtype not in _CASTABLE:
        raise NotLowered(f"Cast to {outs[0].dtype}")
    if x.dtype == outs[0].dtype:
        return [x]
    out = b.like(outs[0], [x])
    b.elementwise("OP_CAST", 0, out, [x])
    return [out]


@lowers("Identity")
def identity(b, st, ins, outs):
    if ins[0] is None:
        raise NotLowered("Identity of nothing")
    return [ins[0]]


def merged_run(b, st, ins, outs):
    """A run of element-wise steps merged at compile time (exec/elementwise_runs.py): the
    first op into a fresh value, each later one in place on it."""
    from hetero_exec.exec import elementwise_runs as er

    op0, rest = st.fn.merged
    out = b.like(outs[0])
    if out.dtype != F32:
        raise NotLowered(f"a merged run of {out.dtype}")
    k = 2 if op0 in BINARY else 1
    _apply(b, op0, out, list(ins[:k]))
    for op, kind in rest:
        if kind in (er.VALUE_FIRST, er.VALUE_SECOND):
            other = ins[k]
            k += 1
            _apply(b, op, out, [out, other] if kind == er.VALUE_FIRST else [other, out])
        else:
            _apply(b, op, out, [out])
    return [out]


def _apply(b, op: str, out, args) -> None:
    for x in args:
        _takes(x, (F32,))
    if len(args) == 2:
        b.elementwise("OP_BINARY", b.codes[BINARY[op][0]], out, args)
    else:
        apply_unary(b, UNARY[op][0], out, args[0])
