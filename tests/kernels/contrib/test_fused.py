"""FusedMatMul, FusedGemm, FusedConv (com.microsoft) against onnxruntime, on cpu and
strict sim-gpu."""

from __future__ import annotations

import numpy as np
import pytest

from tests.kernels.contrib._ort import compare, one_node

RNG = np.random.default_rng(3)


def _r(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("const_b", [False, True])
@pytest.mark.parametrize("transA,transB,alpha", [(0, 0, 1.0), (0, 1, 1.0), (1, 0, 0.5),
                                                  (1, 1, 2.0)])
def test_fused_matmul(transA, transB, alpha, const_b):
    M, K, N = 7, 13, 5
    A = _r(3, K, M) if transA else _r(3, M, K)
    B = _r(N, K) if transB else _r(K, N)
    compare(*one_node("FusedMatMul", [A, B], initializers=(1,) if const_b else (), alpha=alpha,
                      transA=transA, transB=transB), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("tba,tbb", [(1, 0), (0, 1), (1, 1)])
def test_fused_matmul_trans_batch(tba, tbb):
    A = _r(4, 2, 3, 5) if tba else _r(2, 3, 4, 5)
    B = _r(5, 2, 3, 6) if tbb else _r(2, 3, 5, 6)
    compare(*one_node("FusedMatMul", [A, B], transBatchA=tba, transBatchB=tbb), rtol=1e-4,
            atol=1e-5)


@pytest.mark.parametrize("activation,attrs", [("Relu", {}), ("Tanh", {}),
                                              ("Sigmoid", {}),
                                              ("LeakyRelu", {"activation_alpha": 0.1}),
                                              ("HardSigmoid", {"activation_alpha": 0.3,
                                                               "activation_beta": 0.4})])
def test_fused_gemm(activation, attrs):
    A, B, C = _r(9, 6), _r(5, 6), _r(5)
    compare(*one_node("FusedGemm", [A, B, C], initializers=(1, 2), transB=1, alpha=0.7, beta=1.3,
                      activation=activation, **attrs), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("activation,params", [("Relu", None), ("Sigmoid", None),
                                               ("LeakyRelu", [0.2]), ("Clip", [-0.5, 0.5]),
                                               ("HardSigmoid", [0.2, 0.5]), ("Tanh", None)])
@pytest.mark.parametrize("with_z", [False, True])
def test_fused_conv(activation, params, with_z):
    X, W, B = _r(2, 3, 9, 11), _r(4, 3, 3, 3), _r(4)
    Z = _r(2, 4, 5, 6) if with_z else None
    attrs = {"activation": activation, "strides": [2, 2], "pads": [1, 1, 1, 1]}
    if params:
        attrs["activation_params"] = params
    compare(*one_node("FusedConv", [X, W, B, Z], initializers=(1, 2), **attrs), rtol=1e-4,
            atol=1e-5)
