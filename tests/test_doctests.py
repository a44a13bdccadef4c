"""The ``>>>`` examples of the modules whose examples run without a Ray cluster, run as
tests (what ``pytest --doctest-modules`` would do for these files): an example that
drifts from the code fails here. A module listed must keep at least one example.

Examples that need a cluster or started actors stay marked ``+SKIP`` in their
modules (RayExecutor, Reservation, Replay, CompiledChain...).
"""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "actors.batching",
    "actors.cluster_plan",
    "actors.code_version",
    "actors.connect",
    "actors.coordinator",
    "actors.data",
    "actors.dispatch",
    "actors.generation.spin",
    "actors.generation.split",
    "actors.oip",
    "actors.options",
    "actors.profile",
    "actors.remote_errors",
    "actors.request",
    "actors.request_pool",
    "actors.reservation",
    "actors.serve.cli",
    "actors.serve.generate_request",
    "actors.serve.replicas",
    "actors.serve.routes",
    "actors.stage_model",
    "actors.transport",
    "actors.transport.base",
    "actors.transport.object_store",
    "actors.transport.shared_memory",
    "actors.transport.wire",
    "hetero_exec.genai.config",
    "hetero_exec.genai.widths",
    "hetero_exec.kernels._conv_path",
    "hetero_exec.kernels.native.activation",
    "hetero_exec.model_plan",
    "hetero_exec.options",
    "hetero_exec.session",
    "hetero_exec.placement.shape_bounds",
    "hetero_exec.placement.stages",
    "hetero_exec.placement.symbolic",
]


@pytest.mark.parametrize("name", MODULES)
def test_module_examples_run(name):
    pytest.importorskip("ray")
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.attempted > 0, f"{name} has no runnable example left"
    assert result.failed == 0, f"{result.failed} example(s) of {name} failed (output above)"
