"""What an execution provider is: a name, an array module, and answers to
"can you run this node?" with a reason for each refusal."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from hetero_exec.ir.graph import Node
from hetero_exec.kernels.registry import KernelDef, lookup, refusal, resolve_since

#: ops that run on the coordinator's host whatever the provider (bodies are placed inside)
CONTROL_FLOW_OPS = frozenset({"If", "Loop", "Scan"})
SEQUENCE_OPS = frozenset({
    "SequenceConstruct", "SequenceEmpty", "SequenceInsert", "SequenceErase", "SequenceAt",
    "SequenceLength", "SplitToSequence", "ConcatFromSequence", "SequenceMap",
    "Optional", "OptionalHasElement", "OptionalGetElement",
})


@dataclass(frozen=True)
class Support:
    """A provider's answer for one node: supported, or not with a reason."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


SUPPORTED = Support(True)


@dataclass
class ProviderOptions:
    device_id: int = 0
    mem_limit: int | None = None  # bytes; None: unlimited (cpu) or the device's size
    exclude_ops: frozenset[str] = field(default_factory=frozenset)
    #: sim-gpu only: device values are `sim_array.DeviceArray` (CuPy's boundaries);
    #: False hands kernels plain NumPy arrays (the emulation before strict mode)
    strict: bool = True

    @classmethod
    def parse(cls, opts: dict[str, Any] | None) -> "ProviderOptions":
        from hetero_exec.errors import ProviderError

        opts = dict(opts or {})
        known = {"device_id", "mem_limit", "exclude_ops", "strict"}
        unknown = set(opts) - known
        if unknown:
            raise ProviderError(f"unknown provider option(s) {sorted(unknown)}; known: {sorted(known)}")
        excl = opts.get("exclude_ops") or ()
        if isinstance(excl, str):
            excl = [excl]
        mem = opts.get("mem_limit")
        if mem is not None and (not isinstance(mem, int) or mem < 0):
            raise ProviderError(f"mem_limit must be a non-negative int of bytes, got {mem!r}")
        strict = opts.get("strict", True)
        if not isinstance(strict, bool):
            raise ProviderError(f"strict must be True or False, got {strict!r}")
        return cls(device_id=int(opts.get("device_id", 0)), mem_limit=mem,
                   exclude_ops=frozenset(excl), strict=strict)


class Provider:
    """Base provider: runs whatever the kernel table holds, on ``xp`` arrays."""

    kind = "base"
    is_device = False

    def __init__(self, options: ProviderOptions | None = None):
        self.options = options or ProviderOptions()

    @property
    def name(self) -> str:
        return self.kind

    @property
    def xp(self) -> Any:
        return np

    def available(self) -> Support:
        return SUPPORTED

    def to_device(self, arr: Any) -> Any:
        return arr

    def to_host(self, arr: Any) -> Any:
        return arr

    @property
    def mem_limit(self) -> int | None:
        return self.options.mem_limit

    def kernel_for(self, node: Node, opset: int) -> KernelDef | None:
        return lookup(node.domain, node.op_type, opset)

    def supports_op(self, node: Node, opset: int, shapes: Sequence[Any] = (),
                    dtypes: Sequence[np.dtype | None] = (), kinds: Sequence[str] = ()) -> Support:
        """Supported, or not with the reason (the provider's capability table)."""
        excluded = self._excluded(node)
        if excluded is not None:
            return excluded
        kdef = self.kernel_for(node, opset)
        if kdef is None:
            if resolve_since(node.domain, node.op_type, opset) is None:
                return Support(False, f"unknown operator (no schema for opset {opset})")
            from hetero_exec.exec.functions import function_proto_for_support

            if function_proto_for_support(node, opset):
                return SUPPORTED
            return Support(False, "no kernel registered")
        refused = refusal(kdef, node)
        if refused is not None:
            return Support(False, refused)
        if kdef.dtypes is not None:
            for dt in dtypes:
                if dt is not None and _dtype_name(dt) not in kdef.dtypes:
                    return Support(False, f"dtype {_dtype_name(dt)} not supported by the kernel")
        return self._device_rules(kdef, node, dtypes, kinds)

    def _excluded(self, node: Node) -> Support | None:
        ex = self.options.exclude_ops
        if ex and (node.op_type in ex or f"{node.canonical_domain}::{node.op_type}" in ex
                   or f"{node.domain}::{node.op_type}" in ex):
            return Support(False, "excluded by provider options")
        return None

    def _device_rules(self, kdef: KernelDef, node: Node, dtypes: Sequence[np.dtype | None],
                      kinds: Sequence[str]) -> Support:
        return SUPPORTED


def _dtype_name(dt: np.dtype) -> str:
    dt = np.dtype(dt)
    if dt == np.dtype(object) or dt.kind in "US":
        return "string"
    names = {"float32": "float", "float64": "double", "bool": "bool"}
    return names.get(dt.name, dt.name)
