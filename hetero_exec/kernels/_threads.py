"""BLAS threads and our own, on machines with few cores.

OpenBLAS splits each GEMM statically over its workers, and its workers spin-wait for a
while after every call. On a 2-core machine shared with other processes both hurt: a
GEMM waits for whichever worker the scheduler took away (a 0.2 ms product measured
10 ms), and the spinning workers take the cores that the next piece of work needs (our
own single-threaded element-wise kernels, onnxruntime's next run in a benchmark, other
processes). bench/README.md ("Threads") has the measurements.

So the executors enter `run_threads` around a run:

* a run alone in the process splits its products over gemm.c's C workers, the same
  threads as the C kernels' (`one_pool`: native/blas.c cuts a product into one-thread
  BLAS calls), up to its width (one thread per core, or fewer when the run asks:
  `intra_op_threads`, per calling thread, is a session's ``intra_op_num_threads`` or a
  Ray stage's share of its node's cores). Two pools of spinning threads, the BLAS's and
  ours, took each other's cores on 2 cores: after a product OpenBLAS's worker spun on
  while ours ran the next depthwise conv, and ConvNeXt at batch 1 flipped between 5.3
  and 7.8 ms a run by where the scheduler had put them (bench/README.md). Without the
  C kernels or with ``HETERO_EXEC_BLAS_SPLIT=0``, the BLAS gets the run's width and
  splits its products itself;
* as soon as two runs overlap (``run_many``, ``run_async``, a Ray stage running a
  group's requests side by side), the BLAS is held at one thread until the last one
  leaves: the runs already keep the cores busy, and splitting their products too
  measured slower (bench/bench_threads.py, both tables).

OpenBLAS's workers spin 2**28 cycles (~0.1 s of a core) after each call before they
sleep. The first run shortens that to 2**20 (~0.4 ms: `_shorten_spin`), long enough to
stay awake between one run's products, short enough to give the core back when the
run ends: to the next stage actor on the node, to onnxruntime in a benchmark. gemm.c's
workers spin as long (native/library.py, workers.c).

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

import ctypes
import itertools
import logging
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np

log = logging.getLogger(__name__)

#: products below this many FLOPs stay on the calling thread (a hand-off to the pool
#: and back costs tens of microseconds; bench/README.md)
PARALLEL_FLOPS = 16e6
#: least work for a compiled kernel's split in a lone run (`parallel_for`'s ``alone``)
ALONE_FLOPS = 4e6
#: least rows (or columns) per part when a product is split
_MIN_PART = 16
#: OpenBLAS's idle workers spin 2**n cycles before they sleep (`_shorten_spin`)
SPIN_ENV = "HETERO_EXEC_BLAS_THREAD_TIMEOUT"
DEFAULT_SPIN_EXPONENT = 20
#: "0" (or "false", "off", "no"): a lone run's products split on the BLAS's own threads
SPLIT_ENV = "HETERO_EXEC_BLAS_SPLIT"

_LOCK = threading.Lock()
_depth = 0  # runs inside run_threads or single_blas_thread, all threads together
_single_thread_holds = 0  # of them, single_blas_thread's
_held = False  # the BLAS at one thread now (our pool splits)
_blas_on_c_workers = False  # a run alone: its BLAS products split on the C workers (`one_pool`)
_one_pool: bool | None = None
_blas_matmul: Callable[..., Any] | None = None  # packed_gemm's, once `one_pool` says yes
_NESTED = threading.local()  # a thread's own depth: only its outermost entry counts
_saved: list[int] = []
_libs: list[Any] | None = None  # _Blas
_pool: ThreadPoolExecutor | None = None
_pool_free: threading.Semaphore | None = None


def _after_fork_in_child() -> None:
    """A forked child has none of the parent's threads: a fresh lock and pool (the old
    pool's threads do not exist there, so a split would wait for ever), no run inside,
    and the BLAS count a run of the parent was holding given back."""
    global _LOCK, _depth, _single_thread_holds, _held, _pool, _pool_free, _NESTED, _affinity
    global _blas_on_c_workers
    _LOCK = threading.Lock()
    _affinity = None
    _pool, _pool_free = None, None
    if _depth and _libs:
        for lib, n in zip(_libs, _saved):
            lib.set_num_threads(n)
    _depth, _single_thread_holds, _held, _blas_on_c_workers = 0, 0, False, False
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


class _Blas:
    """get/set of one BLAS library's thread count."""

    def __init__(self, get: Callable[[], int], set_: Callable[[int], Any]):
        self.get_num_threads = get
        self.set_num_threads = set_


def _openblas(path: str) -> _Blas | None:
    """OpenBLAS's own process-wide setters, by ctypes. (threadpoolctl's, from 3.6 on, act
    only in the first thread that calls them; a run on a run_async thread would not.)"""
    dll = ctypes.CDLL(path)
    for pre, suf in itertools.product(("", "scipy_"), ("", "64_", "_64")):
        get = getattr(dll, f"{pre}openblas_get_num_threads{suf}", None)
        set_ = getattr(dll, f"{pre}openblas_set_num_threads{suf}", None)
        if get is not None and set_ is not None:
            set_.argtypes, set_.restype, get.restype = [ctypes.c_int], None, ctypes.c_int
            _shorten_spin(dll)
            _find_gemm(dll, pre, suf)
            return _Blas(get, set_)
    return None


class BlasGemm(NamedTuple):
    """Addresses of numpy's OpenBLAS's CBLAS products, for native/blas.c's split of a
    product over gemm.c's workers."""

    sgemm: int
    dgemm: int
    sgemv: int
    dgemv: int
    ilp64: bool  # 64-bit integers


_gemm: BlasGemm | None = None


def _find_gemm(dll: Any, pre: str, suf: str) -> None:
    """Record the library's CBLAS products (numpy's scipy-openblas names them
    ``scipy_cblas_sgemm64_``...: 64-bit integers, as a ``64_`` suffix or USE64BITINT in
    the build's configuration says)."""
    global _gemm
    fns = [getattr(dll, f"{pre}cblas_{name}{suf}", None)
           for name in ("sgemm", "dgemm", "sgemv", "dgemv")]
    if None in fns:
        return
    ilp64 = bool(suf)
    config = getattr(dll, f"{pre}openblas_get_config{suf}", None) or getattr(
        dll, "openblas_get_config", None)
    if config is not None and not ilp64:
        config.restype = ctypes.c_char_p
        ilp64 = b"USE64BITINT" in (config() or b"")
    _gemm = BlasGemm(*(ctypes.cast(f, ctypes.c_void_p).value for f in fns), ilp64)


def blas_gemm() -> BlasGemm | None:
    """numpy's OpenBLAS's CBLAS products, or None (another BLAS, or none found)."""
    _blas_libs()
    return _gemm


def _spin_exponent() -> int | None:
    """The OpenBLAS thread timeout to apply (2**n cycles), or None to leave it alone: the
    user's own OPENBLAS_THREAD_TIMEOUT always wins, and HETERO_EXEC_BLAS_THREAD_TIMEOUT
    (4-30, or 0/off) replaces our default."""
    if os.environ.get("OPENBLAS_THREAD_TIMEOUT", "").strip():
        return None
    raw = os.environ.get(SPIN_ENV, "").strip().lower()
    if not raw:
        return DEFAULT_SPIN_EXPONENT
    if raw in ("0", "off", "no", "false"):
        return None
    try:
        return min(30, max(4, int(raw)))
    except ValueError:
        log.warning("%s=%r is not a number (4-30) or off: OpenBLAS's spin left alone", SPIN_ENV, raw)
        return None


def _shorten_spin(dll: Any) -> None:
    """OpenBLAS's idle workers spin for 2**28 cycles (~0.1 s, a whole core) after every
    threaded call before they sleep; OPENBLAS_THREAD_TIMEOUT, read when the library loads,
    is the only knob. Numpy has loaded it long before us, so: set the variable, have the
    library read its environment again, and stop its workers, which the next threaded
    call starts again with the short timeout. Done once, when the BLAS is first found."""
    n = _spin_exponent()
    read_env = getattr(dll, "openblas_read_env", None)
    shutdown = getattr(dll, "blas_thread_shutdown_", None)
    if n is None or read_env is None or shutdown is None:
        return
    os.environ["OPENBLAS_THREAD_TIMEOUT"] = str(n)  # child processes (Ray workers) inherit it
    read_env()
    shutdown()
    log.debug("OpenBLAS workers now sleep after 2**%d idle cycles", n)


def _blas_libs() -> list[_Blas]:
    """The BLAS libraries numpy loaded, found by threadpoolctl (none without it); found
    once, under the lock, so that OpenBLAS's workers are restarted once (`_shorten_spin`).
    (That restart is what OpenBLAS's own fork handler does; like it, it assumes no other
    thread is inside a threaded BLAS call at that moment: the first run of a session.)"""
    if _libs is None:
        with _LOCK:
            if _libs is None:
                _discover_blas()
    return _libs


def _discover_blas() -> None:
    global _libs
    found: list[_Blas] = []
    try:
        from threadpoolctl import ThreadpoolController

        for ctl in ThreadpoolController().select(user_api="blas").lib_controllers:
            own = None
            if ctl.internal_api == "openblas" and ctl.threading_layer != "openmp":
                own = _openblas(ctl.filepath)
            found.append(own or _Blas(ctl.get_num_threads, ctl.set_num_threads))
    except Exception as e:  # threadpoolctl missing or unable: leave the BLAS alone
        log.debug("no BLAS thread control: %s", e)
    _libs = found


def blas_threads() -> int | None:
    """The BLAS's thread count now (None when it cannot be controlled)."""
    libs = _blas_libs()
    return libs[0].get_num_threads() if libs else None


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
    global _depth, _single_thread_holds, _held, _saved, _blas_on_c_workers
    libs = _blas_libs()
    nested = getattr(_NESTED, "depth", 0)
    if not libs or nested:  # no BLAS to drive, or this thread's outer run already counts
        _NESTED.depth = nested + 1
        try:
            yield
        finally:
            _NESTED.depth = nested
        return
    pool = one_pool()
    with _LOCK:
        if _depth == 0:
            _saved = [lib.get_num_threads() for lib in libs]
        _depth += 1
        _single_thread_holds += hold
        if _single_thread_holds or _depth >= 2:
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
            _single_thread_holds -= hold
            if _depth == 0:
                for lib, n in zip(libs, _saved):
                    lib.set_num_threads(n)
                _held = _blas_on_c_workers = False


#: (blas_matmul, available) of native/blas_split.py, which registers them when imported
#: (`register_c_blas_split`): this module imports nothing of native/, which imports it
_c_blas_split: tuple[Callable[..., Any], Callable[[], bool]] | None = None


def register_c_blas_split(matmul: Callable[..., Any], available: Callable[[], bool]) -> None:
    """The C workers' BLAS split (native/blas_split.blas_matmul) and whether the library
    is loaded: what `one_pool` decides from."""
    global _c_blas_split
    _c_blas_split = (matmul, available)


def one_pool() -> bool:
    """Whether a run alone splits its BLAS products on gemm.c's workers (native/blas.c),
    with the BLAS at one thread, rather than on the BLAS's own threads: numpy's OpenBLAS
    and the C kernels available, and ``HETERO_EXEC_BLAS_SPLIT`` not off. Decided once per
    process."""
    global _one_pool
    if _one_pool is None:
        split = _c_blas_split
        off = os.environ.get(SPLIT_ENV, "").strip().lower() in ("0", "false", "off", "no")
        _one_pool = bool(not off and blas_gemm() is not None and split is not None
                         and split[1]())
        if _one_pool:
            global _blas_matmul
            _blas_matmul = split[0]
        log.debug("BLAS products of a lone run split on %s",
                  "gemm.c's workers" if _one_pool else "the BLAS's own threads")
    return _one_pool


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
    if not _single_thread_holds:
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
    if n >= 2 * least and ((_single_thread_holds and flops >= PARALLEL_FLOPS)
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
