"""The GPU capability table, shared by `gpu` (CuPy) and `sim-gpu` (its emulation).

It is derived from the kernel registry (host-only kernels) plus the dtypes CuPy has,
so every refusal comes with a reason.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

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
        if kdef.host_only is not None:
            return Support(False, f"host-only kernel: {kdef.host_only}")
        return SUPPORTED


def array_nbytes(a: Any) -> int:
    return int(getattr(a, "nbytes", 0) or 0)
