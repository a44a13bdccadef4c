"""onnx OpSchemas for onnxruntime's contrib ops, so onnx's checker and shape inference
accept models that use them (onnxruntime registers these itself; onnx knows none).

`define` registers one schema; a second registration of the same (domain, op, since) is
ignored, so modules may define their schemas at import however often they are loaded.
Inputs and outputs are written ``"name:T"``, with a trailing ``?`` when optional;
attributes map a name to its onnx type letter (``f``, ``i``, ``s``, ``floats``, ``ints``),
with a trailing ``!`` when required. ``infer`` (optional) is called as
``infer(ctx)`` with onnx's InferenceContext; an exception there leaves the outputs
untyped rather than failing the model's inference.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, Mapping, Sequence

import onnx
from onnx import TypeProto
from onnx.defs import OpSchema

log = logging.getLogger(__name__)

MS_DOMAIN = "com.microsoft"

_ATTR_TYPES = {
    "f": OpSchema.AttrType.FLOAT, "i": OpSchema.AttrType.INT, "s": OpSchema.AttrType.STRING,
    "floats": OpSchema.AttrType.FLOATS, "ints": OpSchema.AttrType.INTS,
    "t": OpSchema.AttrType.TENSOR, "g": OpSchema.AttrType.GRAPH,
}

FLOATS = ("tensor(float)", "tensor(float16)", "tensor(double)", "tensor(bfloat16)")

_DONE: set[tuple[str, str, int]] = set()


def _param(spec: str) -> OpSchema.FormalParameter:
    optional = spec.endswith("?")
    name, type_str = spec.rstrip("?").split(":")
    option = (OpSchema.FormalParameterOption.Optional if optional
              else OpSchema.FormalParameterOption.Single)
    return OpSchema.FormalParameter(name, type_str, param_option=option)


def define(name: str, inputs: Sequence[str], outputs: Sequence[str],
           constraints: Mapping[str, Iterable[str]], attrs: Mapping[str, str] | None = None,
           infer: Callable | None = None, domain: str = MS_DOMAIN, since: int = 1) -> None:
    """Register one contrib op's schema with onnx (once; later calls are no-ops)."""
    key = (domain, name, since)
    if key in _DONE:
        return
    _DONE.add(key)
    if domain and onnx.defs.has(name):
        # an op of the default domain has this name (Attention, RotaryEmbedding, Gelu):
        # onnx's reference evaluator assumes names unique across domains and breaks for
        # every user once both exist; such a contrib op loads without a schema
        log.debug("no onnx schema for %s::%s: the default domain has an op of that name",
                  domain, name)
        return
    try:
        existing = onnx.defs.get_schema(name, since, domain)
        if existing.since_version == since and existing.domain == domain:
            return  # registered already (by an earlier import, or by onnx itself)
    except onnx.defs.SchemaError:
        pass
    attributes = []
    for attr, kind in (attrs or {}).items():
        required = kind.endswith("!")
        attributes.append(OpSchema.Attribute(attr, _ATTR_TYPES[kind.rstrip("!")], "",
                                             required=required))
    schema = OpSchema(name, domain, since, "", inputs=[_param(i) for i in inputs],
                      outputs=[_param(o) for o in outputs],
                      type_constraints=[(t, list(allowed), "") for t, allowed in constraints.items()],
                      attributes=attributes)
    if infer is not None:
        schema.set_type_and_shape_inference_function(_guarded(name, infer))
    try:
        onnx.defs.register_schema(schema)
    except Exception as e:  # noqa: BLE001 - a schema onnx refuses only costs the checks
        log.warning("onnx refused the schema of %s::%s: %s", domain, name, e)


def _guarded(name: str, infer: Callable) -> Callable:
    def run(ctx) -> None:
        try:
            infer(ctx)
        except Exception as e:  # noqa: BLE001 - inference is advisory
            log.debug("shape inference of %s failed: %s", name, e)

    return run


# --------------------------------------------------------------------------- inference helpers


def input_type(ctx, i: int) -> TypeProto | None:
    if i >= ctx.get_num_inputs() or not ctx.has_input(i):
        return None
    return ctx.get_input_type(i)


def elem_type(ctx, i: int) -> int:
    tp = input_type(ctx, i)
    return tp.tensor_type.elem_type if tp is not None and tp.HasField("tensor_type") else 0


def input_dims(ctx, i: int) -> list | None:
    """Input i's dims (int, symbol name, or None when unknown), or None without a shape."""
    tp = input_type(ctx, i)
    if tp is None or not tp.tensor_type.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
            for d in tp.tensor_type.shape.dim]


def set_output(ctx, i: int, elem: int, dims: Sequence | None = None) -> None:
    """Output i is a tensor of ``elem`` (onnx code) with ``dims`` (ints, symbols, None)."""
    if i >= ctx.get_num_outputs() or not ctx.has_output(i) or not elem:
        return
    tp = onnx.helper.make_tensor_type_proto(elem, None)
    if dims is not None:
        shape = tp.tensor_type.shape
        for d in dims:
            dim = shape.dim.add()
            if isinstance(d, int):
                dim.dim_value = d
            elif isinstance(d, str):
                dim.dim_param = d
    ctx.set_output_type(i, tp)


def attr_int(ctx, name: str, default: int = 0) -> int:
    a = ctx.get_attribute(name)
    return a.i if a is not None else default


def attr_ints(ctx, name: str) -> list[int]:
    a = ctx.get_attribute(name)
    return list(a.ints) if a is not None else []


def same_as(i: int = 0, *outputs: int) -> Callable:
    """Each output in ``outputs`` (default: output 0) has input i's type and shape."""

    def infer(ctx) -> None:
        for o in outputs or (0,):
            set_output(ctx, o, elem_type(ctx, i), input_dims(ctx, i))

    return infer
