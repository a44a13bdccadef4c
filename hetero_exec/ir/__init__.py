"""IR and loading."""

from hetero_exec.ir.graph import Dim, Graph, Node, Shape, Value
from hetero_exec.ir.load import load, read_model

__all__ = ["Dim", "Graph", "Node", "Shape", "Value", "load", "read_model"]
