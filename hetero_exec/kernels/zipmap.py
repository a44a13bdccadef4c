"""ai.onnx.ml ZipMap: class scores -> one {label: score} map per row (scikit-learn
classifiers' probability output). Values are Python floats, as onnxruntime returns them."""

from __future__ import annotations

import numpy as np

from hetero_exec.kernels.registry import kernel

_HOST = "builds Python dicts (a sequence of maps)"


@kernel("ZipMap", since=1, domain="ai.onnx.ml", host_only=_HOST)
def ZipMap(xp, X, *, classlabels_int64s=None, classlabels_strings=None):
    if (classlabels_int64s is None) == (classlabels_strings is None):
        raise ValueError("ZipMap needs exactly one of classlabels_int64s, classlabels_strings")
    labels = [int(c) for c in classlabels_int64s] if classlabels_int64s is not None \
        else list(classlabels_strings)
    rows = np.asarray(X, dtype=np.float32)
    rows = rows.reshape(1, -1) if rows.ndim == 1 else rows
    if rows.ndim != 2 or rows.shape[1] != len(labels):
        raise ValueError(f"ZipMap: input shape {list(np.shape(X))} does not match "
                         f"{len(labels)} class labels")
    return ([dict(zip(labels, map(float, row))) for row in rows],)
