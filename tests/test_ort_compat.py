"""`import hetero_exec as ort` runs everyday onnxruntime code.

Each snippet below is ordinary onnxruntime code written against a module ``ort``. It
runs once with the real onnxruntime and once with hetero_exec, and both must give the
same answer. Where onnxruntime cannot do something here (no CUDA on this machine), the
snippet keeps to what is comparable, and the tests after the snippets check ours on
sim-gpu: device OrtValues, strict mode, transactional set_providers, BLAS threads.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any, Callable

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper

import hetero_exec
from hetero_exec.errors import (
    HeteroExecError,
    HeterogeneousPlacementRequired,
    InputError,
    MemoryAdmissionError,
    OptionError,
    OrtValueError,
    ProviderError,
    RunTerminatedError,
    SequenceOutputError,
)
from tests._models import F, assert_outputs, init, mlp, model, ort_run, vi

X = np.random.default_rng(3).standard_normal((3, 4)).astype(np.float32)


# --- models -------------------------------------------------------------------------------


def _meta_model() -> onnx.ModelProto:
    m = mlp("N")
    m.producer_name, m.domain, m.model_version, m.doc_string = "prod", "ai.example", 7, "model doc"
    m.graph.name, m.graph.doc_string = "mlp_graph", "graph doc"
    helper.set_model_props(m, {"author": "us", "license": "MIT"})
    return m


def _seq_model() -> onnx.ModelProto:
    return model([helper.make_node("SplitToSequence", ["x"], ["seq"], axis=0),
                  helper.make_node("Relu", ["x"], ["y"])],
                 [vi("x", F, ["N", 4])],
                 [helper.make_tensor_sequence_value_info("seq", F, None), vi("y", F, ["N", 4])])


def _map_model() -> onnx.ModelProto:
    """ZipMap, a scikit-learn classifier's probability output: a sequence of maps."""
    out = helper.make_value_info("probs", helper.make_sequence_type_proto(
        helper.make_map_type_proto(TensorProto.INT64, helper.make_tensor_type_proto(F, []))))
    g = helper.make_graph([helper.make_node("Softmax", ["x"], ["p"]),
                           helper.make_node("ZipMap", ["p"], ["probs"], domain="ai.onnx.ml",
                                            classlabels_int64s=[0, 1, 2, 3])],
                          "zipmap", [vi("x", F, ["N", 4])], [out])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18),
                                               helper.make_opsetid("ai.onnx.ml", 3)])


def _optional_model() -> onnx.ModelProto:
    tp = helper.make_tensor_type_proto(F, [4])
    return model([helper.make_node("Optional", [], ["none"], type=tp),
                  helper.make_node("Relu", ["x"], ["y"])],
                 [vi("x", F, ["N", 4])],
                 [helper.make_value_info("none", helper.make_optional_type_proto(tp)),
                  vi("y", F, ["N", 4])])


def _const_model() -> onnx.ModelProto:
    """x + (W * 2): the product is constant (folded), then an Add."""
    w = np.arange(4, dtype=np.float32)
    return model([helper.make_node("Mul", ["W", "two"], ["w2"]),
                  helper.make_node("Add", ["x", "w2"], ["y"])],
                 [vi("x", F, ["N", 4])], [vi("y", F, ["N", 4])],
                 [init("W", w), init("two", np.array(2.0, np.float32))])


CPU = ["CPUExecutionProvider"]


# --- the snippets --------------------------------------------------------------------------

SNIPPETS: list[Callable[[Any, Any], Any]] = []


def snippet(fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    SNIPPETS.append(fn)
    return fn


@snippet
def session_from_a_path(ort, tmp):
    path = os.path.join(tmp, "model.onnx")
    onnx.save(mlp("N"), path)
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    return sess.run([sess.get_outputs()[0].name], {name: X})[0]


@snippet
def session_from_bytes(ort, tmp):
    sess = ort.InferenceSession(mlp("N").SerializeToString(), providers=CPU)
    return sess.run(None, {"x": X})


@snippet
def session_options_in_second_position(ort, tmp):
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    sess = ort.InferenceSession(mlp("N").SerializeToString(), so, providers=CPU)
    return sess.run(None, {"x": X}), sess.get_providers()


@snippet
def session_options_defaults(ort, tmp):
    so = ort.SessionOptions()
    return (so.graph_optimization_level.name, so.intra_op_num_threads, so.inter_op_num_threads,
            so.execution_mode.name, so.log_severity_level, so.log_verbosity_level,
            so.enable_profiling, so.optimized_model_filepath, so.logid, so.enable_cpu_mem_arena,
            so.enable_mem_pattern, so.enable_mem_reuse, so.use_deterministic_compute)


@snippet
def session_options_set_and_read_back(ort, tmp):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_PARALLEL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    so.log_verbosity_level = 0
    so.logid = "compat"
    so.enable_mem_pattern = False
    so.enable_cpu_mem_arena = False
    so.use_deterministic_compute = True
    sess = ort.InferenceSession(mlp("N").SerializeToString(), so, providers=CPU)
    got = sess.get_session_options()
    return (sess.run(None, {"x": X}), so.intra_op_num_threads, so.execution_mode.name,
            so.graph_optimization_level.name, got.intra_op_num_threads, so.logid)


@snippet
def enums_match(ort, tmp):
    return ({k: int(v) for k, v in ort.GraphOptimizationLevel.__members__.items()},
            {k: int(v) for k, v in ort.ExecutionMode.__members__.items()})


@snippet
def a_wrong_type_is_a_type_error(ort, tmp):
    so = ort.SessionOptions()
    outcomes = []
    for field, bad in (("intra_op_num_threads", "four"), ("enable_profiling", "yes"),
                       ("execution_mode", "parallel")):
        try:
            setattr(so, field, bad)
            outcomes.append("accepted")
        except TypeError:
            outcomes.append("TypeError")
    return outcomes


@snippet
def an_unknown_option_is_an_attribute_error(ort, tmp):
    so = ort.SessionOptions()
    try:
        so.intra_op_num_thread = 2  # a typo
        return "accepted"
    except AttributeError:
        return "AttributeError"


@snippet
def graph_optimization_disabled(ort, tmp):
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(_const_model().SerializeToString(), so, providers=CPU)
    return sess.run(None, {"x": X})


@snippet
def module_level_functions(ort, tmp):
    known = ("CUDAExecutionProvider", "CPUExecutionProvider")
    available = [p for p in ort.get_available_providers() if p in known]
    return (available, available[-1], {"CPUExecutionProvider", "CUDAExecutionProvider"}
            <= set(ort.get_all_providers()), ort.get_device(), isinstance(ort.__version__, str))


@snippet
def cuda_check_everyday_line(ort, tmp):
    sess = ort.InferenceSession(mlp("N").SerializeToString(),
                                providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    use_gpu = "CUDAExecutionProvider" in sess.get_providers()  # no GPU here: both fall back
    return use_gpu, sess.get_providers(), sess.run(None, {"x": X})


@snippet
def providers_as_tuples_and_provider_options(ort, tmp):
    data = mlp("N").SerializeToString()
    a = ort.InferenceSession(data, providers=[("CPUExecutionProvider", {})])
    b = ort.InferenceSession(data, providers=CPU, provider_options=[{}])
    return (a.get_providers(), a.get_provider_options(), b.get_provider_options(),
            a.run(None, {"x": X}))


@snippet
def set_providers_rebuilds(ort, tmp):
    sess = ort.InferenceSession(mlp("N").SerializeToString(), providers=CPU)
    before = sess.run(None, {"x": X})
    sess.set_providers(["CPUExecutionProvider"])
    after_cpu = sess.get_providers()
    sess.set_providers(["CUDAExecutionProvider", "CPUExecutionProvider"])  # no GPU: on cpu
    return before, after_cpu, sess.get_providers(), sess.run(None, {"x": X})


@snippet
def fallback_switches(ort, tmp):
    sess = ort.InferenceSession(mlp("N").SerializeToString(), providers=CPU)
    sess.disable_fallback()
    sess.enable_fallback()
    return sess.run(None, {"x": X})


@snippet
def model_metadata(ort, tmp):
    meta = ort.InferenceSession(_meta_model().SerializeToString(), providers=CPU).get_modelmeta()
    return (meta.producer_name, meta.graph_name, meta.domain, meta.description,
            meta.graph_description, meta.version, meta.custom_metadata_map)


@snippet
def model_version_unset_or_zero(ort, tmp):
    # no model_version: onnxruntime says INT64_MAX; an explicit 0 stays 0
    unset = model([helper.make_node("Relu", ["x"], ["y"])], [vi("x", F, ["N", 4])],
                  [vi("y", F, ["N", 4])])
    unset.ClearField("model_version")
    zero = onnx.ModelProto()
    zero.CopyFrom(unset)
    zero.model_version = 0
    return [ort.InferenceSession(m.SerializeToString(), providers=CPU).get_modelmeta().version
            for m in (unset, zero)]


@snippet
def inputs_and_outputs(ort, tmp):
    sess = ort.InferenceSession(_seq_model().SerializeToString(), providers=CPU)
    return [(a.name, a.type, a.shape) for a in sess.get_inputs() + sess.get_outputs()]


@snippet
def sequence_outputs_are_lists(ort, tmp):
    sess = ort.InferenceSession(_seq_model().SerializeToString(), providers=CPU)
    seq, y = sess.run(None, {"x": X})
    return type(seq).__name__, len(seq), seq, y


@snippet
def map_outputs_are_dicts(ort, tmp):
    sess = ort.InferenceSession(_map_model().SerializeToString(), providers=CPU)
    (probs,) = sess.run(None, {"x": X})
    return (sess.get_outputs()[0].type, type(probs).__name__, type(probs[0]).__name__,
            [sorted(p) for p in probs], [[p[k] for k in sorted(p)] for p in probs])


@snippet
def an_absent_optional_is_none(ort, tmp):
    sess = ort.InferenceSession(_optional_model().SerializeToString(), providers=CPU)
    return sess.run(None, {"x": X})


@snippet
def run_options(ort, tmp):
    sess = ort.InferenceSession(mlp("N").SerializeToString(), providers=CPU)
    ro = ort.RunOptions()
    defaults = (ro.log_severity_level, ro.log_verbosity_level, ro.logid, ro.terminate,
                ro.only_execute_path_to_fetches)
    ro.logid = "request-1"
    ro.log_severity_level = 3
    out = sess.run(None, {"x": X}, ro)
    ro.terminate = True
    try:
        sess.run(None, {"x": X}, ro)
        terminated = False
    except Exception:
        terminated = True
    ro.terminate = False
    return defaults, out, terminated, sess.run(None, {"x": X}, ro)


@snippet
def profiling(ort, tmp):
    so = ort.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = os.path.join(tmp, "prof")
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # the model's ops
    sess = ort.InferenceSession(mlp("N").SerializeToString(), so, providers=CPU)
    sess.run(None, {"x": X})
    path = sess.end_profiling()
    return (os.path.basename(path).startswith("prof"), path.endswith(".json"),
            os.path.exists(path), sess.get_profiling_start_time_ns() > 0, _profiled_ops(path))


def _profiled_ops(path: str) -> list[str]:
    """The op types a profile timed: onnxruntime writes a list of events with
    ``cat: Node``; ours is a Chrome trace object whose node spans name their node."""
    doc = json.load(open(path))
    if isinstance(doc, list):
        return sorted({e["args"]["op_name"] for e in doc if e.get("cat") == "Node"})
    return sorted({e["name"] for e in doc["traceEvents"] if "node" in e.get("args", {})})


@snippet
def optimized_model_filepath(ort, tmp):
    out = os.path.join(tmp, "optimized.onnx")
    so = ort.SessionOptions()
    so.optimized_model_filepath = out
    ort.InferenceSession(_const_model().SerializeToString(), so, providers=CPU)
    reloaded = ort.InferenceSession(out, providers=CPU)
    return os.path.exists(out), reloaded.run(None, {"x": X})


@snippet
def optimized_model_without_optimizations_loads_anywhere(ort, tmp):
    out = os.path.join(tmp, "plain.onnx")
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.optimized_model_filepath = out
    ort.InferenceSession(mlp("N").SerializeToString(), so, providers=CPU)
    theirs = onnxruntime.InferenceSession(out, providers=CPU)  # read back by onnxruntime itself
    return theirs.run(None, {"x": X})


@snippet
def session_config_entries(ort, tmp):
    so = ort.SessionOptions()
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    try:
        so.get_session_config_entry("session.use_env_allocators")
        unset = "returned"
    except Exception:
        unset = "raised"
    return (so.get_session_config_entry("session.disable_cpu_ep_fallback"),
            so.get_session_config_entry("session.intra_op.allow_spinning"), unset)


@snippet
def free_dimension_override(ort, tmp):
    so = ort.SessionOptions()
    so.add_free_dimension_override_by_name("N", 3)
    sess = ort.InferenceSession(mlp("N").SerializeToString(), so, providers=CPU)
    return sess.get_inputs()[0].shape, sess.run(None, {"x": X})


@snippet
def bad_inputs_raise_and_the_session_keeps_working(ort, tmp):
    sess = ort.InferenceSession(mlp("N").SerializeToString(), providers=CPU)
    bad = [{"x": X.astype(np.float64)}, {"x": X[0]}, {"x": np.zeros((3, 5), np.float32)},
           {"x": X, "nope": X}, {}]
    raised = []
    for feed in bad:
        try:
            sess.run(None, feed)
            raised.append(False)
        except Exception:
            raised.append(True)
    try:
        sess.run(["nope"], {"x": X})
        raised.append(False)
    except Exception:
        raised.append(True)
    return raised, sess.run(None, {"x": X})


@snippet
def io_binding_on_cpu(ort, tmp):
    sess = ort.InferenceSession(mlp("N").SerializeToString(), providers=CPU)
    binding = sess.io_binding()
    binding.bind_cpu_input("x", X)
    binding.bind_output("y")
    sess.run_with_iobinding(binding)
    outs = binding.get_outputs()
    return (binding.copy_outputs_to_cpu(), [o.numpy() for o in outs],
            [o.device_name() for o in outs])


@snippet
def io_binding_with_ortvalues(ort, tmp):
    sess = ort.InferenceSession(mlp("N").SerializeToString(), providers=CPU)
    x = ort.OrtValue.ortvalue_from_numpy(X, "cpu", 0)
    y = ort.OrtValue.ortvalue_from_shape_and_type([3, 3], np.float32, "cpu", 0)
    binding = sess.io_binding()
    binding.bind_ortvalue_input("x", x)
    binding.bind_ortvalue_output("y", y)
    sess.run_with_iobinding(binding)
    binding.synchronize_outputs()
    return y.numpy(), binding.get_outputs()[0].numpy()


@snippet
def ortvalue_basics(ort, tmp):
    arr = np.arange(6, dtype=np.float32).reshape(2, 3)
    v = ort.OrtValue.ortvalue_from_numpy(arr)
    facts = (v.shape(), v.data_type(), v.element_type(), v.device_name(), v.is_tensor(),
             v.has_value(), v.is_tensor_sequence(), v.tensor_size_in_bytes(),
             v.data_ptr() == arr.ctypes.data)
    arr[0, 0] = 42.0  # a cpu OrtValue shares the array's memory
    seen = float(v.numpy()[0, 0])
    v.update_inplace(np.ones((2, 3), np.float32))
    return facts, seen, arr


@snippet
def ortvalue_dtypes(ort, tmp):
    out = []
    for dt in (np.float16, np.float64, np.int8, np.int64, np.uint64, np.bool_):
        v = ort.OrtValue.ortvalue_from_numpy(np.zeros(2, dt))
        out.append((v.data_type(), v.element_type()))
    z = ort.OrtValue.ortvalue_from_shape_and_type([2, 2], np.int64)
    return out, z.shape(), z.data_type()


@snippet
def ortvalue_on_cuda_without_a_gpu(ort, tmp):
    try:
        ort.OrtValue.ortvalue_from_numpy(X, "cuda", 0)
        return "accepted"
    except Exception:
        return "raised"


@snippet
def run_with_ort_values(ort, tmp):
    sess = ort.InferenceSession(_seq_model().SerializeToString(), providers=CPU)
    seq, y = sess.run_with_ort_values(None, {"x": ort.OrtValue.ortvalue_from_numpy(X)})
    return (seq.data_type(), seq.is_tensor(), seq.has_value(), y.data_type(), y.numpy(),
            sess.run(["y"], {"x": ort.OrtValue.ortvalue_from_numpy(X)}))


@snippet
def run_async_with_a_callback(ort, tmp):
    sess = ort.InferenceSession(mlp("N").SerializeToString(), providers=CPU)
    done = threading.Event()
    got = {}

    def callback(outputs, user_data, err):
        got.update(outputs=outputs, user_data=user_data, err=err)
        done.set()

    sess.run_async(None, {"x": X}, callback, "request-1")
    assert done.wait(30)
    good = (got["outputs"], got["user_data"], got["err"])
    done.clear()
    sess.run_async(None, {"x": X.astype(np.float64)}, callback, "request-2")
    assert done.wait(30)
    return good, (got["outputs"], got["user_data"], bool(got["err"]))


@snippet
def overridable_initializers(ort, tmp):
    m = model([helper.make_node("Add", ["x", "b"], ["y"])], [vi("x", F, ["N", 4]), vi("b", F, [4])],
              [vi("y", F, ["N", 4])], [init("b", np.ones(4, np.float32))])
    sess = ort.InferenceSession(m.SerializeToString(), providers=CPU)
    return ([a.name for a in sess.get_overridable_initializers()], sess.run(None, {"x": X}),
            sess.run(None, {"x": X, "b": np.full(4, 3.0, np.float32)}))


@snippet
def default_logger_severity(ort, tmp):
    ort.set_default_logger_severity(3)
    sess = ort.InferenceSession(mlp("N").SerializeToString(), providers=CPU)
    ort.set_default_logger_severity(2)
    return sess.run(None, {"x": X})


def _same(ours: Any, theirs: Any, where: str = "answer") -> None:
    if isinstance(theirs, np.ndarray):
        assert isinstance(ours, np.ndarray), f"{where}: {type(ours).__name__} is not an array"
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, f"{where}: {ours!r} vs {theirs!r}"
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6, err_msg=where)
    elif isinstance(theirs, (list, tuple)):
        assert isinstance(ours, (list, tuple)) and len(ours) == len(theirs), f"{where}: {ours!r} vs {theirs!r}"
        for i, (o, t) in enumerate(zip(ours, theirs)):
            _same(o, t, f"{where}[{i}]")
    elif isinstance(theirs, dict):
        assert isinstance(ours, dict) and set(ours) == set(theirs), f"{where}: {ours!r} vs {theirs!r}"
        for k in theirs:
            _same(ours[k], theirs[k], f"{where}[{k!r}]")
    elif isinstance(theirs, float):
        assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-6), f"{where}: {ours!r} vs {theirs!r}"
    else:
        assert ours == theirs, f"{where}: ours {ours!r}, onnxruntime {theirs!r}"


@pytest.mark.parametrize("fn", SNIPPETS, ids=[f.__name__ for f in SNIPPETS])
def test_the_same_answer_as_onnxruntime(fn, tmp_path):
    theirs_dir, ours_dir = tmp_path / "onnxruntime", tmp_path / "hetero_exec"
    theirs_dir.mkdir()
    ours_dir.mkdir()
    theirs = fn(onnxruntime, str(theirs_dir))
    ours = fn(hetero_exec, str(ours_dir))
    _same(ours, theirs)


def test_snippet_count():
    assert len(SNIPPETS) >= 35  # snippets are never dropped silently


# --- ours, where onnxruntime has nothing to compare with here -----------------------------------


def test_errors_are_typed_and_raise_before_running():
    sess = hetero_exec.InferenceSession(mlp("N").SerializeToString(), providers=CPU)
    for feed in ({"x": X.astype(np.float64)}, {"x": X[0]}, {"x": np.zeros((3, 5), np.float32)},
                 {"x": X, "nope": X}, {}):
        with pytest.raises(InputError):
            sess.run(None, feed)
    so = hetero_exec.SessionOptions()
    for bad in (lambda: setattr(so, "intra_op_num_threads", -1),
                lambda: setattr(so, "log_severity_level", 7),
                lambda: so.add_session_config_entry("session.not_a_key", "1"),
                lambda: so.add_session_config_entry("session.disable_cpu_ep_fallback", "yes"),
                lambda: so.add_session_config_entry("hetero_exec.not_an_option", "1"),
                lambda: so.add_session_config_entry("hetero_exec.hetero", "maybe"),
                lambda: so.add_session_config_entry("hetero_exec.stages", "[1,"),
                lambda: hetero_exec.RunOptions().add_run_config_entry("bogus", "1"),
                lambda: setattr(hetero_exec.RunOptions(), "terminate", "yes")):
        with pytest.raises(OptionError):
            bad()
    assert_outputs(sess.run(None, {"x": X}), ort_run(mlp("N"), {"x": X}))


def test_hetero_exec_config_keys_reach_every_option():
    so = hetero_exec.SessionOptions()
    entries = {"hetero_exec.hetero": "1", "hetero_exec.require_gpu": "false",
               "hetero_exec.executor": "local", "hetero_exec.dim_bounds": "N=8",
               "hetero_exec.stages": "0,2", "hetero_exec.strategy": "balanced",
               "hetero_exec.fold_constants": "off", "hetero_exec.optimize": "0",
               "hetero_exec.affinity": '[["relu", "cpu"]]',
               "hetero_exec.enable_profiling": "0", "hetero_exec.profile_file_prefix": "p",
               "hetero_exec.cost_model": '{"per_node_s": 1e-5}',
               "hetero_exec.max_inflight": "4"}
    for k, v in entries.items():
        so.add_session_config_entry(k, v)
        assert so.get_session_config_entry(k) == v
    assert (so.hetero, so.require_gpu, so.dim_bounds, so.stages, so.strategy) == (
        True, False, {"N": 8}, [0, 2], "balanced")
    assert (so.fold_constants, so.optimize) == (False, False)
    assert [tuple(rule) for rule in so.affinity] == [("relu", "cpu")]
    assert so.graph_optimization_level == hetero_exec.GraphOptimizationLevel.ORT_DISABLE_ALL
    assert so.cost_model.per_node_s == 1e-5
    assert so.executor_options == {"max_inflight": 4}  # a Ray executor option
    so.add_session_config_entry("hetero_exec.stages", "3")
    assert so.stages == 3
    with pytest.raises(OptionError, match="max_inflight"):  # executor='local' takes none
        hetero_exec.InferenceSession(mlp("N"), so)


def _declining(excluded="Softmax"):
    return ("sim-gpu", {"exclude_ops": [excluded]})


def test_strict_mode_through_the_config_entry_on_sim_gpu():
    so = hetero_exec.SessionOptions()
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    with pytest.raises(HeterogeneousPlacementRequired, match="Softmax"):
        hetero_exec.InferenceSession(mlp("N"), so, providers=[_declining()])
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "0")
    sess = hetero_exec.InferenceSession(mlp("N"), so, providers=[_declining()])
    assert sess.get_providers() == ["cpu"] and sess.fallback_report is not None
    # mixed placement through our own key: the GPU keeps what it can, cpu the rest
    so.add_session_config_entry("hetero_exec.hetero", "1")
    mixed = hetero_exec.InferenceSession(mlp("N"), so, providers=[_declining()])
    assert mixed.is_heterogeneous and mixed.get_providers() == ["sim-gpu:0", "cpu"]
    assert_outputs(mixed.run(None, {"x": X}), ort_run(mlp("N"), {"x": X}))


def test_set_providers_is_a_transaction():
    m = mlp(3)
    sess = hetero_exec.InferenceSession(m, providers=CPU)
    want = ort_run(m, {"x": X})
    plan = sess.placement
    failures = [(["tpu"], ProviderError),
                ([("sim-gpu", {"mem_limit": 64})], MemoryAdmissionError),
                (["CPUExecutionProvider"], ProviderError)]  # provider_options of the wrong length
    for providers, error in failures:
        options = [{}, {}] if error is ProviderError and providers == ["CPUExecutionProvider"] else None
        with pytest.raises(error):
            sess.set_providers(providers, options)
        assert sess.placement is plan and sess.get_providers() == ["CPUExecutionProvider"]
        assert_outputs(sess.run(None, {"x": X}), want)
    sess.disable_fallback()  # GPU required from now on
    with pytest.raises(HeterogeneousPlacementRequired):
        sess.set_providers([_declining()])
    assert sess.placement is plan
    sess.enable_fallback()
    sess.set_providers([_declining()])  # falls back to cpu, with the report
    assert sess.get_providers() == ["cpu"] and sess.fallback_report is not None
    sess.set_providers(["sim-gpu"], [{"device_id": 0}])
    assert sess.get_providers() == ["sim-gpu:0"] and sess.fallback_report is None
    assert sess.get_provider_options() == {"sim-gpu:0": {"device_id": "0"}}
    assert_outputs(sess.run(None, {"x": X}), want)


def test_ortvalues_on_sim_gpu_stay_on_the_device():
    m = mlp(3)
    sess = hetero_exec.InferenceSession(m, providers=["sim-gpu"], require_gpu=True)
    prov = sess._build.providers[0]
    x = hetero_exec.OrtValue.ortvalue_from_numpy(X, "sim-gpu", 0)
    assert x.device_name() == "sim-gpu" and x.shape() == [3, 4]
    before = prov.bytes_to_host
    (y,) = sess.run_with_ort_values(None, {"x": x})
    assert y.device_name() == "sim-gpu"
    assert prov.bytes_to_host == before  # the output stayed on the device
    binding = sess.io_binding()
    binding.bind_ortvalue_input("x", x)
    binding.bind_output("y")  # the session's device
    sess.run_with_iobinding(binding)
    assert [v.device_name() for v in binding.get_outputs()] == ["sim-gpu"]
    binding.clear_binding_outputs()
    binding.bind_output("y", "cpu")  # asked for on the host
    sess.run_with_iobinding(binding)
    assert [v.device_name() for v in binding.get_outputs()] == ["cpu"]
    want = ort_run(m, {"x": X})
    assert_outputs([y.numpy()], want)  # numpy() is the explicit copy to the host
    assert_outputs(binding.copy_outputs_to_cpu(), want)
    # a device value never reaches a host-only call silently
    with pytest.raises(OrtValueError, match="numpy"):
        sess.run(None, {"x": x})
    cpu = hetero_exec.InferenceSession(m, providers=CPU)
    with pytest.raises(OrtValueError):
        cpu.run_with_ort_values(None, {"x": x})
    with pytest.raises(ProviderError):
        hetero_exec.OrtValue.ortvalue_from_numpy(X, "cuda", 0)  # no GPU works here
    with pytest.raises(ProviderError):
        hetero_exec.OrtValue.ortvalue_from_numpy(X, "tpu", 0)


def test_available_providers_are_honest():
    from hetero_exec.provider_names import cuda_status
    from hetero_exec.providers.gpu import GpuProvider

    works, reason = cuda_status()
    assert ("CUDAExecutionProvider" in hetero_exec.get_available_providers()) == works
    if not GpuProvider().available():
        assert not works and reason
    assert hetero_exec.get_device() == ("GPU" if works else "CPU")


def test_run_async_without_a_callback_is_a_future_and_errors_reach_the_callback():
    sess = hetero_exec.InferenceSession(mlp("N"), providers=CPU)
    assert_outputs(sess.run_async(None, {"x": X}).result(timeout=30), ort_run(mlp("N"), {"x": X}))
    got = []
    done = threading.Event()
    sess.run_async(["nope"], {"x": X}, lambda o, u, e: (got.append((o, u, e)), done.set()), 5)
    assert done.wait(30)
    assert got[0][0] == [] and got[0][1] == 5 and "nope" in got[0][2]


def test_terminate_set_during_a_run_discards_its_outputs():
    ro = hetero_exec.RunOptions()
    ro.logid = "long"
    sess = hetero_exec.InferenceSession(_probe_model(), providers=CPU)
    _PROBE["hook"] = lambda: setattr(ro, "terminate", True)
    try:
        with pytest.raises(RunTerminatedError, match="long"):
            sess.run(None, {"x": X}, ro)
    finally:
        _PROBE["hook"] = None
    ro.terminate = False
    assert_outputs(sess.run(None, {"x": X}, ro), [X])


def test_sequence_outputs_through_io_binding_name_run():
    sess = hetero_exec.InferenceSession(_seq_model(), providers=CPU)
    b = sess.io_binding()
    b.bind_cpu_input("x", X)
    with pytest.raises(SequenceOutputError, match=r"session\.run\("):
        sess.run_with_iobinding(b)  # no outputs bound: all of them, and one is a sequence
    assert len(sess.run(None, {"x": X})[0]) == 3


def test_optimized_model_is_folded_and_fused(tmp_path):
    path = str(tmp_path / "opt.onnx")
    m = mlp("N")
    hetero_exec.InferenceSession(m, optimized_model_filepath=path)
    written = onnx.load(path)
    assert len(written.graph.node) < len(m.graph.node)  # MatMul + Add + Relu fused
    assert_outputs(hetero_exec.InferenceSession(path).run(None, {"x": X}), ort_run(m, {"x": X}))
    folded = str(tmp_path / "folded.onnx")
    hetero_exec.InferenceSession(_const_model(), optimized_model_filepath=folded)
    assert [n.op_type for n in onnx.load(folded).graph.node] == ["Add"]  # W * 2 folded
    with pytest.raises(OptionError, match="cannot write"):
        hetero_exec.InferenceSession(m, optimized_model_filepath=str(tmp_path / "no" / "such.onnx"))


def test_sess_options_are_copied_and_keywords_win():
    so = hetero_exec.SessionOptions()
    so.enable_profiling = False
    sess = hetero_exec.InferenceSession(mlp("N"), so, providers=CPU, fold_constants=False)
    so.intra_op_num_threads = 3  # later edits do not reach the session
    assert sess.get_session_options().intra_op_num_threads == 0
    assert sess.options.fold_constants is False and so.fold_constants is True
    with pytest.raises(ProviderError, match="twice"):
        hetero_exec.InferenceSession(mlp("N"), ["cpu"], providers=["cpu"])
    with pytest.raises(OptionError):
        hetero_exec.InferenceSession(mlp("N"), onnxruntime.SessionOptions())
    assert hetero_exec.InferenceSession(mlp("N"), ["cpu"]).get_providers() == ["cpu"]  # today's code


def test_every_failure_is_a_hetero_exec_error():
    for error in (OptionError, OrtValueError, RunTerminatedError, SequenceOutputError):
        assert issubclass(error, HeteroExecError)


# --- intra-op threads: this session's runs, no other's --------------------------------------------

_PROBE: dict[str, Any] = {"hook": None, "seen": []}


def _register_probe() -> None:
    """A real kernel in a test domain that records, while it runs, the threads its run may
    split work over and the BLAS's own count."""
    from hetero_exec.kernels.registry import kernel, lookup

    if lookup("test.probe", "ThreadProbe", 1) is not None:
        return

    @kernel("ThreadProbe", since=1, domain="test.probe")
    def ThreadProbe(xp, X):
        from hetero_exec.kernels._threads import blas_threads, split_width

        _PROBE["seen"].append((threading.current_thread().name, split_width(), blas_threads()))
        if _PROBE["hook"] is not None:
            _PROBE["hook"]()
        return (X.copy(),)


def _probe_model() -> onnx.ModelProto:
    _register_probe()
    g = helper.make_graph([helper.make_node("ThreadProbe", ["x"], ["y"], domain="test.probe")],
                          "probe", [vi("x", F, ["N", 4])], [vi("y", F, ["N", 4])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                               helper.make_opsetid("test.probe", 1)])


def test_intra_op_threads_apply_to_this_sessions_runs_only(monkeypatch):
    from hetero_exec.kernels import _threads

    monkeypatch.setattr(_threads, "cores", lambda: 4)  # as on a 4-core machine
    before = _threads.blas_threads()
    so = hetero_exec.SessionOptions()
    so.intra_op_num_threads = 1
    limited = hetero_exec.InferenceSession(_probe_model(), so, providers=CPU)
    plain = hetero_exec.InferenceSession(_probe_model(), providers=CPU)
    _PROBE["seen"].clear()
    limited.run(None, {"x": X})
    plain.run(None, {"x": X})
    assert [seen[1] for seen in _PROBE["seen"]] == [1, 4]
    assert _threads.blas_threads() == before  # given back after the run
    # concurrently, from two threads: every run sees its own session's count
    _PROBE["seen"].clear()

    def hammer(sess):
        for _ in range(20):
            sess.run(None, {"x": X})

    threads = [threading.Thread(target=hammer, args=(s,), name=k)
               for s, k in ((limited, "limited"), (plain, "plain"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    by_thread: dict[str, set] = {}
    for name, width, _ in _PROBE["seen"]:
        by_thread.setdefault(name, set()).add(width)
    assert by_thread == {"limited": {1}, "plain": {4}}
    _PROBE["seen"].clear()
    for f in [limited.run_async(None, {"x": X}) for _ in range(4)]:
        f.result(timeout=30)
    assert {width for _, width, _ in _PROBE["seen"]} == {1}  # run_async's pool threads too
    assert _threads.blas_threads() == before


def test_intra_op_threads_on_ray_are_the_stage_actors_threads():
    from hetero_exec.session import _session_options

    so = hetero_exec.SessionOptions()
    so.intra_op_num_threads = 2
    assert _session_options(so, {"executor": "ray"}).executor_options == {"stage_threads": 2}
    given = _session_options(so, {"executor": "ray", "stage_threads": 1})
    assert given.executor_options == {"stage_threads": 1}  # an explicit executor option wins
