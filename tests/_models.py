"""Small models built with onnx.helper, and the two references outputs are checked
against (onnxruntime and onnx.reference.ReferenceEvaluator), for the runtime tests."""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import onnx
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


def ort_run(m: onnx.ModelProto, feed: Mapping[str, Any], outputs: Sequence[str] | None = None) -> list:
    import onnxruntime as ort

    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(list(outputs) if outputs else None, dict(feed))


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
