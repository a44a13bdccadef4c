"""The backend suite's model folders (simple, pytorch-converted, pytorch-operator, real)
and the torch exports (exports/) under mixed placement: strict sim-gpu first, cpu last,
hetero on. The op type of the middle node is excluded from the GPU, so models of two
nodes or more run as several segments with seams (single-node models run on sim-gpu
alone); the exports exclude Softmax, so every attention splits its layer into device,
cpu, device (TorchScript exports compute shape values on the device beside the
activations, and the next device segment reads them). Same known-failure list as on cpu
(test_model_suites.py)."""

from __future__ import annotations

import logging

import onnx
import pytest

from tests.model_suites import CASES, case_params, run_model_case


def excluded_op(case_name: str) -> str:
    """The op type the mixed-placement run keeps off the GPU."""
    case = CASES[case_name]
    return "Softmax" if case.kind == "exports" else _middle_op(case.model_path)


def _middle_op(path: str) -> str:
    nodes = onnx.load(path, load_external_data=False).graph.node
    return nodes[len(nodes) // 2].op_type if len(nodes) >= 2 else ""


@pytest.mark.parametrize("case_name", case_params())
def test_model_case_mixed_simgpu(case_name: str) -> None:
    case = CASES[case_name]
    excluded = excluded_op(case_name)
    gpu = ("sim-gpu", {"exclude_ops": [excluded] if excluded else []})
    logging.disable(logging.WARNING)  # fallback and placement reports
    try:
        run_model_case(case, providers=[gpu, "cpu"], hetero=True)
    finally:
        logging.disable(logging.NOTSET)
