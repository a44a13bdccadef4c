"""InferenceSession: onnxruntime's Python API over hetero_exec's layers.

Building follows SEMANTICS.md section 1 in order (signatures and cycles in `ir.load`,
unsupported-operator rejection on cpu, provider passes, GPU coverage), then the
fallback / require / hetero decision of `placement.decide`, then an executor. A build
is a transaction (section 6): `set_providers` swaps in a new plan only once it is
complete. onnxruntime's surface lives beside this file: options, run_options,
ortvalue, modelmeta, provider_names, threads, optimized_model.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from typing import Any, Callable, Mapping, Sequence

from hetero_exec.errors import (
    BuildError,
    HeteroExecError,
    NotSupportedForHeterogeneous,
    OptionTypeError,
    OrtValueError,
    ProviderError,
    UnknownOutputError,
)
from hetero_exec.ir import Graph
from hetero_exec.ir.load import ModelSource
from hetero_exec.kernels._threads import intra_op_threads
from hetero_exec.logs import apply_severity
from hetero_exec.model_plan import load_and_plan
from hetero_exec.modelmeta import ModelMetadata
from hetero_exec.node_arg import NodeArg, declared_types, node_arg
from hetero_exec.options import SessionOptions, env_flag  # noqa: F401  (env_flag: public before)
from hetero_exec.ortvalue import OrtValue, on_device, unwrap_feed
from hetero_exec.provider_names import ProviderSpecs
from hetero_exec.run_async import answer, terminable
from hetero_exec.run_options import RunOptions, check_run_options, raise_if_terminated

log = logging.getLogger(__name__)


class InferenceSession:
    """Run an ONNX model on the providers asked for, in preference order.

    >>> import numpy as np, onnx.helper as h
    >>> g = h.make_graph([h.make_node("Relu", ["x"], ["y"])], "g",
    ...     [h.make_tensor_value_info("x", 1, [2])], [h.make_tensor_value_info("y", 1, [2])])
    >>> sess = InferenceSession(h.make_model(g).SerializeToString(), providers=["CPUExecutionProvider"])
    >>> sess.run(None, {"x": np.array([-1.0, 2.0], np.float32)})[0]
    array([0., 2.], dtype=float32)
    >>> sess.get_providers()
    ['CPUExecutionProvider']
    """

    def __init__(self, path_or_bytes: ModelSource, sess_options: Any = None,
                 providers: Sequence[Any] | None = None,
                 provider_options: Sequence[dict[str, Any]] | None = None, **kwargs: Any):
        if _is_providers(sess_options):  # InferenceSession(model, ["cpu"]): today's code
            if providers is not None:
                raise ProviderError("providers given twice: as the second argument and as providers=")
            providers, sess_options = sess_options, None
        self.options = _session_options(sess_options, kwargs)
        apply_severity(self.options.log_severity_level, self.options.log_verbosity_level)
        self._closed = False
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        specs = ProviderSpecs.parse(providers, provider_options)
        planned = load_and_plan(path_or_bytes, specs.specs, self.options)
        self._model, self.graph = planned.model, planned.graph
        self._meta = ModelMetadata.of(self._model)
        self._types = declared_types(self._model)
        self._out_index = {n: i for i, n in enumerate(self.graph.outputs)}
        self._install(specs, planned.build, self._start(planned.build))
        self._profiling_start_ns = time.time_ns() if self.options.enable_profiling else 0

    # -- building (a transaction: nothing is installed until it is complete) ----------

    def _new_plan(self, providers: Any, provider_options: Any) -> tuple[ProviderSpecs, Any, Any]:
        """Another plan of the loaded model (`set_providers`), with its executor."""
        from hetero_exec.placement.decide import build_session_plan

        specs = ProviderSpecs.parse(providers, provider_options)
        build = build_session_plan(self.graph, specs.specs, self.options)
        return specs, build, self._start(build)

    def _start(self, build: Any) -> Any:
        """The executor of ``build``, and the optimized model written when asked for; a
        failure releases the executor before it raises."""
        executor = self._make_executor(build)
        try:
            if self.options.optimized_model_filepath:
                from hetero_exec.optimized_model import write_optimized_model

                write_optimized_model(self.options.optimized_model_filepath, self._model,
                                      build.graph, self.options.fold_constants)
        except BaseException as e:
            _release(executor, e)
            raise
        return executor

    def _make_executor(self, build: Any) -> Any:
        if self.options.executor == "ray":
            from actors.coordinator import RayExecutor  # the one lazy import of the Ray layer

            return RayExecutor(build.graph, build, self.options)
        from hetero_exec.exec.local import LocalExecutor

        return LocalExecutor(build.graph, build, self.options)

    def _install(self, specs: ProviderSpecs, build: Any, executor: Any) -> None:
        self._specs, self._build, self._executor = specs, build, executor
        self.placement = build.placement
        self.fallback_report = build.fallback_report

    def set_providers(self, providers: Sequence[Any] | None = None,
                      provider_options: Sequence[dict[str, Any]] | None = None) -> None:
        """Rebuild the plan on other providers; on failure the session is unchanged."""
        with self._lock:
            new = self._new_plan(providers, provider_options)
            old = self._executor
            self._install(*new)
        try:
            old.close()
        except Exception as e:  # the new plan is in place; the old one's release is reported
            log.warning("closing the previous plan's executor failed: %s", e)

    def disable_fallback(self) -> None:
        """Builds from now on (set_providers) require the GPU: no whole-session cpu fallback."""
        self.options.require_gpu = True

    def enable_fallback(self) -> None:
        self.options.require_gpu = False

    # -- metadata ----------------------------------------------------------------------

    def get_inputs(self) -> list[NodeArg]:
        return [self._arg(n) for n in self.graph.inputs if n not in self.graph.initializers]

    def get_overridable_initializers(self) -> list[NodeArg]:
        return [self._arg(n) for n in self.graph.inputs if n in self.graph.initializers]

    def get_outputs(self) -> list[NodeArg]:
        return [self._arg(n) for n in self.graph.outputs]

    def get_providers(self) -> list[str]:
        """The providers in use, spelled as the caller spelled them."""
        return [self._specs.spell(p) for p in self._build.providers]

    def get_provider_options(self) -> dict[str, dict[str, str]]:
        return {self._specs.spell(p): self._specs.options_of(p) for p in self._build.providers}

    def get_session_options(self) -> SessionOptions:
        return self.options

    def get_modelmeta(self) -> ModelMetadata:
        return self._meta

    def get_profiling_start_time_ns(self) -> int:
        return self._profiling_start_ns

    def _arg(self, name: str) -> NodeArg:
        return node_arg(self.graph, self._types, name)

    @property
    def is_heterogeneous(self) -> bool:
        return self.placement is not None and len(self.placement.segments) > 1

    @property
    def stage_actors(self) -> list[Any]:
        """On Ray: the actor handles of the plan's pipeline stages, in order."""
        return list(getattr(self._executor, "actors", []))

    # -- running -------------------------------------------------------------------------

    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any],
            run_options: RunOptions | None = None) -> list[Any]:
        """Tensors as arrays, sequences as lists, maps as dicts, an empty optional as None."""
        names = self._output_names(output_names)
        return self._run(names, unwrap_feed(input_feed), run_options)

    run_outputs = run  # the name sequences and maps used to need

    def _run(self, names: list[str], feed: Mapping[str, Any], run_options: Any,
             on_device: bool = False) -> list[Any]:
        ro = check_run_options(run_options)
        raise_if_terminated(ro)
        if ro is not None and ro.logid:
            log.debug("run %s: %s", ro.logid, names)
        executor = self._executor
        with self._threads():
            outs = executor.run(names, feed, on_device=True) if on_device else executor.run(names, feed)
        raise_if_terminated(ro)
        return outs

    def _threads(self) -> Any:
        """``intra_op_num_threads``: this session's runs split their work over at most
        that many threads (kernels/_threads.py), whatever other sessions do."""
        if self.options.executor != "local":
            return contextlib.nullcontext()  # runs happen in the actors' processes
        return intra_op_threads(self.options.intra_op_num_threads or None)

    def run_async(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any],
                  callback: Callable[[list[Any], Any, str], None] | None = None,
                  user_data: Any = None, run_options: RunOptions | None = None):
        """A concurrent.futures.Future of run(). With ``callback``, onnxruntime's
        contract too: ``callback(outputs, user_data, "")``, or ``([], user_data, error)``."""
        if callback is None:
            return self._submit(self._output_names(output_names), input_feed, run_options)
        try:
            fut = self._submit(self._output_names(output_names), input_feed, run_options)
        except HeteroExecError as e:
            fut = concurrent.futures.Future()
            fut.set_exception(e)
        fut.add_done_callback(lambda f: answer(callback, f, user_data))
        return fut

    def _submit(self, names: list[str], input_feed: Mapping[str, Any], run_options: Any):
        feed = unwrap_feed(input_feed)
        if self.options.executor == "local":
            with self._lock:
                if self._pool is None:
                    self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)
            return self._pool.submit(self._run, names, feed, run_options)
        ro = check_run_options(run_options)
        raise_if_terminated(ro)
        inner = self._executor.run_async(names, feed)
        return inner if ro is None else terminable(inner, ro)

    def run_many(
        self,
        feeds: Sequence[Mapping[str, Any]],
        output_names: Sequence[str] | None = None,
        return_exceptions: bool = False,
    ) -> list[Any]:
        """run() for every feed, concurrently; results in feed order.

        With ``return_exceptions`` a failed request's error takes its place in the list
        and the others still answer; otherwise the first error raises. On Ray every feed
        is checked before any is dispatched, and feeds share actor tasks (``coalesce``).
        """
        names = self._output_names(output_names)
        many = getattr(self._executor, "run_many", None)
        if many is not None:
            return many(names, feeds, return_exceptions)
        futures = [self._submit(names, f, None) for f in feeds]
        concurrent.futures.wait(futures)
        if return_exceptions:
            return [f.exception() or f.result() for f in futures]
        return [f.result() for f in futures]

    def run_with_ort_values(self, output_names: Sequence[str] | None,
                            input_dict_ort_values: Mapping[str, Any],
                            run_options: RunOptions | None = None) -> list[OrtValue]:
        """OrtValues in, OrtValues out. Values on this session's device stay there
        (single-provider device sessions); host values run as run() does."""
        names = self._output_names(output_names)
        device = [v.provider for v in input_dict_ort_values.values()
                  if isinstance(v, OrtValue) and v.provider is not None]
        if not device:
            return [OrtValue(o) for o in self._run(names, unwrap_feed(input_dict_ort_values), run_options)]
        prov = self._device_provider("run_with_ort_values with device OrtValues")
        feed = {k: on_device(k, v, prov) for k, v in input_dict_ort_values.items()}
        return [OrtValue(o, prov) for o in self._run(names, feed, run_options, on_device=True)]

    def _device_provider(self, what: str) -> Any:
        """The single device provider of this session, for device-resident runs."""
        if self.is_heterogeneous:
            raise NotSupportedForHeterogeneous(what)
        prov = self._build.providers[0]
        if not prov.is_device:
            raise OrtValueError(f"{what}: the session runs on {prov.name}, which has no device "
                                f"memory; pass host OrtValues (value.numpy())")
        return prov

    def _output_names(self, output_names: Sequence[str] | None) -> list[str]:
        if not output_names:
            return list(self.graph.outputs)
        for n in output_names:
            if n not in self._out_index:
                raise UnknownOutputError(n, self.graph.outputs)
        return list(output_names)

    # -- device bindings ---------------------------------------------------------------

    def io_binding(self):
        """ORT-style IO binding; single-provider sessions only (SEMANTICS.md section 2)."""
        if self.is_heterogeneous:
            raise NotSupportedForHeterogeneous("io_binding (persistent device bindings)")
        from hetero_exec.exec.binding import IOBinding

        return IOBinding(self)

    def run_with_iobinding(self, iobinding, run_options: RunOptions | None = None) -> None:
        iobinding._run(run_options)

    # -- profiling and lifetime ----------------------------------------------------------

    def end_profiling(self) -> str | None:
        return self._executor.end_profiling()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._pool is not None:
                self._pool.shutdown(wait=False)
            self._executor.close()

    def __enter__(self) -> "InferenceSession":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _is_providers(x: Any) -> bool:
    from hetero_exec.providers import Provider

    return isinstance(x, (list, tuple, str, Provider))


def _session_options(sess_options: Any, kwargs: Mapping[str, Any]) -> SessionOptions:
    """A copy of the caller's options (later edits do not reach the session), then keywords."""
    if sess_options is None:
        opts = SessionOptions()
    elif isinstance(sess_options, SessionOptions):
        opts = sess_options.copy()
    else:
        raise OptionTypeError(f"sess_options must be a hetero_exec.SessionOptions, got "
                              f"{type(sess_options).__module__}.{type(sess_options).__name__}")
    opts.update(kwargs)
    opts.check_executor_options()
    if opts.executor == "ray" and opts.intra_op_num_threads and \
            "stage_threads" not in opts.executor_options:
        # on Ray the runs happen in the stage actors: their threads are the session's
        opts.executor_options = {**opts.executor_options, "stage_threads": opts.intra_op_num_threads}
    return opts


def _release(executor: Any, error: BaseException) -> None:
    """Close a half-built plan's executor; a failing release joins the build error."""
    try:
        executor.close()
    except Exception as release_error:
        raise BuildError(error, release_error) from error


__all__ = ["InferenceSession", "SessionOptions", "NodeArg", "HeteroExecError", "Graph"]
