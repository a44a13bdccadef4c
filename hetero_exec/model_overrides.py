"""SessionOptions edits of the model before it loads, as onnxruntime applies them:
free dimension overrides (a symbolic input dim fixed to a size, by name or by
denotation) and initializers replaced with the caller's values."""

from __future__ import annotations

import copy
from typing import Any

import onnx
from onnx import numpy_helper

from hetero_exec.errors import OptionError


def has_overrides(options: Any) -> bool:
    dims = options._free_dims
    return bool(dims["name"] or dims["denotation"] or options._initializers)


def apply_overrides(model: onnx.ModelProto, options: Any) -> onnx.ModelProto:
    """A copy of ``model`` with the options' overrides applied (the caller's model is kept)."""
    model = copy.deepcopy(model)
    by_name, by_denotation = options._free_dims["name"], options._free_dims["denotation"]
    for vi in model.graph.input:
        if not vi.type.HasField("tensor_type"):
            continue
        for d in vi.type.tensor_type.shape.dim:
            size = by_name.get(d.dim_param) if d.dim_param else None
            if size is None and d.denotation:
                size = by_denotation.get(d.denotation)
            if size is not None:
                d.ClearField("dim_param")
                d.dim_value = size
    _replace_initializers(model, options._initializers)
    return model


def _replace_initializers(model: onnx.ModelProto, values: dict[str, Any]) -> None:
    if not values:
        return
    position = {t.name: i for i, t in enumerate(model.graph.initializer)}
    for name, arr in values.items():
        if name not in position:
            raise OptionError(f"add_initializer: the model has no initializer {name!r}")
        old = model.graph.initializer[position[name]]
        if tuple(old.dims) != tuple(arr.shape) or old.data_type != \
                onnx.helper.np_dtype_to_tensor_dtype(arr.dtype):
            raise OptionError(f"add_initializer: {name!r} is "
                              f"{onnx.TensorProto.DataType.Name(old.data_type).lower()}"
                              f"{list(old.dims)}, got {arr.dtype}{list(arr.shape)}")
        model.graph.initializer[position[name]].CopyFrom(numpy_helper.from_array(arr, name))
