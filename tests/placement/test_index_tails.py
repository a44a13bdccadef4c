"""Index-only device tails after a host-only node run on cpu (no seam round trip)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from hetero_exec import InferenceSession
from hetero_exec.demo import demo_inputs, detector_model


def _by_op(sess) -> dict[str, str]:
    return {n.op_type + ":" + n.name: s.provider.name for s in sess.placement.segments for n in s.nodes}


def test_gathers_after_nms_stay_on_cpu_and_match_onnxruntime():
    m, feed = detector_model(), demo_inputs()
    sess = InferenceSession(m, providers=["sim-gpu", "cpu"], hetero=True)
    placed = _by_op(sess)
    assert placed["NonMaxSuppression:post/nms"] == "cpu"
    assert placed["Gather:post/pick_cols"] == "cpu" and placed["GatherND:post/gather_boxes"] == "cpu"
    assert [s.provider.name for s in sess.placement.segments] == ["sim-gpu:0", "cpu"]
    ref = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)
    for a, b in zip(sess.run(None, feed), ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_pinned_tail_stays_where_it_is_pinned():
    m = detector_model()
    sess = InferenceSession(m, providers=["sim-gpu", "cpu"], hetero=True,
                            affinity=[("post/gather_boxes", "sim-gpu")])
    placed = _by_op(sess)
    assert placed["GatherND:post/gather_boxes"] == "sim-gpu:0"
    assert len(sess.placement.segments) == 3


def test_device_data_movement_fed_by_the_device_stays_on_the_device():
    # the head's Reshape/Transpose read device values only: they stay in the device segment
    sess = InferenceSession(detector_model(), providers=["sim-gpu", "cpu"], hetero=True)
    placed = _by_op(sess)
    assert placed["Reshape:head/box_reshape"] == "sim-gpu:0"
    assert placed["Transpose:head/box_transpose"] == "sim-gpu:0"
