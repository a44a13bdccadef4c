"""Small models for the placement tests, built with onnx.helper, and the references
their outputs are checked against (onnxruntime, or onnx.reference where ORT lacks a
kernel). Nothing here runs hetero_exec."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import onnx
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

F = T.FLOAT
I64 = T.INT64
OPSET = 17


def vi(name: str, elem: int = F, shape: Sequence[Any] | None = None) -> onnx.ValueInfoProto:
    return h.make_tensor_value_info(name, elem, shape)


def init(name: str, arr: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(arr), name)


def model(nodes: Sequence[onnx.NodeProto], inputs: Sequence[onnx.ValueInfoProto],
          outputs: Sequence[onnx.ValueInfoProto], inits: Sequence[onnx.TensorProto] = (),
          opset: int = OPSET, extra_opsets: Mapping[str, int] | None = None,
          name: str = "g") -> onnx.ModelProto:
    g = h.make_graph(list(nodes), name, list(inputs), list(outputs), list(inits))
    ops = [h.make_opsetid("", opset)] + [h.make_opsetid(d, v) for d, v in (extra_opsets or {}).items()]
    m = h.make_model(g, opset_imports=ops)
    m.ir_version = 8
    return m


# --- references ------------------------------------------------------------------------


def ort(m: onnx.ModelProto, feed: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as rt

    from tests._models import u8s8_anchor

    exact = u8s8_anchor(m, feed)
    if exact is not None:
        return exact
    opts = rt.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    sess = rt.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, dict(feed))


def ref(m: onnx.ModelProto, feed: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    from onnx.reference import ReferenceEvaluator

    return list(ReferenceEvaluator(m).run(None, dict(feed)))


def assert_outputs(got: Sequence[Any], want: Sequence[Any], rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert len(got) == len(want), (len(got), len(want))
    for i, (g, w) in enumerate(zip(got, want)):
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape, f"output {i}: shape {g.shape} != {w.shape}"
        assert g.dtype == w.dtype, f"output {i}: dtype {g.dtype} != {w.dtype}"
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=f"output {i}")


def rand(*shape: int, seed: int = 0, dtype=np.float32) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


# --- models ---------------------------------------------------------------------------


def chain(ops: Sequence[str], n: int = 4, names: Sequence[str] | None = None) -> onnx.ModelProto:
    """x[n] -> ops[0] -> ops[1] -> ... -> y, unary float ops; node i named names[i]."""
    nodes = []
    prev = "x"
    for i, op in enumerate(ops):
        out = "y" if i == len(ops) - 1 else f"t{i}"
        nodes.append(h.make_node(op, [prev], [out], name=(names[i] if names else "")))
        prev = out
    return model(nodes, [vi("x", F, [n])], [vi("y", F, [n])])


def mlp(layers: int = 4, width: int = 16, batch: int = 2, seed: int = 0,
        act: str = "Relu") -> onnx.ModelProto:
    """x[batch,width] -> layers x (MatMul "mm{i}", Add "add{i}", act "act{i}") -> y."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    prev = "x"
    for i in range(layers):
        w = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
        b = rng.standard_normal(width).astype(np.float32)
        inits += [init(f"W{i}", w), init(f"B{i}", b)]
        out = "y" if i == layers - 1 else f"h{i}"
        nodes += [h.make_node("MatMul", [prev, f"W{i}"], [f"mm{i}_o"], name=f"mm{i}"),
                  h.make_node("Add", [f"mm{i}_o", f"B{i}"], [f"add{i}_o"], name=f"add{i}"),
                  h.make_node(act, [f"add{i}_o"], [out], name=f"act{i}")]
        prev = out
    return model(nodes, [vi("x", F, [batch, width])], [vi("y", F, [batch, width])], inits)


def cnn(batch: int = 1, seed: int = 0) -> onnx.ModelProto:
    """Conv-Relu-MaxPool-Conv-Relu-GlobalAveragePool-Flatten-Gemm-Softmax, nodes named."""
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((8, 3, 3, 3)) * 0.3).astype(np.float32)
    b1 = rng.standard_normal(8).astype(np.float32) * 0.1
    w2 = (rng.standard_normal((16, 8, 3, 3)) * 0.2).astype(np.float32)
    b2 = rng.standard_normal(16).astype(np.float32) * 0.1
    wf = (rng.standard_normal((10, 16)) * 0.3).astype(np.float32)
    bf = rng.standard_normal(10).astype(np.float32) * 0.1
    nodes = [
        h.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        h.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        h.make_node("MaxPool", ["r1"], ["p1"], name="pool1", kernel_shape=[2, 2], strides=[2, 2]),
        h.make_node("Conv", ["p1", "w2", "b2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        h.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        h.make_node("GlobalAveragePool", ["r2"], ["gap"], name="gap"),
        h.make_node("Flatten", ["gap"], ["flat"], name="flatten"),
        h.make_node("Gemm", ["flat", "wf", "bf"], ["logits"], name="fc", transB=1),
        h.make_node("Softmax", ["logits"], ["y"], name="softmax", axis=1),
    ]
    inits = [init("w1", w1), init("b1", b1), init("w2", w2), init("b2", b2), init("wf", wf), init("bf", bf)]
    return model(nodes, [vi("x", F, [batch, 3, 8, 8])], [vi("y", F, [batch, 10])], inits)


def matmul_chain(widths: Sequence[int], batch: int = 4, seed: int = 0) -> onnx.ModelProto:
    """x[batch, widths[0]] -> MatMul "mm{i}" (W_i: widths[i] x widths[i+1]) -> Relu "r{i}" -> ... -> y."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    prev = "x"
    for i in range(len(widths) - 1):
        w = (rng.standard_normal((widths[i], widths[i + 1])) / np.sqrt(widths[i])).astype(np.float32)
        inits.append(init(f"W{i}", w))
        out = "y" if i == len(widths) - 2 else f"r{i}_o"
        nodes += [h.make_node("MatMul", [prev, f"W{i}"], [f"mm{i}_o"], name=f"mm{i}"),
                  h.make_node("Relu", [f"mm{i}_o"], [out], name=f"r{i}")]
        prev = out
    return model(nodes, [vi("x", F, [batch, widths[0]])], [vi("y", F, [batch, widths[-1]])], inits)


def if_model() -> onnx.ModelProto:
    """y = If(c, then: Relu(x) -> Neg, else: Abs(x)); z = Sigmoid(y)."""
    then_g = h.make_graph([h.make_node("Relu", ["x"], ["tr"], name="t_relu"),
                           h.make_node("Neg", ["tr"], ["t_out"], name="t_neg")],
                          "then_g", [], [vi("t_out", F, [4])])
    else_g = h.make_graph([h.make_node("Abs", ["x"], ["e_out"], name="e_abs")],
                          "else_g", [], [vi("e_out", F, [4])])
    nodes = [h.make_node("Sin", ["x"], ["s"], name="sin"),
             h.make_node("If", ["c"], ["y"], name="branch", then_branch=then_g, else_branch=else_g),
             h.make_node("Sigmoid", ["y"], ["z"], name="sig")]
    return model(nodes, [vi("c", T.BOOL, []), vi("x", F, [4])], [vi("z", F, [4]), vi("s", F, [4])])
