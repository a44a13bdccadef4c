"""Depthwise convolution forms, measured side by side (and against onnxruntime's Conv).

Each form computes the same depthwise Conv (group == channels) of an NCHW float32
input, padding included, and is checked against the first before it is timed. The
shapes are those of the depthwise layers in bench/arch_models.py (MobileNetV2's 3x3,
ConvNeXt's 7x7) plus stride-2 7x7, at batch 1 and 8. Runs are interleaved form by
form (each round calls every form once), and the figure is the median.

Forms:

* ``taps_alloc``: one product per kernel tap over strided slices of the padded input,
  a new array per tap (hetero_exec's depthwise path before issue 12);
* ``taps_inplace``: the same sums accumulated into one output buffer with one reused
  product buffer (``np.multiply(..., out=)``, ``+=``): no allocation per tap;
* ``taps_blocked``: ``taps_inplace`` over tiles of (image, channel block) sized to stay
  in L2 across the taps;
* ``taps_blocked_2t``: the same tiles split over two threads (numpy releases the GIL);
* ``swv_einsum``: ``sliding_window_view`` + ``einsum('nchwij,cij->nchw')``;
* ``im2col_matvec``: windows copied to (N, C, L, K*K), one batched matvec per channel;
* ``nhwc_taps``: the input transposed into a padded NHWC buffer, tap products with a
  (C,) weight row along the contiguous channel axis, blocked over images, transposed back;
* ``nhwc_taps_native``: the same without the two transposes (the cost inside a block
  that stays channels-last);
* ``flat_taps``: the padded image flattened, so that every stride-1 tap is one
  contiguous run of OH*Wp values (stride 2: four polyphase sub-images first), scaled by a
  (C, 1) weight column and accumulated in place; cropped with the bias add;
* ``band_adds``: along W a depthwise conv is a banded matrix product: one GEMM per channel
  of the padded rows (N*Hp, Wp) by the K bands (Wp, K*OW), then K-1 shifted row adds;
* ``colband``: hetero_exec's depthwise path (kernels/conv.py): the K kernel rows of
  input under each tile of T output columns copied side by side, one GEMM per channel by
  a (K*U + 1, T) band (the bias in the last row), as a session runs it (path and band
  chosen at compile time, BLAS held at one thread);
* ``colband_blas2``: the same with the BLAS at its default threads;
* ``native``: the path a session takes with the C kernels: in float32
  kernels/native/depthwise.c (each plane padded into a small buffer, runs of output
  pixels summed a vector at once, split over the library's C workers);
* ``onnxruntime``: a one-node onnxruntime session (spinning off), for scale.

    python bench/bench_conv.py                    # all shapes, all forms
    python bench/bench_conv.py --runs 20 --forms taps_inplace,colband,onnxruntime
    python bench/bench_conv.py --json bench/results/conv.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: (label, channels, spatial, kernel, stride): depthwise layers of the arch models
SHAPES = [
    ("mbv2 3x3 s1 C144 32x32", 144, 32, 3, 1),
    ("mbv2 3x3 s2 C96 64x64", 96, 64, 3, 2),
    ("mbv2 3x3 s1 C576 8x8", 576, 8, 3, 1),
    ("convnext 7x7 s1 C40 32x32", 40, 32, 7, 1),
    ("convnext 7x7 s1 C160 8x8", 160, 8, 7, 1),
    ("7x7 s2 C64 32x32", 64, 32, 7, 2),
]
TILE_BYTES = 256 << 10  # a tile's input + output stays well inside a 2 MiB L2


def _geometry(x: np.ndarray, k: int, s: int) -> tuple[int, int, int]:
    p = k // 2
    oh = (x.shape[2] + 2 * p - k) // s + 1
    ow = (x.shape[3] + 2 * p - k) // s + 1
    return p, oh, ow


def _pad(x: np.ndarray, p: int) -> np.ndarray:
    n, c, h, w = x.shape
    out = np.zeros((n, c, h + 2 * p, w + 2 * p), x.dtype)
    out[:, :, p:p + h, p:p + w] = x
    return out


def _tap(xp_: np.ndarray, i: int, j: int, oh: int, ow: int, s: int) -> np.ndarray:
    return xp_[..., i:i + (oh - 1) * s + 1:s, j:j + (ow - 1) * s + 1:s]


def taps_alloc(x, w, b, s):
    k = w.shape[-1]
    p, oh, ow = _geometry(x, k, s)
    xp_ = _pad(x, p)
    y = None
    for i, j in itertools.product(range(k), range(k)):
        term = _tap(xp_, i, j, oh, ow, s) * w[:, 0, i, j].reshape(-1, 1, 1)
        if y is None:
            y = term
        else:
            y += term
    return y + b.reshape(-1, 1, 1)


def _accumulate(xp_, w, b, s, oh, ow, out, tmp):
    """out = b + sum over taps of tap * w (in place, tmp reused)."""
    k = w.shape[-1]
    first = True
    for i, j in itertools.product(range(k), range(k)):
        wt = w[:, 0, i, j].reshape(-1, 1, 1)
        if first:
            np.multiply(_tap(xp_, i, j, oh, ow, s), wt, out=out)
            first = False
        else:
            np.multiply(_tap(xp_, i, j, oh, ow, s), wt, out=tmp)
            out += tmp
    out += b.reshape(-1, 1, 1)


def taps_inplace(x, w, b, s):
    k = w.shape[-1]
    p, oh, ow = _geometry(x, k, s)
    xp_ = _pad(x, p)
    out = np.empty((x.shape[0], x.shape[1], oh, ow), x.dtype)
    _accumulate(xp_, w, b, s, oh, ow, out, np.empty_like(out))
    return out


def _tiles(x, oh, ow):
    """(n, c0, c1) tiles: one image and a channel block of about TILE_BYTES."""
    n, c, hp, wp = x.shape
    per_c = (hp * wp + 2 * oh * ow) * x.itemsize
    cb = max(1, min(c, TILE_BYTES // per_c))
    return [(i, c0, min(c, c0 + cb)) for i in range(n) for c0 in range(0, c, cb)]


def _blocked(x, w, b, s, threads: int, pool: ThreadPoolExecutor | None):
    k = w.shape[-1]
    p, oh, ow = _geometry(x, k, s)
    xp_ = _pad(x, p)
    out = np.empty((x.shape[0], x.shape[1], oh, ow), x.dtype)
    tiles = _tiles(xp_, oh, ow)

    def run(part):
        tmp = np.empty((tiles[0][2] - tiles[0][1], oh, ow), x.dtype)
        for n, c0, c1 in part:
            _accumulate(xp_[n, c0:c1], w[c0:c1], b[c0:c1], s, oh, ow, out[n, c0:c1],
                        tmp[: c1 - c0])

    if pool is None or threads == 1 or len(tiles) < 2:
        run(tiles)
    else:
        list(pool.map(run, [tiles[t::threads] for t in range(threads)]))
    return out


def taps_blocked(x, w, b, s):
    return _blocked(x, w, b, s, 1, None)


_POOL = ThreadPoolExecutor(2)


def taps_blocked_2t(x, w, b, s):
    return _blocked(x, w, b, s, 2, _POOL)


def swv_einsum(x, w, b, s):
    k = w.shape[-1]
    p, oh, ow = _geometry(x, k, s)
    win = np.lib.stride_tricks.sliding_window_view(_pad(x, p), (k, k), axis=(2, 3))[:, :, ::s, ::s]
    return np.einsum("nchwij,cij->nchw", win, w[:, 0]) + b.reshape(-1, 1, 1)


def im2col_matvec(x, w, b, s):
    k = w.shape[-1]
    p, oh, ow = _geometry(x, k, s)
    win = np.lib.stride_tricks.sliding_window_view(_pad(x, p), (k, k), axis=(2, 3))[:, :, ::s, ::s]
    n, c = x.shape[:2]
    cols = np.ascontiguousarray(win).reshape(n, c, oh * ow, k * k)
    y = np.matmul(cols, w.reshape(c, k * k, 1)).reshape(n, c, oh, ow)
    return y + b.reshape(-1, 1, 1)


def _nhwc_core(xh, w, b, s, k, oh, ow):
    """xh: padded (N, Hp, Wp, C); returns (N, OH, OW, C), blocked per image."""
    n, c = xh.shape[0], xh.shape[3]
    wt = np.ascontiguousarray(w[:, 0].transpose(1, 2, 0))  # (K, K, C)
    out = np.empty((n, oh, ow, c), xh.dtype)
    tmp = np.empty((oh, ow, c), xh.dtype)
    for i in range(n):
        o = out[i]
        first = True
        for a, bb in itertools.product(range(k), range(k)):
            t = xh[i, a:a + (oh - 1) * s + 1:s, bb:bb + (ow - 1) * s + 1:s]
            if first:
                np.multiply(t, wt[a, bb], out=o)
                first = False
            else:
                np.multiply(t, wt[a, bb], out=tmp)
                o += tmp
        o += b
    return out


def _nhwc_padded(x, k, s):
    """x (NCHW) as a zero-padded NHWC array, with the output's height and width."""
    p, oh, ow = _geometry(x, k, s)
    n, c, h, wd = x.shape
    xh = np.zeros((n, h + 2 * p, wd + 2 * p, c), x.dtype)
    xh[:, p:p + h, p:p + wd] = x.transpose(0, 2, 3, 1)
    return xh, oh, ow


def nhwc_taps(x, w, b, s):
    k = w.shape[-1]
    xh, oh, ow = _nhwc_padded(x, k, s)
    return np.ascontiguousarray(_nhwc_core(xh, w, b, s, k, oh, ow).transpose(0, 3, 1, 2))


def make_nhwc_native(x, w, b, s):
    """The padded NHWC input prepared outside the timing (a block already channels-last)."""
    k = w.shape[-1]
    xh, oh, ow = _nhwc_padded(x, k, s)

    def native(x_, w_, b_, s_):
        return _nhwc_core(xh, w, b, s, k, oh, ow).transpose(0, 3, 1, 2)

    return native


def flat_taps(x, w, b, s):
    n, c, h, wd = x.shape
    k = w.shape[-1]
    p, oh, ow = _geometry(x, k, s)
    kq = (k - 1) // s  # the largest tap offset inside a phase image
    wq, hq = ow + kq, oh + kq + 1  # one row of slack: the last tap's run ends past a row
    buf = np.zeros((s, s, n, c, hq, wq), x.dtype)
    for a in range(s):  # phase (a, b) holds xpad[a::s, b::s]
        for bb in range(s):
            i0, j0 = max(0, -(-(p - a) // s)), max(0, -(-(p - bb) // s))
            i1, j1 = min(hq, (h - 1 + p - a) // s + 1), min(wq, (wd - 1 + p - bb) // s + 1)
            if i1 > i0 and j1 > j0:
                buf[a, bb, :, :, i0:i1, j0:j1] = x[:, :, a + s * i0 - p: a + s * (i1 - 1) - p + 1:s,
                                                   bb + s * j0 - p: bb + s * (j1 - 1) - p + 1:s]
    flat = buf.reshape(s, s, n, c, hq * wq)
    length = oh * wq
    acc = np.empty((n, c, length), x.dtype)
    tmp = np.empty_like(acc)
    for t, (i, j) in enumerate(itertools.product(range(k), range(k))):
        src = flat[i % s, j % s, :, :, (i // s) * wq + j // s:(i // s) * wq + j // s + length]
        np.multiply(src, w[:, 0, i, j].reshape(-1, 1), out=acc if t == 0 else tmp)
        if t:
            acc += tmp
    return acc.reshape(n, c, oh, wq)[..., :ow] + b.reshape(-1, 1, 1)


def _wband(w, wp, ow, s):
    """(C, Wp, K*OW): column tap j of output column o at input column o*s + j."""
    c, _, k, _ = w.shape
    band = np.zeros((c, wp, k, ow), np.float32)
    for j in range(k):
        for o in range(ow):
            band[:, o * s + j, :, o] = w[:, 0, :, j]
    return band.reshape(c, wp, k * ow)


def make_band_adds(x, w, b, s):
    n, c, h, wd = x.shape
    k = w.shape[-1]
    p, oh, ow = _geometry(x, k, s)
    hp, wp = h + 2 * p, wd + 2 * p
    band = _wband(w, wp, ow, s)  # a constant weight's band: built once, outside the timing

    def run(x_, w_, b_, s_):
        xt = np.zeros((c, n, hp, wp), np.float32)
        xt[:, :, p:p + h, p:p + wd] = x_.transpose(1, 0, 2, 3)
        z = np.matmul(xt.reshape(c, n * hp, wp), band).reshape(c, n, hp, k, ow)
        out = np.empty((n, c, oh, ow), np.float32)
        o = out.transpose(1, 0, 2, 3)
        np.add(z[:, :, 0:(oh - 1) * s + 1:s, 0], b.reshape(-1, 1, 1, 1), out=o)
        for i in range(1, k):
            o += z[:, :, i:i + (oh - 1) * s + 1:s, i]
        return out

    return run


def _session_conv(x, w, b, s, hold: bool, kind: str = "depthwise"):
    """Conv as a session runs it (path ``kind`` forced, its band cached), inside a run's
    hold on the BLAS (``hold``) or with the BLAS at its default threads."""
    from hetero_exec.kernels._conv_path import ConvPath, conv_full
    from hetero_exec.kernels._threads import single_blas_thread

    k = w.shape[-1]
    attrs = dict(group=x.shape[1], kernel_shape=[k, k], pads=[k // 2] * 4, strides=[s, s])
    path = ConvPath(kind)

    def ours(x_, w_, b_, s_):
        if not hold:
            return conv_full(np, x_, w, b, path=path, **attrs)
        with single_blas_thread():
            return conv_full(np, x_, w, b, path=path, **attrs)

    return ours


def make_colband(x, w, b, s):
    return _session_conv(x, w, b, s, hold=True)


def make_colband_blas2(x, w, b, s):
    return _session_conv(x, w, b, s, hold=False)


def make_native(x, w, b, s):
    from hetero_exec.kernels.native import library

    if not library.available():
        raise SystemExit(f"form native: {library.unavailable_reason()}")
    return _session_conv(x, w, b, s, hold=True, kind="depthwise_native")


def make_onnxruntime(x, w, b, s):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    k = w.shape[-1]
    p = k // 2
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], group=x.shape[1],
                            kernel_shape=[k, k], pads=[p] * 4, strides=[s, s])
    graph = helper.make_graph([node], "dw", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, list(x.shape))], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, None)], [numpy_helper.from_array(w, "w"),
                                             numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    so = ort.SessionOptions()
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])

    def run(x_, w_, b_, s_):
        return sess.run(None, {"x": x_})[0]

    return run


#: name -> fn(x, w, b, stride), or a factory (x, w, b, stride) -> such a fn
FORMS: dict[str, Callable] = {
    "taps_alloc": taps_alloc, "taps_inplace": taps_inplace, "taps_blocked": taps_blocked,
    "taps_blocked_2t": taps_blocked_2t, "swv_einsum": swv_einsum, "im2col_matvec": im2col_matvec,
    "nhwc_taps": nhwc_taps, "flat_taps": flat_taps,
}
FACTORIES: dict[str, Callable] = {
    "nhwc_taps_native": make_nhwc_native, "band_adds": make_band_adds, "colband": make_colband,
    "colband_blas2": make_colband_blas2, "native": make_native,
    "onnxruntime": make_onnxruntime,
}


def bench_shape(label, c, hw, k, s, batch, forms, runs) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, c, hw, hw), np.float32)
    w = rng.standard_normal((c, 1, k, k), np.float32)
    b = rng.standard_normal((c,), np.float32)
    fns = {f: FORMS[f] if f in FORMS else FACTORIES[f](x, w, b, s) for f in forms}
    want = taps_alloc(x, w, b, s)
    for f, fn in fns.items():
        np.testing.assert_allclose(fn(x, w, b, s), want, rtol=1e-4, atol=1e-4, err_msg=f)
    times: dict[str, list[float]] = {f: [] for f in fns}
    for _ in range(runs):
        for f, fn in fns.items():
            t = time.perf_counter()
            fn(x, w, b, s)
            times[f].append(time.perf_counter() - t)
    return {"shape": label, "batch": batch,
            "ms": {f: 1e3 * statistics.median(ts) for f, ts in times.items()},
            "samples_ms": {f: [1e3 * t for t in ts] for f, ts in times.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--forms", default=",".join([*FORMS, *FACTORIES]))
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args(argv)
    forms = [f for f in args.forms.split(",") if f]
    unknown = [f for f in forms if f not in FORMS and f not in FACTORIES]
    if unknown:
        ap.error(f"unknown forms {unknown}; known: {[*FORMS, *FACTORIES]}")
    rows = []
    width = max(len(f) for f in forms)
    print(f"# median ms of {args.runs} interleaved runs; float32 NCHW, pads k//2")
    print(f"{'shape':<28} {'batch':>5} " + " ".join(f"{f:>{width}}" for f in forms))
    for batch in (int(b) for b in args.batches.split(",")):
        for label, c, hw, k, s in SHAPES:
            r = bench_shape(label, c, hw, k, s, batch, forms, args.runs)
            rows.append(r)
            print(f"{label:<28} {batch:>5} " + " ".join(f"{r['ms'][f]:>{width}.3f}" for f in forms),
                  flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
