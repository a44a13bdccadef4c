"""The ONNX backend node suite on sim-gpu with the GPU required, over the cases the GPU
claims: a case is claimed when `InferenceSession(model, providers=["sim-gpu"],
require_gpu=True)` does not raise HeterogeneousPlacementRequired. Every claimed case
must pass as on cpu (the same known-failures list, plus sim-gpu's own, strict xfail);
the others are skipped with the GPU's reasons.

sim-gpu runs strict here (its default): kernels get CuPy's namespace and device arrays
with CuPy's boundaries (`hetero_exec.providers.sim_array`), so a claimed case that
passes here does not convert device data to the host behind the plan's back."""

from __future__ import annotations

import functools
import logging
import os
import re

import pytest

from tests.backend_cases import (
    assert_draws,
    assert_similar,
    is_random_output,
    known_failures,
    node_cases,
    to_value,
)

CASES = node_cases()
#: cases that fail on the GPU's arrays only (CuPy keeps float16 where numpy widens...)
SIMGPU_KNOWN = known_failures(os.path.join(os.path.dirname(__file__),
                                           "node_suite_simgpu_known_failures.txt"))
KNOWN = {**known_failures(), **SIMGPU_KNOWN}

#: every reason the GPU capability table may give for declining a node-suite case
DECLINE_REASONS = re.compile(
    r"dtype \S+ is not available in CuPy"
    r"|host-only kernel: .+"
    r"|string tensors are not supported on the GPU"
    r"|(sequence|map|optional) values are not supported on the GPU")

#: the GPU must claim at least this many of the 1884 cases (1629 with onnx 1.23: the 56
#: casts and quantizations whose *output* dtype CuPy lacks, float8/int4/bfloat16..., are
#: declined since strict mode showed them failing on device arrays)
MIN_CLAIMED = 1620


@functools.lru_cache(maxsize=1)
def claims() -> tuple[dict, dict]:
    """(claimed: name -> session, declined: name -> FallbackReport), built once."""
    from hetero_exec import InferenceSession
    from hetero_exec.errors import HeterogeneousPlacementRequired

    claimed, declined = {}, {}
    logging.disable(logging.WARNING)
    try:
        for name in sorted(CASES):
            try:
                claimed[name] = InferenceSession(CASES[name].model, providers=["sim-gpu"],
                                                 require_gpu=True)
            except HeterogeneousPlacementRequired as e:
                declined[name] = e.report
            except Exception as e:  # noqa: BLE001 - reported by the case's own test
                claimed[name] = e
    finally:
        logging.disable(logging.NOTSET)
    return claimed, declined


def _params():
    for name in sorted(CASES):
        xfail = name in KNOWN and not is_random_output(KNOWN[name])
        marks = [pytest.mark.xfail(reason=KNOWN[name], strict=True)] if xfail else []
        yield pytest.param(name, id=name, marks=marks)


@pytest.mark.parametrize("case_name", list(_params()))
def test_node_case_simgpu(case_name: str) -> None:
    claimed, declined = claims()
    if case_name in declined:
        pytest.skip(f"not claimed by the GPU: {declined[case_name].grouped()}")
    sess = claimed.pop(case_name)  # each session runs once; free it afterwards
    if isinstance(sess, BaseException):
        raise sess
    assert sess.get_providers() == ["sim-gpu:0"] and sess.fallback_report is None
    case = CASES[case_name]
    inputs_decl = [i.name for i in case.model.graph.input]
    outputs_decl = [o.name for o in case.model.graph.output]
    for inputs, expected in case.data_sets:
        feed = dict(zip(inputs_decl, [to_value(i) for i in inputs]))
        got = sess.run_outputs(outputs_decl, feed)
        expected = [to_value(e) for e in expected]
        assert len(got) == len(expected)
        for name, e, g in zip(outputs_decl, expected, got):
            if is_random_output(KNOWN.get(case_name)):
                assert_draws(e, g, where=f"output {name!r}")
            else:
                assert_similar(e, g, case.rtol, case.atol, where=f"output {name!r}")


def test_claimed_case_count(capsys) -> None:
    claimed, declined = claims()
    n_claimed = len(CASES) - len(declined)
    with capsys.disabled():
        print(f"\nsim-gpu claims {n_claimed} of {len(CASES)} node-suite cases "
              f"({len(declined)} declined)")
    assert n_claimed >= MIN_CLAIMED
    # the GPU declines only for the reasons its capability table gives
    for name, report in declined.items():
        assert report.requested_provider == "sim-gpu:0"
        assert report.declines and report.unavailable is None, name
        for d in report.declines:
            assert DECLINE_REASONS.fullmatch(d.reason), f"{name}: {d.node} {d.op_type}: {d.reason}"


def test_float_cases_are_claimed() -> None:
    """Plain float32 element-wise and NN cases must never be declined."""
    _, declined = claims()
    for name in ("test_add", "test_relu", "test_conv_with_strides_padding", "test_matmul_2d",
                 "test_softmax_axis_0", "test_if", "test_loop11"):
        assert name in CASES and name not in declined, name
