"""onnxruntime's contrib operators (com.microsoft and com.microsoft.nchwc domains).

Importing the package registers its kernels (the registry imports it with the other
kernel families)."""

from hetero_exec.kernels.contrib import nchwc, quant_linear, quant_matmul, quant_schemas  # noqa: F401
