"""Every lowering, registered by importing its module (exec/program/registry.py)."""

from hetero_exec.exec.program import (  # noqa: F401
    lower_attention,
    lower_elementwise,
    lower_linalg,
    lower_movement,
    lower_norm,
    lower_quant,
    lower_reduce,
)
