"""The physical floor of a model on this machine: its GEMM and convolution FLOPs at the
BLAS's measured rate.

No runtime can do a model's products faster than the BLAS does a large square GEMM, so
``flops / rate`` is a lower bound on a run (it ignores every memory-bound op, which makes
it a loose bound for depthwise convolutions and normalisation-heavy models).

>>> from bench.models import mlp
>>> model_flops(mlp(width=64, layers=2), {"x": [4, 64]})
65536
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Mapping, Sequence

import numpy as np
import onnx
from onnx import shape_inference


def _static_shapes(model: onnx.ModelProto, input_shapes: Mapping[str, Sequence[int]]
                   ) -> dict[str, list[int]]:
    """Every value's shape with the graph inputs fixed to ``input_shapes`` (onnx shape
    inference with data propagation, so Shape/Gather/Concat reshape targets resolve)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for inp in m.graph.input:
        if inp.name in input_shapes:
            dims = inp.type.tensor_type.shape.dim
            for d, v in zip(dims, input_shapes[inp.name]):
                d.Clear()
                d.dim_value = int(v)
    inferred = shape_inference.infer_shapes(m, data_prop=True)
    shapes: dict[str, list[int]] = {i.name: list(i.dims) for i in m.graph.initializer}
    g = inferred.graph
    for v in list(g.input) + list(g.value_info) + list(g.output):
        t = v.type.tensor_type
        if t.HasField("shape") and all(d.HasField("dim_value") for d in t.shape.dim):
            shapes[v.name] = [d.dim_value for d in t.shape.dim]
    return shapes


def _attr(node: onnx.NodeProto, name: str, default):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def node_flops(node: onnx.NodeProto, shapes: Mapping[str, list[int]]) -> int:
    """Multiply-add FLOPs (2 per MAC) of a Conv, ConvTranspose, MatMul or Gemm; 0 for others.
    Raises KeyError when a shape it needs is unknown."""
    op = node.op_type
    if op == "Conv":
        y, w = shapes[node.output[0]], shapes[node.input[1]]
        return 2 * math.prod(y) * math.prod(w[1:])  # each output: C/group * prod(K) MACs
    if op == "ConvTranspose":
        x, w = shapes[node.input[0]], shapes[node.input[1]]
        return 2 * math.prod(x) * math.prod(w[1:])
    if op == "MatMul":
        a, y = shapes[node.input[0]], shapes[node.output[0]]
        return 2 * math.prod(y) * a[-1]
    if op == "Gemm":
        a, y = shapes[node.input[0]], shapes[node.output[0]]
        k = a[0] if _attr(node, "transA", 0) else a[1]
        return 2 * math.prod(y) * k
    return 0


_COUNTED = ("Conv", "ConvTranspose", "MatMul", "Gemm")


def _run_shapes(model: onnx.ModelProto, feed: Mapping[str, np.ndarray],
                names: list[str]) -> dict[str, list[int]]:
    """Shapes of ``names`` from one onnxruntime run with them as extra outputs (for values
    shape inference leaves unknown, such as whatever follows a Where on a sliced mask)."""
    import onnxruntime as ort

    m = onnx.ModelProto()
    m.CopyFrom(model)
    have = {o.name for o in m.graph.output}
    for name in names:
        if name not in have:
            m.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT,
                                                                     None))
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    outs = sess.run(names, dict(feed))
    return {n: list(np.shape(v)) for n, v in zip(names, outs)}


def model_flops(model: onnx.ModelProto, feed: Mapping[str, np.ndarray | Sequence[int]]) -> int:
    """Sum of node_flops over the top-level graph (bodies of Loop/If/Scan are not counted).

    ``feed`` gives each graph input's array or shape. Shapes come from onnx shape
    inference; when it leaves some unknown and ``feed`` holds arrays, one onnxruntime
    run with those values as outputs finds them."""
    shapes_in = {k: list(np.shape(v)) if isinstance(v, np.ndarray) else list(v)
                 for k, v in feed.items()}
    shapes = _static_shapes(model, shapes_in)
    nodes = [n for n in model.graph.node if n.op_type in _COUNTED]
    missing = sorted({v for n in nodes for v in list(n.input[:2]) + [n.output[0]]
                      if v and v not in shapes})
    if missing and all(isinstance(v, np.ndarray) for v in feed.values()):
        shapes.update(_run_shapes(model, feed, missing))
    return sum(node_flops(n, shapes) for n in nodes)


def blas_gflops(n: int = 1024, runs: int = 10) -> float:
    """The float32 GEMM rate of numpy's BLAS here, GFLOP/s: the median of ``runs`` n^3
    products after one warm-up (with the BLAS's default threads)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), np.float32)
    b = rng.standard_normal((n, n), np.float32)
    out = np.empty((n, n), np.float32)
    np.matmul(a, b, out=out)
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        np.matmul(a, b, out=out)
        times.append(time.perf_counter() - t)
    return 2.0 * n ** 3 / statistics.median(times) / 1e9
