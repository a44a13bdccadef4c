"""The quantized contrib ops' onnx schemas (kernels/contrib/quant_schemas.py): onnx's
checker and shape inference accept onnxruntime's models, and onnx.reference still
imports once they are registered."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import pytest

from tests.kernels.contrib.test_quant_matmul_nbits import nbits_model

schemas = pytest.importorskip("hetero_exec.kernels.contrib.schemas")


def test_matmul_nbits_schema_infers_the_output():
    import hetero_exec.kernels.contrib.quant_schemas  # noqa: F401

    m = nbits_model(100, 37, 4, 16, True, "packed", True, np.float16)
    onnx.checker.check_model(m)  # against the registered schema
    del m.graph.output[:]
    m.graph.output.extend([onnx.helper.make_tensor_value_info("y", 0, None)])
    out = onnx.shape_inference.infer_shapes(m, strict_mode=True).graph.output[0]
    assert out.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    dims = [d.dim_value or d.dim_param for d in out.type.tensor_type.shape.dim]
    assert dims == ["B", "S", 37]


def test_onnx_reference_imports_after_registration():
    code = ("import hetero_exec.kernels.contrib.quant_schemas, onnx.defs\n"
            "assert onnx.defs.has('MatMulNBits', 'com.microsoft')\n"
            "import onnx.reference\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
