"""InferenceSession: ONNX Runtime's conventions over hetero_exec's layers.

Building follows SEMANTICS.md section 1 in order (signatures and cycles in `ir.load`,
unsupported-operator rejection on cpu, provider passes, GPU coverage), then the
fallback / require / hetero decision of `placement.decide`, then an executor.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from hetero_exec.errors import (
    HeteroExecError,
    NotSupportedForHeterogeneous,
    ProviderError,
    SequenceOutputError,
    UnknownOutputError,
)
from hetero_exec.ir import Graph, load
from hetero_exec.ir.load import ModelSource

log = logging.getLogger(__name__)

TRUE_VALUES = ("1", "true", "on")


def env_flag(name: str) -> bool:
    """Trimmed, case-insensitive 1/true/on; anything else (unset, empty, 0, off...) is off."""
    return os.environ.get(name, "").strip().lower() in TRUE_VALUES


@dataclass
class SessionOptions:
    require_gpu: bool | None = None  # None: from HETERO_EXEC_REQUIRE_GPU
    hetero: bool | None = None  # None: from HETERO_EXEC_HETERO
    executor: str = "local"  # local | ray
    dim_bounds: dict[str, int] = field(default_factory=dict)
    affinity: list[tuple[str, str]] = field(default_factory=list)
    placement: Any = None  # a saved plan (path or dict)
    strategy: str = "greedy"  # multi-GPU split: greedy | balanced | memory
    base_dir: str | None = None  # for external data of a model given as bytes
    enable_profiling: bool = False
    profile_file_prefix: str = "hetero_exec_profile"
    fold_constants: bool = True
    optimize: bool = True  # run the provider's graph passes (fusions) on the single-provider path
    cost_model: Any = None  # placement.partition.CostModel for multi-GPU splits (e.g. calibrate())
    #: pipeline stages of a mixed plan: "auto" (the cost model's cuts), an int K, or
    #: explicit cuts (segment indices where a new stage starts); see placement.stages
    stages: Any = "auto"
    executor_options: dict[str, Any] = field(default_factory=dict)

    KNOWN = ("require_gpu", "hetero", "executor", "dim_bounds", "affinity", "placement",
             "strategy", "base_dir", "enable_profiling", "profile_file_prefix",
             "fold_constants", "optimize", "cost_model", "stages")

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> "SessionOptions":
        own = {k: v for k, v in kwargs.items() if k in cls.KNOWN}
        rest = {k: v for k, v in kwargs.items() if k not in cls.KNOWN}
        opts = cls(**own)
        opts.executor_options = rest
        if opts.executor not in ("local", "ray"):
            raise ProviderError(f"unknown executor {opts.executor!r}; use 'local' or 'ray'")
        if rest and opts.executor == "local":
            raise ProviderError(f"unknown session option(s) {sorted(rest)}")
        return opts

    @property
    def require_gpu_on(self) -> bool:
        return self.require_gpu if self.require_gpu is not None else env_flag("HETERO_EXEC_REQUIRE_GPU")

    @property
    def hetero_on(self) -> bool:
        return self.hetero if self.hetero is not None else env_flag("HETERO_EXEC_HETERO")


@dataclass(frozen=True)
class NodeArg:
    """What get_inputs()/get_outputs() return, as in onnxruntime."""

    name: str
    shape: list[Any]
    type: str


class InferenceSession:
    """Run an ONNX model on the providers asked for, in preference order.

    >>> import numpy as np, onnx.helper as h
    >>> g = h.make_graph([h.make_node("Relu", ["x"], ["y"])], "g",
    ...     [h.make_tensor_value_info("x", 1, [2])], [h.make_tensor_value_info("y", 1, [2])])
    >>> sess = InferenceSession(h.make_model(g))
    >>> sess.run(None, {"x": np.array([-1.0, 2.0], np.float32)})[0]
    array([0., 2.], dtype=float32)
    """

    def __init__(self, model: ModelSource, providers: Sequence[Any] | None = None,
                 **options: Any):
        from hetero_exec.placement.decide import build_session_plan

        self.options = SessionOptions.from_kwargs(options)
        self._model, self.graph = load(model, self.options.base_dir)
        self._build = build_session_plan(self.graph, providers, self.options)
        self.placement = self._build.placement
        self.fallback_report = self._build.fallback_report
        self._providers = self._build.provider_names
        self._executor = self._make_executor()
        self._out_index = {n: i for i, n in enumerate(self.graph.outputs)}
        self._lock = threading.Lock()
        self._closed = False

    def _make_executor(self):
        if self.options.executor == "ray":
            from actors.coordinator import RayExecutor  # the one lazy import of the Ray layer

            return RayExecutor(self._build.graph, self._build, self.options)
        from hetero_exec.exec.local import LocalExecutor

        return LocalExecutor(self._build.graph, self._build, self.options)

    # -- metadata ----------------------------------------------------------------

    def get_inputs(self) -> list[NodeArg]:
        return [self._arg(n) for n in self.graph.inputs if n not in self.graph.initializers]

    def get_overridable_initializers(self) -> list[NodeArg]:
        return [self._arg(n) for n in self.graph.inputs if n in self.graph.initializers]

    def get_outputs(self) -> list[NodeArg]:
        return [self._arg(n) for n in self.graph.outputs]

    def get_providers(self) -> list[str]:
        return list(self._providers)

    def get_modelmeta(self) -> dict[str, Any]:
        m = self._model
        return {"producer_name": m.producer_name, "graph_name": m.graph.name,
                "domain": m.domain, "version": m.model_version,
                "custom_metadata_map": {p.key: p.value for p in m.metadata_props}}

    def _arg(self, name: str) -> NodeArg:
        v = self.graph.value(name)
        if v.kind == "tensor":
            return NodeArg(name, list(v.shape) if v.shape is not None else None,
                           f"tensor({_ort_type(v.dtype_name)})")
        # onnxruntime spells sequences "seq(...)" and gives non-tensors an empty shape
        kind = "seq" if v.kind == "sequence" else v.kind
        t = f"{kind}(tensor({_ort_type(v.dtype_name)}))" if v.elem_type else kind
        return NodeArg(name, [], t)

    @property
    def is_heterogeneous(self) -> bool:
        return self.placement is not None and len(self.placement.segments) > 1

    @property
    def stage_actors(self) -> list[Any]:
        """On Ray: the actor handles of the plan's pipeline stages, in order."""
        return list(getattr(self._executor, "actors", []))

    # -- running -----------------------------------------------------------------

    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any],
            run_options: Any = None) -> list[np.ndarray]:
        """Tensors only: a sequence, map or optional output names run_outputs()."""
        names = self._output_names(output_names)
        for n in names:
            kind = self.graph.value(n).kind
            if kind in ("sequence", "map"):
                raise SequenceOutputError(n, kind)
        outs = self._executor.run(names, input_feed)
        for n, o in zip(names, outs):
            if isinstance(o, (list, dict)):
                raise SequenceOutputError(n, "sequence" if isinstance(o, list) else "map")
        return outs

    def run_outputs(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any]) -> list[Any]:
        """Like run(), but sequences (lists), maps (dicts) and optionals (None) come back too."""
        return self._executor.run(self._output_names(output_names), input_feed)

    def run_async(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any]):
        """A concurrent.futures.Future of run()."""
        names = self._output_names(output_names)
        return self._executor.run_async(names, input_feed)

    def run_many(
        self,
        feeds: Sequence[Mapping[str, Any]],
        output_names: Sequence[str] | None = None,
        return_exceptions: bool = False,
    ) -> list[Any]:
        """run() for every feed, concurrently; results in feed order.

        With ``return_exceptions`` a failed request's error takes its place in the list
        and the others still answer; otherwise the first error raises. On Ray every feed
        is checked before any is dispatched, and feeds share actor tasks (``coalesce``).
        """
        names = self._output_names(output_names)
        many = getattr(self._executor, "run_many", None)
        if many is not None:
            return many(names, feeds, return_exceptions)
        futures = [self._executor.run_async(names, f) for f in feeds]
        concurrent.futures.wait(futures)
        if return_exceptions:
            return [f.exception() or f.result() for f in futures]
        return [f.result() for f in futures]

    def _output_names(self, output_names: Sequence[str] | None) -> list[str]:
        if not output_names:
            return list(self.graph.outputs)
        for n in output_names:
            if n not in self._out_index:
                raise UnknownOutputError(n, self.graph.outputs)
        return list(output_names)

    # -- device bindings -----------------------------------------------------------

    def io_binding(self):
        """ORT-style IO binding; single-provider sessions only (SEMANTICS.md section 2)."""
        if self.is_heterogeneous:
            raise NotSupportedForHeterogeneous("io_binding (persistent device bindings)")
        from hetero_exec.exec.binding import IOBinding

        return IOBinding(self)

    def run_with_iobinding(self, binding) -> None:
        binding._run()

    # -- profiling and lifetime ------------------------------------------------------

    def end_profiling(self) -> str | None:
        return self._executor.end_profiling()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._executor.close()

    def __enter__(self) -> "InferenceSession":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _ort_type(name: str) -> str:
    return {"float": "float", "double": "double", "float16": "float16"}.get(name, name)


__all__ = ["InferenceSession", "SessionOptions", "NodeArg", "HeteroExecError", "Graph"]
