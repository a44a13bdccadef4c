"""The ONNX backend node suite, built from onnx's own case definitions
(onnx 1.23 no longer ships the node data files) and compared like onnx's runner."""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any

import numpy as np

KNOWN_FAILURES_FILE = os.path.join(os.path.dirname(__file__), "node_suite_known_failures.txt")


@functools.lru_cache(maxsize=1)
def node_cases() -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import onnx.backend.test.case.node as node

        return {c.name: c for c in node.collect_testcases(None)}


def known_failures(path: str = KNOWN_FAILURES_FILE) -> dict[str, str]:
    """``case_name  # reason`` per line."""
    out: dict[str, str] = {}
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            name, _, reason = line.partition("#")
            out[name.strip()] = reason.strip()
    return out


def assert_similar(ref: Any, out: Any, rtol: float, atol: float, where: str = "") -> None:
    """onnx's runner comparison: same structure, shape, dtype; allclose within rtol/atol."""
    if isinstance(ref, (list, tuple)):
        assert isinstance(out, (list, tuple)), f"{where}: expected a sequence, got {type(out).__name__}"
        assert len(out) == len(ref), f"{where}: sequence length {len(out)} != {len(ref)}"
        for i, (r, o) in enumerate(zip(ref, out)):
            assert_similar(r, o, rtol, atol, f"{where}[{i}]")
        return
    if isinstance(ref, dict):
        assert isinstance(out, dict), f"{where}: expected a map, got {type(out).__name__}"
        assert set(ref) == set(out)
        for k in ref:
            assert_similar(ref[k], out[k], rtol, atol, f"{where}[{k!r}]")
        return
    if ref is None:
        assert out is None, f"{where}: expected an empty optional, got {type(out).__name__}"
        return
    assert out is not None, f"{where}: got None"
    ref = np.asarray(ref)
    assert hasattr(out, "dtype"), f"{where}: expected an array, got {type(out).__name__}"
    out = np.asarray(out)
    np.testing.assert_array_equal(out.shape, ref.shape, err_msg=f"{where}: shape")
    if ref.dtype == object:
        np.testing.assert_array_equal(out, ref, err_msg=where)
        return
    assert out.dtype == ref.dtype, f"{where}: dtype {out.dtype} != {ref.dtype}"
    if out.dtype.name == "bfloat16" or out.dtype.itemsize == 1 and out.dtype.kind == "V" or "float8" in out.dtype.name or "float4" in out.dtype.name or out.dtype.name in ("int4", "uint4", "int2", "uint2"):
        r = max(rtol, 2**-6) if out.dtype.name == "bfloat16" else rtol
        np.testing.assert_allclose(out.astype(np.float32), ref.astype(np.float32), rtol=r, atol=atol, err_msg=where)
        return
    np.testing.assert_allclose(out, ref, rtol=rtol, atol=atol, err_msg=where)


def is_random_output(reason: str | None) -> bool:
    """A known failure whose output is a random draw (Bernoulli): its expected data are one
    draw of another generator, so an exact comparison passes by chance now and then
    (each of 10 draws matches with probability p^2 + (1-p)^2). Such cases are checked by
    what every draw must be instead (`assert_draws`), not marked xfail."""
    return bool(reason) and reason.startswith("random output")


def assert_draws(ref: Any, out: Any, where: str = "") -> None:
    """A Bernoulli draw like ``ref``: the same shape and dtype, every value 0 or 1."""
    ref = np.asarray(ref)
    assert hasattr(out, "dtype"), f"{where}: expected an array, got {type(out).__name__}"
    out = np.asarray(out)
    np.testing.assert_array_equal(out.shape, ref.shape, err_msg=f"{where}: shape")
    assert out.dtype == ref.dtype, f"{where}: dtype {out.dtype} != {ref.dtype}"
    assert np.isin(out, (0, 1)).all(), f"{where}: draws outside {{0, 1}}: {out}"


def to_value(v: Any) -> Any:
    """Case data may be protos (TensorProto, SequenceProto, ...): make them values."""
    import onnx
    from onnx import numpy_helper

    if isinstance(v, onnx.TensorProto):
        return numpy_helper.to_array(v)
    if isinstance(v, onnx.SequenceProto):
        return numpy_helper.to_list(v)
    if isinstance(v, onnx.OptionalProto):
        return numpy_helper.to_optional(v)
    if isinstance(v, onnx.MapProto):
        return numpy_helper.to_dict(v)
    if isinstance(v, list):
        return [to_value(x) for x in v]
    return v


def run_case(case: Any, providers: list | None = None, random_output: bool = False,
             repeat: int = 1, **options: Any) -> None:
    """Run every data set of one case through an InferenceSession's plain run() (as
    onnxruntime code calls it: sequences, maps and optionals come back too); raise on
    mismatch (``random_output``: on a draw that no Bernoulli draw could be). ``repeat``:
    each data set that many times in a row (the second run binds a plan to the input
    shapes, exec/bound.py, and the third replays it)."""
    from hetero_exec import InferenceSession

    sess = InferenceSession(case.model, providers=providers, **options)
    inputs_decl = [i.name for i in case.model.graph.input]
    outputs_decl = [o.name for o in case.model.graph.output]
    for inputs, expected in case.data_sets:
        feed = dict(zip(inputs_decl, [to_value(i) for i in inputs]))
        expected = [to_value(e) for e in expected]
        for run in range(repeat):
            got = sess.run(outputs_decl, feed)
            assert len(got) == len(expected)
            for name, e, g in zip(outputs_decl, expected, got):
                where = f"output {name!r}" + (f" (run {run + 1})" if run else "")
                if random_output:
                    assert_draws(e, g, where=where)
                else:
                    assert_similar(e, g, case.rtol, case.atol, where=where)
