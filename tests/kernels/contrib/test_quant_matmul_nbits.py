"""com.microsoft MatMulNBits against onnxruntime: weights quantized by onnxruntime's own
blockwise quantizers (the functions its MatMulNBitsQuantizer calls, and the quantizer
itself where its onnx_ir dependency is installed), odd K / N / block sizes, 2/4/8 bits,
packed and float zero points or none, g_idx, bias, float16; on cpu (the compile-time
dequantized weight and the tiled kernel) and on strict sim-gpu."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from onnxruntime.capi import _pybind_state as ort_c

import hetero_exec
from hetero_exec.errors import HeteroExecError
from hetero_exec.kernels.contrib import quant_matmul
from hetero_exec.kernels.native import library
from tests._models import init, model, vi
from tests.kernels.contrib._quant_helpers import MS, compare

_QUANTIZE = {2: ort_c.quantize_matmul_2bits, 4: ort_c.quantize_matmul_4bits,
             8: ort_c.quantize_matmul_8bits}


def quantized(W: np.ndarray, bits: int, block: int, symmetric: bool):
    """onnxruntime's blockwise quantization of W [K, N]: (B, scales, packed zero points)."""
    K, N = W.shape
    kb, per = -(-K // block), 8 // bits
    B = np.zeros((N, kb, block * bits // 8), np.uint8)
    zp = np.zeros((N, -(-kb // per)), np.uint8)
    sc = np.zeros((N, kb), W.dtype)
    _QUANTIZE[bits](B, np.ascontiguousarray(W), sc, zp, block, N, K, symmetric)
    return B, sc, zp


def nbits_model(K, N, bits=4, block=32, symmetric=False, zp="packed", bias=False,
                dtype=np.float32, g_idx=None, seed=0):
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((K, N)).astype(dtype)
    B, sc, zpp = quantized(W, bits, block, symmetric)
    inits, names = [init("B", B), init("scales", sc)], ["x", "B", "scales"]
    if not symmetric:
        if zp == "float":  # unpacked, in A's dtype
            z = quant_matmul.unpack_codes(np, zpp, bits)[:, :sc.shape[1]].astype(dtype)
            inits.append(init("zp", z))
        else:
            inits.append(init("zp", zpp))
        names.append("zp")
    if g_idx is not None:
        names += [""] * (4 - len(names)) + ["g_idx"]
        inits.append(init("g_idx", g_idx.astype(np.int32)))
    if bias:
        names += [""] * (5 - len(names)) + ["bias"]
        inits.append(init("bias", rng.standard_normal(N).astype(dtype)))
    t = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    node = helper.make_node("MatMulNBits", names, ["y"], domain=MS, K=K, N=N, bits=bits,
                            block_size=block)
    return model([node], [vi("x", t, ["B", "S", K])], [vi("y", t, ["B", "S", N])], inits,
                 extra_opsets={MS: 1})


def _x(K, dtype=np.float32, rows=(2, 3), seed=1):
    return np.random.default_rng(seed).standard_normal(rows + (K,)).astype(dtype)


CASES = {  # name: (K, N, bits, block, symmetric, zp, bias, dtype)
    "4b_asym": (96, 40, 4, 32, False, "packed", False, np.float32),
    "4b_sym_odd": (100, 37, 4, 16, True, "packed", False, np.float32),
    "4b_k_tail_b128": (200, 19, 4, 128, False, "packed", True, np.float32),
    "4b_float_zp": (130, 21, 4, 64, False, "float", False, np.float32),
    "4b_bias": (70, 9, 4, 32, False, "packed", True, np.float32),
    "4b_fp16": (72, 24, 4, 32, False, "packed", True, np.float16),
    "8b_asym": (77, 13, 8, 32, False, "packed", False, np.float32),
    "8b_sym_b16": (50, 33, 8, 16, True, "packed", True, np.float32),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matmul_nbits_vs_onnxruntime(name):
    K, N, bits, block, sym, zp, bias, dt = CASES[name]
    m = nbits_model(K, N, bits, block, sym, zp, bias, dt)
    tol = 2e-2 if dt == np.float16 else 1e-4
    compare(m, {"x": _x(K, dt)}, device_ops=["MatMulNBits"], rtol=tol, atol=tol)


def test_matmul_nbits_two_bits():
    m = nbits_model(64, 11, bits=2, block=32)
    try:
        compare(m, {"x": _x(64)}, device_ops=["MatMulNBits"], rtol=1e-4, atol=1e-4)
    except Exception as e:  # noqa: BLE001 - onnxruntime's build may lack 2-bit cpu kernels
        if "onnxruntime" in type(e).__module__:
            pytest.skip(f"onnxruntime runs no 2-bit MatMulNBits here: {e}")
        raise


@pytest.mark.parametrize("zp", ["none", "float"])
@pytest.mark.parametrize("order", ["blocks", "random"])
def test_matmul_nbits_g_idx(zp, order):
    # onnxruntime (1.32) ignores packed uint8 zero points when g_idx is given (it keeps
    # 8); we follow the operator's definition there, so that case is not compared
    K, block = 96, 32
    g = np.arange(K) // block if order == "blocks" else \
        np.random.default_rng(3).integers(0, K // block, K)
    m = nbits_model(K, 40, 4, block, symmetric=zp == "none", zp="float", g_idx=g)
    compare(m, {"x": _x(K)}, device_ops=["MatMulNBits"], rtol=1e-4, atol=1e-4)


def test_matmul_nbits_tiled_kernel_on_cpu(monkeypatch):
    """No compile-time copy (over the limit) and no C kernel: the numpy kernel dequantizes
    tiles of a few rows."""
    monkeypatch.setattr(quant_matmul, "DEQUANT_ONCE_MAX_BYTES", 0)
    monkeypatch.setattr(quant_matmul, "native_nbits", lambda *a: None)
    monkeypatch.setattr(quant_matmul, "TILE_BYTES", 4 * 100 * 5)  # 5 rows of B a tile
    m = nbits_model(100, 23, 4, 32, bias=True)
    compare(m, {"x": _x(100)}, providers=["cpu"], rtol=1e-4, atol=1e-4)


def test_matmul_nbits_batch_one_and_many_rows():
    m = nbits_model(256, 48, 4, 32)
    for rows in [(1, 1), (4, 33)]:
        compare(m, {"x": _x(256, rows=rows)}, providers=["cpu"], rtol=1e-4, atol=1e-4)


def test_matmul_nbits_quantizer_model():
    """A MatMul model quantized by onnxruntime's MatMulNBitsQuantizer (needs onnx_ir)."""
    pytest.importorskip("onnx_ir")
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    rng = np.random.default_rng(5)
    W1 = rng.standard_normal((72, 56)).astype(np.float32)
    W2 = rng.standard_normal((56, 30)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"]),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "W2"], ["y"])]
    m = model(nodes, [vi("x", 1, ["N", 72])], [vi("y", 1, ["N", 30])],
              [init("W1", W1), init("W2", W2)])
    for symmetric in (False, True):
        q = MatMulNBitsQuantizer(m, block_size=32, is_symmetric=symmetric)
        q.process()
        qm = q.model.model
        assert [n.op_type for n in qm.graph.node].count("MatMulNBits") == 2
        compare(qm, {"x": rng.standard_normal((5, 72)).astype(np.float32)},
                device_ops=["MatMulNBits"], rtol=1e-4, atol=1e-4)


def test_matmul_nbits_bad_weight_is_a_typed_error():
    m = nbits_model(96, 40)
    bad = onnx.ModelProto()
    bad.CopyFrom(m)
    for t in bad.graph.initializer:
        if t.name == "B":  # one k-block short
            t.CopyFrom(numpy_helper.from_array(np.zeros((40, 2, 16), np.uint8), "B"))
    sess = hetero_exec.InferenceSession(bad.SerializeToString(), providers=["cpu"])
    with pytest.raises(HeteroExecError, match="MatMulNBits: B must be uint8"):
        sess.run(None, {"x": _x(96)})
    with pytest.raises(HeteroExecError, match="MatMulNBits: B must be uint8"):
        sess.run(None, {"x": _x(96)})  # the session still answers, with the same error


@pytest.mark.skipif(not library.available(), reason="C kernels not built")
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("block", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("zp", ["packed", "float", "none"])
def test_matmul_nbits_native_kernel(bits, block, zp):
    """native/nbits.c (the C kernel unpacking a block at a time) against onnxruntime: a
    decode step (one row), a few rows, and past NATIVE_ROWS (the float copy's GEMM), with
    K off the blocks, N odd, bias. The CI reruns it with HETERO_EXEC_ISA=avx2 and baseline."""
    if bits == 8 and zp == "float":
        pytest.skip("onnxruntime's cpu runs no 8-bit MatMulNBits with float zero points")
    K, N = 3 * block + 5, 37
    m = nbits_model(K, N, bits, block, symmetric=zp == "none", zp=zp, bias=True, seed=block)
    for rows in [(1, 1), (2, 3), (1, quant_matmul.NATIVE_ROWS + 3)]:
        compare(m, {"x": _x(K, rows=rows)}, providers=["cpu"], rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not library.available(), reason="C kernels not built")
def test_matmul_nbits_native_matches_definition_without_hook():
    """The C kernel on a fed (non-constant) weight, against the numpy tiled definition."""
    rng = np.random.default_rng(9)
    K, N, block = 300, 70, 32
    B, sc, zp = quantized(rng.standard_normal((K, N)).astype(np.float32), 4, block, False)
    A = rng.standard_normal((3, K)).astype(np.float32)
    got = quant_matmul.native_nbits(A, B, sc, zp, None, K, N, 4, block)
    W = quant_matmul.dequantize_rows(np, B, sc, zp, None, K, N, 4, block)
    np.testing.assert_allclose(got, A @ W.T, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not library.available(), reason="C kernels not built")
@pytest.mark.parametrize("N", [4003, 7])
def test_matmul_nbits_native_one_row_split_over_workers(N):
    """A decode step's row (nbits.c's columns four at a time) with N not a multiple of
    four, large enough to be split over the workers at odd bounds, against the numpy
    tiled definition."""
    rng = np.random.default_rng(N)
    K, block = 512, 32
    B, sc, zp = quantized(rng.standard_normal((K, N)).astype(np.float32), 4, block, False)
    A = rng.standard_normal((1, K)).astype(np.float32)
    got = quant_matmul.native_nbits(A, B, sc, zp, None, K, N, 4, block)
    W = quant_matmul.dequantize_rows(np, B, sc, zp, None, K, N, 4, block)
    np.testing.assert_allclose(got, A @ W.T, rtol=1e-4, atol=1e-4)

