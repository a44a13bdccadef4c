"""Ray Data batch inference over a real local Ray (``ray_session``): HeteroPredictor in
map_batches and infer(), checked row by row against onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from actors.data import (
    BatchShapeError,
    ColumnConflictError,
    HeteroPredictor,
    MissingColumnError,
    infer,
)
from hetero_exec import InferenceSession
from hetero_exec.errors import DtypeMismatchError
from tests.ray.helpers import eventually, live_placement_groups, live_stage_actors
from tests.ray.models import mlp

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

WIDTH = 16
MIXED = [("sim-gpu", {"exclude_ops": ["Relu"]}), "cpu"]  # Relu on cpu: a mixed plan
CPU = 0.5  # per replica: the session's Ray may have only 2 CPUs


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "mlp.onnx"
    onnx.save(mlp(WIDTH, layers=2), str(path))
    return str(path)


def ort_rows(path, xs):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": np.stack(xs)})[0]


def rows(n, seed=0):
    rng = np.random.default_rng(seed)
    return [{"id": i, "tag": f"row{i}", "x": rng.standard_normal(WIDTH).astype(np.float32)}
            for i in range(n)]


def check_rows(out_rows, in_rows, path):
    by_id = {r["id"]: r for r in out_rows}
    assert sorted(by_id) == [r["id"] for r in in_rows], "every row comes back once"
    want = ort_rows(path, [r["x"] for r in in_rows])
    for r, w in zip(in_rows, want):
        got = by_id[r["id"]]
        assert got["tag"] == r["tag"], "other columns pass through"
        np.testing.assert_array_equal(got["x"], r["x"])
        assert got["y"].dtype == np.float32 and got["y"].shape == (WIDTH,)
        np.testing.assert_allclose(got["y"], w, rtol=1e-5, atol=1e-6)


def test_infer_cpu_plan_row_by_row(ray_session, model_path):
    ray = ray_session
    items = rows(37)
    out = infer(ray.data.from_items(items), model_path, providers=["cpu"], batch_size=8,
                concurrency=2, num_cpus=CPU)
    check_rows(out.take_all(), items, model_path)


def test_infer_a_model_given_as_bytes_or_proto(ray_session, model_path):
    """A model that is no path travels to the replicas through the object store, once
    (an ObjectRef of its bytes), and a HeteroPredictor takes such a reference itself."""
    ray = ray_session
    proto = onnx.load(model_path)
    items = rows(21, seed=3)
    for model in (proto.SerializeToString(), proto):
        out = infer(ray.data.from_items(items), model, providers=["cpu"], batch_size=8,
                    num_cpus=CPU)
        check_rows(out.take_all(), items, model_path)
    predict = HeteroPredictor(ray.put(proto.SerializeToString()), ["cpu"])
    x = np.stack([r["x"] for r in items])
    np.testing.assert_allclose(predict({"x": x})["y"], ort_rows(model_path, list(x)),
                               rtol=1e-5, atol=1e-6)


def test_map_batches_mixed_plan_in_replica(ray_session, model_path):
    ray = ray_session
    local = InferenceSession(model_path, MIXED, hetero=True)
    assert [s.provider_name for s in local.placement.segments] == [
        "sim-gpu:0", "cpu", "sim-gpu:0", "cpu"]
    xs = np.random.default_rng(1).standard_normal((50, WIDTH)).astype(np.float32)
    items = [{"id": i, "tag": "", "x": x} for i, x in enumerate(xs)]
    ds = ray.data.from_items(items)
    out = ds.map_batches(
        HeteroPredictor,
        fn_constructor_kwargs={"model": model_path, "providers": MIXED, "hetero": True},
        batch_size=16,
        compute=ray.data.ActorPoolStrategy(size=1),
        num_gpus=1,
        num_cpus=CPU,
    )
    check_rows(out.take_all(), items, model_path)


def test_from_numpy_read_only_batches(ray_session, model_path):
    ray = ray_session
    xs = np.random.default_rng(2).standard_normal((20, WIDTH)).astype(np.float32)
    xs.setflags(write=False)
    ds = ray.data.from_numpy(xs).rename_columns({"data": "x"})
    got = np.concatenate([b["y"] for b in infer(ds, model_path, batch_size=7, num_cpus=CPU).iter_batches(
        batch_format="numpy", batch_size=None)])
    np.testing.assert_allclose(got, ort_rows(model_path, list(xs)), rtol=1e-5, atol=1e-6)


def test_stage_actors_driven_by_the_replica(ray_session, tmp_path):
    """executor='ray' passed through: the replica drives the plan's segment actors, and
    they go when the pipeline ends."""
    ray = ray_session
    path = str(tmp_path / "one.onnx")
    onnx.save(mlp(WIDTH, layers=1), path)
    items = rows(24, seed=3)
    actors_before, groups_before = live_stage_actors(), live_placement_groups()
    out = infer(ray.data.from_items(items), path, providers=MIXED, hetero=True,
                executor="ray", batch_size=8, concurrency=1, num_cpus=CPU)
    check_rows(out.take_all(), items, path)
    assert eventually(lambda: live_stage_actors() <= actors_before
                      and live_placement_groups() <= groups_before, 30)


def _error_chain(e):
    while e is not None:
        yield e
        e = e.__cause__ or e.__context__


def test_wrong_dtype_is_our_typed_error_inside_ray_datas(ray_session, model_path):
    ray = ray_session
    items = [{"id": 0, "x": np.zeros(WIDTH, np.float64)}]  # float64, the model takes float32
    with pytest.raises(Exception) as e:
        infer(ray.data.from_items(items), model_path, num_cpus=CPU).take_all()
    # Ray Data carries the replica's error as text (a RayTaskError(UserCodeException))
    text = "".join(str(x) for x in _error_chain(e.value))
    assert "DtypeMismatchError: input 'x': dtype mismatch, expected float, got float64" in text


def test_missing_column_is_named(ray_session, model_path):
    ray = ray_session
    with pytest.raises(Exception) as e:
        infer(ray.data.from_items([{"id": 0, "z": np.zeros(WIDTH, np.float32)}]),
              model_path, num_cpus=CPU).take_all()
    text = "".join(str(x) for x in _error_chain(e.value))
    assert "no column 'x'" in text and "['id', 'z']" in text


def test_predictor_checks_without_ray(model_path):
    predict = HeteroPredictor(model_path)
    x = np.ones((3, WIDTH), np.float32)
    x.setflags(write=False)  # a zero-copy batch
    out = predict({"x": x, "keep": np.arange(3)})
    assert out["keep"].tolist() == [0, 1, 2] and out["y"].shape == (3, WIDTH)
    with pytest.raises(MissingColumnError, match="no column 'x'"):
        predict({"keep": np.arange(3)})
    with pytest.raises(ColumnConflictError, match="overwrite the batch's column 'y'"):
        predict({"x": x, "y": np.arange(3)})
    with pytest.raises(DtypeMismatchError, match="expected float, got int64"):
        predict({"x": np.ones((3, WIDTH), np.int64)})
    ragged = np.empty(2, dtype=object)
    ragged[:] = [np.ones(WIDTH, np.float32), np.ones(WIDTH, np.float32)]
    assert predict({"x": ragged})["y"].shape == (2, WIDTH)
    assert BatchShapeError("y", (1,), 3).rows == 3
