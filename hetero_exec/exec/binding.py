"""ORT-style IO binding for a single-provider session: inputs and outputs stay on the
provider's device between runs (no host round trip). Heterogeneous sessions refuse it
(SEMANTICS.md section 2)."""

from __future__ import annotations

from typing import Any

import numpy as np


class IOBinding:
    """>>> b = sess.io_binding(); b.bind_input("x", x); b.bind_output("y")
    >>> sess.run_with_iobinding(b); y = b.copy_outputs_to_cpu()[0]"""

    def __init__(self, session: Any):
        self._session = session
        self._provider = session._build.providers[0]
        self._inputs: dict[str, Any] = {}
        self._outputs: list[str] = []
        self._results: list[Any] = []

    def bind_input(self, name: str, value: Any) -> None:
        """Bind an array; host arrays are copied to the device once, here."""
        if isinstance(value, np.ndarray):
            value = self._provider.to_device(value)
        self._inputs[name] = value

    bind_cpu_input = bind_input

    def bind_output(self, name: str, device_type: str | None = None, device_id: int = 0) -> None:
        self._session._output_names([name])
        self._outputs.append(name)

    def clear_binding_inputs(self) -> None:
        self._inputs.clear()

    def clear_binding_outputs(self) -> None:
        self._outputs.clear()

    def _run(self) -> None:
        names = self._outputs or list(self._session.graph.outputs)
        self._results = self._session._executor.run(names, self._inputs, on_device=True)

    def get_outputs(self) -> list[Any]:
        """The outputs as the provider's arrays (device arrays on a GPU)."""
        return list(self._results)

    def copy_outputs_to_cpu(self) -> list[np.ndarray]:
        return [self._provider.to_host(v) for v in self._results]
