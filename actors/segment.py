"""SegmentActor: one device's segments, compiled where they run.

An actor hosts the segments the coordinator gives it (one segment, or every segment
of one device when they are colocated). It builds each segment from its ONNX bytes
and compiles it in ``__init__``, so a restarted actor reloads its weights by itself.
A run reads its inputs (seam values arrive as Ray resolved them, or from the actor's
device-local store), executes the RunPlan and hands each output to its transport.
Errors the segment raises on purpose travel back as `SegmentRunError`.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from typing import Any, Sequence

import ray

from actors.remote_errors import FailedValue, SegmentRunError
from actors.request import Layout, pick
from actors.segment_model import SegmentSpec, load_segment_graph
from actors.transport import make_transport
from actors.transport.base import SeamKey
from actors.transport.device_local import DeviceLocalTransport
from actors.transport.shared_memory import ShmArray
from hetero_exec.errors import HeteroExecError, KernelError
from hetero_exec.exec.executor import execute
from hetero_exec.exec.plan import Compiler, RunPlan
from hetero_exec.providers import Provider

log = logging.getLogger(__name__)


class HostedSegment:
    """One compiled segment inside an actor."""

    def __init__(self, spec: SegmentSpec, device_id: int | None):
        started = time.perf_counter()
        self.spec = spec
        self.provider: Provider = spec.make_provider(device_id)
        graph = load_segment_graph(spec)
        compiler = Compiler.for_provider(self.provider, spec.fold_constants)
        self.plan: RunPlan = compiler.compile(graph, graph.nodes, spec.inputs, spec.outputs)
        self.compile_s = time.perf_counter() - started
        self.runs = 0  # requests run
        self.tasks = 0  # Ray tasks that ran them (fewer when requests come in groups)
        self.run_s = 0.0

    def info(self) -> dict[str, Any]:
        return {
            "segment": self.spec.segment_id,
            "provider": self.provider.name,
            "nodes": len(self.spec.node_ids),
            "weight_bytes": self.spec.weight_bytes,
            "compile_s": self.compile_s,
        }


class SegmentActor:
    """The actor class (made remote by `remote_class`); one per device or per segment.

    >>> import ray  # doctest: +SKIP
    >>> cls = remote_class().options(num_cpus=1)  # doctest: +SKIP
    >>> actor = cls.remote([spec], set(), "object_store")  # doctest: +SKIP
    >>> ray.get(actor.ready.remote())["segments"][0]["provider"]  # doctest: +SKIP
    'cpu'
    """

    def __init__(
        self,
        specs: Sequence[SegmentSpec] | tuple[ray.ObjectRef],
        local_values: set[str] | frozenset[str],
        seam_transport: str = "object_store",
        profile: bool = False,
        seam_config: dict[str, Any] | None = None,
    ):
        if len(specs) == 1 and isinstance(specs[0], ray.ObjectRef):
            # the specs, put once by the coordinator, which holds the ref: a restart reads
            # them again (a ref inside a tuple is not resolved by Ray, so it is fetched here)
            specs = ray.get(specs[0])
        self.incarnation = uuid.uuid4().hex
        self.local_values = frozenset(local_values)
        self.local = DeviceLocalTransport()
        self.seam = self._make_seam(seam_transport, seam_config or {})
        self.profile = profile
        self.spans: list[dict[str, Any]] = []
        self.segments: dict[int, HostedSegment] = {}
        self.init_error: BaseException | None = None
        device_id = 0 if ray.is_initialized() and ray.get_gpu_ids() else None
        try:
            for spec in specs:
                self.segments[spec.segment_id] = HostedSegment(spec, device_id)
                log.info(
                    "%s compiled in %.3fs", spec.label, self.segments[spec.segment_id].compile_s
                )
        except Exception as e:  # reported by ready(), so the build names the failure
            label = specs[len(self.segments)].label if len(self.segments) < len(specs) else "actor"
            self.init_error = SegmentRunError(label, e)

    def _make_seam(self, name: str, config: dict[str, Any]) -> Any:
        if name != "shared_memory":
            return make_transport(name)
        prefix = f"{config['prefix']}-{self.incarnation[:8]}"  # names, briefly, while created
        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
        return make_transport(name, prefix=prefix, node=node, budget=int(config["budget"]))

    # -- lifecycle ----------------------------------------------------------------

    def ready(self) -> dict[str, Any]:
        """Start-up report: incarnation, pid, node and each segment's compile time."""
        if self.init_error is not None:
            raise self.init_error
        return {
            "incarnation": self.incarnation,
            "pid": os.getpid(),
            "node": ray.get_runtime_context().get_node_id() if ray.is_initialized() else "",
            "segments": [s.info() for s in self.segments.values()],
        }

    def ping(self) -> str:
        """This actor's incarnation (a new one after each restart)."""
        if self.init_error is not None:
            raise self.init_error
        return self.incarnation

    def drop(self, *requests: int) -> None:
        """Forget the device-local values of finished requests."""
        for request in requests:
            self.local.drop(request)

    # -- running --------------------------------------------------------------------

    def run(self, meta: tuple[list[int], int, Layout, int], *flat: Any) -> Any:
        """Run one segment for each request of a group: ``meta`` is (request ids, segment
        id, `Layout`, floor), one argument so Ray serializes it once; ``flat`` the values.

        One return per segment output, each a list with one value per request, so a
        group of requests costs Ray one task and one object per output. A request whose
        run fails on purpose (a kernel error, an input refused) gets a `FailedValue` in
        its place and the others still run; a later segment passes it on. Every request
        before ``floor`` has finished, so the seam transport may reuse what they held.
        """
        requests, segment_id, layout, floor = meta
        self.seam.release_below(floor)
        return self._run_group(requests, segment_id, layout, flat)

    def run_fetching(self, meta: tuple[list[int], int, Layout, int], flat: list[Any]) -> Any:
        """Like `run`, with seam ObjectRefs fetched here (profiling times each fetch)."""
        requests, segment_id, layout, floor = meta
        self.seam.release_below(floor)
        seg = self.segments[segment_id]
        fetched = []
        for item in flat:
            if isinstance(item, ray.ObjectRef):
                t0 = time.time_ns()
                item = ray.get(item)
                self._span(
                    f"seam -> {seg.spec.name}",
                    t0,
                    "seam",
                    {"requests": list(requests), "bytes": _nbytes(item)},
                )
            fetched.append(item)
        return self._run_group(requests, segment_id, layout, fetched)

    def _run_group(
        self, requests: list[int], segment_id: int, layout: Layout, flat: Sequence[Any]
    ) -> Any:
        seg = self.segments[segment_id]
        seg.tasks += 1
        n_out = len(seg.spec.outputs)
        columns: list[list[Any]] = [[] for _ in range(n_out)]
        for j, request in enumerate(requests):
            carried = [pick(flat, entries[j]) for entries in layout]
            failed = next((c for c in carried if isinstance(c, FailedValue)), None)
            if failed is not None:
                outs: list[Any] = [failed] * n_out  # an upstream failure, passed on
            else:
                try:
                    outs = self._run(request, segment_id, carried)
                except SegmentRunError as e:
                    outs = [FailedValue(e)] * n_out
            for column, value in zip(columns, outs):
                column.append(value)
        return columns[0] if n_out == 1 else tuple(columns)

    def run_dict(self, segment_id: int, *sources: dict[str, Any]) -> dict[str, Any]:
        """The compiled-graph form: named values in (feeds, upstream outputs), named out."""
        seg = self.segments[segment_id]
        merged: dict[str, Any] = {}
        for src in sources:
            merged.update(src)
        t0 = time.time_ns()
        try:
            args = [merged.get(n) for n in seg.spec.inputs]
            if seg.provider.is_device:
                args = [seg.provider.to_device(v) for v in args]
            outs = execute(seg.plan, args)
        except KernelError as e:
            raise SegmentRunError(
                seg.spec.label, KernelError(e.node, e.op, e.detail, seg.spec.label)
            ) from None
        except HeteroExecError as e:
            raise SegmentRunError(seg.spec.label, e) from None
        if seg.provider.is_device:
            outs = [seg.provider.to_host(v) for v in outs]
        seg.runs += 1
        seg.run_s += (time.time_ns() - t0) / 1e9
        return dict(zip(seg.spec.outputs, outs))

    def _run(self, request: int, segment_id: int, carried: list[Any]) -> list[Any]:
        seg = self.segments[segment_id]
        spec, prov = seg.spec, seg.provider
        t0 = time.time_ns()
        try:
            args = [
                self._read(request, name, item, prov) for name, item in zip(spec.inputs, carried)
            ]
            outs = execute(seg.plan, args)
        except KernelError as e:
            raise SegmentRunError(
                spec.label, KernelError(e.node, e.op, e.detail, spec.label)
            ) from None
        except HeteroExecError as e:
            raise SegmentRunError(spec.label, e) from None
        results = [self._write(request, name, v, prov) for name, v in zip(spec.outputs, outs)]
        seg.runs += 1
        seg.run_s += (time.time_ns() - t0) / 1e9
        if self.profile:
            self._span(
                f"{spec.name} run", t0, "segment", {"request": request, "provider": prov.name}
            )
        return results

    def _read(self, request: int, name: str, item: Any, prov: Provider) -> Any:
        if name in self.local_values:
            return self.local.read(SeamKey(request, name), item)
        t0 = time.time_ns()
        value = self.seam.read(SeamKey(request, name), item)
        if self.profile and isinstance(item, ShmArray):
            self._span(
                f"seam {name} read (shared memory)", t0, "seam",
                {"request": request, "bytes": _nbytes(value)},
            )
        return prov.to_device(value) if prov.is_device else value

    def _write(self, request: int, name: str, value: Any, prov: Provider) -> Any:
        key = SeamKey(request, name)
        if name in self.local_values:
            return self.local.write(key, value)
        t0 = time.time_ns()
        host = prov.to_host(value) if prov.is_device else value
        carried = self.seam.write(key, host)
        if self.profile and isinstance(carried, ShmArray):
            self._span(
                f"seam {name} written (shared memory)", t0, "seam",
                {"request": request, "bytes": _nbytes(host)},
            )
        return carried

    # -- observability ------------------------------------------------------------------

    def _span(self, name: str, start_ns: int, cat: str, args: dict[str, Any]) -> None:
        end = time.time_ns()
        self.spans.append(
            {
                "name": name,
                "cat": cat,
                "ts": start_ns / 1e3,
                "dur": (end - start_ns) / 1e3,
                "args": args,
            }
        )

    def take_spans(self) -> list[dict[str, Any]]:
        """The profile spans recorded since the last call (wall-clock microseconds)."""
        spans, self.spans = self.spans, []
        return spans

    def stats(self) -> dict[int, dict[str, float]]:
        """Per segment: requests run, tasks that ran them, seconds spent running."""
        return {
            sid: {"runs": s.runs, "tasks": s.tasks, "run_s": s.run_s, "compile_s": s.compile_s}
            for sid, s in self.segments.items()
        }


def _nbytes(value: Any) -> int:
    if isinstance(value, list):
        return sum(_nbytes(v) for v in value)
    return int(getattr(value, "nbytes", 0) or 0)


_REMOTE: Any = None


def remote_class() -> Any:
    """`SegmentActor` as a Ray actor class (made once, on first use)."""
    global _REMOTE
    if _REMOTE is None:
        _REMOTE = ray.remote(SegmentActor)
    return _REMOTE
