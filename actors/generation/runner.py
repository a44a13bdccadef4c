"""A stage's step: `hetero_exec.genai.runner.StepRunner` over the stage's compiled
segments, returning every value later stages read (not only the logits), each where
it was made (`where`), so the stage moves to the host only what it sends."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from hetero_exec.genai.runner import StepRunner
from hetero_exec.kernels._threads import intra_op_threads, run_threads


class StageRunner(StepRunner):
    def __init__(self, executor: Any, resident: Mapping[str, Any], passthrough: set[str],
                 outputs: Sequence[str], threads: int | None = None):
        super().__init__(executor, resident, passthrough, outputs[-1], threads)
        self.outputs = list(outputs)
        self.where: dict[str, Any] = {}
        for prov, plan, _ in self.segments:
            for name in plan.output_names:
                if name in self.outputs:
                    self.where[name] = prov
        missing = [n for n in self.outputs if n not in self.where]
        if missing:
            raise ValueError(f"no segment of the stage makes {missing}")

    def run(self, feeds: Mapping[str, Any]) -> dict[str, Any]:  # type: ignore[override]
        with intra_op_threads(self.threads), run_threads():
            env = self.values(feeds)
            return {n: env[n] for n in self.outputs}
