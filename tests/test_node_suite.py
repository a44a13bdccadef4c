"""The ONNX backend node suite (1884 cases with onnx 1.23), built from onnx's own case
definitions. Known failures are listed, each with its reason, in
node_suite_known_failures.txt; that list may only shrink (a listed case that passes
fails the run: strict xfail). Cases whose output is a random draw are checked by what
a draw must be instead (`is_random_output`): compared exactly, they pass by chance."""

from __future__ import annotations

import pytest

from tests.backend_cases import is_random_output, known_failures, node_cases, run_case

CASES = node_cases()
KNOWN = known_failures()


def _params():
    for name in sorted(CASES):
        xfail = name in KNOWN and not is_random_output(KNOWN[name])
        marks = [pytest.mark.xfail(reason=KNOWN[name], strict=True)] if xfail else []
        yield pytest.param(name, id=name, marks=marks)


@pytest.mark.parametrize("case_name", list(_params()))
def test_node_case_cpu(case_name: str) -> None:
    # three runs: plain, binding a plan to the input shapes, replaying it (exec/bound.py)
    run_case(CASES[case_name], providers=["cpu"], random_output=is_random_output(KNOWN.get(case_name)),
             repeat=3)


def test_known_failures_are_real_cases() -> None:
    assert set(KNOWN) <= set(CASES), sorted(set(KNOWN) - set(CASES))


def test_suite_size() -> None:
    assert len(CASES) == 1884
