"""Checking a kernel against onnx's ReferenceEvaluator on a one-node model."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import onnx
from onnx import helper
from onnx.reference import ReferenceEvaluator

from hetero_exec.kernels import lookup


def reference(op_type: str, inputs: Sequence[np.ndarray | None], opset: int = 21,
              domain: str = "", n_outputs: int = 1, **attrs: Any) -> list[np.ndarray]:
    """Run one node of ``op_type`` through onnx.reference."""
    in_names = [f"x{i}" if v is not None else "" for i, v in enumerate(inputs)]
    out_names = [f"y{i}" for i in range(n_outputs)]
    node = helper.make_node(op_type, in_names, out_names, domain=domain, **attrs)
    graph = helper.make_graph(
        [node], "one",
        [helper.make_tensor_value_info(n, onnx.helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
         for n, v in zip(in_names, inputs) if v is not None],
        [helper.make_tensor_value_info(n, onnx.TensorProto.UNDEFINED, None) for n in out_names],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(domain, opset)])
    feeds = {n: v for n, v in zip(in_names, inputs) if v is not None}
    return list(ReferenceEvaluator(model).run(None, feeds))


def ours(xp, op_type: str, inputs: Sequence[np.ndarray | None], opset: int = 21,
         domain: str = "", **attrs: Any):
    """Run the registered kernel directly on ``xp`` arrays."""
    kdef = lookup(domain, op_type, opset)
    assert kdef is not None, f"no kernel for {op_type} at opset {opset}"
    if kdef.host_only is not None and xp is not np:
        import pytest

        pytest.skip(f"host-only kernel: {kdef.host_only}")
    # declared host inputs stay host values, as a device plan hands them (exec/plan.py)
    args = [v if v is None or i in kdef.host_inputs else xp.asarray(v) for i, v in enumerate(inputs)]
    extra = {}
    if "opset" in kdef.wants:
        extra["opset"] = kdef.since
    return kdef.fn(xp, *args, **attrs, **extra)


def check(xp, op_type: str, inputs, opset: int = 21, rtol: float = 1e-5, atol: float = 1e-6,
          n_outputs: int = 1, **attrs: Any):
    """Our kernel on ``xp`` against onnx.reference: same dtypes and shapes; floats (and
    ml_dtypes, compared in float64) within rtol/atol, everything else exactly unless
    atol >= 1."""
    from tests.conftest import to_numpy

    want = reference(op_type, inputs, opset=opset, n_outputs=n_outputs, **attrs)
    got = ours(xp, op_type, inputs, opset=opset, **attrs)
    assert isinstance(got, tuple)
    for w, g in zip(want, got):
        g = to_numpy(g)
        assert isinstance(g, np.ndarray)
        assert g.dtype == w.dtype, (op_type, g.dtype, w.dtype)
        assert g.shape == w.shape, (op_type, g.shape, w.shape)
        if w.dtype.kind in "fV" or atol >= 1:  # atol >= 1: integer results within a step
            np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=rtol, atol=atol)
        else:
            np.testing.assert_array_equal(g, w)
    return got


def activation_reference(name: str, params, y):
    """What a fused op's ``activation`` (kernels/fused.ACTIVATIONS) gives, by numpy's
    formulas in y's precision ("" is none; GELUs in float64)."""
    import math

    if name == "":
        return y
    if name == "Relu":
        return np.maximum(y, 0)
    if name == "Clip":
        return np.minimum(np.maximum(y, params[0]), params[1])
    if name in ("HardSigmoid", "HardSwish"):
        a, b = params if name == "HardSigmoid" else (1 / 6, 0.5)
        hs = np.clip(y * a + b, 0, 1)
        return hs if name == "HardSigmoid" else y * hs
    if name == "SiLU":
        return y / (1 + np.exp(-y))
    if name == "Sigmoid":
        return 1 / (1 + np.exp(-y))
    if name == "Tanh":
        return np.tanh(y)
    if name == "GeluTanh":
        y64 = np.asarray(y, np.float64)
        with np.errstate(over="ignore", invalid="ignore"):  # +-inf and 1e30 inputs
            return 0.5 * y64 * (1 + np.tanh(math.sqrt(2 / math.pi) * (y64 + 0.044715 * y64 ** 3)))
    assert name == "Gelu", name
    y64 = np.asarray(y, np.float64)
    erf = np.vectorize(math.erf, otypes=[np.float64])
    return 0.5 * y64 * (1 + erf(y64 / math.sqrt(2)))
