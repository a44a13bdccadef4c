"""Kernels written once against an array module (numpy on cpu, cupy on gpu).

Modules here register into `registry` by decorator; `registry.lookup` imports them all
on first use.
"""

from hetero_exec.kernels.registry import KernelDef, kernel, lookup, registered

__all__ = ["KernelDef", "kernel", "lookup", "registered"]
