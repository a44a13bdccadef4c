"""SEMANTICS.md sections 1, 2 and 5: the load-time order, the grouped fallback report,
whole-session fallback / require / hetero, the guard, IO binding on heterogeneous
sessions, and memory refused before admission.

Outputs are checked against onnxruntime (tests/placement/_models.py), never against
hetero_exec itself."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from onnx import TensorProto as T
from onnx import helper as h

from hetero_exec import InferenceSession
from hetero_exec.errors import (
    ControlFlowError,
    GraphCycleError,
    HeterogeneousPlacementRequired,
    MemoryAdmissionError,
    MissingKernelsError,
    NotSupportedForHeterogeneous,
    PlacementError,
    UnboundedSymbolError,
    UnsupportedOperatorError,
)
from hetero_exec.kernels.registry import lookup
from hetero_exec.placement import passes
from tests.placement._models import (
    F,
    assert_outputs,
    chain,
    if_model,
    init,
    mlp,
    model,
    ort,
    rand,
    vi,
)

HINT = "Set HETERO_EXEC_REQUIRE_GPU=1 to reject this fallback"
DECIDE_LOGGER = "hetero_exec.placement.decide"
EXCLUDED = "excluded by provider options"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    """Every test starts with neither placement variable set."""
    monkeypatch.delenv("HETERO_EXEC_HETERO", raising=False)
    monkeypatch.delenv("HETERO_EXEC_REQUIRE_GPU", raising=False)


def sim(*exclude: str, **opts):
    """A sim-gpu provider spec that declines ``exclude`` op types."""
    return ("sim-gpu", {"exclude_ops": list(exclude), **opts})


def _mixed():
    """x[4] -> Relu -> Neg "neg" -> Sigmoid -> y; the GPU declines Neg when excluded."""
    return chain(["Relu", "Neg", "Sigmoid"], names=["relu", "neg", "sig"])


def _feed():
    return {"x": np.array([-1.5, 0.25, 2.0, -0.5], np.float32)}


def _is_fallback(sess) -> bool:
    return sess.get_providers() == ["cpu"] and sess.fallback_report is not None


def _is_hetero(sess) -> bool:
    return (sess.fallback_report is None and sess.is_heterogeneous
            and {s.provider.name for s in sess.placement.segments} == {"sim-gpu:0", "cpu"})


# --- 1. the grouped report --------------------------------------------------------------


def _report_model():
    """13 nodes: Neg at #1, #2 "neg_b", #10 "neg_a", #11; Abs "abs" at #5;
    an ai.onnx.ml Binarizer "bin" (host-only on the GPU) at #12; Relu elsewhere."""
    kinds = {1: ("Neg", ""), 2: ("Neg", "neg_b"), 5: ("Abs", "abs"), 10: ("Neg", "neg_a"), 11: ("Neg", "")}
    nodes = []
    prev = "x"
    for i in range(12):
        op, name = kinds.get(i, ("Relu", f"relu{i}"))
        nodes.append(h.make_node(op, [prev], [f"t{i}"], name=name))
        prev = f"t{i}"
    nodes.append(h.make_node("Binarizer", [prev], ["y"], name="bin", domain="ai.onnx.ml", threshold=0.1))
    return model(nodes, [vi("x", F, [4])], [vi("y", F, [4])], extra_opsets={"ai.onnx.ml": 3})


def test_report_format_is_exact():
    m = _report_model()
    sess = InferenceSession(m, providers=[sim("Neg", "Abs")])
    rep = sess.fallback_report
    host = lookup("ai.onnx.ml", "Binarizer", 3).host_only
    # groups sorted by (domain, op_type, reason): "ai.onnx" sorts before "ai.onnx.ml";
    # examples sorted as strings (node#10 before node#2), at most 3, count is all of them
    expected = (
        f'ai.onnx::Abs: {EXCLUDED} [count=1; examples: graph/node#5 "abs"]; '
        f'ai.onnx::Neg: {EXCLUDED} [count=4; examples: graph/node#1, graph/node#10 "neg_a", graph/node#11]; '
        f'ai.onnx.ml::Binarizer: host-only kernel: {host} [count=1; examples: graph/node#12 "bin"]'
    )
    assert rep.grouped() == expected
    text = str(rep)
    assert text.endswith(expected)
    assert "requested=sim-gpu:0" in text and "fallback=cpu" in text
    assert rep.requested_provider == "sim-gpu:0" and rep.fallback_provider == "cpu"
    assert rep.assigned_node_count == 13
    assert rep.assigned_ops == ["ai.onnx.ml::Binarizer", "ai.onnx::Abs", "ai.onnx::Neg", "ai.onnx::Relu"]
    assert "assigned_ops=[ai.onnx.ml::Binarizer, ai.onnx::Abs, ai.onnx::Neg, ai.onnx::Relu]" in text
    assert "assigned_nodes=13" in text
    x = rand(4, seed=3)
    assert_outputs(sess.run(None, {"x": x}), ort(m, {"x": x}))


def test_report_subgraph_scopes_and_recursive_counts():
    """Declines inside If branches are named by scope; assigned nodes and op classes
    are counted recursively through the branches."""
    m = if_model()
    sess = InferenceSession(m, providers=[sim("Neg", "Abs")])
    rep = sess.fallback_report
    assert rep.grouped() == (
        f'ai.onnx::Abs: {EXCLUDED} [count=1; examples: graph/node#1/else_branch/node#0 "e_abs"]; '
        f'ai.onnx::Neg: {EXCLUDED} [count=1; examples: graph/node#1/then_branch/node#1 "t_neg"]')
    assert rep.assigned_node_count == 6  # Sin, If, Sigmoid + Relu, Neg (then) + Abs (else)
    assert rep.assigned_ops == ["ai.onnx::Abs", "ai.onnx::If", "ai.onnx::Neg", "ai.onnx::Relu",
                                "ai.onnx::Sigmoid", "ai.onnx::Sin"]
    for c in (True, False):
        feed = {"c": np.array(c), "x": rand(4, seed=1)}
        assert_outputs(sess.run(None, feed), ort(m, feed))


def test_report_nested_subgraph_scope():
    inner_then = h.make_graph([h.make_node("Neg", ["x"], ["it"])], "it", [], [vi("it", F, [4])])
    inner_else = h.make_graph([h.make_node("Relu", ["x"], ["ie"], name="deep")], "ie", [], [vi("ie", F, [4])])
    outer_then = h.make_graph([h.make_node("If", ["c"], ["ot"], then_branch=inner_then, else_branch=inner_else)],
                              "ot", [], [vi("ot", F, [4])])
    outer_else = h.make_graph([h.make_node("Abs", ["x"], ["oe"])], "oe", [], [vi("oe", F, [4])])
    m = model([h.make_node("Sin", ["x"], ["s"]),
               h.make_node("If", ["c"], ["y"], then_branch=outer_then, else_branch=outer_else)],
              [vi("c", T.BOOL, []), vi("x", F, [4])], [vi("y", F, [4])])
    sess = InferenceSession(m, providers=[sim("Relu")])
    assert sess.fallback_report.grouped() == (
        f'ai.onnx::Relu: {EXCLUDED} [count=1; examples: '
        f'graph/node#1/then_branch/node#0/else_branch/node#0 "deep"]')
    assert sess.fallback_report.assigned_node_count == 6


def test_fallback_warning_is_logged_and_report_kept(caplog):
    m = _mixed()
    with caplog.at_level(logging.WARNING, logger=DECIDE_LOGGER):
        sess = InferenceSession(m, providers=[sim("Neg")])
    rep = sess.fallback_report
    assert rep is not None and rep.grouped() == f'ai.onnx::Neg: {EXCLUDED} [count=1; examples: graph/node#1 "neg"]'
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == DECIDE_LOGGER]
    assert len(warnings) == 1
    msg = warnings[0].getMessage()
    assert msg == f"{rep}. {HINT}"
    assert msg.endswith(HINT)


def test_default_is_whole_session_fallback():
    m = _mixed()
    sess = InferenceSession(m, providers=[sim("Neg"), "cpu"])
    assert sess.get_providers() == ["cpu"]
    assert not sess.is_heterogeneous
    assert [s.provider.name for s in sess.placement.segments] == ["cpu"]
    assert len(sess.placement.segments[0].nodes) == 3
    assert_outputs(sess.run(None, _feed()), ort(m, _feed()))


def test_fallback_restores_graph_before_gpu_passes():
    """The GPU passes drop Identity nodes; the fallback graph is the one before them,
    and the report's counts are recomputed for it (Identity included)."""
    m = chain(["Identity", "Neg", "Identity", "Relu"], names=["id0", "neg", "id1", "relu"])
    sess = InferenceSession(m, providers=[sim("Neg")])
    rep = sess.fallback_report
    assert rep.grouped() == f'ai.onnx::Neg: {EXCLUDED} [count=1; examples: graph/node#1 "neg"]'
    assert rep.assigned_node_count == 4
    assert rep.assigned_ops == ["ai.onnx::Identity", "ai.onnx::Neg", "ai.onnx::Relu"]
    assert [n.op_type for n in sess.placement.segments[0].nodes] == ["Identity", "Neg", "Identity", "Relu"]
    assert_outputs(sess.run(None, _feed()), ort(m, _feed()))
    # and without a decline the GPU runs its own (pass-rewritten) graph
    gpu = InferenceSession(m, providers=["sim-gpu"])
    assert gpu.fallback_report is None and gpu.get_providers() == ["sim-gpu:0"]
    assert [n.op_type for n in gpu.placement.segments[0].nodes] == ["Neg", "Relu"]
    assert_outputs(gpu.run(None, _feed()), ort(m, _feed()))


def test_fully_supported_gpu_session_has_no_report():
    m = _mixed()
    sess = InferenceSession(m, providers=["sim-gpu", "cpu"], require_gpu=True)
    assert sess.get_providers() == ["sim-gpu:0"]
    assert sess.fallback_report is None
    assert_outputs(sess.run(None, _feed()), ort(m, _feed()))


# --- require_gpu ------------------------------------------------------------------------


def _assert_required(excinfo, caplog):
    err = excinfo.value
    assert err.report is not None
    assert err.report.grouped() == f'ai.onnx::Neg: {EXCLUDED} [count=1; examples: graph/node#1 "neg"]'
    assert str(err).startswith("heterogeneous placement required: ")
    assert err.report.grouped() in str(err)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and HINT in r.getMessage()]


def test_require_gpu_option_raises_with_report(caplog):
    with caplog.at_level(logging.WARNING), pytest.raises(HeterogeneousPlacementRequired) as ei:
        InferenceSession(_mixed(), providers=[sim("Neg")], require_gpu=True)
    _assert_required(ei, caplog)


@pytest.mark.parametrize("value", ["1", "true", " TRUE ", "on"])
def test_require_gpu_env_raises_with_report(monkeypatch, caplog, value):
    monkeypatch.setenv("HETERO_EXEC_REQUIRE_GPU", value)
    with caplog.at_level(logging.WARNING), pytest.raises(HeterogeneousPlacementRequired) as ei:
        InferenceSession(_mixed(), providers=[sim("Neg")])
    _assert_required(ei, caplog)


def test_require_gpu_option_overrides_env(monkeypatch):
    monkeypatch.setenv("HETERO_EXEC_REQUIRE_GPU", "1")
    sess = InferenceSession(_mixed(), providers=[sim("Neg")], require_gpu=False)
    assert _is_fallback(sess)


# --- 2. hetero: env values, overrides, interplay ------------------------------------------


@pytest.mark.parametrize("value", ["1", "true", " TRUE ", "on", "On", "\ttrue\n"])
def test_hetero_env_enables(monkeypatch, value):
    monkeypatch.setenv("HETERO_EXEC_HETERO", value)
    m = _mixed()
    sess = InferenceSession(m, providers=[sim("Neg")])
    assert _is_hetero(sess)
    assert sess.get_providers() == ["sim-gpu:0", "cpu"]
    assert_outputs(sess.run(None, _feed()), ort(m, _feed()))


@pytest.mark.parametrize("value", ["", "0", "false", "off", "yes", "2", "enabled", None])
def test_hetero_env_disables(monkeypatch, value):
    if value is not None:
        monkeypatch.setenv("HETERO_EXEC_HETERO", value)
    m = _mixed()
    sess = InferenceSession(m, providers=[sim("Neg")])
    assert _is_fallback(sess)
    assert_outputs(sess.run(None, _feed()), ort(m, _feed()))


def test_hetero_option_overrides_env(monkeypatch):
    monkeypatch.setenv("HETERO_EXEC_HETERO", "1")
    assert _is_fallback(InferenceSession(_mixed(), providers=[sim("Neg")], hetero=False))
    monkeypatch.setenv("HETERO_EXEC_HETERO", "0")
    assert _is_hetero(InferenceSession(_mixed(), providers=[sim("Neg")], hetero=True))


def test_hetero_session_report_and_placement():
    m = _mixed()
    sess = InferenceSession(m, providers=[sim("Neg")], hetero=True)
    assert _is_hetero(sess)
    assert [(s.provider.name, [n.name for n in s.nodes]) for s in sess.placement.segments] == [
        ("sim-gpu:0", ["relu"]), ("cpu", ["neg"]), ("sim-gpu:0", ["sig"])]
    assert [(s.value, s.producer, s.consumers, s.nbytes) for s in sess.placement.seams] == [
        ("t0", 0, [1], 16), ("t1", 1, [2], 16)]
    assert_outputs(sess.run(None, _feed()), ort(m, _feed()))


def test_hetero_placement_logged_at_info(caplog):
    with caplog.at_level(logging.INFO, logger=DECIDE_LOGGER):
        sess = InferenceSession(_mixed(), providers=[sim("Neg")], hetero=True)
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and r.name == DECIDE_LOGGER]
    assert any("heterogeneous placement" in msg and "3 segments" in msg for msg in infos), infos
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert sess.placement is not None


@pytest.mark.parametrize("providers", [["cpu"], ["cpu", "sim-gpu"]])
def test_hetero_with_requested_cpu_does_nothing(providers, caplog):
    m = _mixed()
    with caplog.at_level(logging.INFO, logger=DECIDE_LOGGER):
        sess = InferenceSession(m, providers=providers, hetero=True)
    assert sess.get_providers() == ["cpu"]
    assert sess.fallback_report is None and not sess.is_heterogeneous
    assert not [r for r in caplog.records if "heterogeneous placement" in r.getMessage()]
    assert_outputs(sess.run(None, _feed()), ort(m, _feed()))


def test_hetero_fully_supported_is_single_provider():
    m = _mixed()
    sess = InferenceSession(m, providers=["sim-gpu"], hetero=True)
    assert sess.get_providers() == ["sim-gpu:0"]
    assert not sess.is_heterogeneous and sess.fallback_report is None
    assert_outputs(sess.run(None, _feed()), ort(m, _feed()))


@pytest.mark.parametrize("how", ["options", "env", "env-hetero-option-require"])
def test_require_wins_over_hetero(monkeypatch, how):
    kwargs = {}
    if how == "options":
        kwargs = {"hetero": True, "require_gpu": True}
    elif how == "env":
        monkeypatch.setenv("HETERO_EXEC_HETERO", "1")
        monkeypatch.setenv("HETERO_EXEC_REQUIRE_GPU", "1")
    else:
        monkeypatch.setenv("HETERO_EXEC_HETERO", "on")
        kwargs = {"require_gpu": True}
    with pytest.raises(HeterogeneousPlacementRequired) as ei:
        InferenceSession(_mixed(), providers=[sim("Neg")], **kwargs)
    assert "ai.onnx::Neg" in str(ei.value)


# --- 1. the load-time order ---------------------------------------------------------------


def _bad_if(dtype_mismatch: bool = False):
    """An If whose branches disagree (2 vs 1 outputs, or float vs int64)."""
    if dtype_mismatch:
        then_g = h.make_graph([h.make_node("Relu", ["x"], ["a"])], "t", [], [vi("a", F, [4])])
        else_g = h.make_graph([h.make_node("Shape", ["x"], ["b"])], "e", [], [vi("b", T.INT64, [1])])
        return h.make_node("If", ["c"], ["y"], name="cond", then_branch=then_g, else_branch=else_g)
    then_g = h.make_graph([h.make_node("Relu", ["x"], ["a"]), h.make_node("Neg", ["x"], ["a2"])],
                          "t", [], [vi("a", F, [4]), vi("a2", F, [4])])
    else_g = h.make_graph([h.make_node("Relu", ["x"], ["b"])], "e", [], [vi("b", F, [4])])
    return h.make_node("If", ["c"], ["y"], name="cond", then_branch=then_g, else_branch=else_g)


def _cycle_nodes():
    return [h.make_node("Add", ["x", "q"], ["p"], name="loop_a"),
            h.make_node("Relu", ["p"], ["q"], name="loop_b")]


def _foo(inp="x", out="f"):
    return h.make_node("Foo", [inp], [out], name="foo", domain="com.example")


@pytest.mark.parametrize("providers", [["cpu"], ["sim-gpu"]])
def test_if_signature_error_comes_before_cycle(providers):
    m = model([_foo("x", "f")] + _cycle_nodes() + [_bad_if()],
              [vi("c", T.BOOL, []), vi("x", F, [4])], [vi("y", F, [4]), vi("q", F, [4])],
              extra_opsets={"com.example": 3})
    with pytest.raises(ControlFlowError) as ei:
        InferenceSession(m, providers=providers)
    msg = str(ei.value)
    assert "If" in msg and 'graph/node#3 "cond"' in msg
    assert "branches declare different output counts: then_branch has 2, else_branch has 1" in msg


def test_if_branch_dtype_mismatch_is_a_control_flow_error():
    m = model([_bad_if(dtype_mismatch=True)], [vi("c", T.BOOL, []), vi("x", F, [4])], [vi("y", F, None)])
    with pytest.raises(ControlFlowError) as ei:
        InferenceSession(m)
    assert "dtype" in str(ei.value) and "float" in str(ei.value) and "int64" in str(ei.value)


@pytest.mark.parametrize("providers", [["cpu"], ["sim-gpu"]])
def test_cycle_comes_before_unsupported_operator(providers):
    m = model([_foo("x", "f")] + _cycle_nodes(), [vi("x", F, [4])], [vi("q", F, [4]), vi("f", F, [4])],
              extra_opsets={"com.example": 3})
    with pytest.raises(GraphCycleError) as ei:
        InferenceSession(m, providers=providers)
    assert sorted(ei.value.nodes) == ['graph/node#1 "loop_a"', 'graph/node#2 "loop_b"']
    assert 'graph/node#1 "loop_a"' in str(ei.value) and 'graph/node#2 "loop_b"' in str(ei.value)


def _foo_model(shape=(4,)):
    return model([h.make_node("Relu", ["x"], ["r"], name="relu"), _foo("r", "f"),
                  h.make_node("Neg", ["f"], ["y"], name="neg")],
                 [vi("x", F, list(shape))], [vi("y", F, list(shape))], extra_opsets={"com.example": 3})


def test_unsupported_operator_on_cpu_is_a_load_error():
    with pytest.raises(UnsupportedOperatorError) as ei:
        InferenceSession(_foo_model(), providers=["cpu"])
    e = ei.value
    assert (e.node, e.domain, e.op_type, e.opset, e.provider) == (
        'graph/node#1 "foo"', "com.example", "Foo", 3, "cpu")
    assert e.reason
    msg = str(e)
    for part in ('graph/node#1 "foo"', "com.example::Foo", "opset 3", "'cpu'", e.reason):
        assert part in msg


def test_unsupported_operator_on_gpu_request_goes_to_coverage():
    """On a GPU request the terminal-provider rejection is skipped: the op is a decline."""
    with pytest.raises(HeterogeneousPlacementRequired) as ei:
        InferenceSession(_foo_model(), providers=["sim-gpu"], require_gpu=True)
    declines = ei.value.report.declines
    assert [(d.node, d.domain, d.op_type) for d in declines] == [('graph/node#1 "foo"', "com.example", "Foo")]
    assert "com.example::Foo" in ei.value.report.grouped()


def test_op_without_kernel_fails_the_build_whatever_its_shapes():
    """An op no provider has a kernel for does not wait for shapes (SEMANTICS.md 1.3's
    deferral is for support that depends on them): the build fails, listing every such
    op with its count, on cpu, and on a GPU request that falls back to cpu."""
    for providers in (["cpu"], ["sim-gpu"]):
        with pytest.raises(MissingKernelsError) as ei:
            InferenceSession(_foo_model(shape=("N",)), providers=providers)
        e = ei.value
        assert isinstance(e, UnsupportedOperatorError)
        assert e.missing == {"com.example::Foo": 1}
        assert e.node == 'graph/node#1 "foo"' and e.op_type == "Foo"
        assert "com.example::Foo x1" in str(e)


def test_missing_kernels_are_listed_together_with_counts():
    nodes = [h.make_node("Relu", ["x"], ["a"]), _foo("a", "b"), _foo("b", "c"),
             h.make_node("Bar", ["c"], ["y"], domain="com.example", name="bar")]
    m = model(nodes, [vi("x", F, [4])], [vi("y", F, [4])], extra_opsets={"com.example": 3})
    for providers, opts in ((["cpu"], {}), (["sim-gpu"], {"hetero": True})):
        with pytest.raises(MissingKernelsError) as ei:
            InferenceSession(m, providers=providers, **opts)
        assert ei.value.missing == {"com.example::Foo": 2, "com.example::Bar": 1}
        msg = str(ei.value)
        assert "com.example::Foo x2" in msg and "com.example::Bar x1" in msg


# --- the guard ----------------------------------------------------------------------------


def _relu_to_unique(graph):
    """A provider pass that turns the (fully supported) Relu into a host-only Unique."""
    for node in graph.nodes:
        if node.op_type == "Relu":
            node.op_type = "Unique"
            return graph
    return None


@pytest.fixture
def unique_pass():
    passes.register_pass("sim-gpu", _relu_to_unique)
    try:
        yield
    finally:
        passes.unregister_pass("sim-gpu", _relu_to_unique)
    assert _relu_to_unique not in passes._PASSES.get("sim-gpu", [])


def _relu_model():
    return chain(["Relu"], names=["relu"])


def test_guard_fails_closed_when_a_pass_introduces_a_decline(unique_pass):
    with pytest.raises(PlacementError) as ei:
        InferenceSession(_relu_model(), providers=["sim-gpu"], hetero=True)
    assert not isinstance(ei.value, HeterogeneousPlacementRequired)
    assert "guard" in str(ei.value)


def test_guard_follows_the_env(unique_pass, monkeypatch):
    monkeypatch.setenv("HETERO_EXEC_HETERO", "1")
    with pytest.raises(PlacementError):
        InferenceSession(_relu_model(), providers=["sim-gpu"])


def test_pass_decline_without_hetero_falls_back_with_report(unique_pass):
    m = _relu_model()
    sess = InferenceSession(m, providers=["sim-gpu"])
    assert _is_fallback(sess)
    rep = sess.fallback_report
    host = lookup("", "Unique", 17).host_only
    assert rep.grouped() == f'ai.onnx::Unique: host-only kernel: {host} [count=1; examples: graph/node#0 "relu"]'
    # the cpu graph is the one before the GPU passes: Relu, not Unique
    assert rep.assigned_ops == ["ai.onnx::Relu"]
    assert_outputs(sess.run(None, _feed()), ort(m, _feed()))


def _make_cycle(graph):
    """A broken provider pass: feeds the last node's output back into the first."""
    first, last = graph.nodes[0], graph.nodes[-1]
    first.inputs = [last.outputs[0]]
    return graph


def test_a_pass_that_breaks_the_graph_is_not_adopted(caplog):
    passes.register_pass("sim-gpu", _make_cycle)
    try:
        m = chain(["Relu", "Neg"], names=["relu", "neg"])
        with caplog.at_level(logging.WARNING, logger="hetero_exec.placement.passes"):
            sess = InferenceSession(m, providers=["sim-gpu"])
        assert any("not adopted" in r.getMessage() for r in caplog.records)
        assert sess.get_providers() == ["sim-gpu:0"] and sess.fallback_report is None
        assert_outputs(sess.run(None, _feed()), ort(m, _feed()))
    finally:
        passes.unregister_pass("sim-gpu", _make_cycle)


def test_no_pass_no_guard():
    """Control: without the pass the same request is a plain single-provider session."""
    sess = InferenceSession(_relu_model(), providers=["sim-gpu"], hetero=True)
    assert sess.get_providers() == ["sim-gpu:0"] and sess.fallback_report is None


# --- an unavailable gpu -------------------------------------------------------------------


@pytest.fixture
def no_cupy(monkeypatch):
    import hetero_exec.providers.gpu as gpu

    def missing():
        raise ModuleNotFoundError("No module named 'cupy'")

    monkeypatch.setattr(gpu, "_cupy", missing)


def test_unavailable_gpu_falls_back_with_reason(no_cupy, caplog):
    m = _mixed()
    with caplog.at_level(logging.WARNING, logger=DECIDE_LOGGER):
        sess = InferenceSession(m, providers=["gpu"])
    assert _is_fallback(sess)
    rep = sess.fallback_report
    assert rep.requested_provider == "gpu:0"
    assert rep.unavailable and "CuPy is not importable" in rep.unavailable
    assert rep.unavailable in str(rep)
    assert rep.assigned_node_count == 3
    assert any(HINT in r.getMessage() and "CuPy" in r.getMessage() for r in caplog.records)
    assert_outputs(sess.run(None, _feed()), ort(m, _feed()))


def test_unavailable_gpu_with_hetero_still_reports(no_cupy):
    """hetero=True cannot place anything on a GPU that is not there: the session falls
    back with the unavailable reason rather than silently becoming cpu-only."""
    m = _mixed()
    sess = InferenceSession(m, providers=["gpu"], hetero=True)
    assert sess.get_providers() == ["cpu"]
    assert sess.fallback_report is not None and "CuPy is not importable" in sess.fallback_report.unavailable
    assert_outputs(sess.run(None, _feed()), ort(m, _feed()))


def test_unavailable_gpu_required_is_an_error(no_cupy):
    with pytest.raises(HeterogeneousPlacementRequired) as ei:
        InferenceSession(_mixed(), providers=["gpu"], require_gpu=True)
    assert "CuPy is not importable" in ei.value.report.unavailable
    assert "CuPy is not importable" in str(ei.value)


def test_real_gpu_provider_without_cupy_falls_back():
    """Where CuPy is missing, the real gpu provider is unavailable."""
    import importlib.util

    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed here")
    sess = InferenceSession(_mixed(), providers=["gpu"])
    assert _is_fallback(sess) and "CuPy" in sess.fallback_report.unavailable


# --- APIs that need a single device --------------------------------------------------------


def test_io_binding_refused_on_heterogeneous_session():
    sess = InferenceSession(_mixed(), providers=[sim("Neg")], hetero=True)
    assert sess.is_heterogeneous
    with pytest.raises(NotSupportedForHeterogeneous) as ei:
        sess.io_binding()
    assert str(ei.value).startswith("not supported for a heterogeneous session: ")
    assert "io_binding" in str(ei.value)
    # the session stays usable
    assert_outputs(sess.run(None, _feed()), ort(_mixed(), _feed()))


def test_io_binding_on_single_provider_sim_gpu_session():
    m = mlp(2)
    sess = InferenceSession(m, providers=["sim-gpu"], require_gpu=True)
    prov = sess._build.providers[0]
    x = rand(2, 16, seed=5)
    b = sess.io_binding()
    before = prov.bytes_to_device
    b.bind_input("x", x)
    assert prov.bytes_to_device - before == x.nbytes  # copied to the device once, at bind
    b.bind_output("y")
    for _ in range(2):
        sess.run_with_iobinding(b)
    assert prov.bytes_to_device - before == x.nbytes  # not again per run
    h_before = prov.bytes_to_host
    outs = b.copy_outputs_to_cpu()
    assert prov.bytes_to_host - h_before == 2 * 16 * 4
    assert_outputs(outs, ort(m, {"x": x}))
    assert [v.device_name() for v in b.get_outputs()] == ["sim-gpu"]  # OrtValues, on the device
    assert_outputs([v.numpy() for v in b.get_outputs()], ort(m, {"x": x}))


# --- 5. memory: refuse before admission ------------------------------------------------------


def _one_matmul(batch="1"):
    w = rand(16, 16, seed=2)
    return model([h.make_node("MatMul", ["x", "W"], ["y"], name="mm")],
                 [vi("x", F, [int(batch) if batch.isdigit() else batch, 16])],
                 [vi("y", F, [int(batch) if batch.isdigit() else batch, 16])], [init("W", w)])


def test_memory_refused_at_session_creation():
    # need: weights 16*16*4 = 1024 + peak activations x (64) + y (64) = 1152 bytes
    with pytest.raises(MemoryAdmissionError) as ei:
        InferenceSession(_one_matmul(), providers=[("sim-gpu", {"mem_limit": 1000})])
    e = ei.value
    assert (e.segment, e.provider, e.needed, e.free) == ("segment#0", "sim-gpu:0", 1152, 1000)
    msg = str(e)
    for part in ("segment#0", "sim-gpu:0", "1152", "1000"):
        assert part in msg


def test_memory_admitted_when_it_fits():
    m = _one_matmul()
    sess = InferenceSession(m, providers=[("sim-gpu", {"mem_limit": 1152})])
    assert sess.get_providers() == ["sim-gpu:0"]
    assert sess.placement.segments[0].mem_need == 1152
    x = rand(1, 16)
    assert_outputs(sess.run(None, {"x": x}), ort(m, {"x": x}))


def test_memory_resident_weights_accumulate_across_segments():
    """Two sim-gpu segments of one hetero session share the device: the first one's
    weights (1088 B) stay resident, so the second (needs 1344 B) sees 2000-1088 free."""
    m = mlp(2)
    sess = InferenceSession(m, providers=[sim("Relu", mem_limit=2432)], hetero=True)
    assert [s.mem_need for s in sess.placement.segments if s.provider.is_device] == [1344, 1344]
    with pytest.raises(MemoryAdmissionError) as ei:
        InferenceSession(m, providers=[sim("Relu", mem_limit=2000)], hetero=True)
    e = ei.value
    assert (e.segment, e.provider, e.needed, e.free) == ("segment#2", "sim-gpu:0", 1344, 912)


def test_unbounded_symbol_is_an_error_with_explicit_mem_limit():
    with pytest.raises(UnboundedSymbolError) as ei:
        InferenceSession(_one_matmul("N"), providers=[("sim-gpu", {"mem_limit": 10**6})])
    assert ei.value.symbol == "N"
    assert "'N'" in str(ei.value)


def test_bounded_symbol_is_admitted():
    m = _one_matmul("N")
    sess = InferenceSession(m, providers=[("sim-gpu", {"mem_limit": 10**6})], dim_bounds={"N": 8})
    # weights 1024 + x (8*16*4) + y (8*16*4)
    assert sess.placement.segments[0].mem_need == 1024 + 512 + 512
    x = rand(5, 16)
    assert_outputs(sess.run(None, {"x": x}), ort(m, {"x": x}))


def test_bound_too_large_is_refused():
    with pytest.raises(MemoryAdmissionError) as ei:
        InferenceSession(_one_matmul("N"), providers=[("sim-gpu", {"mem_limit": 10**6})],
                         dim_bounds={"N": 10**4})
    assert ei.value.needed == 1024 + 2 * 10**4 * 16 * 4 and ei.value.free == 10**6


def test_unbounded_symbol_in_hetero_segment():
    m = model([h.make_node("Relu", ["x"], ["r"], name="relu"), h.make_node("Neg", ["r"], ["y"], name="neg")],
              [vi("x", F, ["B", 4])], [vi("y", F, ["B", 4])])
    with pytest.raises(UnboundedSymbolError) as ei:
        InferenceSession(m, providers=[sim("Neg", mem_limit=4096)], hetero=True)
    assert ei.value.symbol == "B"
    sess = InferenceSession(m, providers=[sim("Neg", mem_limit=4096)], hetero=True, dim_bounds={"B": 4})
    x = rand(3, 4)
    assert_outputs(sess.run(None, {"x": x}), ort(m, {"x": x}))
