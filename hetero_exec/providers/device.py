"""The GPU capability table, shared by `gpu` (CuPy) and `sim-gpu` (its emulation).

It is derived from the kernel registry (host-only kernels) plus the dtypes CuPy has,
so every refusal comes with a reason.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import onnx

from hetero_exec.ir.graph import Node
from hetero_exec.kernels.registry import KernelDef
from hetero_exec.providers.base import SUPPORTED, Provider, Support, _dtype_name

#: dtypes CuPy has no arrays for (ml_dtypes' extensions, strings)
DEVICE_MISSING_DTYPES = frozenset({
    "bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
    "float8_e8m0fnu", "int4", "uint4", "int2", "uint2", "float4_e2m1fn",
})


class DeviceCapabilities(Provider):
    """Rules every GPU-like provider applies on top of the kernel table."""

    is_device = True

    def _device_rules(self, kdef: KernelDef, node: Node, dtypes: Sequence[np.dtype | None],
                      kinds: Sequence[str]) -> Support:
        for kind in kinds:
            if kind in ("sequence", "map", "optional"):
                return Support(False, f"{kind} values are not supported on the GPU")
        for dt in dtypes:
            if dt is None:
                continue
            name = _dtype_name(dt)
            if name == "string":
                return Support(False, "string tensors are not supported on the GPU")
            if name in DEVICE_MISSING_DTYPES:
                return Support(False, f"dtype {name} is not available in CuPy")
        refused = _output_dtype_refusal(node)
        if refused is not None:
            return refused
        if kdef.host_only is not None:
            return Support(False, f"host-only kernel: {kdef.host_only}")
        return SUPPORTED


#: attributes that name the dtype of a node's output (Cast.to, QuantizeLinear's
#: output_dtype, the generators' dtype) or hold it (Constant's and ConstantOfShape's value)
_DTYPE_ATTRS = ("to", "output_dtype", "dtype")
_VALUE_ATTRS = ("value", "sparse_value")


def _output_dtype_refusal(node: Node) -> Support | None:
    """A node whose attributes make it produce a dtype CuPy has no arrays of."""
    codes = [node.attrs[a].i for a in _DTYPE_ATTRS
             if a in node.attrs and node.attrs[a].type == onnx.AttributeProto.INT]
    codes += [node.attrs[a].t.data_type for a in _VALUE_ATTRS
              if a in node.attrs and node.attrs[a].type == onnx.AttributeProto.TENSOR]
    for code in codes:
        if not code:
            continue
        try:
            name = _dtype_name(np.dtype(onnx.helper.tensor_dtype_to_np_dtype(code)))
        except (KeyError, TypeError, ValueError):
            continue
        if name == "string":
            return Support(False, "string tensors are not supported on the GPU")
        if name in DEVICE_MISSING_DTYPES:
            return Support(False, f"dtype {name} is not available in CuPy")
    return None


def map_tensors(value: Any, move: Callable[[Any], Any]) -> Any:
    """``move`` applied to a tensor, or to each tensor of a sequence value (a list);
    None (an absent optional) and maps stay as they are."""
    if type(value) is list:
        return [map_tensors(v, move) for v in value]
    if value is None or isinstance(value, dict):
        return value
    return move(value)


def array_nbytes(a: Any) -> int:
    return int(getattr(a, "nbytes", 0) or 0)
