"""onnx schemas (with type and shape inference) for the quantized contrib ops and the
NCHWc domain, written with `schemas.define` (kernels/contrib/schemas.py).

Without that helper (a tree that has not got it yet) nothing is registered: the
kernels run all the same, and onnx's checker skips domains it has no schemas for.
QLinearConcat (variadic inputs of several types) is left without a schema, and so are
the NCHWc ops named like default-domain ones (see `_define_nchwc`).
"""

from __future__ import annotations

try:
    from hetero_exec.kernels.contrib import schemas
except ImportError:  # pragma: no cover - the helper lands with the contrib norm kernels
    schemas = None  # type: ignore[assignment]

NCHWC = "com.microsoft.nchwc"
_F = ("tensor(float)", "tensor(float16)", "tensor(bfloat16)")
_I8 = ("tensor(int8)", "tensor(uint8)")
_F32 = ("tensor(float)",)


def _attr_int(ctx, name: str, default: int) -> int:
    a = ctx.get_attribute(name)
    return a.i if a is not None else default


def _infer_nbits(ctx) -> None:
    dims = schemas.input_dims(ctx, 0)
    out = None if dims is None else dims[:-1] + [_attr_int(ctx, "N", 0)]
    schemas.set_output(ctx, 0, schemas.elem_type(ctx, 0), out)


def _matmul_dims(ctx, a: int, b: int) -> list | None:
    da, db = schemas.input_dims(ctx, a), schemas.input_dims(ctx, b)
    if da is None or db is None or len(da) < 2 or len(db) != 2:
        return None
    return da[:-1] + [db[-1]]


def _infer_float_product(scale_input: int):
    """Output: float (the scale's type) shaped as A @ B."""

    def infer(ctx) -> None:
        schemas.set_output(ctx, 0, schemas.elem_type(ctx, scale_input), _matmul_dims(ctx, 0, 1))

    return infer


def _infer_qgemm(ctx) -> None:
    da, db = schemas.input_dims(ctx, 0), schemas.input_dims(ctx, 3)
    dims = None
    if da is not None and db is not None and len(da) == 2 and len(db) == 2:
        m = da[1] if _attr_int(ctx, "transA", 0) else da[0]
        n = db[0] if _attr_int(ctx, "transB", 0) else db[1]
        dims = [m, n]
    quantized = ctx.get_num_inputs() > 8 and ctx.has_input(8)
    elem = schemas.elem_type(ctx, 8) if quantized else 1
    schemas.set_output(ctx, 0, elem, dims)


def _infer_gather_block(ctx) -> None:
    data, idx = schemas.input_dims(ctx, 0), schemas.input_dims(ctx, 1)
    dims = None
    if data is not None and idx is not None:
        g = _attr_int(ctx, "gather_axis", 0) % len(data)
        if schemas.elem_type(ctx, 0) == 2 and isinstance(data[-1], int):  # packed uint8
            data = data[:-1] + [data[-1] * (8 // _attr_int(ctx, "bits", 4))]
        dims = data[:g] + idx + data[g + 1:]
    schemas.set_output(ctx, 0, schemas.elem_type(ctx, 2), dims)


def _define_all() -> None:
    d = schemas.define
    d("MatMulNBits", ["A:T1", "B:T2", "scales:T1", "zero_points:T3?", "g_idx:T4?", "bias:T1?"],
      ["Y:T1"], {"T1": _F, "T2": ("tensor(uint8)", "tensor(int32)"),
                 "T3": ("tensor(uint8)", "tensor(int32)") + _F, "T4": ("tensor(int32)",)},
      {"K": "i!", "N": "i!", "bits": "i", "block_size": "i!", "accuracy_level": "i"},
      _infer_nbits)
    d("DynamicQuantizeMatMul", ["A:T1", "B:T2", "b_scale:T1", "b_zero_point:T2?", "bias:T1?"],
      ["Y:T1"], {"T1": _F32, "T2": _I8}, {}, _infer_float_product(0))
    d("MatMulIntegerToFloat", ["A:T1", "B:T2", "a_scale:T3", "b_scale:T3",
                               "a_zero_point:T1?", "b_zero_point:T2?", "bias:T3?"],
      ["Y:T3"], {"T1": _I8, "T2": _I8, "T3": ("tensor(float)", "tensor(float16)")}, {},
      _infer_float_product(2))
    d("QGemm", ["A:TA", "a_scale:T", "a_zero_point:TA", "B:TB", "b_scale:T", "b_zero_point:TB",
                "C:TC?", "y_scale:T?", "y_zero_point:TYZ?"], ["Y:TY"],
      {"T": _F32, "TA": _I8, "TB": _I8, "TC": ("tensor(int32)",), "TYZ": _I8,
       "TY": ("tensor(float)",) + _I8},
      {"alpha": "f", "transA": "i", "transB": "i"}, _infer_qgemm)
    for op in ("QLinearAdd", "QLinearMul"):
        d(op, ["A:T", "A_scale:tensor(float)", "A_zero_point:T?", "B:T",
               "B_scale:tensor(float)", "B_zero_point:T?", "C_scale:tensor(float)",
               "C_zero_point:T?"], ["C:T"], {"T": _I8}, {}, _infer_broadcast)
    for op, attrs in (("QLinearSigmoid", {}), ("QLinearLeakyRelu", {"alpha": "f"})):
        d(op, ["X:T", "X_scale:tensor(float)", "X_zero_point:T?", "Y_scale:tensor(float)",
               "Y_zero_point:T?"], ["Y:T"], {"T": _I8}, attrs, schemas.same_as(0))
    pool_q = ["X:T", "x_scale:tensor(float)", "x_zero_point:T?", "y_scale:tensor(float)",
              "y_zero_point:T?"]
    d("QLinearAveragePool", pool_q, ["Y:T"], {"T": _I8},
      {"auto_pad": "s", "ceil_mode": "i", "channels_last": "i", "count_include_pad": "i",
       "kernel_shape": "ints!", "pads": "ints", "strides": "ints"}, _infer_elem(0))
    d("QLinearGlobalAveragePool", pool_q, ["Y:T"], {"T": _I8}, {"channels_last": "i"},
      _infer_elem(0))
    d("GatherBlockQuantized", ["data:T1", "indices:Tind", "scales:T2", "zero_points:T1?"],
      ["output:T2"], {"T1": ("tensor(int4)", "tensor(uint4)", "tensor(uint8)"),
                      "T2": _F, "Tind": ("tensor(int32)", "tensor(int64)")},
      {"gather_axis": "i", "quantize_axis": "i", "block_size": "i", "bits": "i"},
      _infer_gather_block)
    _define_nchwc(d)


def _infer_elem(i: int):
    def infer(ctx) -> None:
        schemas.set_output(ctx, 0, schemas.elem_type(ctx, i), None)

    return infer


def _infer_broadcast(ctx) -> None:
    da, db = schemas.input_dims(ctx, 0), schemas.input_dims(ctx, 3)
    dims = None
    if da is not None and db is not None:
        n = max(len(da), len(db))
        da, db = [1] * (n - len(da)) + da, [1] * (n - len(db)) + db
        dims = [b if a == 1 else a for a, b in zip(da, db)]
    schemas.set_output(ctx, 0, schemas.elem_type(ctx, 0), dims)


def _define_nchwc(d) -> None:
    """Only the NCHWc ops whose names no other domain has: onnx.reference refuses to
    import once one op name has schemas in two domains (MaxPool, Conv, AveragePool,
    GlobalAveragePool, GlobalMaxPool and Upsample are default-domain names too)."""
    T = {"T": ("tensor(float)",)}
    d("ReorderInput", ["X:T"], ["Y:T"], T, {"channels_last": "i"}, _infer_elem(0),
      domain=NCHWC)
    d("ReorderOutput", ["X:T"], ["Y:T"], T, {"channels": "i", "channels_last": "i"},
      _infer_elem(0), domain=NCHWC)


if schemas is not None:
    _define_all()
