"""The torch exports of the model suites (tests/exports/: BART, T5, Marian, Whisper, each
by the TorchScript and the dynamo exporter) on stage actors, under the mixed placement of
tests/test_model_suites_simgpu.py: strict sim-gpu with Softmax declined, then cpu. Each
must match onnxruntime. The TorchScript exports failed here with a host shape value read
by a device kernel of the next segment (`exec.plan.Compiler._device_outputs`)."""

from __future__ import annotations

import logging

import pytest

from tests.model_suites import CASES, run_model_case

pytestmark = pytest.mark.ray

EXPORTS = sorted(name for name, case in CASES.items() if case.kind == "exports")


def test_both_exporters_of_every_architecture_are_here():
    archs = {name.split("/")[1].rsplit("_", 1)[0] for name in EXPORTS}
    assert archs == {"bart", "t5", "marian", "whisper"}
    assert EXPORTS == sorted(f"exports/{a}_{e}" for a in archs for e in ("ts", "dynamo"))


def _device_segments_on_stage_actors(sess) -> None:
    providers = [s.provider_name for s in sess.placement.segments]
    assert providers.count("sim-gpu:0") >= 2 and "cpu" in providers, providers
    assert len(sess.stage_actors) == len(sess.placement.stages) >= 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case_name", EXPORTS)
def test_export_mixed_on_ray_matches_onnxruntime(ray_session, case_name):
    logging.disable(logging.WARNING)  # fallback and placement reports
    try:
        run_model_case(CASES[case_name], providers=[("sim-gpu", {"exclude_ops": ["Softmax"]}),
                                                    "cpu"], hetero=True, executor="ray",
                       inspect=_device_segments_on_stage_actors)
    finally:
        logging.disable(logging.NOTSET)
