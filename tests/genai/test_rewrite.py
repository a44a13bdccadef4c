"""genai/rewrite.py: the decoder a generator runs. Its logits are the last position's
only, gathered before the lm_head's MatMul (a prompt's other positions never reach the
vocabulary product), and a prompt's logits still equal onnxruntime's at that position."""

from __future__ import annotations

import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import hetero_exec.genai as og
from hetero_exec.genai.layout import discover
from hetero_exec.genai.rewrite import LAST_POSITION, rewrite
from tests.genai._ref import ARCHS, EXPORTERS, MODELS, left_padded, model_path, prompts

PATHS = [model_path(a, e) for a in ARCHS for e in EXPORTERS] + \
    [os.path.join(MODELS, "llama_genai", "model.onnx")]


@pytest.mark.parametrize("path", PATHS, ids=os.path.basename)
def test_the_lm_head_sees_only_the_last_position(path):
    proto = onnx.load(path)
    layout = discover(proto, names=og.Config(os.path.dirname(path)).names()
                      if path.endswith("model.onnx") else None)
    g = rewrite(proto, layout).graph
    made = {o: n for n in g.node for o in n.output}
    head = made[layout.logits]
    assert head.op_type == "MatMul"
    gather = made[head.input[0]]
    assert gather.op_type == "Gather" and list(gather.input)[1] == LAST_POSITION
    assert onnx.helper.get_attribute_value(gather.attribute[0]) == 1  # the positions' axis
    out = next(o for o in g.output if o.name == layout.logits)
    assert out.type.tensor_type.shape.dim[1].dim_value == 1


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("arch", ARCHS)
def test_a_prompts_logits_are_onnxruntimes_at_its_last_position(arch, exporter):
    path = model_path(arch, exporter)
    rows = prompts(3)
    ids, mask = left_padded(rows)
    layout = discover(onnx.load(path))
    past = {e.past: np.zeros((3, e.kv_heads, 0, e.head_size), np.float32) for e in layout.entries}
    pos = np.where(mask == 0, 1, np.cumsum(mask, 1) - 1)
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    want = sess.run([layout.logits], {layout.input_ids: ids, layout.attention_mask: mask,
                                      layout.position_ids: pos, **past})[0][:, -1]
    model = og.Model(path)
    params = og.GeneratorParams(model)
    params.set_search_options(batch_size=3, max_length=ids.shape[1] + 4)
    with og.Generator(model, params) as gen:
        gen.append_tokens(rows)
        got = gen.get_logits()
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
