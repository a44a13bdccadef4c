"""Matrix products: Gemm, MatMul, MatMulInteger, QLinearMatMul, Einsum."""

from __future__ import annotations

import numpy as np

from hetero_exec.kernels._int_gemm import CenteredWeight, centered_weight_hook, int_matmul
from hetero_exec.kernels._nn_common import acc_dtype, is_numpy
from hetero_exec.kernels._packed import gemm_hook, matmul_hook
from hetero_exec.kernels._threads import matmul
from hetero_exec.kernels.registry import kernel


def _float_operands(xp, *arrays):
    """Cast to the compute dtype when numpy has no fast (BLAS) path for the dtype
    (float16, bfloat16): returns the cast arrays and the dtype to cast results back to."""
    dt = arrays[0].dtype
    if dt.kind in "iub":
        return arrays, None
    cdt = acc_dtype(xp, dt)
    if cdt == dt:
        return arrays, None
    return tuple(a.astype(cdt, copy=False) for a in arrays), dt


@kernel("Gemm", since=(1, 6, 7, 9, 11, 13),
        specialize=gemm_hook(lambda: Gemm))
def Gemm(xp, A, B, C=None, alpha=1.0, beta=1.0, transA=0, transB=0, broadcast=0):
    dt = A.dtype
    (Ac, Bc), back = _float_operands(xp, A, B)
    if transA:
        Ac = Ac.T
    if transB:
        Bc = Bc.T
    Y = matmul(xp, Ac, Bc)  # a large product split over our threads inside a run
    if alpha != 1.0:
        Y = Y * (Y.dtype.type(alpha) if Y.dtype.kind == "f" else alpha)
    if C is not None and beta != 0:
        Cc = C.astype(Y.dtype, copy=False)
        if beta != 1.0:
            Cc = Cc * (Y.dtype.type(beta) if Y.dtype.kind == "f" else beta)
        if Y.ndim == 2 and Cc.ndim <= 2 and np.broadcast_shapes(Y.shape, Cc.shape) == Y.shape:
            Y += Cc  # Y is the fresh product: add in place
        else:
            Y = Y + Cc
    return (Y.astype(dt, copy=False),)


@kernel("MatMul", since=(1, 9, 13),
        specialize=matmul_hook(lambda: MatMul))
def MatMul(xp, A, B):
    (Ac, Bc), back = _float_operands(xp, A, B)
    Y = xp.asarray(matmul(xp, Ac, Bc))  # 1-D @ 1-D gives a scalar
    if back is not None:
        Y = Y.astype(back)
    return (Y,)


def _matmul_integer(cw: CenteredWeight | None = None):
    def MatMulInteger(xp, A, B, a_zero_point=None, b_zero_point=None):
        if cw is not None and cw.serves(B, b_zero_point):
            return (int_matmul(xp, A, B, a_zero_point, cw=cw),)
        return (int_matmul(xp, A, B, a_zero_point, b_zero_point),)

    return MatMulInteger


MatMulInteger = kernel("MatMulInteger", since=10,
                       specialize=centered_weight_hook(1, 3, lambda: _matmul_integer))(
    _matmul_integer())


def _qlinear_matmul(cw: CenteredWeight | None = None):
    def QLinearMatMul(xp, a, a_scale, a_zero_point, b, b_scale, b_zero_point, y_scale,
                      y_zero_point):
        if cw is not None and cw.serves(b, b_zero_point):
            acc = int_matmul(xp, a, b, a_zero_point, cw=cw)
        else:
            acc = int_matmul(xp, a, b, a_zero_point, b_zero_point)
        # a scales are per-tensor or per-row, b (and y) per-tensor or per-column; the
        # requantisation multiplier is formed in the scales' own dtype, as onnxruntime does
        as_ = a_scale.reshape(-1, 1) if a_scale.size > 1 else a_scale.reshape(())
        bs = b_scale.reshape(1, -1) if b_scale.size > 1 else b_scale.reshape(())
        ys = y_scale.reshape(1, -1) if y_scale.size > 1 else y_scale.reshape(())
        D = acc * (as_ * bs / ys).astype(np.float64)
        out_dt = np.dtype(y_zero_point.dtype if y_zero_point is not None else a.dtype)
        if y_zero_point is not None:
            yz = y_zero_point.reshape(1, -1) if y_zero_point.size > 1 else y_zero_point.reshape(())
            D = D + yz.astype(np.float64)
        info = np.iinfo(out_dt)
        return (xp.asarray(xp.clip(xp.rint(D), info.min, info.max).astype(out_dt)),)

    return QLinearMatMul


QLinearMatMul = kernel("QLinearMatMul", since=(10, 21),
                       specialize=centered_weight_hook(3, 5, lambda: _qlinear_matmul))(
    _qlinear_matmul())


@kernel("Einsum", since=(12, 28))
def Einsum(xp, *Inputs, equation=""):
    eq = equation.replace(" ", "")
    dt = Inputs[0].dtype if Inputs else None
    ops, back = _float_operands(xp, *Inputs) if Inputs else ((), None)
    if is_numpy(xp):
        Y = np.einsum(eq, *ops, optimize=len(ops) > 1)
    else:
        Y = xp.einsum(eq, *ops)
    Y = xp.asarray(Y)
    if back is not None or (dt is not None and Y.dtype != dt):
        Y = Y.astype(dt)
    return (Y,)
