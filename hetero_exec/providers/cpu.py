"""The cpu provider: NumPy arrays, every kernel in the table."""

from __future__ import annotations

from hetero_exec.providers.base import Provider


class CpuProvider(Provider):
    kind = "cpu"
