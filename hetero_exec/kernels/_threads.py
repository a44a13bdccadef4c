"""Our threads and the BLAS's for a run, on machines with few cores: how many cores a
run may use, how runs nest and overlap, which pool splits a lone run's products, and
how products and kernels' blocks are split. Apart, each a concern of its own: the BLAS
library (discovery, its thread count, OpenBLAS's spin, its CBLAS addresses) in
kernels/_blas.py, the core count in _cores.py, the helper pool and its hand-off in
_helper_pool.py, and whether a lone run's BLAS products split on the C workers in
_c_workers_split.py.

OpenBLAS splits each GEMM statically over its workers, and its workers spin-wait for a
while after every call. On a 2-core machine shared with other processes both hurt: a
GEMM waits for whichever worker the scheduler took away (a 0.2 ms product measured
10 ms), and the spinning workers take the cores that the next piece of work needs (our
own single-threaded element-wise kernels, onnxruntime's next run in a benchmark, other
processes). bench/README.md ("Threads") has the measurements.

So the executors enter `run_threads` around a run:

* a run alone in the process splits its products over the C library's workers, the
  same threads as the C kernels' (`blas_split_on_c_workers`: native/blas.c cuts a
  product into one-thread BLAS calls), up to its width (one thread per core, or fewer
  when the run asks: `intra_op_threads`, per calling thread, is a session's
  ``intra_op_num_threads`` or a Ray stage's share of its node's cores). Two pools of
  spinning threads, the BLAS's and ours, took each other's cores on 2 cores: after a
  product OpenBLAS's worker spun on while ours ran the next depthwise conv, and ConvNeXt
  at batch 1 flipped between 5.3 and 7.8 ms a run by where the scheduler had put them
  (bench/README.md). Without the C kernels or with ``HETERO_EXEC_BLAS_SPLIT=0``, the
  BLAS gets the run's width and splits its products itself;
* as soon as two runs overlap (``run_many``, ``run_async``, a Ray stage running a
  group's requests side by side), the BLAS is held at one thread until the last one
  leaves: the runs already keep the cores busy, and splitting their products too
  measured slower (bench/bench_threads.py, both tables).

`single_blas_thread` holds the BLAS at one thread whatever else runs; inside it the
kernels split their large products and independent blocks over a small pool of our own
(`matmul`, `parallel_for`), whose idle threads block instead of spinning: one thread per
usable core, or at most ``HETERO_EXEC_INTRA_OP_THREADS`` (1: nothing is split). Small
products run on one thread either way: a hand-off costs more than they do.

>>> import numpy as np
>>> a, b = np.ones((64, 32), np.float32), np.ones((32, 16), np.float32)
>>> with single_blas_thread():
...     float(matmul(np, a, b)[0, 0])
32.0
"""

from __future__ import annotations

import logging
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np

from hetero_exec.kernels import _blas, _c_workers_split
from hetero_exec.kernels._blas import (  # noqa: F401 (the BLAS's, re-exported for callers)
    DEFAULT_SPIN_EXPONENT,
    SPIN_ENV,
    BlasGemm,
    blas_gemm,
    blas_libs,
    blas_threads,
)
from hetero_exec.kernels._c_workers_split import (  # noqa: F401 (re-exported for callers)
    SPLIT_ENV,
    blas_split_on_c_workers,
    register_c_blas_split,
)
from hetero_exec.kernels._cores import cores
from hetero_exec.kernels._helper_pool import helper_pool, run_parts

log = logging.getLogger(__name__)

#: products below this many FLOPs stay on the calling thread (a hand-off to the pool
#: and back costs tens of microseconds; bench/README.md)
PARALLEL_FLOPS = 16e6
#: least work for a compiled kernel's split in a lone run (`parallel_for`'s ``alone``)
ALONE_FLOPS = 4e6
#: least rows (or columns) per part when a product is split
_MIN_PART = 16
_LOCK = threading.Lock()
_depth = 0  # runs inside run_threads or single_blas_thread, all threads together
_single_thread_holders = 0  # of them, single_blas_thread's
_held = False  # the BLAS at one thread now (our pool splits)
_blas_on_c_workers = False  # a run alone now: its BLAS products split on the C workers
_NESTED = threading.local()  # a thread's own depth: only its outermost entry counts
_saved: list[int] = []


def _after_fork_in_child() -> None:
    """A forked child has none of the parent's threads: a fresh lock, no run inside, and
    the BLAS count a run of the parent was holding given back (the helper pool and the
    core count reset themselves: _helper_pool.py, _cores.py)."""
    global _LOCK, _depth, _single_thread_holders, _held, _NESTED, _blas_on_c_workers
    _LOCK = threading.Lock()
    if _depth and _blas._libs:
        for lib, n in zip(_blas._libs, _saved):
            lib.set_num_threads(n)
    _depth, _single_thread_holders, _held, _blas_on_c_workers = 0, 0, False, False
    _NESTED = threading.local()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


_WIDTH = threading.local()  # a run's own cap on its split (intra_op_threads)


class _Width:
    """`intra_op_threads`'s context: a class, not a generator, as `_Entered` is."""

    __slots__ = ("n", "previous")

    def __init__(self, n: int | None):
        self.n = n or None
        self.previous: int | None = None

    def __enter__(self) -> None:
        self.previous = getattr(_WIDTH, "n", None)
        _WIDTH.n = self.n

    def __exit__(self, *exc: object) -> None:
        _WIDTH.n = self.previous


def intra_op_threads(n: int | None) -> _Width:
    """Runs on this thread split their work over at most ``n`` threads (None or 0: as
    many as `cores` allows); other threads' runs keep their own.

    >>> with intra_op_threads(1):
    ...     split_width()
    1
    """
    return _Width(n)


def split_width() -> int:
    """Threads the current run may split a product or a kernel's blocks over."""
    n = getattr(_WIDTH, "n", None)
    c = cores()
    return c if n is None else max(1, min(n, c))


def run_threads() -> "_Entered":
    """Around a run: alone in the process, the BLAS at this run's width (`split_width`);
    with another run beside it, the BLAS held at one thread until the last run leaves
    (the setting is process-wide). Cheap: a few ctypes calls per outermost entry.

    >>> with run_threads():
    ...     pass
    """
    return _Entered(hold=False)


def single_blas_thread() -> "_Entered":
    """Hold the BLAS at one thread while any caller is inside, whatever else runs; the
    count it had is restored when the last run leaves."""
    return _Entered(hold=True)


class _Entered:
    """A run's entry (`run_threads`, `single_blas_thread`): a class rather than a
    generator context, as every step of a decode loop enters one (two nested generator
    contexts and `intra_op_threads`' cost 5.7 us a step, this 1-2)."""

    __slots__ = ("hold", "outer", "nested")

    def __init__(self, hold: bool):
        self.hold = hold
        self.outer = False
        self.nested = 0

    def __enter__(self) -> None:
        global _depth, _single_thread_holders, _held, _saved, _blas_on_c_workers
        libs = blas_libs()
        nested = self.nested = getattr(_NESTED, "depth", 0)
        if not libs or nested:  # no BLAS to drive, or this thread's outer run already counts
            _NESTED.depth = nested + 1
            return
        self.outer = True
        hold = self.hold
        pool = blas_split_on_c_workers()
        with _LOCK:
            if _depth == 0:
                _saved = [lib.get_num_threads() for lib in libs]
            _depth += 1
            _single_thread_holders += hold
            if _single_thread_holders or _depth >= 2:
                _blas_on_c_workers = False
                if not _held:
                    for lib in libs:
                        lib.set_num_threads(1)
                    _held = True
            else:  # alone: with one pool, BLAS calls at one thread split on gemm.c's
                # workers; else the BLAS splits this run's products itself, at its width
                # (above the count it started with, too: Ray starts a fractional-CPU actor's
                # BLAS at OMP_NUM_THREADS=1, and a lone stage there may use its node's cores)
                _blas_on_c_workers = pool
                width = 1 if pool else split_width()
                if libs[0].get_num_threads() != width:
                    for lib in libs:
                        lib.set_num_threads(width)
        _NESTED.depth = 1

    def __exit__(self, *exc: object) -> None:
        global _depth, _single_thread_holders, _held, _blas_on_c_workers
        if not self.outer:
            _NESTED.depth = self.nested
            return
        _NESTED.depth = 0
        with _LOCK:
            _depth -= 1
            _single_thread_holders -= self.hold
            if _depth == 0:
                for lib, n in zip(blas_libs(), _saved):
                    if lib.get_num_threads() != n:  # a ctypes call cheaper than a set
                        lib.set_num_threads(n)
                _held = _blas_on_c_workers = False


def _helpers() -> tuple[ThreadPoolExecutor, threading.Semaphore] | None:
    """The pool that takes the other parts of a split (cores - 1 threads)."""
    return helper_pool(cores() - 1)


def matmul(xp, a, b, out=None):
    """``xp.matmul(a, b, out=out)``; on numpy inside `single_blas_thread`, a product of
    at least PARALLEL_FLOPS is split over the calling thread and the idle helpers, by
    rows of ``a`` or columns of ``b``, whichever is longer (a busy helper, such as one
    working for a concurrent run, is skipped: its part runs here)."""
    if (a.ndim > 2 and b.ndim == 2 and a.flags.c_contiguous
            and (out is None or out.flags.c_contiguous)):
        # (..., M, K) @ (K, N): one (prod(...) * M, K) GEMM, not one per leading index
        # (numpy's loop; cuBLAS too prefers one large GEMM); 10-40% on transformer MLPs
        # (bench/README.md)
        flat = matmul(xp, a.reshape(-1, a.shape[-1]), b,
                      None if out is None else out.reshape(-1, b.shape[-1]))
        return flat.reshape(a.shape[:-1] + (b.shape[-1],)) if out is None else out
    if xp is not np or a.ndim < 2 or b.ndim < 2:
        return xp.matmul(a, b, out=out)
    if not _single_thread_holders:
        split = _c_workers_split.blas_matmul
        if _blas_on_c_workers and split is not None:
            y = split(a, b, out)
            if y is not None:
                return y
        return xp.matmul(a, b, out=out)
    rows, inner, cols = a.shape[-2], a.shape[-1], b.shape[-1]
    if out is None:
        batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        out = np.empty(batch + (rows, cols), dtype=np.result_type(a, b))
    by_rows = rows >= cols
    n = rows if by_rows else cols
    if 2.0 * math.prod(out.shape) * inner < PARALLEL_FLOPS or n < 2 * _MIN_PART:
        return np.matmul(a, b, out=out)
    width = split_width()
    helpers = _helpers() if width > 1 else None
    if helpers is None:
        return np.matmul(a, b, out=out)
    parts = min(width, n // _MIN_PART)
    run_parts(helpers, [n * i // parts for i in range(parts + 1)],
              lambda p0, p1: _product(a, b, out, by_rows, p0, p1))
    return out


def parallel_for(xp, n: int, work: Callable[[int, int], None], flops: float,
                 least: int = 1, alone: bool = False) -> None:
    """``work(i0, i1)`` over [0, n): on numpy inside `single_blas_thread` and for at least
    PARALLEL_FLOPS of work, the range is cut in parts of at least ``least`` items over
    the calling thread and the idle helpers (a kernel's independent blocks: images,
    channels), each part doing its own copies and products; else one call here. Parts
    must write disjoint outputs.

    ``alone``: work that calls no BLAS (the compiled kernels) is split in a run alone in
    the process too, from ALONE_FLOPS: there the BLAS splits only the products, and
    the other core would idle through the depthwise and epilogue passes between them
    (MobileNetV2 and ConvNeXt at batch 8: 12-15% of a run, bench/README.md)."""
    parts = split_parts(n, flops, least, alone) if xp is np else 1
    helpers = _helpers() if parts > 1 else None
    if helpers is None:
        work(0, n)
        return
    run_parts(helpers, [n * i // parts for i in range(parts + 1)], work)


def split_parts(n: int, flops: float, least: int = 1, alone: bool = True,
                alone_flops: float = ALONE_FLOPS) -> int:
    """The parts ``n`` independent items of ``flops`` work are cut into (1: none), of at
    least ``least`` items each and at most `split_width`: inside `single_blas_thread`
    from PARALLEL_FLOPS; for work that calls no BLAS (``alone``) in a run alone too,
    from ``alone_flops``. `parallel_for`'s rule, and that of native code's own workers
    (native/library.parts)."""
    # the cheap tests first: most calls (a lone run's, or small work) stop there
    if n >= 2 * least and ((_single_thread_holders and flops >= PARALLEL_FLOPS)
                           or (alone and _depth <= 1 and flops >= alone_flops)):
        return max(1, min(split_width(), n // least))
    return 1


def _product(a, b, out, by_rows: bool, p0: int, p1: int) -> None:
    if by_rows:
        np.matmul(a[..., p0:p1, :], b, out=out[..., p0:p1, :])
    else:
        np.matmul(a, b[..., p0:p1], out=out[..., p0:p1])
