"""The interpreter's record (native/program.h's ``he_op``) as a numpy structured dtype,
laid out from the offsets and sizes the library exports: no copy of the C struct here.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Sequence

import numpy as np

from hetero_exec.kernels.native import library


def codes() -> dict[str, int]:
    """The library's constants (record layout, op, unary, binary and reduce codes)."""
    library.lib()
    return library._state["constants"]


@lru_cache(maxsize=1)
def record_dtype() -> np.dtype:
    c = codes()
    nd, nt, np_, nf = c["HE_ND"], c["HE_NT"], c["HE_NP"], c["HE_NF"]
    tensor = np.dtype({"names": ["buf", "dtype", "off", "st"],
                       "formats": [np.int32, np.int32, np.int64, (np.int64, nd)],
                       "offsets": [c["HE_OFF_T_BUF"], c["HE_OFF_T_DTYPE"], c["HE_OFF_T_OFF"],
                                   c["HE_OFF_T_ST"]],
                       "itemsize": c["HE_TENSOR_SIZE"]})
    return np.dtype({"names": ["op", "code", "ndim", "parts", "dims", "t", "p", "f"],
                     "formats": [np.int32, np.int32, np.int32, np.int32, (np.int64, nd),
                                 (tensor, nt), (np.int64, np_), (np.float64, nf)],
                     "offsets": [c["HE_OFF_OP"], c["HE_OFF_CODE"], c["HE_OFF_NDIM"],
                                 c["HE_OFF_PARTS"], c["HE_OFF_DIMS"], c["HE_OFF_T"],
                                 c["HE_OFF_P"], c["HE_OFF_F"]],
                     "itemsize": c["HE_OP_SIZE"]})


def pack(records: Sequence[dict[str, Any]]) -> np.ndarray:
    """The records as one C array of ``he_op`` (tensors not given: buffer -1)."""
    out = np.zeros(len(records), record_dtype())
    out["t"]["buf"] = -1
    for i, r in enumerate(records):
        row = out[i]
        row["op"], row["code"], row["ndim"], row["parts"] = r["op"], r["code"], r["ndim"], r["parts"]
        row["dims"][:len(r["dims"])] = r["dims"]
        for k, t in enumerate(r["t"]):
            if t is None:
                continue
            buf, dt, off, st = t
            row["t"][k]["buf"], row["t"][k]["dtype"], row["t"][k]["off"] = buf, dt, off
            row["t"][k]["st"][:len(st)] = st
        row["p"][:len(r["p"])] = r["p"]
        row["f"][:len(r["f"])] = r["f"]
    return out
