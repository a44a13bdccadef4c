"""MatMulNBits lowered into a program (exec/program/lower_quant.py, native/nbits.c's
record) against onnxruntime: 4 and 8 bits, zero points packed, float or none, bias, a
decode row and a few rows; past NATIVE_ROWS the step stays in Python (the float copy)."""

from __future__ import annotations

import pytest

from hetero_exec.kernels.contrib import quant_matmul
from hetero_exec.kernels.native import library
from tests.exec.program.test_lowerings import check
from tests.kernels.contrib.test_quant_matmul_nbits import _x, nbits_model

pytestmark = pytest.mark.skipif(not library.available(), reason="no C library in this tree")


@pytest.mark.parametrize("bits,block,zp,bias", [(4, 32, "packed", False), (4, 16, "none", True),
                                                (4, 128, "float", True), (8, 64, "packed", True),
                                                (4, 256, "packed", False)])
@pytest.mark.parametrize("rows", [(1, 1), (2, 3)])
def test_matmul_nbits_runs_in_the_program(bits, block, zp, bias, rows):
    K = 2 * block + 7
    m = nbits_model(K, 45, bits, block, symmetric=zp == "none", zp=zp, bias=bias, seed=block)
    check(m, {"x": _x(K, rows=rows)}, rtol=1e-4, atol=1e-4)


def test_matmul_nbits_many_rows_stay_in_python():
    m = nbits_model(64, 20, 4, 32)
    check(m, {"x": _x(64, rows=(1, quant_matmul.NATIVE_ROWS + 1))}, python=["MatMulNBits"],
          rtol=1e-4, atol=1e-4)
