"""hetero-exec run | plan | demo, through hetero_exec.cli.main (stdout/stderr captured)."""

from __future__ import annotations

import json
import re

import numpy as np
import onnx
import pytest

from hetero_exec import InferenceSession
from hetero_exec.cli import main, random_feed
from tests._models import assert_outputs, mlp, ort_run


@pytest.fixture
def model_path(tmp_path):
    path = tmp_path / "mlp.onnx"
    onnx.save_model(mlp("N"), str(path))
    return str(path)


def _summary_line(out: str, name: str) -> str:
    lines = [ln.strip() for ln in out.splitlines() if ln.strip().startswith(f"{name}:")]
    assert len(lines) == 1, out
    return lines[0]


def test_run_with_input_files(model_path, tmp_path, capsys):
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    rc = main(["run", model_path, "--input", f"x={tmp_path / 'x.npy'}", "--save", str(tmp_path / "out_")])
    out = capsys.readouterr().out
    assert rc == 0
    want = ort_run(mlp("N"), {"x": x})[0]
    assert f"ran {model_path} on cpu" in out
    line = _summary_line(out, "y")
    assert line.startswith("y: float32[3, 3]")
    assert f"min={want.min():.4g}" in line and f"max={want.max():.4g}" in line
    assert_outputs([np.load(tmp_path / "out_y.npy")], [want])


def test_run_with_random_inputs(model_path, tmp_path, capsys):
    rc = main(["run", model_path, "--random-inputs", "--dim", "N=5", "--save", str(tmp_path / "r_")])
    out = capsys.readouterr().out
    assert rc == 0
    assert _summary_line(out, "y").startswith("y: float32[5, 3]")
    saved = np.load(tmp_path / "r_y.npy")
    feed = random_feed(InferenceSession(model_path), {"N": 5})  # the CLI's own feed (seed 0)
    assert feed["x"].shape == (5, 4) and feed["x"].dtype == np.float32
    assert_outputs([saved], ort_run(mlp("N"), feed))


def test_run_bad_input_file_is_exit_2(model_path, tmp_path, capsys):
    np.save(tmp_path / "x64.npy", np.zeros((2, 4), np.float64))
    rc = main(["run", model_path, "--input", f"x={tmp_path / 'x64.npy'}"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "DtypeMismatchError" in err and "'x'" in err


def test_plan_writes_json_and_dot(model_path, tmp_path, capsys):
    js, dot = tmp_path / "plan.json", tmp_path / "plan.dot"
    rc = main(["plan", model_path, "--json", str(js), "--dot", str(dot)])
    out = capsys.readouterr().out
    assert rc == 0
    assert f"wrote {js}" in out and f"wrote {dot}" in out
    plan = json.loads(js.read_text())
    assert len(plan["segments"]) == 1
    seg = plan["segments"][0]
    assert seg["provider"] == "cpu"
    assert len(seg["nodes"]) == 4 and seg["nodes"][0] == 'graph/node#0 "mm"'
    assert plan["seams"] == []
    text = dot.read_text()
    assert text.lstrip().startswith("digraph") and text.rstrip().endswith("}")
    assert "segment#0 on cpu" in text
    # the dot shows what runs: on cpu, MatMul + Add + Relu run as one fused node
    for op in ("FusedMatMul", "Softmax"):
        assert op in text


def test_plan_hetero_json_reloads(model_path, tmp_path, capsys):
    js = tmp_path / "hplan.json"
    rc = main(["plan", model_path, "--providers", "sim-gpu,cpu", "--hetero", "--dim", "N=4", "--json", str(js)])
    capsys.readouterr()
    assert rc == 0
    plan = json.loads(js.read_text())
    assert {s["provider"] for s in plan["segments"]} == {"sim-gpu:0"}
    sess = InferenceSession(model_path, providers=["sim-gpu", "cpu"], placement=str(js), dim_bounds={"N": 4})
    x = np.random.default_rng(1).standard_normal((4, 4)).astype(np.float32)
    assert_outputs(sess.run(None, {"x": x}), ort_run(mlp("N"), {"x": x}))


def test_demo_local(capsys):
    rc = main(["demo", "--executor", "local", "--runs", "1"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "matches the cpu session: True" in out
    assert re.search(r"placement \(hetero\): \d+ segment", out)


@pytest.mark.parametrize("cmd", ["run", "plan"])
def test_corrupt_model_is_exit_2(tmp_path, capsys, cmd):
    bad = tmp_path / "corrupt.onnx"
    data = mlp("N").SerializeToString()
    bad.write_bytes(data[: len(data) // 2] + b"\xff\xff\xff")
    extra = ["--random-inputs"] if cmd == "run" else []
    rc = main([cmd, str(bad), *extra])
    captured = capsys.readouterr()
    assert rc == 2
    err = captured.err
    assert err.startswith("error: ModelLoadError:")
    assert "corrupt.onnx" in err and "cannot parse" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert captured.out == ""


def test_missing_model_is_exit_2(tmp_path, capsys):
    rc = main(["run", str(tmp_path / "absent.onnx"), "--random-inputs"])
    err = capsys.readouterr().err
    assert rc == 2 and "ModelLoadError" in err and "absent.onnx" in err


def test_stage_options_reach_the_model():
    from hetero_exec.cli import _session_options, build_parser

    args = build_parser().parse_args(["generate", "m.onnx", "--prompt-ids", "1 2", "--executor",
                                      "ray", "--stage-layers", "3,1"])
    assert _session_options(args) == {"executor": "ray", "stage_layers": [3, 1]}
    args = build_parser().parse_args(["serve", "m.onnx", "--executor", "ray", "--stages", "3",
                                      "--stage-layers", "1 2 1", "--stage-spin-ms", "0",
                                      "--stage-cores", "os"])
    assert _session_options(args) == {"executor": "ray", "stages": 3, "stage_layers": [1, 2, 1],
                                      "stage_spin_ms": 0.0, "stage_cores": "os"}


def test_stage_layers_that_are_not_counts_are_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "m.onnx", "--prompt-ids", "1", "--stage-layers", "3,x"])
    assert e.value.code == 2
    assert "--stage-layers: expects layer counts such as 3,1, got '3,x'" in capsys.readouterr().err


def test_stage_cores_other_than_os_or_auto_are_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "m.onnx", "--prompt-ids", "1", "--stage-cores", "0,1"])
    assert e.value.code == 2
    assert "--stage-cores: invalid choice: '0,1'" in capsys.readouterr().err
