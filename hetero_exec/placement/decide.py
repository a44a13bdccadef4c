"""The session-building decision of SEMANTICS.md section 1, in its order.

(ir.load has checked control-flow signatures and cycles.) Then:
hetero (opt-in, decided first; its segments then get their providers' segment passes)
-> unsupported-operator rejection on cpu -> provider passes -> GPU coverage -> require /
guard / whole-session fallback -> memory admission.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

from hetero_exec.errors import (
    HeterogeneousPlacementRequired,
    MissingKernelsError,
    PlacementError,
    ProviderError,
    UnsupportedOperatorError,
)
from hetero_exec.ir.graph import Graph
from hetero_exec.placement.coverage import (
    FallbackReport,
    assigned_ops,
    coverage_report,
    has_kernel,
    is_static,
    node_signature,
    skipped,
    walk_scoped,
)
from hetero_exec.placement.memory import admit
from hetero_exec.placement.plan import PlacementPlan
from hetero_exec.placement.planner import classify_placement, single_plan
from hetero_exec.providers import Provider, parse_provider

log = logging.getLogger(__name__)

FALLBACK_HINT = "Set HETERO_EXEC_REQUIRE_GPU=1 to reject this fallback"


@dataclass
class SessionBuild:
    """What the session runs: the plan, the providers in use, and any fallback report."""

    placement: PlacementPlan
    providers: list[Provider]
    graph: Graph
    fallback_report: FallbackReport | None = None
    requested: str = "cpu"
    #: every provider of the session, ranked (for placing control-flow bodies)
    all_providers: list[Provider] | None = None

    @property
    def provider_names(self) -> list[str]:
        return [p.name for p in self.providers]


def parse_providers(providers: Sequence[Any] | None) -> list[Provider]:
    """Rank: the requested provider first, cpu last (added when absent)."""
    if providers is None:
        providers = ["cpu"]
    if isinstance(providers, (str, tuple)):
        providers = [providers]
    parsed = [parse_provider(p) for p in providers]
    if not parsed:
        raise ProviderError("providers must name at least one provider")
    names = [p.name for p in parsed]
    if len(set(names)) != len(names):
        raise ProviderError(f"a provider is listed twice: {names}")
    cpus = [p for p in parsed if p.kind == "cpu"]
    if not cpus:
        from hetero_exec.providers.cpu import CpuProvider

        parsed.append(CpuProvider())
    elif parsed[-1].kind != "cpu" and parsed[0].kind != "cpu":
        parsed.remove(cpus[0])
        parsed.append(cpus[0])
    return parsed


def reject_missing_kernels(graph: Graph, provider: Provider) -> None:
    """Ops no provider has a kernel for: one MissingKernelsError listing every such
    ``domain::op_type`` with its count, whatever the shapes (a missing kernel does not
    depend on them). ``provider`` is the one the error names."""
    missing: dict[str, int] = {}
    nodes: dict[str, list[str]] = {}
    first = None
    for g, node in walk_scoped(graph):
        if skipped(node):
            continue
        opset = g.opset(node.domain)
        if has_kernel(node, opset):
            continue
        op = f"{node.canonical_domain}::{node.op_type}"
        missing[op] = missing.get(op, 0) + 1
        if len(nodes.setdefault(op, [])) < 3:
            nodes[op].append(node.identity)
        if first is None:
            first = (node.identity, node.canonical_domain, node.op_type, opset)
    if missing:
        raise MissingKernelsError(missing, nodes, first, provider.name)


def reject_unsupported_operators(graph: Graph, provider: Provider) -> None:
    """When cpu is requested: every op without a kernel at all is one load-time error
    (reject_missing_kernels); then the first node with static input shapes the provider
    refuses for another reason; symbolic ones are deferred to run time."""
    reject_missing_kernels(graph, provider)
    for g, node in walk_scoped(graph):
        if skipped(node):
            continue
        shapes, dtypes, kinds = node_signature(g, node)
        if not is_static(shapes):
            continue
        opset = g.opset(node.domain)
        sup = provider.supports_op(node, opset, shapes, dtypes, kinds)
        if not sup:
            raise UnsupportedOperatorError(node.identity, node.canonical_domain, node.op_type,
                                           opset, provider.name, sup.reason)


def build_session_plan(graph: Graph, providers: Sequence[Any] | None, options) -> SessionBuild:
    """The session's plan, then its pipeline stages (``options.stages``; a saved plan's
    own cuts when the session asks for "auto")."""
    from hetero_exec.placement.stages import plan_stages

    build = _place(graph, providers, options)
    plan = build.placement
    spec = getattr(options, "stages", "auto")
    if spec == "auto" and plan.saved_cuts is not None:
        spec = plan.saved_cuts
    plan.stages = plan_stages(plan, spec, bounds=dict(options.dim_bounds or {}))
    return build


def _place(graph: Graph, providers: Sequence[Any] | None, options) -> SessionBuild:
    provs = parse_providers(providers)
    requested = provs[0]
    cpu = provs[-1]
    require = options.require_gpu_on
    hetero = options.hetero_on
    bounds = dict(options.dim_bounds or {})
    _check_affinity_needs_hetero(options, requested, hetero)

    if options.placement is not None:
        from hetero_exec.placement.saved_plan import load_plan

        plan = _segment_passes(load_plan(options.placement, graph, provs), options)
        admit(plan, bounds)
        return SessionBuild(plan, _used(plan, provs), plan.graph, requested=requested.name,
                            all_providers=provs)

    # -- opt-in mixed placement, decided before the single-provider path ------------
    # (an unavailable requested device places nothing: the single-provider path below
    # falls back with its reason in the report, or fails when the GPU is required)
    if hetero and not require and requested.kind != "cpu" and requested.available():
        reject_missing_kernels(graph, requested)  # no segment of any provider could run them
        plan = classify_placement(graph, provs, affinity=options.affinity,
                                  strategy=options.strategy, dim_bounds=bounds,
                                  cost_model=options.cost_model)
        if plan is not None:
            plan = _segment_passes(plan, options)
            admit(plan, bounds)
            log.info("heterogeneous placement: %s", plan.summary())
            return SessionBuild(plan, _used(plan, provs), plan.graph, requested=requested.name,
                                all_providers=provs)

    # -- the single-provider path (place_graph) ----------------------------------------
    if not requested.is_device:
        reject_unsupported_operators(graph, requested)
    from hetero_exec.placement.passes import run_provider_passes

    graph_before = graph
    passes = run_provider_passes if options.optimize else (lambda g, _p: g)
    graph = passes(graph, requested)
    report = coverage_report(graph, requested)
    if report is not None:
        if require:
            raise HeterogeneousPlacementRequired(report)
        guard_heterogeneous_fallback(graph_before, provs, hetero)
        graph = passes(graph_before, cpu)
        report.assigned_node_count, report.assigned_ops = assigned_ops(graph)
        log.warning("%s. %s", report, FALLBACK_HINT)
        reject_unsupported_operators(graph, cpu)
        requested_name, requested = requested.name, cpu
    else:
        requested_name = requested.name
    plan = single_plan(graph, requested)
    admit(plan, bounds)
    return SessionBuild(plan, [requested], graph, fallback_report=report, requested=requested_name)


def _segment_passes(plan: PlacementPlan, options) -> PlacementPlan:
    """A placed plan (mixed, or loaded from a saved one) gets its segments' provider
    passes: placement is decided before them, and they never move a node."""
    if not options.optimize:
        return plan
    from hetero_exec.placement.passes import run_segment_passes

    return run_segment_passes(plan)


def guard_heterogeneous_fallback(graph_before: Graph, provs: Sequence[Provider], hetero: bool) -> None:
    """With hetero on, reaching the fallback means the planner judged the graph
    single-provider before the provider passes, and a pass introduced a decline:
    fail closed instead of collapsing silently to cpu."""
    if not hetero:
        return
    if classify_placement(graph_before, provs) is None and provs[0].available():
        raise PlacementError(
            "heterogeneous placement guard: the graph was single-provider on "
            f"{provs[0].name} before its provider passes, which introduced declines; "
            "refusing to fall back to cpu silently")


def _check_affinity_needs_hetero(options, requested: Provider, hetero: bool) -> None:
    if options.affinity and not (hetero and requested.kind != "cpu"):
        from hetero_exec.placement.planner import compile_affinity

        compile_affinity(options.affinity)  # still reject malformed rules
        if any(prov not in (requested.name, requested.kind) for _, prov in options.affinity):
            raise PlacementError("affinity pins nodes to another provider; mixed placement needs "
                                 "hetero=True (or HETERO_EXEC_HETERO=1) and a non-cpu provider first")


def _used(plan: PlacementPlan, provs: Sequence[Provider]) -> list[Provider]:
    used = {s.provider.name for s in plan.segments}
    return [p for p in provs if p.name in used]
