"""Load a model and plan it: the first half of a session build, in one place.

`InferenceSession` builds on it; code that needs only the plan calls it without
building a session: a Ray session's stage bundles (`actors.cluster_plan.stage_bundles`)
and a Serve replica's devices (`actors.serve.replicas`). All three then load and plan
alike, the options' model overrides (free dimensions, initializers) included.

>>> import onnx.helper as h
>>> g = h.make_graph([h.make_node("Relu", ["x"], ["y"])], "g",
...     [h.make_tensor_value_info("x", 1, [2])], [h.make_tensor_value_info("y", 1, [2])])
>>> planned = load_and_plan(h.make_model(g).SerializeToString(), ["cpu"], SessionOptions())
>>> planned.graph.outputs, planned.build.provider_names
(['y'], ['cpu'])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import onnx

from hetero_exec.ir import Graph, load
from hetero_exec.ir.load import ModelSource, read_model
from hetero_exec.options import SessionOptions

if TYPE_CHECKING:
    from hetero_exec.placement.decide import SessionBuild


@dataclass
class PlannedModel:
    """A model as loaded (with the options' overrides), its IR, and its plan."""

    model: onnx.ModelProto
    graph: Graph
    build: SessionBuild


def load_model(source: ModelSource, options: SessionOptions) -> tuple[onnx.ModelProto, Graph]:
    """Read and validate ``source``, with the options' overrides applied first."""
    from hetero_exec.model_overrides import apply_overrides, has_overrides

    if has_overrides(options):
        source = apply_overrides(read_model(source, options.base_dir), options)
    return load(source, options.base_dir)


def load_and_plan(source: ModelSource, providers: Sequence[Any] | None,
                  options: SessionOptions) -> PlannedModel:
    """`load_model`, then the session's plan on ``providers`` (`build_session_plan`)."""
    from hetero_exec.placement.decide import build_session_plan  # planning loads on first use

    model, graph = load_model(source, options)
    return PlannedModel(model, graph, build_session_plan(graph, providers, options))


__all__ = ["PlannedModel", "load_model", "load_and_plan"]
