"""The backend suite's other folders (simple, pytorch-converted, pytorch-operator, real)
and the torch exports (exports/), with their own known-failure list that may only
shrink."""

from __future__ import annotations

import pytest

from tests.model_suites import CASES, case_params, run_model_case


@pytest.mark.parametrize("case_name", case_params())
def test_model_case_cpu(case_name: str) -> None:
    run_model_case(CASES[case_name], providers=["cpu"])
