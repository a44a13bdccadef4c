"""onnxruntime's contrib ops (the ``com.microsoft`` and ``com.microsoft.nchwc`` domains,
and SimplifiedLayerNormalization, which onnxruntime registers in the default domain), as
its operator documentation defines them. Each module registers its kernels into `kernels.registry` and its ops' onnx schemas
(`schemas.define`) at import; importing this package imports every module in it.
"""

from __future__ import annotations

import importlib
import logging
import pkgutil

log = logging.getLogger(__name__)

_LOADED = False


def ensure_schemas() -> None:
    """Import every contrib module once, so their schemas are registered with onnx
    (before a model that uses them meets onnx's checker)."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_"):
            continue
        try:
            importlib.import_module(f"{__name__}.{info.name}")
        except Exception:  # one broken family must not take the others down
            log.exception("contrib kernel module %s failed to import", info.name)


ensure_schemas()
