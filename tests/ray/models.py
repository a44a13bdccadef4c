"""Small graphs for the Ray tests, built with onnx.helper, and plans made by hand."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from hetero_exec.ir import load
from hetero_exec.ir.graph import Graph
from hetero_exec.placement.decide import SessionBuild
from hetero_exec.placement.segments import build_plan
from hetero_exec.providers import parse_provider
from hetero_exec.session import SessionOptions

F = TensorProto.FLOAT


def _w(rng: np.random.Generator, name: str, *shape: int) -> onnx.TensorProto:
    return numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name)


def mlp(width: int = 32, layers: int = 3, seed: int = 0) -> onnx.ModelProto:
    """x [N, width] -> (Gemm, Relu) * layers -> y [N, width]."""
    rng = np.random.default_rng(seed)
    nodes, inits, x = [], [], "x"
    for i in range(layers):
        inits += [_w(rng, f"w{i}", width, width), _w(rng, f"b{i}", width)]
        nodes.append(helper.make_node("Gemm", [x, f"w{i}", f"b{i}"], [f"h{i}"], name=f"fc{i}"))
        x = f"r{i}" if i < layers - 1 else "y"
        nodes.append(helper.make_node("Relu", [f"h{i}"], [x], name=f"relu{i}"))
    g = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", F, ["N", width])],
        [helper.make_tensor_value_info("y", F, ["N", width])],
        inits,
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def cnn(seed: int = 0) -> onnx.ModelProto:
    """x [N, 3, 16, 16] -> Conv, Relu, MaxPool, Conv, Relu, GlobalAveragePool, Flatten, Gemm."""
    rng = np.random.default_rng(seed)
    inits = [
        _w(rng, "c1", 8, 3, 3, 3),
        _w(rng, "c1b", 8),
        _w(rng, "c2", 16, 8, 3, 3),
        _w(rng, "c2b", 16),
        _w(rng, "fc", 16, 10),
        _w(rng, "fcb", 10),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "c1", "c1b"], ["a"], pads=[1, 1, 1, 1], name="conv1"),
        helper.make_node("Relu", ["a"], ["b"], name="relu1"),
        helper.make_node("MaxPool", ["b"], ["c"], kernel_shape=[2, 2], strides=[2, 2], name="pool"),
        helper.make_node("Conv", ["c", "c2", "c2b"], ["d"], pads=[1, 1, 1, 1], name="conv2"),
        helper.make_node("Relu", ["d"], ["e"], name="relu2"),
        helper.make_node("GlobalAveragePool", ["e"], ["f"], name="gap"),
        helper.make_node("Flatten", ["f"], ["g"], name="flatten"),
        helper.make_node("Gemm", ["g", "fc", "fcb"], ["logits"], name="head"),
    ]
    g = helper.make_graph(
        nodes,
        "cnn",
        [helper.make_tensor_value_info("x", F, ["N", 3, 16, 16])],
        [helper.make_tensor_value_info("logits", F, ["N", 10])],
        inits,
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def gather_model() -> onnx.ModelProto:
    """y = Gather(Relu(x), idx) + 1: a run-time IndexError inside the Gather kernel."""
    one = numpy_helper.from_array(np.ones(1, np.float32), "one")
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Gather", ["r", "idx"], ["g"], axis=0, name="pick"),
        helper.make_node("Add", ["g", "one"], ["y"], name="plus"),
    ]
    g = helper.make_graph(
        nodes,
        "gather",
        [
            helper.make_tensor_value_info("x", F, [4]),
            helper.make_tensor_value_info("idx", TensorProto.INT64, [2]),
        ],
        [helper.make_tensor_value_info("y", F, [2])],
        [one],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def skip_model(width: int = 8) -> onnx.ModelProto:
    """``h`` skips the middle: placed [dev, dev, cpu, dev], it is read only on the device.

    Tanh(x) -> h, Neg(x) -> m; Relu(m) -> r; Add(h, r) -> y.
    """
    nodes = [
        helper.make_node("Tanh", ["x"], ["h"], name="tanh"),
        helper.make_node("Neg", ["x"], ["m"], name="neg"),
        helper.make_node("Relu", ["m"], ["r"], name="relu"),
        helper.make_node("Add", ["h", "r"], ["y"], name="skip"),
    ]
    g = helper.make_graph(
        nodes,
        "skip",
        [helper.make_tensor_value_info("x", F, ["N", width])],
        [helper.make_tensor_value_info("y", F, ["N", width])],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


#: where skip_model's nodes go to exercise device-local seams
SKIP_PLACEMENT = ["sim-gpu:0", "sim-gpu:0", "cpu", "sim-gpu:0"]


def hand_build(model: onnx.ModelProto, providers: Sequence[str]) -> tuple[Graph, SessionBuild]:
    """A plan placing node i on ``providers[i]`` (build_plan, bypassing the planner).

    ``"cpu/2"`` is a second cpu provider instance: consecutive nodes on ``cpu`` and
    ``cpu/2`` make two segments on cpu (two stages with ``stages=[cut]``).
    """
    _, graph = load(model)
    provs = {name: parse_provider(name.split("/")[0]) for name in dict.fromkeys(providers)}
    assignment = {node: provs[p] for node, p in zip(graph.nodes, providers)}
    plan = build_plan(graph, graph.nodes, assignment, strategy="hand")
    return graph, SessionBuild(placement=plan, providers=list(provs.values()), graph=graph)


def options(stages="auto", **executor_options) -> SessionOptions:
    profiling = executor_options.pop("enable_profiling", False)
    return SessionOptions(
        executor="ray", enable_profiling=profiling, stages=stages,
        executor_options=executor_options
    )
