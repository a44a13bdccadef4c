"""The cost model calibrated from a short profile of a real session."""

from __future__ import annotations

import numpy as np
import pytest

from hetero_exec import InferenceSession
from hetero_exec.placement.partition import CostModel, calibrate, node_cost, node_flops
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


def _mlp_plan(cost_model):
    from hetero_exec.placement.partition import annotate_costs

    sess = InferenceSession(mlp(4, width=64, batch=8))
    plan = sess._build.placement
    annotate_costs(plan, {"N": 8}, cost_model)
    return sess._build.graph, plan.segments[0]


def test_the_threaded_part_comes_from_both_thread_counts():
    """Amdahl through the two fits: t(1) = s + p, t(2) = s + p/2, so p/2 = t(1) - t(2)."""
    from dataclasses import replace

    wide = CostModel(flops_per_s=4e9, bytes_per_s=1e9, per_node_s=1e-5, threads=2)
    # at one thread products run at 2/1.4 of the time (the BLAS scaled 1.4x, not 2x)
    wide.single = replace(wide, flops_per_s=4e9 / 1.4, threads=1)
    graph, seg = _mlp_plan(wide)
    one = sum(node_cost(graph, n, {"N": 8}, wide.single) for n in seg.nodes)
    assert seg.cost_threads == 2
    assert seg.product_cost == pytest.approx(one - seg.compute_cost)
    assert 0 < seg.product_cost < seg.compute_cost
    # a stage on one core: the fixed part plus the threaded part at twice the time
    fixed = seg.compute_cost - seg.product_cost
    assert fixed + 2 * seg.product_cost == pytest.approx(one)
    # without the one-thread fit: the products' seconds, as if they split perfectly
    plain = replace(wide, single=None)
    _, seg2 = _mlp_plan(plain)
    flops_s = sum(plain.product_seconds(node_flops(graph, n, {"N": 8})) for n in seg2.nodes)
    assert seg2.product_cost == pytest.approx(flops_s) and seg2.product_cost > seg.product_cost


def test_a_one_thread_fit_that_is_faster_scales_nothing():
    from dataclasses import replace

    wide = CostModel(flops_per_s=4e9, bytes_per_s=1e9, per_node_s=1e-5, threads=2)
    wide.single = replace(wide, flops_per_s=8e9, threads=1)  # noise: one thread faster
    _, seg = _mlp_plan(wide)
    assert seg.product_cost == 0.0


def test_calibrate_fits_one_thread_too_when_runs_split():
    from hetero_exec.kernels._threads import split_width

    m = mlp(4, width=256, batch=64)
    sess = InferenceSession(m)
    feed = {"x": np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)}
    model = calibrate(sess, feed, runs=2)
    if split_width() > 1:
        assert model.threads == split_width() and model.single is not None
        assert model.single.threads == 1 and model.single.single is None
    else:
        assert model.single is None
