"""Compound symbolic dims (an exporter's ``past_sequence_length + sequence_length``)
count in memory admission through the bounds of the symbols they name."""

from __future__ import annotations

import numpy as np
import onnx.helper as h
import pytest
from onnx import TensorProto

import hetero_exec as hx
from hetero_exec.errors import MemoryAdmissionError, UnboundedSymbolError
from hetero_exec.placement.dims import bound_dim, symbols_of


def test_bound_dim_expressions():
    b = {"past_sequence_length": 95, "sequence_length": 1, "batch_size": 4}
    assert bound_dim("past_sequence_length + sequence_length", b) == 96
    assert bound_dim("batch_size*sequence_length", b) == 4
    assert bound_dim("past_sequence_length - sequence_length", b) == 95  # a ceiling
    assert bound_dim("batch_size // 2", b) == 4
    assert bound_dim("past_sequence_length % batch_size", b) == 3
    assert bound_dim("unknown + 1", b) is None
    assert bound_dim("not an expression!", b) is None
    assert symbols_of("a + b*c") == ["a", "b", "c"]


def _concat_model() -> bytes:
    dims = ["past", 256]
    g = h.make_graph([h.make_node("Concat", ["p", "x"], ["y"], axis=0)], "g",
                     [h.make_tensor_value_info("p", TensorProto.FLOAT, dims),
                      h.make_tensor_value_info("x", TensorProto.FLOAT, ["seq", 256])],
                     [h.make_tensor_value_info("y", TensorProto.FLOAT, ["past + seq", 256])])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 18)]).SerializeToString()


def test_compound_dim_admitted_under_bounds():
    m = _concat_model()
    sess = hx.InferenceSession(m, providers=[("sim-gpu", {"mem_limit": 10 * 2**20})],
                               require_gpu=True, dim_bounds={"past": 1000, "seq": 24})
    y = sess.run(None, {"p": np.ones((3, 256), np.float32), "x": np.zeros((2, 256), np.float32)})[0]
    assert y.shape == (5, 256)
    need = sess.placement.segments[0].mem_need
    assert need == (1000 + 24 + 1024) * 256 * 4  # p, x and y at their bounds
    with pytest.raises(MemoryAdmissionError):
        hx.InferenceSession(m, providers=[("sim-gpu", {"mem_limit": need - 1})],
                            require_gpu=True, dim_bounds={"past": 1000, "seq": 24})
    with pytest.raises(UnboundedSymbolError, match="'seq'"):
        hx.InferenceSession(m, providers=[("sim-gpu", {"mem_limit": need})],
                            require_gpu=True, dim_bounds={"past": 1000})
