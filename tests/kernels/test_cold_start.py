"""A cold start compiles nothing and writes nothing (issue 26): four fresh processes build
sessions at once with no compiler on PATH and empty HOME and cache folders, and each
runs the native variant built into the package, the same one this process picked.

What made cold starts slow was a compile on first use (11 s alone, 45 s each with three
at once) and its cache; with nothing compiled or written at import and session build,
a cold build costs what a warm one does. That is asserted here by what makes it true,
not by timing it (no timed assertions in tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import hetero_exec
from hetero_exec.kernels.native import library

ort = pytest.importorskip("onnxruntime")

PACKAGE = Path(hetero_exec.__file__).resolve().parent
PROCESSES = 4

#: the child: import, build a session on the model given, run it once, report
CHILD = r"""
import json, sys
import numpy as np
from hetero_exec.session import InferenceSession
from hetero_exec.kernels.native import library
model = open(sys.argv[1], "rb").read()
x = np.load(sys.argv[2])
sess = InferenceSession(model, providers=["cpu"])
(y,) = sess.run(None, {"x": x})
print(json.dumps({"variant": library.variant(), "describe": library.describe(),
                  "y": y.ravel().tolist()}))
"""


def _conv_model() -> onnx.ModelProto:
    """Conv 3x3 (8 -> 16 channels, a native packed conv) + Relu, then a pointwise Conv."""
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((16, 8, 3, 3)).astype(np.float32) * 0.2
    b1 = rng.standard_normal(16).astype(np.float32)
    w2 = rng.standard_normal((8, 16, 1, 1)).astype(np.float32) * 0.2
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["h"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Conv", ["r", "w2"], ["y"])]
    graph = helper.make_graph(
        nodes, "cold_start",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 20, 20])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 20, 20])],
        [onnx.numpy_helper.from_array(w1, "w1"), onnx.numpy_helper.from_array(b1, "b1"),
         onnx.numpy_helper.from_array(w2, "w2")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _files(root: Path) -> set[str]:
    """Every path under root, bytecode caches aside (the children write none, but another
    test process importing the package for the first time may)."""
    return {str(p.relative_to(root)) for p in root.rglob("*") if "__pycache__" not in p.parts}


def test_four_cold_processes_compile_and_write_nothing(tmp_path):
    picked = library.variant()
    if picked is None:
        pytest.skip(f"no native library here: {library.unavailable_reason()}")
    model = _conv_model()
    x = np.random.default_rng(1).standard_normal((1, 8, 20, 20)).astype(np.float32)
    model_path, x_path = tmp_path / "model.onnx", tmp_path / "x.npy"
    model_path.write_bytes(model.SerializeToString())
    np.save(x_path, x)
    expected = ort.InferenceSession(model.SerializeToString(),
                                    providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]

    empty_bin = tmp_path / "bin"  # PATH: no cc, gcc, clang or ld anywhere
    empty_bin.mkdir()
    homes = []
    procs = []
    before = _files(PACKAGE)
    env_base = {k: v for k, v in os.environ.items()
                if not k.startswith(("HETERO_EXEC_", "XDG_", "CC", "CFLAGS", "LD"))}
    for i in range(PROCESSES):
        home = tmp_path / f"home{i}"
        cache = home / ".cache"
        cache.mkdir(parents=True)
        homes.append(home)
        env = {**env_base, "PATH": str(empty_bin), "HOME": str(home),
               "XDG_CACHE_HOME": str(cache), "PYTHONDONTWRITEBYTECODE": "1",
               # the variant this process picked, as the children would pick it too
               library.ISA_ENV: picked}
        procs.append(subprocess.Popen([sys.executable, "-c", CHILD, str(model_path), str(x_path)],
                                      env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    reports = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
        reports.append(json.loads(out.strip().splitlines()[-1]))

    for report in reports:
        assert report["variant"] == picked, report["describe"]
        y = np.asarray(report["y"], np.float32).reshape(expected.shape)
        np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-5)
    for home in homes:  # nothing cached, nothing built under HOME or the cache folder
        assert _files(home) == {".cache"}, sorted(_files(home))
    assert _files(PACKAGE) == before  # and nothing written beside the package


def test_the_variant_does_not_depend_on_a_compiler(tmp_path):
    """Picking a variant reads the CPU's features and loads a built library: the same
    choice with PATH empty as with the usual PATH."""
    if library.variant() is None:
        pytest.skip(f"no native library here: {library.unavailable_reason()}")
    code = "from hetero_exec.kernels.native import library; print(library.describe())"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETERO_EXEC_")}
    usual = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, check=True).stdout.strip()
    bare = subprocess.run([sys.executable, "-c", code], env={**env, "PATH": str(tmp_path)},
                          capture_output=True, text=True, check=True).stdout.strip()
    assert bare == usual
    assert bare.startswith("native: ") and not bare.startswith("native: off")
