"""Small models built with onnx.helper, and the two references outputs are checked
against (onnxruntime and onnx.reference.ReferenceEvaluator), for the runtime tests."""

from __future__ import annotations

import functools
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import onnx
import onnx.version_converter
from onnx import TensorProto, helper, numpy_helper

OPSET = 18
IR_VERSION = 10  # old enough for the installed onnxruntime

F = TensorProto.FLOAT
I64 = TensorProto.INT64
BOOL = TensorProto.BOOL


def vi(name: str, elem_type: int = F, shape: Sequence[Any] | None = None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem_type, shape)


def init(name: str, array: Any) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(array), name)


def model(nodes: Sequence[onnx.NodeProto], inputs: Sequence[onnx.ValueInfoProto],
          outputs: Sequence[onnx.ValueInfoProto], initializers: Iterable[onnx.TensorProto] = (),
          opset: int = OPSET, extra_opsets: Mapping[str, int] | None = None,
          name: str = "g", value_info: Sequence[onnx.ValueInfoProto] = ()) -> onnx.ModelProto:
    graph = helper.make_graph(list(nodes), name, list(inputs), list(outputs),
                              initializer=list(initializers), value_info=list(value_info))
    opsets = [helper.make_opsetid("", opset)]
    opsets += [helper.make_opsetid(d, v) for d, v in (extra_opsets or {}).items()]
    return helper.make_model(graph, opset_imports=opsets, ir_version=IR_VERSION)


def graph(nodes: Sequence[onnx.NodeProto], inputs: Sequence[onnx.ValueInfoProto],
          outputs: Sequence[onnx.ValueInfoProto], name: str = "body") -> onnx.GraphProto:
    return helper.make_graph(list(nodes), name, list(inputs), list(outputs))


def ort_run(m: onnx.ModelProto, feed: Mapping[str, Any], outputs: Sequence[str] | None = None,
            *, weights_7bit: bool = False) -> list:
    """onnxruntime's outputs; on a host where its uint8 x int8 products saturate
    (`ort_u8s8_saturates`), a model that has them gets the reference evaluator's
    (`exact_anchor`) instead, unless ``weights_7bit``: its int8 weights lie in [-64, 63]
    (onnxruntime's ``reduce_range``), where a pair of products cannot pass int16."""
    exact = None if weights_7bit else u8s8_anchor(m, feed, outputs)
    return exact if exact is not None else _ort(m, feed, outputs)


def u8s8_anchor(m: onnx.ModelProto, feed: Mapping[str, Any],
                outputs: Sequence[str] | None = None) -> list | None:
    """`exact_anchor`'s outputs where onnxruntime's uint8 x int8 sums are not exact on
    this host and ``m`` has such products; else None (onnxruntime is the anchor)."""
    if ort_u8s8_saturates() and mixes_u8_s8(m):
        return exact_anchor(m, feed, outputs)
    return None


def _ort(m: onnx.ModelProto, feed: Mapping[str, Any], outputs: Sequence[str] | None = None) -> list:
    import onnxruntime as ort

    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(list(outputs) if outputs else None, dict(feed))


@functools.lru_cache(maxsize=None)
def ort_u8s8_saturates() -> bool:
    """Whether onnxruntime's uint8 x int8 integer products saturate on this host. On a CPU
    with AVX2 but neither AVX-VNNI nor AVX-512, MLAS adds each pair of byte products in
    int16 (vpmaddubsw): [255, 255] . [127, 127] gives 32767, not 64770 (onnxruntime
    1.32, 2026-12-07, an AMD EPYC VM with AVX2 only). Such a host has no exact
    onnxruntime anchor for those products."""
    node = helper.make_node("MatMulInteger", ["A", "B"], ["Y"])
    m = model([node], [vi("A", TensorProto.UINT8, [1, 2]), vi("B", TensorProto.INT8, [2, 1])],
              [vi("Y", TensorProto.INT32, [1, 1])])
    got = _ort(m, {"A": np.full((1, 2), 255, np.uint8), "B": np.full((2, 1), 127, np.int8)})
    return int(got[0][0, 0]) != 2 * 255 * 127


#: ops onnxruntime runs on its 8-bit integer products, or fuses into them (Q/DQ pairs)
_INTEGER_OPS = frozenset({
    "MatMulInteger", "ConvInteger", "QLinearMatMul", "QLinearConv", "QGemm",
    "MatMulIntegerToFloat", "DynamicQuantizeMatMul", "DynamicQuantizeLinear", "QAttention",
    "DynamicQuantizeLSTM", "QuantizeLinear", "DequantizeLinear"})


def mixes_u8_s8(m: onnx.ModelProto) -> bool:
    """Whether ``m`` has uint8 and int8 tensors (inputs, weights, or values as inferred)
    and an op onnxruntime multiplies 8-bit integers in."""
    if not any(n.op_type in _INTEGER_OPS for n in m.graph.node):
        return False
    try:
        g = onnx.shape_inference.infer_shapes(m).graph
    except Exception:  # onnx does not infer every contrib op
        g = m.graph
    types = {t.data_type for t in g.initializer}
    types |= {v.type.tensor_type.elem_type for v in [*g.input, *g.value_info, *g.output]}
    if any(n.op_type in _QUANTIZE_TO_U8 for n in m.graph.node):
        types.add(TensorProto.UINT8)  # its uint8 activations never appear in the graph
    return TensorProto.UINT8 in types and TensorProto.INT8 in types


#: ops that quantize their float input to uint8 inside
_QUANTIZE_TO_U8 = frozenset({"DynamicQuantizeMatMul", "DynamicQuantizeLSTM"})


def exact_anchor(m: onnx.ModelProto, feed: Mapping[str, Any],
                 outputs: Sequence[str] | None = None) -> list:
    """The reference evaluator's outputs, where onnxruntime's are not exact
    (`ort_u8s8_saturates`); the test is skipped for a model with onnxruntime's own ops,
    which the reference evaluator does not run."""
    import pytest

    if any(n.domain not in ("", "ai.onnx") for n in m.graph.node):
        pytest.skip("onnxruntime's uint8 x int8 products saturate on this host (AVX2 without "
                    "VNNI) and the reference evaluator has no com.microsoft ops: no exact "
                    "anchor for this model here")
    version = next((o.version for o in m.opset_import if o.domain in ("", "ai.onnx")), OPSET)
    if version < 19:  # the reference evaluator's Q/DQ start at opset 19 (same semantics here)
        m = onnx.version_converter.convert_version(m, 19)
    return ref_run(m, feed, outputs)


def ref_run(m: onnx.ModelProto, feed: Mapping[str, Any], outputs: Sequence[str] | None = None) -> list:
    from onnx.reference import ReferenceEvaluator

    return list(ReferenceEvaluator(m).run(list(outputs) if outputs else None, dict(feed)))


def assert_outputs(got: Sequence[Any], want: Sequence[Any], rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert len(got) == len(want), (len(got), len(want))
    for i, (g, w) in enumerate(zip(got, want)):
        if isinstance(w, (list, tuple)):
            assert isinstance(g, (list, tuple)), f"output {i}: expected a sequence, got {type(g)}"
            assert_outputs(g, w, rtol, atol)
            continue
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape, f"output {i}: shape {g.shape} != {w.shape}"
        assert g.dtype == w.dtype, f"output {i}: dtype {g.dtype} != {w.dtype}"
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=f"output {i}")


def mlp(n: str | int = "N") -> onnx.ModelProto:
    """x[n,4] -> MatMul(W) -> Add(b) -> Relu -> Softmax -> y[n,3]: a few intermediates."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 3)).astype(np.float32)
    b = rng.standard_normal((3,)).astype(np.float32)
    return model(
        [helper.make_node("MatMul", ["x", "W"], ["mm"], name="mm"),
         helper.make_node("Add", ["mm", "b"], ["biased"], name="add"),
         helper.make_node("Relu", ["biased"], ["act"], name="relu"),
         helper.make_node("Softmax", ["act"], ["y"], axis=-1, name="softmax")],
        [vi("x", F, [n, 4])], [vi("y", F, [n, 3])], [init("W", w), init("b", b)])
