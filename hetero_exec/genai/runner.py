"""One decoder step over a session's compiled segments, with feeds that already live
where they are read: the cache buffers on the provider of their layer's attention,
placeholders (shape-only past inputs) never moved. Each segment's argument sources are
bound once; a step is then a list of slot reads, the segments' run loops, and the moves
at real seams (hidden states between providers), nothing per context length.

A decode step at a fixed shape reads the same arrays every time (the generator writes
the new token, its position and the mask into them in place): `StepRunner.fixed` binds
those arrays once, and each call then runs the plan bound to their shapes (a program,
where the C library runs it) with nothing else to look up.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from hetero_exec.exec.bound import ShapeBoundPlans
from hetero_exec.exec.chain import move_value
from hetero_exec.kernels._threads import intra_op_threads, run_threads


class StepRunner:
    def __init__(self, executor: Any, resident: Mapping[str, Any], passthrough: set[str],
                 output: str, threads: int | None = None):
        """``resident``: feed name -> the provider it lives on; ``passthrough``: feeds
        handed to any provider as they are (zero-stride placeholders read for shapes);
        ``output``: the one output a step returns, where it was made."""
        # each plan bound to the input shapes that repeat (a fixed-shape decode step)
        # (a decode step binds once per width: generator.decode_width's few dozen at most)
        self.segments = [(s.provider, s.plan, ShapeBoundPlans(s.plan, max_bound=64))
                         for s in executor.segments]
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

    def fixed(self, feeds: Mapping[str, Any]) -> Callable[[], Any]:
        """A step over these very arrays (their contents change between calls, never
        their shapes): `run` without building its arguments each time."""
        if len(self.segments) != 1 or self.segments[0][0].is_device:
            return lambda: self.run(feeds)
        _prov, plan, bound = self.segments[0]
        args = [feeds.get(name) for name, _slot in plan.input_slots]
        at = plan.output_names.index(self.output)
        threads = self.threads
        state: dict[str, Any] = {}

        def step() -> Any:
            call = state.get("direct")
            if call is not None:
                return call()
            with intra_op_threads(threads), run_threads():
                outs = bound.run(args)
                p = bound.plan_for(args)
                if p is not plan:  # bound: it stays so for these shapes
                    state["direct"] = _direct(p, args, plan.output_slots[at])
                return outs[at]

        return step

    def _run(self, feeds: Mapping[str, Any]) -> Any:
        return self.values(feeds)[self.output]

    def values(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        """Every value of a step by name (the feeds and each segment's outputs), each on
        the provider that made it; call within `run`'s thread settings."""
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
            outs = bound.run(args)
            for name, v in zip(plan.output_names, outs):
                env[name] = v
                where[name] = prov
        return env


def _direct(plan: Any, args: list[Any], out_slot: int) -> Callable[[], Any] | None:
    """The plan's one program region called straight over ``args``, when the whole plan
    is that region and it drives no BLAS (which runs inside `run_threads` only)."""
    from hetero_exec.exec.program.run import Region

    if len(plan.steps) != 1 or not isinstance(plan.steps[0].fn, Region):
        return None
    st = plan.steps[0]
    region = st.fn
    if region.program.uses_blas or out_slot not in st.outputs:
        return None
    by_slot = {slot: v for (_, slot), v in zip(plan.input_slots, args)}
    if any(s not in by_slot for s in st.inputs):
        return None
    return region.direct([by_slot[s] for s in st.inputs], st.outputs.index(out_slot))
