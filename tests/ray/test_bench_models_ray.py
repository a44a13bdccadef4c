"""The benchmark models (MLP, ResNet-18, BERT, GPT-2 shaped as torch exports them) on
Ray under mixed sim-gpu + cpu placement: outputs equal the local cpu executor's."""

from __future__ import annotations

import numpy as np
import pytest

from bench.models import MODELS, inputs
from hetero_exec import InferenceSession

pytestmark = pytest.mark.ray

#: nodes pinned to cpu, so each plan alternates devices (the first pin set of
#: bench/bench_hetero.py: 2 to 4 seams per model)
PINS = {
    "mlp": ["Relu_1"],
    "resnet18": ["Relu_4"],
    "bert": ["MatMul_30"],
    "gpt2": ["Transpose_16"],
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", list(MODELS))
def test_benchmark_model_mixed_on_ray_matches_local(ray_session, name):
    model = MODELS[name]()
    feeds = [inputs(name, batch, seed=batch, seq=8) for batch in (1, 2, 2)]
    local = InferenceSession(model, ["cpu"])
    want = [local.run(None, f) for f in feeds]
    with InferenceSession(
        model,
        ["sim-gpu", "cpu"],
        hetero=True,
        affinity=[(p, "cpu") for p in PINS[name]],
        executor="ray",
        max_inflight=4,
    ) as sess:
        providers = {s.provider_name for s in sess.placement.segments}
        assert providers == {"sim-gpu:0", "cpu"} and len(sess.placement.seams) >= 2
        assert len(sess.stage_actors) == len(sess.placement.stages) >= 1
        got = [sess.run(None, feeds[0]), *sess.run_many(feeds[1:])]
    for g, w in zip(got, want):
        assert len(g) == len(w)
        for a, b in zip(g, w):
            assert a.shape == b.shape and a.dtype == b.dtype
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
