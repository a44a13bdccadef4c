"""Our threads and the BLAS's for a run, on machines with few cores: how many cores a
run may use, how runs nest and overlap, which pool splits a lone run's products, and
the helper pool that splits products and kernels' blocks. The BLAS library itself
(discovery, its thread count, OpenBLAS's spin, its CBLAS addresses) is kernels/_blas.py.

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
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import numpy as np

from hetero_exec.kernels import _blas
from hetero_exec.kernels._blas import (  # noqa: F401 (the BLAS's, re-exported for callers)
    DEFAULT_SPIN_EXPONENT,
    SPIN_ENV,
    BlasGemm,
    blas_gemm,
    blas_libs,
    blas_threads,
)

log = logging.getLogger(__name__)

#: products below this many FLOPs stay on the calling thread (a hand-off to the pool
#: and back costs tens of microseconds; bench/README.md)
PARALLEL_FLOPS = 16e6
#: least work for a compiled kernel's split in a lone run (`parallel_for`'s ``alone``)
ALONE_FLOPS = 4e6
#: least rows (or columns) per part when a product is split
_MIN_PART = 16
#: "0" (or "false", "off", "no"): a lone run's products split on the BLAS's own threads
SPLIT_ENV = "HETERO_EXEC_BLAS_SPLIT"

_LOCK = threading.Lock()
_depth = 0  # runs inside run_threads or single_blas_thread, all threads together
_single_thread_holders = 0  # of them, single_blas_thread's
_held = False  # the BLAS at one thread now (our pool splits)
_blas_on_c_workers = False  # a run alone now: its BLAS products split on the C workers
_split_on_c_workers: bool | None = None
#: native/blas_split.blas_matmul, once `blas_split_on_c_workers` says yes
_blas_matmul: Callable[..., Any] | None = None
_NESTED = threading.local()  # a thread's own depth: only its outermost entry counts
_saved: list[int] = []
_pool: ThreadPoolExecutor | None = None
_pool_free: threading.Semaphore | None = None


def _after_fork_in_child() -> None:
    """A forked child has none of the parent's threads: a fresh lock and pool (the old
    pool's threads do not exist there, so a split would wait for ever), no run inside,
    and the BLAS count a run of the parent was holding given back."""
    global _LOCK, _depth, _single_thread_holders, _held, _pool, _pool_free, _NESTED, _affinity
    global _blas_on_c_workers
    _LOCK = threading.Lock()
    _affinity = None
    _pool, _pool_free = None, None
    if _depth and _blas._libs:
        for lib, n in zip(_blas._libs, _saved):
            lib.set_num_threads(n)
    _depth, _single_thread_holders, _held, _blas_on_c_workers = 0, 0, False, False
    _NESTED = threading.local()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def cores() -> int:
    """Threads a product or a kernel's blocks are split over: the cores this process may
    use, at most HETERO_EXEC_INTRA_OP_THREADS when set (1: never split). The affinity is
    read once per process (and again in a forked child): every split asks, and reading it
    cost 2.5 us a call."""
    global _affinity
    cap = os.environ.get("HETERO_EXEC_INTRA_OP_THREADS", "")
    if _affinity is None:
        try:
            _affinity = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            _affinity = os.cpu_count() or 1
    n = _affinity
    if cap.strip():
        try:
            n = min(n, max(1, int(cap)))
        except ValueError:
            log.warning("HETERO_EXEC_INTRA_OP_THREADS=%r is not a number: ignored", cap)
    return n


_affinity: int | None = None  # the cores of this process's affinity mask, once read


_WIDTH = threading.local()  # a run's own cap on its split (intra_op_threads)


@contextmanager
def intra_op_threads(n: int | None) -> Iterator[None]:
    """Runs on this thread split their work over at most ``n`` threads (None or 0: as
    many as `cores` allows); other threads' runs keep their own.

    >>> with intra_op_threads(1):
    ...     split_width()
    1
    """
    previous = getattr(_WIDTH, "n", None)
    _WIDTH.n = n or None
    try:
        yield
    finally:
        _WIDTH.n = previous


def split_width() -> int:
    """Threads the current run may split a product or a kernel's blocks over."""
    n = getattr(_WIDTH, "n", None)
    c = cores()
    return c if n is None else max(1, min(n, c))


@contextmanager
def run_threads() -> Iterator[None]:
    """Around a run: alone in the process, the BLAS at this run's width (`split_width`);
    with another run beside it, the BLAS held at one thread until the last run leaves
    (the setting is process-wide). Cheap: a few ctypes calls per outermost entry.

    >>> with run_threads():
    ...     pass
    """
    with _entered(hold=False):
        yield


@contextmanager
def single_blas_thread() -> Iterator[None]:
    """Hold the BLAS at one thread while any caller is inside, whatever else runs; the
    count it had is restored when the last run leaves."""
    with _entered(hold=True):
        yield


@contextmanager
def _entered(hold: bool) -> Iterator[None]:
    global _depth, _single_thread_holders, _held, _saved, _blas_on_c_workers
    libs = blas_libs()
    nested = getattr(_NESTED, "depth", 0)
    if not libs or nested:  # no BLAS to drive, or this thread's outer run already counts
        _NESTED.depth = nested + 1
        try:
            yield
        finally:
            _NESTED.depth = nested
        return
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
    try:
        yield
    finally:
        _NESTED.depth = 0
        with _LOCK:
            _depth -= 1
            _single_thread_holders -= hold
            if _depth == 0:
                for lib, n in zip(libs, _saved):
                    lib.set_num_threads(n)
                _held = _blas_on_c_workers = False


#: (blas_matmul, available) of native/blas_split.py, which registers them when imported
#: (`register_c_blas_split`): this module imports nothing of native/, which imports it
_c_workers_blas_split: tuple[Callable[..., Any], Callable[[], bool]] | None = None


def register_c_blas_split(matmul: Callable[..., Any], available: Callable[[], bool]) -> None:
    """The C workers' BLAS split (native/blas_split.blas_matmul) and whether the library
    is loaded: what `blas_split_on_c_workers` decides from."""
    global _c_workers_blas_split
    _c_workers_blas_split = (matmul, available)


def blas_split_on_c_workers() -> bool:
    """Whether a run alone splits its BLAS products on gemm.c's workers (native/blas.c),
    with the BLAS at one thread, rather than on the BLAS's own threads: numpy's OpenBLAS
    and the C kernels available, and ``HETERO_EXEC_BLAS_SPLIT`` not off. Decided once per
    process."""
    global _split_on_c_workers
    if _split_on_c_workers is None:
        split = _c_workers_blas_split
        off = os.environ.get(SPLIT_ENV, "").strip().lower() in ("0", "false", "off", "no")
        _split_on_c_workers = bool(not off and _blas.blas_gemm() is not None and split is not None
                         and split[1]())
        if _split_on_c_workers:
            global _blas_matmul
            _blas_matmul = split[0]
        log.debug("BLAS products of a lone run split on %s",
                  "gemm.c's workers" if _split_on_c_workers else "the BLAS's own threads")
    return _split_on_c_workers


def _helpers() -> tuple[ThreadPoolExecutor, threading.Semaphore] | None:
    """The pool that takes the other parts of a split product (cores - 1 threads)."""
    global _pool, _pool_free
    if _pool is None:
        n = cores() - 1
        if n < 1:
            return None
        with _LOCK:
            if _pool is None:
                _pool_free = threading.Semaphore(n)
                _pool = ThreadPoolExecutor(n, thread_name_prefix="hetero_exec-gemm")
    return _pool, _pool_free


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
        if _blas_on_c_workers and _blas_matmul is not None:
            y = _blas_matmul(a, b, out)
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
    pool, free = helpers
    parts = min(width, n // _MIN_PART)
    bounds = [n * i // parts for i in range(parts + 1)]
    pieces = list(zip(bounds[:-1], bounds[1:]))
    mine, futures = [pieces[0]], []
    for piece in pieces[1:]:
        if free.acquire(blocking=False):
            futures.append(pool.submit(_part, free, a, b, out, by_rows, *piece))
        else:
            mine.append(piece)
    for p0, p1 in mine:
        _product(a, b, out, by_rows, p0, p1)
    for f in futures:
        f.result()
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
    pool, free = helpers
    bounds = [n * i // parts for i in range(parts + 1)]
    pieces = list(zip(bounds[:-1], bounds[1:]))
    mine, futures = [pieces[0]], []
    for piece in pieces[1:]:
        if free.acquire(blocking=False):
            futures.append(pool.submit(_run_part, free, work, *piece))
        else:
            mine.append(piece)
    for i0, i1 in mine:
        work(i0, i1)
    for f in futures:
        f.result()


def _run_part(free: threading.Semaphore, work: Callable[[int, int], None], i0: int, i1: int):
    try:
        work(i0, i1)
    finally:
        free.release()


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


def _part(free: threading.Semaphore, a, b, out, by_rows: bool, p0: int, p1: int) -> None:
    try:
        _product(a, b, out, by_rows, p0, p1)
    finally:
        free.release()
