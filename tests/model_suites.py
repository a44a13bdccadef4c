"""The backend suite's other folders: simple, pytorch-converted, pytorch-operator and
real (the "light" models shipped inside onnx, with dummy inputs made as onnx's own
runner makes them, and expected outputs shipped beside them); and ``exports``: tiny
random-weight encoder-decoders (BART, T5, Marian, Whisper) exported by both of torch's
exporters (tests/exports/export_models.py), checked against onnxruntime on seeded feeds
of other lengths than the export traced."""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import onnx
import onnx.backend.test as _bt
import pytest
from onnx import numpy_helper

from tests.backend_cases import known_failures

DATA_DIR = os.path.join(os.path.dirname(_bt.__file__), "data")
KINDS = ("simple", "pytorch-converted", "pytorch-operator", "real")
EXPORTS_DIR = os.path.join(os.path.dirname(__file__), "exports", "models")
#: the exports' vocabulary (tests/exports/export_models.py); ids 0-2 are special tokens
EXPORT_VOCAB = 128


@dataclass
class ModelCase:
    name: str
    kind: str
    model_path: str
    #: (inputs, expected outputs); expected None: onnxruntime's outputs, computed at run
    data_sets: list[tuple[list[Any], list[Any] | None]]
    rtol: float
    atol: float


def _read_pb(path: str) -> Any:
    t = onnx.TensorProto()
    with open(path, "rb") as f:
        t.ParseFromString(f.read())
    return numpy_helper.to_array(t)


def collect(kind: str) -> list[ModelCase]:
    out = []
    for case_dir in sorted(glob.glob(os.path.join(DATA_DIR, kind, "*"))):
        name = os.path.basename(case_dir)
        rtol, atol = 1e-3, 1e-7
        meta = os.path.join(case_dir, "data.json")
        if os.path.exists(meta):
            with open(meta) as f:
                data = json.load(f)
            rtol, atol = data.get("rtol", rtol), data.get("atol", atol)
        model_path = os.path.join(case_dir, "model.onnx")
        if os.path.exists(model_path):
            sets = []
            for ds in sorted(glob.glob(os.path.join(case_dir, "test_data_set_*"))):
                ins = [_read_pb(p) for p in sorted(glob.glob(os.path.join(ds, "input_*.pb")),
                                                   key=_index)]
                outs = [_read_pb(p) for p in sorted(glob.glob(os.path.join(ds, "output_*.pb")),
                                                    key=_index)]
                sets.append((ins, outs))
            out.append(ModelCase(name, kind, model_path, sets, rtol, atol))
        elif os.path.exists(meta) and data.get("url", "").startswith("onnx/backend/test/data/light/"):
            out.append(_light_case(name, kind, data, rtol, atol))
    return out


def _index(path: str) -> int:
    return int(os.path.splitext(path)[0].rsplit("_", 1)[1])


def _light_case(name: str, kind: str, data: dict, rtol: float, atol: float) -> ModelCase:
    """Inputs as onnx's runner makes them for the light models (seed 0, not random)."""
    from onnx.backend.test.runner import Runner

    path = os.path.join(DATA_DIR, "light", os.path.basename(data["url"]))
    model = onnx.load(path)
    inits = {i.name for i in model.graph.initializer}
    ins = [Runner.generate_dummy_data(x, seed=0, name=data["model_name"], random=False)
           for x in model.graph.input if x.name not in inits]
    prefix = os.path.splitext(path)[0]
    outs = [_read_pb(f"{prefix}_output_{i}.pb") for i in range(len(model.graph.output))]
    return ModelCase(name, kind, path, [(ins, outs)], rtol, atol)


def collect_exports() -> list[ModelCase]:
    """The checked-in torch exports, each with one seeded data set (batch 3, encoder
    length 6 or Whisper's fixed frames, decoder length 4, a padded encoder row) run three
    times: on the compiled plans, while binding them to the shapes, on the bound plans
    (exec/bound.py)."""
    out = []
    for path in sorted(glob.glob(os.path.join(EXPORTS_DIR, "*.onnx"))):
        graph = onnx.load(path, load_external_data=False).graph
        rng = np.random.default_rng(0)
        ins = [_export_feed(rng, v) for v in graph.input]
        name = os.path.splitext(os.path.basename(path))[0]
        out.append(ModelCase(name, "exports", path, [(ins, None)] * 3, 1e-4, 1e-5))
    return out


def _export_feed(rng: np.random.Generator, value: onnx.ValueInfoProto) -> np.ndarray:
    lengths = {"batch": 3, "encoder_sequence_length": 6, "decoder_sequence_length": 4}
    shape = [d.dim_value if d.HasField("dim_value") else lengths[d.dim_param]
             for d in value.type.tensor_type.shape.dim]
    if value.name == "attention_mask":
        mask = np.ones(shape, np.int64)
        mask[-1, shape[1] // 2:] = 0
        return mask
    if value.name.endswith("input_ids"):
        return rng.integers(3, EXPORT_VOCAB, shape).astype(np.int64)
    return rng.standard_normal(shape).astype(np.float32)


def onnxruntime_outputs(path: str, feeds: dict[str, Any]) -> list[Any]:
    import onnxruntime as ort

    return ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feeds)


def run_model_case(case: ModelCase, providers: list | None = None,
                   inspect: Callable[[Any], None] | None = None, **options: Any) -> None:
    """Run every data set of ``case``; ``inspect`` sees the session first (its placement)."""
    from hetero_exec import InferenceSession
    from tests.backend_cases import assert_similar

    sess = InferenceSession(case.model_path, providers=providers, **options)
    try:
        if inspect is not None:
            inspect(sess)
        names = [i.name for i in sess.get_inputs()]
        outs_decl = [o.name for o in sess.get_outputs()]
        reference: dict[int, list[Any]] = {}
        for ins, expected in case.data_sets:
            feeds = dict(zip(names, ins))
            if expected is None:
                if id(ins) not in reference:
                    reference[id(ins)] = onnxruntime_outputs(case.model_path, feeds)
                expected = reference[id(ins)]
            got = sess.run_outputs(None, feeds)
            for name, e, g in zip(outs_decl, expected, got):
                assert_similar(e, g, case.rtol, case.atol, where=f"output {name!r}")
    finally:
        sess.close()


KNOWN = known_failures(os.path.join(os.path.dirname(__file__), "model_suites_known_failures.txt"))
CASES = {f"{kind}/{c.name}": c for kind in KINDS for c in collect(kind)}
CASES.update({f"exports/{c.name}": c for c in collect_exports()})


def case_params() -> list[Any]:
    """Every case as a pytest param: known failures xfail (strict), the real models slow.
    Both suites (cpu, mixed sim-gpu) share one list of known failures."""
    params = []
    for name in sorted(CASES):
        marks = [pytest.mark.xfail(reason=KNOWN[name], strict=True)] if name in KNOWN else []
        if CASES[name].kind == "real":
            marks.append(pytest.mark.slow)
        params.append(pytest.param(name, id=name, marks=marks))
    return params
