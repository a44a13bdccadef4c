"""The cost model calibrated from a short profile of a real session."""

from __future__ import annotations

import numpy as np

from hetero_exec import InferenceSession
from hetero_exec.placement.partition import CostModel, calibrate, node_cost
from tests.placement._models import mlp


def test_calibrate_from_a_profile_gives_a_usable_model():
    m = mlp(4, width=64, batch=8)
    sess = InferenceSession(m)
    feed = {"x": np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)}
    model = calibrate(sess, feed, runs=2)
    assert model.flops_per_s > 0 and model.bytes_per_s > 0 and model.per_node_s >= 0
    graph = sess._build.graph
    costs = [node_cost(graph, n, {}, model) for n in graph.nodes]
    assert all(c > 0 and np.isfinite(c) for c in costs)


def test_nonnegative_fit_drops_a_term_that_would_go_negative():
    # seconds grow with bytes only; flops anti-correlated noise must not give a negative rate
    samples = [(1e9 - i * 1e7, 1e6 * i, 1e-3 * i + 1e-6) for i in range(1, 30)]
    fitted = CostModel.calibrate(None, samples)
    assert fitted.flops_per_s > 0 and fitted.bytes_per_s > 0
