"""One-node (or small) models of onnxruntime's contrib ops, run by onnxruntime's
CPUExecutionProvider and by hetero_exec on cpu and on strict sim-gpu with the GPU
required (so a kernel that claims the device must run on CuPy's boundaries)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import onnx
import onnxruntime
from onnx import helper

import hetero_exec

MS = "com.microsoft"
PROVIDERS = (("cpu", {}), ("sim-gpu", {"require_gpu": True}))


def tensor_type(v: np.ndarray) -> int:
    return helper.np_dtype_to_tensor_dtype(v.dtype)


def one_node(op_type: str, inputs: Sequence[np.ndarray | None], n_outputs: int = 1,
             domain: str = MS, initializers: Sequence[int] = (), output_names=None,
             out_types: Sequence[Any] | None = None, **attrs: Any) -> tuple[bytes, dict]:
    """A model of one node: inputs named x0.. (None: omitted), ``initializers`` the
    positions given as constants; ``out_types`` the outputs' numpy dtypes (default: the
    first floating input's); returns (model bytes, feeds)."""
    names = [f"x{i}" if v is not None else "" for i, v in enumerate(inputs)]
    outs = list(output_names) if output_names else [f"y{i}" for i in range(n_outputs)]
    node = helper.make_node(op_type, names, outs, domain=domain, **attrs)
    graph_inputs, inits, feeds = [], [], {}
    for i, (n, v) in enumerate(zip(names, inputs)):
        if v is None:
            continue
        if i in initializers:
            inits.append(onnx.numpy_helper.from_array(v, n))
        else:
            graph_inputs.append(helper.make_tensor_value_info(n, tensor_type(v), v.shape))
            feeds[n] = v
    if out_types is None:
        first = next(v for v in inputs if v is not None and v.dtype.kind == "f")
        out_types = [first.dtype] * len(outs)
    graph_outputs = [helper.make_tensor_value_info(o, tensor_type(np.empty(0, t)), None)
                     for o, t in zip(outs, out_types) if o]
    graph = helper.make_graph([node], "one", graph_inputs, graph_outputs,
                              initializer=inits)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    return model.SerializeToString(), feeds


def with_output_shapes(model: bytes, outputs: Sequence[np.ndarray]) -> bytes:
    """The model with its graph outputs' shapes declared (onnx's checker wants a shape
    on a typed graph output; onnxruntime does not), from onnxruntime's results."""
    proto = onnx.load_from_string(model)
    for vi, v in zip(proto.graph.output, outputs):
        vi.CopyFrom(helper.make_tensor_value_info(vi.name, tensor_type(np.asarray(v)),
                                                  np.asarray(v).shape))
    return proto.SerializeToString()


def run_ort(model: bytes, feeds: dict) -> list[np.ndarray]:
    so = onnxruntime.SessionOptions()
    so.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = onnxruntime.InferenceSession(model, so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def run_ours(model: bytes, feeds: dict, provider: str, **options: Any) -> list[np.ndarray]:
    sess = hetero_exec.InferenceSession(model, providers=[provider], **options)
    if provider != "cpu":  # the GPU claimed every node: nothing fell back
        assert sess.fallback_report is None and sess.get_providers() == [f"{provider}:0"]
    return sess.run(None, feeds)


def compare(model: bytes, feeds: dict, rtol: float = 1e-5, atol: float = 1e-5,
            outputs: Sequence[int] | None = None, rows=None) -> list[np.ndarray]:
    """onnxruntime's outputs against ours on each provider; ``rows(i, array)`` may cut
    each output to the part onnxruntime defines."""
    want = run_ort(model, feeds)
    model = with_output_shapes(model, want)
    for provider, options in PROVIDERS:
        got = run_ours(model, feeds, provider, **options)
        assert len(got) == len(want)
        for i, (w, g) in enumerate(zip(want, got)):
            if outputs is not None and i not in outputs:
                continue
            g = np.asarray(g)
            assert g.dtype == w.dtype, (provider, i, g.dtype, w.dtype)
            assert g.shape == w.shape, (provider, i, g.shape, w.shape)
            if rows is not None:
                w, g = rows(i, w), rows(i, g)
            np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=rtol,
                                       atol=atol, err_msg=f"{provider} output {i}")
    return want
