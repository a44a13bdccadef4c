"""Pipeline stages: contiguous runs of a plan's segments, each run by one actor.

A mixed plan often alternates devices: a GPU that declines a handful of op types
leaves many small cpu segments between its own. Running each segment on its own Ray
actor pays a hop (a task, a copy, milliseconds) at every seam, where onnxruntime
copies in process. So segments are grouped into *stages*: a stage holds at most one
device, and the cpu segments beside that device's segments run on the same actor,
with in-process seam moves. A cut between stages costs a Ray hop (`HopModel`: a fixed
cost per task plus bytes over bandwidth) but lets the stages work on different
requests at once; the planner cuts only where that shortens the pipeline *period*:
the slowest stage with its hop, or, when the host's cores are the limit, all the host
work of one request (cpu and emulated-device compute, and every hop) over the cores.
That second bound is what keeps a 2-core laptop from paying hops for stages that could
never run at once.

Constraints, in order of strength:
* each stage holds at most one device provider;
* each device is in one stage (one actor per device), unless the plan interleaves
  two devices' segments, where that cannot hold; then a device spans several stages;
* a cut never falls between two segments of a device that is whole in one stage.

``stages`` (the session option) is ``"auto"`` (the cuts that minimise the period, the
fewest stages among near-equal periods), an int K (the best K-stage split), or a
list of cuts: the segment indices at which a new stage starts.

>>> from hetero_exec.placement.stages import cut_positions
>>> cut_positions([[0, 1], [2], [3, 4]])
[2, 3]
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

from hetero_exec.errors import PlacementError
from hetero_exec.placement.sizes import cost_bounds, value_bytes

log = logging.getLogger(__name__)

#: ``stages="auto"`` keeps the fewest stages whose period is within this of the best
AUTO_TOLERANCE = 0.05


@dataclass(frozen=True)
class HopModel:
    """What a cut between two stages costs per request: one Ray task and its seam bytes.

    ``task_s`` is the fixed cost of an actor task (driver, raylet, worker), calibrated on
    the cluster at hand by `actors.hop_cost`; ``bytes_per_s`` the seam bandwidth
    between stage actors; ``local_bytes_per_s`` an in-process move inside a stage (a
    host/device copy).

    >>> HopModel(task_s=1e-3, bytes_per_s=1e9).hop_seconds(10**6)
    0.002
    """

    task_s: float = 2.5e-3
    bytes_per_s: float = 2e9
    local_bytes_per_s: float = 1e10

    def hop_seconds(self, nbytes: float) -> float:
        return self.task_s + nbytes / self.bytes_per_s

    def move_seconds(self, nbytes: float) -> float:
        return nbytes / self.local_bytes_per_s


@dataclass
class Stage:
    """A contiguous run of segments that one actor runs, on at most one device."""

    id: int
    segments: list[int]  # segment ids, in plan order
    device: str | None  # the device provider it holds; None: a cpu-only stage
    inputs: list[str] = field(default_factory=list)  # graph inputs and earlier stages' values
    outputs: list[str] = field(default_factory=list)  # what later stages read, graph outputs
    compute_s: float | None = None  # predicted: its segments and in-process seam moves
    hop_s: float | None = None  # predicted: the Ray hop into it (task + bytes in)

    @property
    def name(self) -> str:
        return f"stage#{self.id}"

    @property
    def predicted_s(self) -> float | None:
        if self.compute_s is None:
            return None
        return self.compute_s + (self.hop_s or 0.0)

    @property
    def provider(self) -> str:
        """What the stage's actor reserves: its device, or cpu."""
        return self.device or "cpu"


StagesSpec = str | int | Sequence[int]


def cut_positions(groups: Sequence[Sequence[int]]) -> list[int]:
    """The cuts (start index of every stage after the first) of consecutive groups."""
    cuts, at = [], 0
    for g in groups[:-1]:
        at += len(g)
        cuts.append(at)
    return cuts


def plan_stages(plan: Any, spec: StagesSpec = "auto", hop: HopModel | None = None,
                segment_costs: Sequence[float] | None = None,
                cores: float | None = None,
                bounds: dict[str, int] | None = None) -> list[Stage]:
    """The stages of ``plan`` (a PlacementPlan) for ``spec``.

    ``segment_costs``: predicted seconds per segment (default: each segment's
    ``compute_cost``, else its ``predicted_cost``, else 0). ``cores``: the host cores
    the stages share (None: as many as they need); ``"auto"`` weighs the period with
    them. ``bounds``: symbol sizes for seam bytes (other symbols count as 1).
    """
    hop = hop or HopModel()
    segs = plan.segments
    n = len(segs)
    if n == 0:
        return []
    if segment_costs is not None:  # given: no part of them scales with threads
        costs = [(float(c), 0.0, None) for c in segment_costs]
    else:
        costs = [_segment_cost(s) for s in segs]
    layout = _Layout(plan, costs, hop, bounds or {}, cores)
    if isinstance(spec, bool) or not isinstance(spec, (str, int, list, tuple)):
        raise PlacementError(f"stages must be 'auto', an int or a list of cuts, got {spec!r}")
    if isinstance(spec, str):
        if spec != "auto":
            raise PlacementError(f"stages must be 'auto', an int or a list of cuts, got {spec!r}")
        cuts = layout.auto(cores)
    elif isinstance(spec, int):
        cuts = layout.best_of(spec)
    else:
        cuts = layout.checked(list(spec))
    return layout.stages(cuts)


def stage_report(stages: Sequence[Stage]) -> list[str]:
    """Report lines: one per stage, with its segments, device and predicted times."""
    lines = []
    period = max((s.predicted_s or 0.0) for s in stages) if stages else 0.0
    for s in stages:
        seg = _span(s.segments)
        pred = ""
        if s.compute_s is not None:
            pred = f", predicted {s.compute_s * 1e3:.2f} ms + hop {(s.hop_s or 0) * 1e3:.2f} ms"
        lines.append(f"  {s.name} on {s.provider}: segments {seg}{pred}")
    if stages and stages[0].compute_s is not None:
        lines.append(f"  pipeline period (slowest stage, its hop included): {period * 1e3:.2f} ms")
    return lines


def _span(ids: Sequence[int]) -> str:
    if not ids:
        return "-"
    return f"#{ids[0]}" if len(ids) == 1 else f"#{ids[0]}..#{ids[-1]} ({len(ids)})"


def _segment_cost(seg: Any) -> tuple[float, float, int | None]:
    """(seconds, the part of them large products take, the threads they were costed at)."""
    for attr in ("compute_cost", "predicted_cost"):
        v = getattr(seg, attr, None)
        if v is not None:
            return float(v), float(getattr(seg, "product_cost", 0.0) or 0.0), \
                getattr(seg, "cost_threads", None)
    return 0.0, 0.0, None


class _Layout:
    """A plan's segments with what the stage planner needs: devices, costs, bytes."""

    def __init__(self, plan: Any, costs: Sequence[tuple[float, float, int | None]], hop: HopModel,
                 bounds: dict[str, int], cores: float | None = None):
        self.plan = plan
        self.cores = cores
        self.segs = plan.segments
        self.n = len(self.segs)
        self.hop = hop
        self.device = [s.provider.name if s.provider.is_device else None for s in self.segs]
        self.span: dict[str, tuple[int, int]] = {}
        for i, d in enumerate(self.device):
            if d is not None:
                lo, _ = self.span.get(d, (i, i))
                self.span[d] = (lo, i)
        ordered = sorted(self.span.items(), key=lambda kv: kv[1][0])
        #: devices whose segments interleave with another device's: they may span stages
        self.interleaved: set[str] = set()
        for (d1, (_, l1)), (d2, (f2, _)) in zip(ordered, ordered[1:]):
            if f2 < l1:
                self.interleaved |= {d1, d2}
        # per segment: seconds that do not depend on threads, and products' seconds at
        # the threads they were costed at (a stage's share of the cores changes those)
        self.fixed = [c - p for c, p, _ in costs]
        self.products = [p for _, p, _ in costs]
        self.at_threads = [t for _, _, t in costs]
        # what a segment costs the host's cores: all of it, except a real GPU's compute
        self.host_costs = [0.0 if s.provider.kind == "gpu" else c
                           for s, (c, _, _) in zip(self.segs, costs)]
        self._hops: dict[tuple[int, int], float] = {}
        self._values(bounds)

    def _values(self, bounds: dict[str, int]) -> None:
        """Per value: producing segment, reading segments and bytes; graph outputs."""
        plan = self.plan
        self.producer: dict[str, int] = {}
        self.readers: dict[str, list[int]] = {}
        for i, s in enumerate(self.segs):
            for o in s.outputs:
                self.producer[o] = i
        graph = plan.graph
        weights = set(graph.initializers) - set(graph.inputs)
        for i, s in enumerate(self.segs):
            for name in s.inputs:
                if name in weights:
                    continue  # loaded where they are read; never fed
                self.readers.setdefault(name, []).append(i)
        estimate = cost_bounds(graph, bounds)
        self.nbytes = {name: value_bytes(graph, name, estimate) for name in self.readers}
        self.outputs = [o for o in graph.outputs if o in self.producer]
        # in-process moves inside a stage: a seam between segments of different providers
        self.move_s = [0.0] * self.n
        for name, rs in self.readers.items():
            p = self.producer.get(name)
            for r in rs:
                if p is not None and self.device[p] != self.device[r]:
                    self.move_s[r] += self.hop.move_seconds(self.nbytes.get(name, 0))

    # -- validity and cost of one stage [a, b) ----------------------------------------

    def valid(self, a: int, b: int) -> bool:
        devices = {d for d in self.device[a:b] if d is not None}
        if len(devices) > 1:
            return False
        for d in devices:
            lo, hi = self.span[d]
            if d not in self.interleaved and (lo < a or hi >= b):
                return False  # the device is split across stages
        return True

    def stage_inputs(self, a: int, b: int) -> list[str]:
        """Values the stage [a, b) reads from outside it (feeds and earlier stages')."""
        out = []
        for name, rs in self.readers.items():
            p = self.producer.get(name)
            if (p is None or p < a) and any(a <= r < b for r in rs):
                out.append(name)
        return out

    def stage_outputs(self, a: int, b: int) -> list[str]:
        out = []
        for name, p in self.producer.items():
            if a <= p < b and (name in self.outputs
                               or any(r >= b for r in self.readers.get(name, []))):
                out.append(name)
        return out

    def threads(self, k: int) -> int | None:
        """Host threads each of ``k`` stages gets (they share the cores); None: unknown."""
        return max(1, int(self.cores // k)) if self.cores else None

    def compute(self, a: int, b: int, threads: int | None = None) -> float:
        """Its segments (their products at ``threads``), and the host/device moves into
        them (a value that crossed a hop arrives on the host, so a device segment still
        moves it)."""
        total = sum(self.fixed[a:b]) + sum(self.move_s[a:b])
        for i in range(a, b):
            at = self.at_threads[i]
            total += self.products[i] * (at / threads if at and threads else 1.0)
        return total

    def hop_into(self, a: int, b: int) -> float:
        key = (a, b)
        if key not in self._hops:
            nbytes = sum(self.nbytes.get(name, 0) for name in self.stage_inputs(a, b)
                         if self.producer.get(name) is not None)
            self._hops[key] = self.hop.hop_seconds(nbytes)
        return self._hops[key]

    def cost(self, a: int, b: int, threads: int | None = None) -> float:
        return self.compute(a, b, threads) + self.hop_into(a, b)

    # -- choosing cuts ------------------------------------------------------------------

    def _table(self, k_max: int, threads: int | None = None
               ) -> tuple[list[list[float]], list[list[int]]]:
        """best[k][b]: the smallest slowest stage covering segments [0, b) with k
        stages, each costed at ``threads``."""
        inf = float("inf")
        n = self.n
        cost = [[inf] * (n + 1) for _ in range(n + 1)]
        for a in range(n):
            for b in range(a + 1, n + 1):
                if self.valid(a, b):
                    cost[a][b] = self.cost(a, b, threads)
        best = [[inf] * (n + 1) for _ in range(k_max + 1)]
        arg = [[0] * (n + 1) for _ in range(k_max + 1)]
        best[0][0] = 0.0
        for k in range(1, k_max + 1):
            for b in range(1, n + 1):
                for a in range(k - 1, b):
                    v = max(best[k - 1][a], cost[a][b])
                    if v < best[k][b]:
                        best[k][b], arg[k][b] = v, a
        return best, arg

    @staticmethod
    def _cuts(arg: list[list[int]], k: int, n: int) -> list[int]:
        cuts, b = [], n
        while k > 1:
            b = arg[k][b]
            cuts.append(b)
            k -= 1
        return sorted(cuts)

    def best_of(self, k: int) -> list[int]:
        if k < 1:
            raise PlacementError(f"stages must be at least 1, got {k}")
        if k > self.n:
            raise PlacementError(f"stages={k}, but the plan has only {self.n} segment(s)")
        best, arg = self._table(k, self.threads(k))
        if best[k][self.n] == float("inf"):
            raise PlacementError(self._why_not(k))
        return self._cuts(arg, k, self.n)

    def auto(self, cores: float | None) -> list[int]:
        """For each stage count, the cuts with the smallest slowest stage (its stages
        costed at their share of the cores); then the count whose period (with the
        cores bound) is best, the fewest among near-equal ones. More stages than cores
        (or devices) only share the cores thinner, so the counts stop there."""
        devices = len(self.span)
        k_max = self.n if not cores else min(self.n, max(devices, int(cores), 1))
        options = []
        for k in range(1, k_max + 1):
            best, arg = self._table(k, self.threads(k))
            if best[k][self.n] < float("inf"):
                cuts = self._cuts(arg, k, self.n)
                options.append((self.period(cuts, cores), cuts))
        if not options:
            raise PlacementError(self._why_not(1))
        top = min(p for p, _ in options)
        return next(c for p, c in options if p <= top * (1 + AUTO_TOLERANCE))

    def period(self, cuts: list[int], cores: float | None) -> float:
        """The slowest stage with its hop, or one request's host work over ``cores``."""
        bounds = [0, *cuts, self.n]
        stages = list(zip(bounds, bounds[1:]))
        threads = self.threads(len(stages))
        slowest = max(self.cost(a, b, threads) for a, b in stages)
        if not cores:
            return slowest
        host = sum(self.host_costs) + sum(self.move_s) + sum(self.hop_into(a, b) for a, b in stages)
        return max(slowest, host / cores)

    def checked(self, cuts: list[int]) -> list[int]:
        if any(isinstance(c, bool) or not isinstance(c, int) for c in cuts):
            raise PlacementError(f"stage cuts must be segment indices (ints), got {cuts!r}")
        if cuts != sorted(set(cuts)) or any(c <= 0 or c >= self.n for c in cuts):
            raise PlacementError(f"stage cuts must be increasing segment indices in 1..{self.n - 1}, "
                                 f"got {cuts!r}")
        bounds = [0, *cuts, self.n]
        for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
            if not self.valid(a, b):
                devices = sorted({d for d in self.device[a:b] if d is not None})
                if len(devices) > 1:
                    why = f"it holds {len(devices)} devices ({', '.join(devices)})"
                else:
                    lo, hi = self.span[devices[0]]
                    why = (f"{devices[0]} has segments #{lo}..#{hi}, which must run on one "
                           f"actor")
                raise PlacementError(f"stage cuts {cuts}: stage {k} (segments {a}..{b - 1}) is "
                                     f"not valid: {why}")
        return cuts

    def _why_not(self, k: int) -> str:
        devices = len(self.span)
        return (f"no valid split of {self.n} segment(s) into {k} stage(s): the plan has "
                f"{devices} device(s), each a stage of its own, and a device's segments "
                f"run on one actor")

    def stages(self, cuts: list[int]) -> list[Stage]:
        bounds = [0, *cuts, self.n]
        threads = self.threads(len(bounds) - 1)
        out = []
        for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
            devices = [d for d in self.device[a:b] if d is not None]
            out.append(Stage(
                id=k,
                segments=[s.id for s in self.segs[a:b]],
                device=devices[0] if devices else None,
                inputs=self.stage_inputs(a, b),
                outputs=self.stage_outputs(a, b),
                compute_s=self.compute(a, b, threads),
                hop_s=self.hop_into(a, b),
            ))
        return out
