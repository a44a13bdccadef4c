"""Fused segments on Ray: a mixed plan's segments are fused after placement (custom
"hetero_exec" domain ops), cut into ONNX models for their actors, and give the local
executor's outputs."""

from __future__ import annotations

import pytest

from hetero_exec import InferenceSession
from tests.placement._models import assert_outputs
from tests.placement.test_segment_passes import FEED, block, layout

pytestmark = pytest.mark.ray


@pytest.mark.timeout(120)
def test_fused_segments_run_on_ray(ray_session):
    m = block()
    pins = [("ln_.*", "cpu"), ("gelu_.*", "cpu")]
    local = InferenceSession(m, ["sim-gpu", "cpu"], hetero=True, affinity=pins)
    with InferenceSession(m, ["sim-gpu", "cpu"], hetero=True, affinity=pins, executor="ray") as sess:
        assert layout(sess) == layout(local) == [
            ("sim-gpu:0", ["FusedMatMul"]), ("cpu", ["FusedLayerNorm", "FusedGelu"]),
            ("sim-gpu:0", ["FusedMatMul"])]
        assert_outputs(sess.run(None, FEED), local.run(None, FEED))
