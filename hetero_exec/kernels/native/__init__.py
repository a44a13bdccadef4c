"""The C kernels: the cpu provider's own fast paths, like cuDNN's are CuPy's.

numpy runs one pass over memory per operation and has no fused multiply-add, so an op
that is a chain of small element-wise steps (a depthwise convolution is a sum of K*K
scaled shifted copies, an activation after a product a dozen passes) runs at a fraction
of the machine's speed however it is written. The C library (``*.c`` here, built by the
package's build into one shared library per instruction-set variant) does those ops:
float32 products on packed weights, convolutions, depthwise convolutions, MaxPool,
softmax, row and channel norms, and activations after a product or alone.

This package is the one native mechanism: library.py loads the variant the CPU runs
(or says why none), activation.py maps an activation to the kernels' arguments, and
packed_gemm.py, plane_kernels.py, row_kernels.py and blas_split.py wrap the kernels.
The array-module kernels (kernels/*.py on numpy) stay the definition: they run where
the library does not (float64, other array modules, an unbuilt tree) and are what these
are tested against (tests/kernels/).

``HETERO_EXEC_NATIVE=0`` (or ``HETERO_EXEC_PACKED_GEMM=0``, ``HETERO_EXEC_ISA=off``)
turns the library off: every op then keeps its numpy path.
"""

from __future__ import annotations

import os

from hetero_exec.kernels.native.activation import ACT_CODES, ACT_DEFAULTS

__all__ = ["ACT_CODES", "ACT_DEFAULTS", "ENV", "switched_off"]

#: set to "0" (or "false", "off", "no") to run the numpy paths only
ENV = "HETERO_EXEC_NATIVE"


def switched_off(env: str) -> bool:
    """Whether the environment variable ``env`` turns a fast path off ("0", "false",
    "off" or "no")."""
    return os.environ.get(env, "").strip().lower() in ("0", "false", "off", "no")
