"""One decoder step over a session's compiled segments, with feeds that already live
where they are read: the cache buffers on the provider of their layer's attention,
placeholders (shape-only past inputs) never moved. Each segment's argument sources are
bound once; a step is then a list of slot reads, the segments' run loops, and the moves
at real seams (hidden states between providers), nothing per context length.
"""

from __future__ import annotations

from typing import Any, Mapping

from hetero_exec.exec.bound import ShapeBoundPlans
from hetero_exec.exec.chain import move_value
from hetero_exec.exec.executor import execute
from hetero_exec.kernels._threads import intra_op_threads, run_threads


class StepRunner:
    def __init__(self, executor: Any, resident: Mapping[str, Any], passthrough: set[str],
                 output: str, threads: int | None = None):
        """``resident``: feed name -> the provider it lives on; ``passthrough``: feeds
        handed to any provider as they are (zero-stride placeholders read for shapes);
        ``output``: the one output a step returns, where it was made."""
        # each plan bound to the input shapes that repeat (a fixed-shape decode step)
        self.segments = [(s.provider, s.plan, ShapeBoundPlans(s.plan)) for s in executor.segments]
        self.output = output
        self.threads = threads
        self._resident = dict(resident)
        self._passthrough = set(passthrough)
        self.output_provider = None
        for prov, plan, _ in self.segments:
            if output in plan.output_names:
                self.output_provider = prov
        if self.output_provider is None:
            raise ValueError(f"no segment makes {output!r}")

    def run(self, feeds: Mapping[str, Any]) -> Any:
        """``output`` on its provider (a device array there, a host array on cpu)."""
        with intra_op_threads(self.threads), run_threads():
            return self._run(feeds)

    def _run(self, feeds: Mapping[str, Any]) -> Any:
        env = dict(feeds)
        where: dict[str, Any] = dict(self._resident)
        passthrough = self._passthrough
        for prov, plan, bound in self.segments:
            args = []
            for name, _slot in plan.input_slots:
                v = env.get(name)
                if v is not None and name not in passthrough and where.get(name) is not prov:
                    v = move_value(v, where.get(name), prov)
                args.append(v)
            outs = execute(bound.plan_for(args), args)
            for name, v in zip(plan.output_names, outs):
                env[name] = v
                where[name] = prov
        return env[self.output]
