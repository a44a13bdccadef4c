"""Per-node timing (for the cost model's calibration) and Chrome-trace spans."""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Sequence

from hetero_exec.exec.plan import RunPlan


def timed_execute(plan: RunPlan, inputs: Sequence[Any]) -> tuple[list[Any], list[tuple[Any, float]]]:
    """Run a plan step by step, timing each step: (outputs, [(node, seconds), ...]).

    Slower than `execute` (no fast path); for profiling, never on the hot path.
    """
    vals = plan.template.copy()
    for (_, s), v in zip(plan.input_slots, inputs):
        if v is not None:
            vals[s] = v
    timings = []
    for step in plan.steps:
        xp = step.xp or plan.xp
        args = [vals[i] for i in step.inputs]
        t = time.perf_counter()
        if step.wants_scope:
            outs = step.fn(xp, *args, scope=vals, **step.kwargs)
        else:
            outs = step.fn(xp, *args, **step.kwargs)
        timings.append((step.node, time.perf_counter() - t))
        for s, v in zip(step.outputs, outs):
            vals[s] = v
    return [vals[s] for s in plan.output_slots], timings


class ChromeTrace:
    """Collects complete events ("ph": "X") and writes the Chrome trace JSON."""

    def __init__(self, prefix: str = "hetero_exec_profile"):
        self.prefix = prefix
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        self._lanes: dict[str, int] = {}

    def lane(self, name: str) -> int:
        with self._lock:
            if name not in self._lanes:
                self._lanes[name] = len(self._lanes) + 1
            return self._lanes[name]

    def span(self, name: str, lane: str, start: float, end: float, **args: Any) -> None:
        tid = self.lane(lane)
        ev = {"name": name, "ph": "X", "pid": os.getpid(), "tid": tid,
              "ts": (start - self._t0) * 1e6, "dur": (end - start) * 1e6, "args": args}
        with self._lock:
            self.events.append(ev)

    def write(self, path: str | None = None) -> str:
        path = path or f"{self.prefix}_{time.strftime('%Y-%m-%d_%H-%M-%S')}.json"
        meta = [{"name": "thread_name", "ph": "M", "pid": os.getpid(), "tid": tid, "args": {"name": lane}}
                for lane, tid in self._lanes.items()]
        with open(path, "w") as f:
            json.dump({"traceEvents": meta + self.events, "displayTimeUnit": "ms"}, f)
        return os.path.abspath(path)
