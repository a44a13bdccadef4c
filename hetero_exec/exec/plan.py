"""Compiling a graph (or a segment of one) into a flat RunPlan.

A RunPlan is a list of Steps over integer value slots: attributes are parsed, kernels
looked up and liveness computed here, once, so the run loop does no attribute parsing
and no string lookups (SEMANTICS.md section 4).
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import onnx

from hetero_exec.errors import UnsupportedOperatorError
from hetero_exec.exec import half
from hetero_exec.exec.elementwise_runs import merge_runs
from hetero_exec.exec.functions import expand_function
from hetero_exec.exec.host_steps import METADATA_OPS, host_step_nodes
from hetero_exec.exec.steps import (  # noqa: F401 (the names callers import from here)
    MANY_INPUTS,
    NO_INPUTS,
    NONDETERMINISTIC,
    NONE_SLOT,
    ONE_INPUT,
    TRASH_SLOT,
    WITH_SCOPE,
    RunPlan,
    Step,
    fast_step,
)
from hetero_exec.exec.subgraph import Subgraph
from hetero_exec.ir.graph import Graph, Node, attr_value, node_reads
from hetero_exec.kernels.registry import KnownInput, lookup, refusal

log = logging.getLogger(__name__)

class Compiler:
    """Compiles node lists for one provider (its array module and its kernel choice)."""

    def __init__(self, xp: Any = np, provider: str = "cpu", fold_constants: bool = True,
                 to_device: Callable[[Any], Any] | None = None,
                 body_placer: Callable[[Graph, dict[str, int]], Any] | None = None,
                 to_host: Callable[[Any], Any] | None = None):
        self.xp = xp
        #: a device provider: shape arithmetic runs as host steps (exec.host_steps)
        self.device = to_host is not None
        self.to_host = to_host or (lambda a: a)
        self.provider = provider
        self.fold_constants = fold_constants
        self.to_device = to_device or (lambda a: a)
        #: compiles control-flow bodies with their own placement (heterogeneous sessions)
        self.body_placer = body_placer
        #: runs of element-wise float steps become one step (exec/elementwise_runs.py); on
        #: cpu, where a step's dispatch is most of a small tensor's cost
        self.merge_elementwise = not self.device and provider == "cpu"
        self._known: dict[str, Any] = {}  # the constant inputs of the plan being compiled

    @classmethod
    def for_provider(cls, provider: Any, fold_constants: bool = True,
                     body_placer: Callable[[Graph, dict[str, int]], Any] | None = None) -> "Compiler":
        """The compiler of one provider: its arrays, its copies, host steps on devices."""
        return cls(provider.xp, provider.name, fold_constants, provider.to_device, body_placer,
                   provider.to_host if provider.is_device else None)

    def compile_graph(self, graph: Graph, outer: dict[str, int] | None = None) -> RunPlan:
        return self.compile(graph, graph.nodes, graph.inputs, graph.outputs, outer)

    def compile(self, graph: Graph, nodes: Sequence[Node], inputs: Sequence[str],
                outputs: Sequence[str], outer: dict[str, int] | None = None,
                known: Mapping[str, Any] | None = None) -> RunPlan:
        """Compile ``nodes`` (already in a valid order) fed by ``inputs`` into a RunPlan.
        ``known``: inputs that are constants (host values), such as a seam an earlier
        segment folded: they become this plan's constants, moved to its provider once,
        and are fed no more."""
        previous, self._known = self._known, dict(known or {})
        try:  # (bodies compile inside: each with its own known constants)
            return self._compile(graph, nodes, inputs, outputs, outer)
        finally:
            self._known = previous

    def _compile(self, graph: Graph, nodes: Sequence[Node], inputs: Sequence[str],
                 outputs: Sequence[str], outer: dict[str, int] | None) -> RunPlan:
        known = self._known
        inputs = [name for name in inputs if name not in known]
        slot_of: dict[str, int] = {"": NONE_SLOT}
        template: list[Any] = [None, None]
        constants: set[int] = set()

        def slot(name: str) -> int:
            s = slot_of.get(name)
            if s is None:
                s = slot_of[name] = len(template)
                template.append(None)
            return s

        input_slots = [(name, slot(name)) for name in inputs]
        fed = {name for name in inputs}
        captures: list[tuple[int, int]] = []
        if outer is not None:
            for name in graph.captures:
                if name in outer and name not in fed:
                    captures.append((outer[name], slot(name)))
        # only the initializers these nodes read: a segment holds its own weights, not
        # the whole model's (bodies' outer captures count as reads)
        wanted = {r for node in nodes for r in node_reads(node)} | set(inputs) | set(outputs)
        host_nodes = host_step_nodes(graph, nodes) if self.device else set()
        host_slots: set[int] = set()  # slots holding host values in a device plan
        device_reads = {r for node in nodes if node not in host_nodes for r in node_reads(node)}
        graph_inputs = set(graph.inputs)
        for name, arr in itertools.chain(graph.initializers.items(), known.items()):
            if name not in wanted:
                continue
            s = slot(name)
            if template[s] is None:
                if self.device and name not in device_reads and name not in outputs:
                    template[s] = arr  # read by host steps only: no upload
                    host_slots.add(s)
                else:
                    template[s] = self.to_device(arr)
            # a segment lists the initializers it reads among its inputs, but only an
            # overridable one (also a graph input) can be fed: the others are constants
            if name not in fed or name not in graph_inputs:
                constants.add(s)

        host_copy: dict[int, int] = {}  # constant slot -> its host copy's slot
        raw_steps: list[tuple] = []
        for node in nodes:
            # captures of bodies are read from this plan's slots: give them slots before
            # the bodies compile against slot_of, and count them as uses for liveness
            cap_slots = tuple(slot(c) for sub in node.subgraphs.values() for c in sub.captures)
            try:
                fn, kwargs, wants_scope = self._resolve(graph, node, slot_of)
            except UnsupportedOperatorError as e:
                if _static_inputs(graph, node):
                    raise
                # symbolic input shapes: deferred to run time (SEMANTICS.md 1.3)
                fn, kwargs, wants_scope = _raising_step(e), {}, False
            in_slots = tuple(slot(i) if i else NONE_SLOT for i in _trim(node.inputs))
            out_slots = tuple(slot(o) if o else TRASH_SLOT for o in node.outputs)
            step_xp = self.xp
            if node in host_nodes:
                step_xp = np
                if node.op_type not in METADATA_OPS:
                    in_slots = self._host_constants(in_slots, constants, host_copy, template)
                    fn = _converting(fn, [p for p, s in enumerate(in_slots)
                                          if s not in host_slots and s not in host_copy.values()
                                          and s != NONE_SLOT], self.to_host)
                host_slots.update(out_slots)
            elif self.device:
                kdef = lookup(node.domain, node.op_type, graph.opset(node.domain))
                host_pos = kdef.host_inputs if kdef else frozenset()
                data_pos = [p for p, s in enumerate(in_slots) if s in host_slots and p not in host_pos]
                if data_pos:
                    fn = _converting(fn, data_pos, self.to_device)
                # declared host inputs arrive as host values: constants from host copies
                # made once, device values moved per run (kernels never read device data)
                in_slots = self._host_constants(in_slots, constants, host_copy, template, host_pos)
                fn = _converting(fn, [p for p in host_pos if p < len(in_slots) and in_slots[p]
                                      not in host_slots and in_slots[p] not in host_copy.values()
                                      and in_slots[p] != NONE_SLOT], self.to_host)
            if (self.fold_constants and not wants_scope and node.op_type not in NONDETERMINISTIC
                    and all(s in constants or s == NONE_SLOT for s in in_slots)):
                if self._fold(fn, kwargs, in_slots, out_slots, template, node, step_xp):
                    constants.update(s for s in out_slots if s != TRASH_SLOT)
                    if not self.device and node.op_type == "DequantizeLinear":
                        # a QDQ model's weight, folded: its MatMul's / Conv's specialize
                        # hook sees the float weight (and packs it) as in a float model
                        for o, s in zip(node.outputs, out_slots):
                            if o and s != TRASH_SLOT and type(template[s]) is np.ndarray:
                                known[o] = template[s]
                    continue
            raw_steps.append((node, fn, in_slots, cap_slots, out_slots, kwargs, wants_scope, step_xp))

        if self.device:
            self._device_outputs(nodes, outputs, slot_of, template, host_slots, constants,
                                 raw_steps)
        output_slots = [slot(o) for o in outputs]
        # outer captures are held by the enclosing run: releasing them here frees nothing
        # (and a Loop's later iterations read them again from the same slot list)
        keep = (set(constants) | {s for _, s in input_slots} | set(output_slots)
                | {inner for _, inner in captures} | {NONE_SLOT, TRASH_SLOT})
        if self.merge_elementwise:
            raw_steps = merge_runs(graph, raw_steps, keep, self.xp,
                                   {s: n for n, s in slot_of.items()})
        last_use: dict[int, int] = {}
        for idx, (_, _, in_slots, cap_slots, *_rest) in enumerate(raw_steps):
            for s in in_slots + cap_slots:
                last_use[s] = idx
        # a constant that only folded nodes read (a weight whose transpose was folded) is
        # not held beside what they made of it
        held = set(output_slots) | {inner for _, inner in captures}
        for s in constants:
            if s not in last_use and s not in held:
                template[s] = None
        release_at: dict[int, list[int]] = {}
        for s, idx in last_use.items():
            if s not in keep:
                release_at.setdefault(idx, []).append(s)
        # values produced and never read are dropped right away too
        for idx, (_, _, _, _, out_slots, *_rest) in enumerate(raw_steps):
            for s in out_slots:
                if s not in keep and s not in last_use:
                    release_at.setdefault(idx, []).append(s)
        steps = [
            Step(fn=fn, inputs=in_slots, outputs=out_slots,
                 kwargs=kwargs, release=tuple(sorted(set(release_at.get(idx, ())))), node=node,
                 wants_scope=wants_scope, xp=step_xp, on_host=node in host_nodes)
            for idx, (node, fn, in_slots, cap_slots, out_slots, kwargs, wants_scope, step_xp)
            in enumerate(raw_steps)
        ]
        constant_outputs = {name: template[s] for name, s in zip(outputs, output_slots)
                            if s in constants and template[s] is not None}
        return RunPlan(steps=steps, template=template, input_slots=input_slots,
                       output_slots=output_slots, output_names=list(outputs), captures=captures,
                       slot_of=slot_of, xp=self.xp, provider=self.provider,
                       constant_outputs=constant_outputs)

    # -- one node --------------------------------------------------------------

    def check_node(self, graph: Graph, node: Node) -> None:
        """Create the node's kernel call (lookup, attributes) without running it."""
        self._resolve(graph, node, {c: -1 for sub in node.subgraphs.values() for c in sub.captures})

    def _resolve(self, graph: Graph, node: Node, slot_of: dict[str, int]) -> tuple[Callable, dict, bool]:
        opset = graph.opset(node.domain)
        kdef = lookup(node.domain, node.op_type, opset)
        if kdef is None:
            body = expand_function(graph, node)
            if body is None:
                raise UnsupportedOperatorError(
                    node.identity, node.canonical_domain, node.op_type, opset, self.provider,
                    "no kernel registered and the op has no function body")
            sub = Subgraph(self.compile_graph(body, outer=None))
            return _function_step(sub), {}, False
        refused = refusal(kdef, node)
        if refused is not None:
            raise UnsupportedOperatorError(node.identity, node.canonical_domain, node.op_type,
                                           opset, self.provider, refused)
        kwargs: dict[str, Any] = {}
        for name, attr in node.attrs.items():
            if kdef.attrs is not None and name not in kdef.attrs:
                raise UnsupportedOperatorError(
                    node.identity, node.canonical_domain, node.op_type, opset, self.provider,
                    f"attribute {name!r} is not supported by the kernel")
            if attr.type == onnx.AttributeProto.GRAPH:
                body = node.subgraphs[name]
                if self.body_placer is not None:
                    kwargs[name] = self.body_placer(body, slot_of)
                else:
                    kwargs[name] = Subgraph(self.compile_graph(body, outer=slot_of),
                                            [body.value(o).dtype for o in body.outputs],
                                            [body.value(o).shape for o in body.outputs])
            elif attr.type == onnx.AttributeProto.GRAPHS:
                raise UnsupportedOperatorError(node.identity, node.canonical_domain, node.op_type,
                                               opset, self.provider, "GRAPHS attributes are not supported")
            else:
                kwargs[name] = attr_value(attr)
        if "num_outputs" in kdef.wants:
            kwargs["num_outputs"] = len(_trim(node.outputs))
        if "opset" in kdef.wants:
            kwargs["opset"] = kdef.since
        return self._specialized(graph, node, kdef, kwargs), kwargs, "scope" in kdef.wants

    def _specialized(self, graph: Graph, node: Node, kdef: Any, kwargs: dict) -> Callable:
        """The kernel's choice of function for this node (registry ``specialize`` hook); a
        failing hook costs only the specialisation, logged, never the node."""
        half_ops = node.op_type in half.FLOAT32_OPS and self.xp is np
        if kdef.specialize is None and not half_ops:
            return kdef.fn
        known = [KnownInput(*_declared(graph, name), self._known[name])
                 if name in self._known else _known_input(graph, name) for name in node.inputs]
        positions = half.half_inputs(self.xp, node, known)
        seen = half.upcast_known(known, positions) if positions else known
        fn = None
        if kdef.specialize is not None:
            try:
                fn = kdef.specialize(self.xp, kwargs, seen)
            except Exception as e:
                log.warning("%s: %s's specialize hook failed (%s: %s); running the generic "
                            "kernel", node.identity, node.op_type, type(e).__name__, e)
        fn = fn or kdef.fn
        if positions:  # float16 storage, float32 arithmetic (exec/half.py)
            out_dtypes = [_declared(graph, o)[1] if o else None for o in node.outputs]
            fn = half.float32_compute(fn, positions, known, seen, out_dtypes)
        return fn

    def _host_constants(self, in_slots: tuple[int, ...], constants: set[int],
                        host_copy: dict[int, int], template: list[Any],
                        positions: Any = None) -> tuple[int, ...]:
        """A host step (or a device step's host inputs at ``positions``) reads constants
        from host copies made once, here."""
        out = []
        for p, s in enumerate(in_slots):
            if s in constants and s != NONE_SLOT and (positions is None or p in positions):
                if s not in host_copy:
                    host_copy[s] = len(template)
                    template.append(self.to_host(template[s]))
                    constants.add(host_copy[s])
                s = host_copy[s]
            out.append(s)
        return tuple(out)

    def _device_outputs(self, nodes: Sequence[Node], outputs: Sequence[str],
                        slot_of: dict[str, int], template: list[Any], host_slots: set[int],
                        constants: set[int], raw_steps: list[tuple]) -> None:
        """A device plan hands out device values only. A host step's result (shape
        arithmetic, Shape, a constant folded on the host) that another segment reads
        leaves as a device value: a seam between two segments of one device moves
        nothing, and the next may read it as data (a device Add of it)."""
        producers = {o: node for node in nodes for o in node.outputs if o}
        for name in outputs:
            s = slot_of.get(name)
            if s is None or s not in host_slots:
                continue
            moved = slot_of[name] = len(template)
            if s in constants:  # moved once, here
                template.append(self.to_device(template[s]) if template[s] is not None
                                else None)
                constants.add(moved)
                continue
            template.append(None)
            node = producers.get(name)
            raw_steps.append((node, _converting(_passed, [0], self.to_device), (s,), (),
                              (moved,), {}, False, self.xp))

    def _fold(self, fn: Callable, kwargs: dict, in_slots: tuple[int, ...], out_slots: tuple[int, ...],
              template: list[Any], node: Node, xp: Any = None) -> bool:
        try:
            outs = fn(xp if xp is not None else self.xp, *(template[s] for s in in_slots), **kwargs)
        except Exception as e:  # leave it to run time, where the error names the node
            log.debug("not folding %s: %s", node.identity, e)
            return False
        for s, v in zip(out_slots, outs):
            if s != TRASH_SLOT:
                # a folded Transpose is a strided view; every run's readers would walk it
                # across the cache lines (a relative position bias: 3x slower attention)
                if isinstance(v, np.ndarray) and not v.flags.c_contiguous:
                    v = np.ascontiguousarray(v)
                template[s] = v
        return True


def _passed(xp: Any, value: Any) -> tuple[Any]:
    """A step that hands its input on (moved first by `_converting`)."""
    return (value,)


def _converting(fn: Callable, positions: Sequence[int], convert: Callable[[Any], Any]) -> Callable:
    """``fn`` with the inputs at ``positions`` moved (host <-> device) first."""
    if not positions:
        return fn
    positions = tuple(positions)

    def moved(xp, *args, **kwargs):
        args = list(args)
        for p in positions:
            if p < len(args) and args[p] is not None:
                args[p] = convert(args[p])
        return fn(xp, *args, **kwargs)

    moved.__name__ = getattr(fn, "__name__", "moved")
    return moved


def _declared(graph: Graph, name: str) -> tuple[tuple | None, Any]:
    """(shape, dtype) the graph declares for value ``name``."""
    v = graph.value(name)
    return (tuple(v.shape) if v.shape is not None else None), v.dtype


def _known_input(graph: Graph, name: str) -> KnownInput:
    if not name:
        return KnownInput()
    shape, dtype = _declared(graph, name)
    owner = graph.defining(name)  # (a body's capture: a constant of an enclosing graph)
    value = owner.initializers.get(name)
    return KnownInput(shape, dtype, value, value is not None and name in owner.inputs)


def _static_inputs(graph: Graph, node: Node) -> bool:
    return all(graph.value(i).static for i in node.inputs if i)


def _raising_step(error: Exception) -> Callable:
    def unsupported(xp, *inputs):
        raise error

    return unsupported


def _function_step(sub: Subgraph) -> Callable:
    def run_function(xp, *inputs):
        n = sub.input_count
        padded = list(inputs[:n]) + [None] * (n - len(inputs))
        return tuple(sub.run(None, padded))

    return run_function


def _trim(names: Sequence[str]) -> list[str]:
    """Trailing omitted optional inputs are trimmed; inner ones keep their position."""
    names = list(names)
    while names and not names[-1]:
        names.pop()
    return names
