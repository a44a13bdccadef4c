"""hetero_exec: run ONNX models across CPU and GPU execution providers and Ray actors.

``import hetero_exec as ort`` runs everyday onnxruntime code: the names below are
onnxruntime's, with hetero_exec's own options beside them.
"""

import logging

from hetero_exec import errors
from hetero_exec.errors import HeteroExecError
from hetero_exec.exec.binding import IOBinding
from hetero_exec.logs import set_default_logger_severity, set_default_logger_verbosity
from hetero_exec.modelmeta import ModelMetadata
from hetero_exec.options import ExecutionMode, GraphOptimizationLevel, SessionOptions
from hetero_exec.ortvalue import OrtValue
from hetero_exec.provider_names import get_all_providers, get_available_providers, get_device
from hetero_exec.run_options import RunOptions
from hetero_exec.runtime_info import show_runtime
from hetero_exec.session import InferenceSession, NodeArg

logging.getLogger(__name__).addHandler(logging.NullHandler())

__version__ = "0.1.0"
version = __version__

__all__ = [
    "InferenceSession", "SessionOptions", "RunOptions", "NodeArg", "ModelMetadata", "OrtValue",
    "IOBinding", "GraphOptimizationLevel", "ExecutionMode", "get_available_providers",
    "get_all_providers", "get_device", "set_default_logger_severity",
    "set_default_logger_verbosity", "HeteroExecError", "errors", "show_runtime", "__version__",
]
