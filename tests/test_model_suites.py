"""The backend suite's other folders (simple, pytorch-converted, pytorch-operator, real),
with their own known-failure list that may only shrink."""

from __future__ import annotations

import os

import pytest

from tests.backend_cases import known_failures
from tests.model_suites import KINDS, collect, run_model_case

KNOWN = known_failures(os.path.join(os.path.dirname(__file__), "model_suites_known_failures.txt"))
CASES = {f"{kind}/{c.name}": c for kind in KINDS for c in collect(kind)}


def _params():
    for name in sorted(CASES):
        marks = [pytest.mark.xfail(reason=KNOWN[name], strict=True)] if name in KNOWN else []
        if CASES[name].kind == "real":
            marks.append(pytest.mark.slow)
        yield pytest.param(name, id=name, marks=marks)


@pytest.mark.parametrize("case_name", list(_params()))
def test_model_case_cpu(case_name: str) -> None:
    run_model_case(CASES[case_name], providers=["cpu"])
