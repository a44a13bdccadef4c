"""The C integer GEMM (native/qgemm.c through kernels/_int_gemm.PackedInt8) against
onnxruntime's MatMulInteger: every pair of 8-bit types, per-column zero points, K and N
off the kernel's groups and panels, one row (the decode path) and batched rows, extreme
values (the largest partial sums, where AVX2's vpmaddubsw would saturate). The CI reruns
this file with HETERO_EXEC_ISA=avx2 and baseline, so each variant's path is checked."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from hetero_exec.kernels import _int_gemm
from hetero_exec.kernels.native import library
from tests._models import model, ort_run, vi

pytestmark = pytest.mark.skipif(not library.available(), reason="C kernels not built")

_T = {np.uint8: TensorProto.UINT8, np.int8: TensorProto.INT8}


def _ints(rng, dtype, shape, extreme):
    info = np.iinfo(dtype)
    if extreme:
        return rng.choice([info.min, info.max], size=shape).astype(dtype)
    return rng.integers(info.min, int(info.max) + 1, size=shape).astype(dtype)


def _ort_matmul_integer(A, B, azp, bzp):
    node = helper.make_node("MatMulInteger", ["A", "B", "azp", "bzp"], ["Y"])
    m = model([node], [vi("A", _T[A.dtype.type], list(A.shape)),
                       vi("B", _T[B.dtype.type], list(B.shape)),
                       vi("azp", _T[A.dtype.type], list(azp.shape)),
                       vi("bzp", _T[B.dtype.type], list(bzp.shape))],
              [vi("Y", TensorProto.INT32, None)], [])
    return ort_run(m, {"A": A, "B": B, "azp": azp, "bzp": bzp})[0]


@pytest.mark.parametrize("a_t,b_t", [(np.uint8, np.int8), (np.uint8, np.uint8),
                                     (np.int8, np.int8), (np.int8, np.uint8)])
@pytest.mark.parametrize("shape", [(1, 7, 5), (1, 515, 70), (13, 300, 45), (2, 67, 130, 33)])
@pytest.mark.parametrize("extreme", [False, True])
def test_packed_int8_matches_onnxruntime(a_t, b_t, shape, extreme):
    rng = np.random.default_rng(sum(shape))
    *lead, K, N = shape
    A = _ints(rng, a_t, (*lead, K), extreme)
    B = _ints(rng, b_t, (K, N), extreme)
    azp = _ints(rng, a_t, (), False)
    bzp = _ints(rng, b_t, (N,), False)
    if a_t is np.int8 and b_t is np.uint8:  # onnxruntime has no s8 x u8 MatMulInteger
        want = (A.astype(np.int64) - int(azp)) @ (B.astype(np.int64) - bzp.astype(np.int64))
    else:
        want = _ort_matmul_integer(A, B, azp, bzp)
    got = _int_gemm.PackedInt8(B, bzp).product(A, azp)
    assert got is not None and got.dtype == np.int32
    np.testing.assert_array_equal(got, want)
    # B given transposed ([N, K], QGemm's transB) packs to the same product
    got_t = _int_gemm.PackedInt8(np.ascontiguousarray(B.T), bzp, transpose=True).product(A, azp)
    np.testing.assert_array_equal(got_t, want)


def test_packed_int8_scaled_output_and_per_row_zero_points():
    rng = np.random.default_rng(7)
    M, K, N = 9, 131, 37
    A = _ints(rng, np.uint8, (M, K), False)
    B = _ints(rng, np.int8, (K, N), False)
    azp = _ints(rng, np.uint8, (M,), False)  # one per row: QLinearMatMul's per-row a
    scale = (rng.random(N) * 0.01).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32)
    want_int = np.stack([_ort_matmul_integer(A[i:i + 1], B, np.asarray(azp[i]),
                                             np.zeros((), np.int8))[0]
                         for i in range(M)])
    pw = _int_gemm.PackedInt8(B, None)
    np.testing.assert_array_equal(pw.product(A, azp), want_int)
    got = pw.product(A, azp, scale=scale, bias=bias)
    np.testing.assert_allclose(got, want_int.astype(np.float32) * scale + bias, rtol=1e-6,
                               atol=1e-6)


def test_packed_int8_declines_what_it_does_not_take():
    B = np.ones((8, 4), np.int8)
    pw = _int_gemm.PackedInt8(B, None)
    assert pw.product(np.ones((3, 8), np.float32), None) is None  # not 8-bit
    assert pw.product(np.ones((3, 7), np.uint8), None) is None  # K differs
    assert pw.product(np.ones((3, 8), np.uint8), np.ones((2, 3), np.uint8)) is None
    assert _int_gemm.PackedInt8(B, np.ones((2, 2), np.int8)).zp is None
