"""Shared by the quantized-contrib tests: run a model on onnxruntime, on our cpu and on
strict sim-gpu, and say where each op was placed."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import onnx

import hetero_exec
from tests._models import ort_run

MS = "com.microsoft"
SIM = ("sim-gpu", {"strict": True})


def placed(sess: Any, op_type: str) -> set[str]:
    """The kinds of provider the nodes of ``op_type`` were placed on."""
    return {seg.provider.kind for seg in sess.placement.segments
            for n in seg.nodes if n.op_type == op_type}


def compare(m: onnx.ModelProto, feed: Mapping[str, Any], *, device_ops: Sequence[str] = (),
            rtol: float = 1e-5, atol: float = 1e-5, providers: Sequence[Any] | None = None,
            weights_7bit: bool = False) -> list[np.ndarray]:
    """Outputs of ``m`` on our cpu and on strict sim-gpu (then cpu) against onnxruntime's
    (`ort_run`: ``weights_7bit`` says its int8 weights keep it exact on every host);
    each op of ``device_ops`` must have been placed on sim-gpu."""
    want = ort_run(m, feed, weights_7bit=weights_7bit)
    data = m.SerializeToString()
    runs = [["cpu"], [SIM, "cpu"]] if providers is None else [list(providers)]
    for provs in runs:
        sess = hetero_exec.InferenceSession(data, providers=provs)
        got = sess.run(None, dict(feed))
        for i, (g, w) in enumerate(zip(got, want)):
            g, w = np.asarray(g), np.asarray(w)
            assert g.shape == w.shape and g.dtype == w.dtype, (provs, i, g.shape, w.shape, g.dtype)
            np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=rtol,
                                       atol=atol, err_msg=f"output {i} on {provs}")
        if provs[0] is SIM:
            for op in device_ops:
                assert placed(sess, op) == {"sim-gpu"}, (op, placed(sess, op))
    return want
