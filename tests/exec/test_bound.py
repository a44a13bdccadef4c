"""Plans bound to repeating input shapes (exec/bound.py): the shape arithmetic of real
decoder exports runs once per signature, and the answers stay onnxruntime's."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as h
import onnxruntime as ort
import pytest
from onnx import TensorProto

import hetero_exec as hx
from hetero_exec.exec.bound import ShapeBoundPlans
from hetero_exec.genai.layout import discover
from tests.genai._ref import model_path


def _feed(path: str, batch: int, seq: int, past: int) -> dict:
    layout = discover(onnx.load(path))
    rng = np.random.default_rng(batch * 100 + seq + past)
    feed = {layout.input_ids: rng.integers(3, 256, (batch, seq)),
            layout.attention_mask: np.ones((batch, past + seq), np.int64),
            layout.position_ids: np.tile(np.arange(past, past + seq), (batch, 1))}
    for e in layout.entries:
        feed[e.past] = rng.standard_normal((batch, e.kv_heads, past, e.head_size)).astype(np.float32)
    return feed


@pytest.mark.parametrize("name", ["llama_optimum", "gpt2_dynamo", "qwen2_optimum"])
@pytest.mark.parametrize("mixed", [False, True])
def test_repeated_shapes_replay_a_bound_plan(name, mixed):
    arch, exporter = name.split("_")
    path = model_path(arch, exporter)
    opts = ({"providers": [("sim-gpu", {"exclude_ops": ["Softmax"]}), "cpu"], "hetero": True}
            if mixed else {})
    sess = hx.InferenceSession(path, **opts)
    ref = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    for batch, seq, past in [(2, 1, 7), (2, 1, 7), (2, 1, 7), (1, 4, 0), (2, 1, 7), (1, 4, 0),
                             (1, 4, 0)]:
        feed = _feed(path, batch, seq, past)
        want = ref.run(None, feed)
        got = sess.run(None, feed)
        for w, g in zip(want, got):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
        got[0][...] = np.nan  # the caller's to keep: the next run is unaffected
    bound = [s.bound for s in sess._executor.segments]
    assert any(b._bound for b in bound)
    plans = [p for b in bound for p in b._bound.values()]
    assert sum(len(p.steps) for p in plans) < sum(len(b.plan.steps) for b in bound
                                                  for _ in b._bound)


def test_data_shaped_ops_are_not_bound():
    # y = Reshape(x, NonZero-derived shape): the shape follows x's values, never bound
    nodes = [h.make_node("NonZero", ["x"], ["nz"]), h.make_node("Shape", ["nz"], ["s"]),
             h.make_node("ConstantOfShape", ["s"], ["y"])]
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                     [h.make_tensor_value_info("y", TensorProto.FLOAT, [1, "n"])])
    sess = hx.InferenceSession(h.make_model(g, opset_imports=[h.make_opsetid("", 18)])
                               .SerializeToString())
    for x, n in [([0, 1, 0, 1], 2), ([0, 1, 0, 1], 2), ([1, 1, 1, 0], 3), ([1, 0, 0, 0], 1)]:
        y = sess.run(None, {"x": np.array(x, np.float32)})[0]
        assert y.shape == (1, n)
    plans = ShapeBoundPlans(sess._executor.segments[0].plan)
    assert plans.static_steps == []
