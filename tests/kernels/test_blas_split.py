"""native/blas.c: a run alone splits numpy's OpenBLAS products over gemm.c's workers
(`blas_split.blas_matmul`, `_threads.blas_split_on_c_workers`), with the BLAS at one thread."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from hetero_exec.kernels import _c_workers_split, _threads
from hetero_exec.kernels.native import blas_split
from hetero_exec.kernels.native import packed_gemm as pg

pytestmark = pytest.mark.skipif(
    not (pg.available() and _threads.blas_gemm() is not None and _threads.cores() >= 2),
    reason="needs the C kernels, numpy's OpenBLAS and two cores")


@pytest.fixture
def split_on_c_workers(monkeypatch):
    """One pool on, every product worth a split."""
    monkeypatch.setattr(_c_workers_split, "_split_on_c_workers", None)
    monkeypatch.delenv(_threads.SPLIT_ENV, raising=False)
    assert _threads.blas_split_on_c_workers()
    monkeypatch.setattr(blas_split, "BLAS_SPLIT_FLOPS", 0.0)


def _operand(rng, shape, dtype, layout):
    """An array of ``shape`` stored as asked: "c" C-contiguous, "t" as the transpose of a
    contiguous array, "view" a strided window of a larger one, "bcast" broadcast over its
    first axis (stride 0)."""
    if layout == "t":
        return np.swapaxes(rng.standard_normal(shape[:-2] + shape[-2:][::-1]).astype(dtype), -1, -2)
    if layout == "view":
        big = rng.standard_normal(shape[:-1] + (shape[-1] + 5,)).astype(dtype)
        return big[..., 2:2 + shape[-1]]
    if layout == "bcast":
        return np.broadcast_to(rng.standard_normal((1,) + shape[1:]).astype(dtype), shape)
    return rng.standard_normal(shape).astype(dtype)


CASES = [
    # (a shape, b shape, layouts): the ways blas.c cuts a product
    ((300, 40), (40, 70), ("c", "c")),        # by rows
    ((40, 70), (70, 300), ("c", "c")),        # by columns
    ((300, 40), (40, 70), ("t", "t")),        # both stored transposed
    ((300, 40), (40, 70), ("view", "view")),  # leading dimensions above the width
    ((1, 500), (500, 300), ("c", "c")),       # a row: cut along k, partial sums added
    ((1, 500), (500, 300), ("t", "t")),       # a row, B stored transposed: by columns
    ((1, 200), (200, 700), ("c", "c")),       # a row, k below n: by columns
    ((700, 300), (300, 1), ("c", "c")),       # a column
    ((700, 300), (300, 1), ("t", "t")),
    ((6, 50, 40), (6, 40, 30), ("c", "c")),   # by matrices
    ((6, 50, 40), (6, 40, 30), ("t", "view")),
    ((2, 3, 50, 40), (2, 3, 40, 30), ("c", "c")),  # two batch axes, one stride apart
    ((50, 40), (6, 40, 30), ("c", "c")),      # a broadcast over b's batch
    ((6, 50, 40), (40, 30), ("c", "t")),      # b broadcast
    ((6, 50, 40), (6, 40, 30), ("bcast", "c")),  # a stride-0 batch axis
    ((5, 1, 33, 20), (5, 1, 20, 17), ("c", "c")),  # batch axes of one
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("sa, sb, layouts", CASES)
def test_split_products_match_numpy(split_on_c_workers, sa, sb, layouts, dtype):
    rng = np.random.default_rng(1)
    a = _operand(rng, sa, dtype, layouts[0])
    b = _operand(rng, sb, dtype, layouts[1])
    want = a.astype(np.float64) @ b.astype(np.float64)
    with _threads.run_threads():
        got = blas_split.blas_matmul(a, b)
        assert got is not None, "the product did not take the split"
        out = np.full(want.shape, np.nan, dtype)
        assert blas_split.blas_matmul(a, b, out=out) is out
        via = _threads.matmul(np, a, b)  # the kernels' entry point takes the same path
    tol = 1e-4 if dtype == np.float32 else 1e-10
    for y in (got, out, via):
        assert y.dtype == dtype and y.shape == want.shape
        np.testing.assert_allclose(y, want, rtol=tol, atol=tol * np.abs(want).max())


def test_products_it_does_not_take(split_on_c_workers):
    rng = np.random.default_rng(2)
    a = rng.standard_normal((40, 30), np.float32)
    b = rng.standard_normal((30, 20), np.float32)
    with _threads.run_threads():
        assert blas_split.blas_matmul(a.astype(np.float16), b.astype(np.float16)) is None
        assert blas_split.blas_matmul(a, b.astype(np.float64)) is None  # mixed dtypes: numpy casts
        assert blas_split.blas_matmul(a, rng.standard_normal((31, 20), np.float32)) is None
        # an out that is not C-contiguous, or that overlaps an operand
        assert blas_split.blas_matmul(a, b, out=np.empty((20, 40), np.float32).T) is None
        sq = rng.standard_normal((30, 30), np.float32)
        assert blas_split.blas_matmul(sq, sq, out=sq) is None
        # batch axes that are not one stride apart (b broadcast along a middle axis)
        a4 = rng.standard_normal((2, 3, 40, 30), np.float32)
        b4 = rng.standard_normal((2, 1, 30, 20), np.float32)
        assert blas_split.blas_matmul(a4, b4) is None
        np.testing.assert_allclose(_threads.matmul(np, a4, b4), a4 @ b4, rtol=1e-5, atol=1e-5)
    # outside a run nothing is split: the BLAS keeps its own threads there
    assert _threads._blas_on_c_workers is False


def test_small_products_stay_on_the_calling_thread(monkeypatch):
    monkeypatch.setattr(_c_workers_split, "_split_on_c_workers", True)
    a = np.ones((8, 8), np.float32)
    with _threads.run_threads():
        assert blas_split.blas_matmul(a, a) is None  # below BLAS_SPLIT_FLOPS: one thread
    with _threads.intra_op_threads(1), _threads.run_threads():
        big = np.ones((256, 256), np.float32)
        assert blas_split.blas_matmul(big, big) is None  # a run that asks for one thread


def test_concurrent_splits_share_the_workers(split_on_c_workers):
    """Callers that find the workers busy run their parts themselves (workers.c); a row
    product cut along k must then still sum every part once."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal((1, 2000), np.float32)
    b = rng.standard_normal((2000, 300), np.float32)
    m = rng.standard_normal((200, 300), np.float32)
    c = b.T[:, :200]  # (300, 200), stored transposed
    want_row, want_m = a @ b, m @ c
    errors: list[str] = []
    go = threading.Barrier(3)

    def work():
        go.wait(10)
        for _ in range(200):
            y = blas_split.blas_matmul(a, b)
            if y is None or not np.allclose(y, want_row, rtol=1e-4, atol=1e-3):
                errors.append("row product")
            y = blas_split.blas_matmul(m, c)
            if y is None or not np.allclose(y, want_m, rtol=1e-4, atol=1e-3):
                errors.append("matrix product")

    with _threads.run_threads():  # one run's two threads, as run_async callers would be
        threads = [threading.Thread(target=work) for _ in range(2)]
        for t in threads:
            t.start()
        go.wait(10)
        for t in threads:
            t.join(60)
    assert not errors, errors[:3]


def test_a_run_alone_holds_the_blas_at_one_thread_and_splits_on_the_workers(split_on_c_workers):
    before = _threads.blas_threads()
    with _threads.run_threads():
        assert _threads.blas_threads() == 1
        assert _threads._blas_on_c_workers
    assert _threads.blas_threads() == before and not _threads._blas_on_c_workers


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv(_threads.SPLIT_ENV, "0")
    monkeypatch.setattr(_c_workers_split, "_split_on_c_workers", None)
    assert _threads.blas_split_on_c_workers() is False
    with _threads.run_threads():
        assert not _threads._blas_on_c_workers
        assert _threads.blas_threads() == _threads.split_width()  # the BLAS's own threads
