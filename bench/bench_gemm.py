"""The packed float32 GEMM (kernels/native/packed_gemm.py) against numpy's BLAS and
onnxruntime, side by side. A benchmark, not a test.

Two parts:

* ``shapes``: one product per shape, interleaved: numpy's ``matmul`` (OpenBLAS at its
  threads), our packed product on one thread and split over gemm.c's workers, and
  onnxruntime's MatMul on a one-node model with the same constant weight (spinning
  off). Right-hand shapes are ``A (M, K) @ W (K, N)`` with M rows of activations (an
  MLP at batch M); left-hand shapes are MobileNetV2's pointwise convs,
  ``W (M, C) @ X_n (C, L)`` over n images. Interleaving puts each library's spinning
  workers beside the next one's run (OpenBLAS's spin 2**20 cycles after a product,
  ours 100 us): read the ratios of this part as upper bounds for us.
* ``models``: whole sessions in one process, packed on against packed off (the switch
  flipped between interleaved runs), as a ratio of medians.

    python bench/bench_gemm.py                      # both parts, ~2 minutes
    python bench/bench_gemm.py --part models --models mlp,mobilenetv2_ts --runs 60

OpenBLAS's workers spin after each product and would take a core from the next
configuration, so the script shortens their spin as our sessions do
(kernels/_threads.py) before it starts.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Callable

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "20")  # as kernels/_blas._shorten_spin

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hetero_exec.kernels.native import packed_gemm as pg  # noqa: E402

RIGHT = [(M, K, N) for K, N in ((1024, 1024), (768, 3072)) for M in (4, 8, 16, 32, 64, 128)]
LEFT = [(n, M, C, L) for n in (1, 8) for M, C, L in
        ((96, 16, 12544), (24, 96, 3136), (144, 24, 3136), (192, 32, 784), (960, 160, 49))]


def interleaved(fns: list[Callable[[], object]], runs: int) -> list[float]:
    for f in fns:
        f()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(runs):
        for t, f in zip(times, fns):
            t0 = time.perf_counter()
            f()
            t.append(time.perf_counter() - t0)
    return [float(np.median(t)) * 1e3 for t in times]


def ort_matmul(weight: np.ndarray, left: bool):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    if left:  # W @ X: X (n, C, L) -> (n, M, L)
        ins = ["w", "x"]
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", weight.shape[1], "L"])
    else:
        ins = ["x", "w"]
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", weight.shape[0]])
    graph = helper.make_graph([helper.make_node("MatMul", ins, ["y"])], "g", [x],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(weight, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    so = ort.SessionOptions()
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])


def part_shapes(runs: int) -> None:
    lib = pg._lib()
    rng = np.random.default_rng(0)
    print("right: A (M, K) @ W (K, N), ms: numpy | packed, 1 thread | packed, split | ort")
    for M, K, N in RIGHT:
        A = rng.standard_normal((M, K), dtype=np.float32)
        W = rng.standard_normal((K, N), dtype=np.float32)
        p, Y, o = pg.PackedRight(W), np.empty((M, N), np.float32), ort_matmul(W, left=False)

        def right(parts: int, p=p, A=A, Y=Y, M=M, K=K, N=N) -> None:
            lib.he_gemm_right_mt(M, N, K, A.ctypes.data, K, p.data.ctypes.data, Y.ctypes.data,
                                 N, None, None, N, 0, 0.0, 0.0, parts)

        r = interleaved([lambda: np.matmul(A, W, out=Y), lambda: right(1), lambda: right(2),
                         lambda: o.run(None, {"x": A})], runs)
        print(f"  {M:4d} x {K:4d} x {N:4d}: " + " | ".join(f"{v:7.3f}" for v in r))
    print("left: W (M, C) @ X_n (C, L) over n images, ms: numpy | packed, 1 thread | packed, "
          "split | ort")
    for n, M, C, L in LEFT:
        W = rng.standard_normal((M, C), dtype=np.float32)
        X = rng.standard_normal((n, C, L), dtype=np.float32)
        p, Y, o = pg.PackedLeft(W), np.empty((n, M, L), np.float32), ort_matmul(W, left=True)
        items = n * -(-L // pg.NR)

        def left(parts: int, p=p, X=X, Y=Y, M=M, C=C, L=L, items=items) -> None:
            lib.he_gemm_left_mt(M, C, L, p.data.ctypes.data, X.ctypes.data, L, C * L,
                                Y.ctypes.data, M * L, items, None, None, 0, 0.0, 0.0, parts)

        def numpy_per_image(W=W, X=X, Y=Y, n=n):
            for i in range(n):
                np.matmul(W, X[i], out=Y[i])

        r = interleaved([numpy_per_image, lambda: left(1), lambda: left(2),
                         lambda: o.run(None, {"x": X})], runs)
        print(f"  n={n} {M:4d} x {C:4d} x {L:5d}: " + " | ".join(f"{v:7.3f}" for v in r))


def part_models(names: list[str], runs: int) -> None:
    from bench.arch_models import ARCH_MODELS, arch_inputs
    from bench.models import MODELS, inputs
    from hetero_exec import InferenceSession

    pg.unavailable_reason()
    saved = dict(pg.library._state)

    def switch(on: bool) -> None:
        if on:
            pg.library._state.update(saved)
        else:
            pg.library._state["reason"] = "off for the A/B"

    for name in names:
        model = MODELS[name]() if name in MODELS else ARCH_MODELS[name]()
        on = InferenceSession(model, ["cpu"])
        switch(False)  # compiled with it off: MatMul/Gemm keep their generic kernels
        off = InferenceSession(model, ["cpu"])
        switch(True)
        for batch in (1, 8):
            feeds = inputs(name, batch, seed=0) if name in MODELS else arch_inputs(
                name, batch, seed=0)

            def run(sess, packed: bool):
                switch(packed)
                sess.run(None, feeds)

            a, b = interleaved([lambda: run(on, True), lambda: run(off, False)], runs)
            print(f"  {name} b{batch}: packed {a:.2f} ms, unpacked {b:.2f} ms, "
                  f"packed/unpacked {a / b:.3f}", flush=True)
        switch(True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["shapes", "models", "all"], default="all")
    parser.add_argument("--models", default="mlp,resnet18,mobilenetv2_ts,mobilenetv2_dynamo")
    parser.add_argument("--runs", type=int, default=41)
    args = parser.parse_args()
    reason = pg.unavailable_reason()
    if reason:
        raise SystemExit(f"packed GEMM unavailable here: {reason}")
    if args.part in ("shapes", "all"):
        part_shapes(args.runs)
    if args.part in ("models", "all"):
        part_models(args.models.split(","), args.runs)


if __name__ == "__main__":
    main()
