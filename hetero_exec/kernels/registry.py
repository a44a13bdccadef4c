"""The one kernel table: (domain, op_type, since_version) -> KernelDef.

Kernels are plain functions named after the ONNX op::

    @kernel("Relu")
    def Relu(xp, x):
        return (xp.maximum(x, 0),)

* the first parameter is the array module (numpy or cupy) of the provider running it;
* then the node's inputs, positionally (an omitted optional input is ``None``);
* then the node's attributes as keyword parameters with the spec's defaults
  (an op that turned an attribute into an input keeps one kernel: the same name is
  a positional input in new opsets and a keyword attribute in old ones);
* it returns a tuple of outputs.

A kernel may also name a ``specialize`` hook, called once per node at compile time with
the provider's array module, the node's attributes and what is known of its inputs
(`KnownInput`: shapes, dtypes, constant values). It returns the function to run for that
node (same signature as the kernel), or None to keep the kernel: so a kernel picks its
path (a convolution's GEMM form, say) from attributes and shapes once, not every run.

Optional keyword-only parameters the executor fills in when a kernel declares them:
``num_outputs`` (how many outputs the node asks for), ``scope`` (the enclosing values,
for kernels that run subgraphs), ``opset`` (the resolved since_version of the node).

A kernel may name a ``refuse`` hook too: the variants of its op (attribute values,
optional inputs or outputs) it does not take, each with a reason, known from the node.

A provider answers "supported?" from this table (`lookup`) plus its own dtype rules,
so why a node was refused is data, not scattered ``if``s.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import onnx
import onnx.defs

log = logging.getLogger(__name__)

# The canonical names for the default ONNX domain.
DEFAULT_DOMAIN = ""
ONNX_DOMAINS = ("", "ai.onnx")

#: parameters the executor passes when a kernel declares them
CONTEXT_PARAMS = frozenset({"num_outputs", "scope", "opset"})


@dataclass(frozen=True)
class KnownInput:
    """What the compiler knows of one node input, for a kernel's ``specialize`` hook."""

    #: dims (int when static, a symbol name or None otherwise); None when the rank is unknown
    #: or the input is omitted
    shape: tuple | None = None
    dtype: Any = None
    #: the host array of a constant input (an initializer), else None
    value: Any = None
    #: an initializer that is also a graph input: a run may feed another value
    overridable: bool = False


@dataclass(frozen=True)
class KernelDef:
    domain: str
    op_type: str
    since: int
    fn: Callable
    #: input positions whose values the kernel reads on the host (shape, axes, pads...):
    #: the planner keeps their producers on cpu
    host_inputs: frozenset[int] = frozenset()
    #: None when the kernel runs on device arrays too; else why it is host-only
    host_only: str | None = None
    #: ONNX dtype names (``"float"``, ``"int64"`` ...) the kernel accepts for its
    #: inputs; None means whatever the op's schema allows
    dtypes: frozenset[str] | None = None
    #: context parameters the function declares (subset of CONTEXT_PARAMS)
    wants: frozenset[str] = field(default_factory=frozenset)
    #: the attribute names the function accepts, or None for **kwargs
    attrs: frozenset[str] | None = None
    #: compile-time hook ``specialize(xp, kwargs, inputs: list[KnownInput]) -> fn | None``
    specialize: Callable | None = None
    #: ``refuse(attrs, inputs, num_outputs) -> reason | None``: a variant of the op the
    #: kernel does not take (an attribute value, an optional input or output present),
    #: known from the node alone: providers decline it and the compiler refuses it, as
    #: for a missing kernel. ``attrs``: the node's attribute values; ``inputs``: which
    #: input positions are given
    refuse: Callable | None = None

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.domain, self.op_type, self.since)

    @property
    def device(self) -> bool:
        return self.host_only is None


class DuplicateKernelError(ValueError):
    pass


_TABLE: dict[tuple[str, str], dict[int, KernelDef]] = {}
_GENERATION = [0]  # bumped on every registration: caches over the table compare it


def canonical_domain(domain: str) -> str:
    return "" if domain in ONNX_DOMAINS else domain


def kernel(
    op_type: str,
    since: int | Iterable[int] = 1,
    domain: str = "",
    *,
    host_inputs: Iterable[int] = (),
    host_only: str | None = None,
    dtypes: Iterable[str] | None = None,
    specialize: Callable | None = None,
    refuse: Callable | None = None,
) -> Callable[[Callable], Callable]:
    """Register ``fn`` for ``op_type`` from opset ``since`` on (several sinces allowed)."""
    sinces = (since,) if isinstance(since, int) else tuple(since)

    def register(fn: Callable) -> Callable:
        params = inspect.signature(fn).parameters
        wants = frozenset(p for p in params if p in CONTEXT_PARAMS)
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            attrs = None
        else:
            attrs = frozenset(
                name
                for name, p in params.items()
                if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and name not in CONTEXT_PARAMS
            )
        dom = canonical_domain(domain)
        versions = _TABLE.get((dom, op_type), {})
        for i, s in enumerate(sinces):  # all or nothing: a refused decorator adds no entry
            if s in versions or s in sinces[:i]:
                raise DuplicateKernelError(f"kernel {domain}::{op_type} since {s} registered twice")
        versions = _TABLE.setdefault((dom, op_type), {})
        for s in sinces:
            versions[s] = KernelDef(
                domain=dom,
                op_type=op_type,
                since=s,
                fn=fn,
                host_inputs=frozenset(host_inputs),
                host_only=host_only,
                dtypes=frozenset(dtypes) if dtypes is not None else None,
                wants=wants,
                attrs=attrs,
                specialize=specialize,
                refuse=refuse,
            )
        _GENERATION[0] += 1
        return fn

    return register


def refusal(kdef: KernelDef, node: Any) -> str | None:
    """Why ``kdef`` does not take this variant of its op (its ``refuse`` hook), or None."""
    if kdef.refuse is None:
        return None
    from hetero_exec.ir.graph import attr_value

    attrs = {name: attr_value(a) for name, a in node.attrs.items()
             if a.type not in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)}
    given = frozenset(i for i, name in enumerate(node.inputs) if name)
    outputs = list(node.outputs)
    while outputs and not outputs[-1]:
        outputs.pop()
    return kdef.refuse(attrs, given, len(outputs))


def resolve_since(domain: str, op_type: str, opset: int) -> int | None:
    """The since_version of the op's schema in force at ``opset`` (None if unknown to onnx)."""
    try:
        return onnx.defs.get_schema(op_type, opset, canonical_domain(domain)).since_version
    except onnx.defs.SchemaError:
        return None


def lookup(domain: str, op_type: str, opset: int) -> KernelDef | None:
    """The kernel for a node of ``op_type`` in a model importing ``domain`` at ``opset``.

    The newest registered kernel whose ``since`` is at most the schema's since_version
    (a kernel registered at 1 serves every later version until a newer one is added).
    """
    _ensure_loaded()
    versions = _TABLE.get((canonical_domain(domain), op_type))
    if not versions:
        return None
    since = resolve_since(domain, op_type, opset)
    if since is None:  # a domain onnx does not know (custom ops): match on opset itself
        since = opset
    best = None
    for s, kdef in versions.items():
        if s <= since and (best is None or s > best.since):
            best = kdef
    return best


def registered() -> list[KernelDef]:
    _ensure_loaded()
    return [k for versions in _TABLE.values() for k in versions.values()]


def generation() -> int:
    """A number that changes whenever a kernel is registered (for caches over the table)."""
    _ensure_loaded()
    return _GENERATION[0]


def has_op(domain: str, op_type: str) -> bool:
    _ensure_loaded()
    return (canonical_domain(domain), op_type) in _TABLE


_LOADED = False


def _ensure_loaded() -> None:
    """Import every kernel module once, so their decorators fill the table."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    import importlib
    import pkgutil

    import hetero_exec.kernels as pkg

    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name.startswith("_") or info.name == "registry":
            continue
        try:
            importlib.import_module(f"{pkg.__name__}.{info.name}")
        except Exception:  # one broken family must not take the others down
            log.exception("kernel module %s failed to import", info.name)
