"""Every failure a user can act on, under one base class.

Each error names what is wrong (SEMANTICS.md section 3). After any of them the
session that raised it keeps working.
"""

from __future__ import annotations

from typing import Any, Sequence


class HeteroExecError(Exception):
    """Base class of every error hetero_exec raises on purpose."""


# --- loading -----------------------------------------------------------------


class ModelLoadError(HeteroExecError):
    """The model could not be read: truncated, corrupt or invalid."""


class GraphCycleError(ModelLoadError):
    """The graph is not a DAG."""

    def __init__(self, nodes: Sequence[str]):
        self.nodes = list(nodes)
        super().__init__(f"graph has a cycle through {len(self.nodes)} node(s): " + ", ".join(self.nodes))


class ControlFlowError(ModelLoadError):
    """A control-flow node's signature is inconsistent (SEMANTICS.md 1.1)."""

    def __init__(self, node: str, op_type: str, reason: str):
        self.node, self.op_type, self.reason = node, op_type, reason
        super().__init__(f"{op_type} {node}: {reason}")


class UnsupportedOperatorError(HeteroExecError):
    """A node the requested provider cannot run (load time, or run time for symbolic shapes)."""

    def __init__(self, node: str, domain: str, op_type: str, opset: int, provider: str, reason: str):
        self.node, self.domain, self.op_type = node, domain, op_type
        self.opset, self.provider, self.reason = opset, provider, reason
        super().__init__(
            f"unsupported operator {domain}::{op_type} (opset {opset}) at {node} "
            f"on provider {provider!r}: {reason}"
        )


class MissingKernelsError(UnsupportedOperatorError):
    """Ops of the model that no provider has a kernel for, all of them at once, at
    session build: ``missing`` maps each ``domain::op_type`` to its node count (through
    subgraphs); ``nodes`` holds up to 3 node identities per op. The single-node fields
    (node, domain, op_type, opset) describe the first missing node."""

    def __init__(self, missing: dict[str, int], nodes: dict[str, list[str]], first: tuple,
                 provider: str):
        self.missing, self.nodes = dict(missing), {k: list(v) for k, v in nodes.items()}
        node, domain, op_type, opset = first
        self.node, self.domain, self.op_type = node, domain, op_type
        self.opset, self.provider = opset, provider
        self.reason = "no kernel registered"
        listed = "; ".join(f"{op} x{n} (at {', '.join(self.nodes.get(op, []))})"
                           for op, n in sorted(self.missing.items()))
        HeteroExecError.__init__(
            self, f"no kernel for {len(self.missing)} operator(s) of this model, on any "
                  f"provider (requested {provider!r}): {listed}. First: unsupported operator "
                  f"{domain}::{op_type} (opset {opset}) at {node}: {self.reason}")

    def __reduce__(self):
        first = (self.node, self.domain, self.op_type, self.opset)
        return (type(self), (self.missing, self.nodes, first, self.provider))


# --- session configuration ---------------------------------------------------


class ProviderError(HeteroExecError):
    """An unknown provider name, bad provider options or an unusable provider."""


class OptionError(ProviderError, ValueError):
    """An unknown session option, config entry or run option, or a bad value for one."""


class OptionTypeError(OptionError, TypeError):
    """A session or run option set to a value of the wrong type."""


class UnknownOptionError(OptionError, AttributeError):
    """Setting an option that SessionOptions or RunOptions does not have."""


class PlacementError(HeteroExecError):
    """The placement request cannot be satisfied (affinity pins, saved plans, guard)."""


class HeterogeneousPlacementRequired(PlacementError):
    """The GPU is required but some nodes would need another provider."""

    def __init__(self, report: Any):
        self.report = report
        super().__init__(f"heterogeneous placement required: {report}")


class MemoryAdmissionError(PlacementError):
    """A segment needs more memory than its provider has free (refused before admission)."""

    def __init__(self, segment: str, provider: str, needed: int, free: int, detail: str = ""):
        self.segment, self.provider, self.needed, self.free = segment, provider, needed, free
        msg = (
            f"segment {segment} on {provider} needs {needed} bytes but {free} bytes are free"
        )
        super().__init__(msg + (f" ({detail})" if detail else ""))


class UnboundedSymbolError(PlacementError):
    """A symbolic dim has no provable ceiling, so memory cannot be admitted."""

    def __init__(self, symbol: str, value: str):
        self.symbol, self.value = symbol, value
        super().__init__(
            f"symbolic dim {symbol!r} (in {value!r}) has no declared bound; "
            f"pass dim_bounds={{{symbol!r}: N}}"
        )


class NotSupportedForHeterogeneous(HeteroExecError):
    """An API that needs a single device, called on a heterogeneous session."""

    def __init__(self, what: str):
        super().__init__(f"not supported for a heterogeneous session: {what}")


# --- running -----------------------------------------------------------------


class InputError(HeteroExecError, ValueError):
    """Base of the errors about the feeds given to run()."""


class UnknownInputError(InputError):
    def __init__(self, name: str, known: Sequence[str]):
        self.name = name
        super().__init__(f"unknown input {name!r}; the model's inputs are {list(known)}")


class MissingInputError(InputError):
    def __init__(self, name: str):
        self.name = name
        super().__init__(f"missing required input {name!r}")


class DtypeMismatchError(InputError):
    def __init__(self, name: str, expected: str, got: str):
        self.name, self.expected, self.got = name, expected, got
        super().__init__(f"input {name!r}: dtype mismatch, expected {expected}, got {got}")


class RankMismatchError(InputError):
    def __init__(self, name: str, expected: Sequence[Any], got: Sequence[int]):
        self.name, self.expected, self.got = name, tuple(expected), tuple(got)
        super().__init__(
            f"input {name!r}: rank mismatch, expected rank {len(self.expected)} "
            f"{_shape(self.expected)}, got rank {len(self.got)} {_shape(self.got)}"
        )


class DimMismatchError(InputError):
    def __init__(self, name: str, expected: Sequence[Any], got: Sequence[int]):
        self.name, self.expected, self.got = name, tuple(expected), tuple(got)
        super().__init__(
            f"input {name!r}: static dim mismatch, expected shape {_shape(self.expected)}, "
            f"got shape {_shape(self.got)}"
        )


class SymbolConflictError(InputError):
    def __init__(self, symbol: str, first: int, second: int, where: str = ""):
        self.symbol, self.first, self.second = symbol, first, second
        super().__init__(
            f"symbol conflict: dim {symbol!r} bound to {first} and to {second}"
            + (f" ({where})" if where else "")
        )


class UnresolvedShapeError(HeteroExecError):
    def __init__(self, value: str, producer: str):
        self.value, self.producer = value, producer
        super().__init__(f"unresolved shape for value {value!r} produced by {producer}")


class SequenceOutputError(HeteroExecError):
    """A run bound to device buffers returns tensors only (SEMANTICS.md section 3)."""

    def __init__(self, name: str, kind: str, call: str = "run_with_iobinding", use: str = "run"):
        self.name, self.kind, self.call, self.use = name, kind, call, use
        super().__init__(
            f"output {name!r} is a {kind}, not a tensor: {call}() returns tensors only; "
            f"call session.{use}(...) to get sequences, maps and optionals"
        )


class RunTerminatedError(HeteroExecError):
    """The run's RunOptions.terminate flag was set."""

    def __init__(self, tag: str = ""):
        self.tag = tag
        super().__init__("run terminated: RunOptions.terminate is set"
                         + (f" (run {tag!r})" if tag else ""))


class OrtValueError(HeteroExecError, ValueError):
    """An OrtValue used where its kind or device does not fit (named in the message)."""


class UnknownOutputError(HeteroExecError, ValueError):
    def __init__(self, name: str, known: Sequence[str]):
        self.name = name
        super().__init__(f"unknown output {name!r}; the model's outputs are {list(known)}")


class KernelError(HeteroExecError):
    """A kernel failed while running a node: names node, op, and input shapes."""

    def __init__(self, node: str, op: str, detail: str, segment: str | None = None):
        self.node, self.op, self.detail, self.segment = node, op, detail, segment
        where = f"segment {segment}, " if segment else ""
        super().__init__(f"{where}node {node} ({op}) failed: {detail}")


class ActorError(HeteroExecError):
    """A Ray segment actor could not be created, reached or recovered."""


class BuildError(HeteroExecError):
    """A session build failed and its release failed too (SEMANTICS.md section 6)."""

    def __init__(self, build_error: BaseException, release_error: BaseException):
        self.build_error, self.release_error = build_error, release_error
        super().__init__(
            f"session build failed: {build_error!r}; releasing what it created also failed: "
            f"{release_error!r}"
        )


def _shape(shape: Sequence[Any]) -> str:
    return "[" + ", ".join(str(d) if d is not None else "?" for d in shape) + "]"
