"""hetero_exec: run ONNX models across CPU and GPU execution providers and Ray actors."""

import logging

from hetero_exec import errors
from hetero_exec.errors import HeteroExecError
from hetero_exec.session import InferenceSession, NodeArg, SessionOptions

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = ["InferenceSession", "SessionOptions", "NodeArg", "HeteroExecError", "errors"]
__version__ = "0.1.0"
