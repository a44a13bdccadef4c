"""Ray Data batch inference: `HeteroPredictor` for ``Dataset.map_batches``, and `infer`.

The standard pattern, with our session inside each replica::

    ds.map_batches(HeteroPredictor,
                   fn_constructor_kwargs={"model": path, "providers": ["gpu", "cpu"]},
                   batch_size=64, compute=ray.data.ActorPoolStrategy(size=4), num_gpus=1)

or, the same in one call, ``infer(ds, path, providers=["gpu", "cpu"], batch_size=64,
concurrency=4, num_gpus=1)``.

Columns named like the model's inputs are fed; the other columns pass through; each
output comes back as a new column of the output's name. The batch dimension is the
batch's. Nothing is cast: a column of the wrong dtype fails with the session's
`DtypeMismatchError` (inside Ray Data's error), a missing column is named. Batches may
be read-only zero-copy views (``zero_copy_batch=True``, Ray Data's default).

Each replica builds its session once, in its constructor; sessions are never pickled,
only the constructor's arguments are. A mixed plan runs in process inside the replica
(the local executor, the default), or, with ``executor="ray"`` among the session
options, on stage actors that the replica drives.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Mapping, Sequence

import numpy as np

from hetero_exec import InferenceSession
from hetero_exec.errors import HeteroExecError, InputError, MissingInputError

log = logging.getLogger(__name__)


class MissingColumnError(MissingInputError):
    """A batch has no column for one of the model's required inputs."""

    def __init__(self, name: str, columns: Sequence[str]):
        self.name, self.columns = name, list(columns)
        InputError.__init__(self, f"batch has no column {name!r} for the model's required input "
                                  f"{name!r}; its columns are {self.columns}")


class ColumnConflictError(InputError):
    """An output would overwrite a column that passes through (nothing is dropped silently)."""

    def __init__(self, name: str):
        self.name = name
        super().__init__(f"the model's output {name!r} would overwrite the batch's column "
                         f"{name!r}; rename or drop that column before inference")


class BatchShapeError(HeteroExecError):
    """An output without one row per batch row cannot become a column."""

    def __init__(self, name: str, shape: Sequence[int], rows: int):
        self.name, self.shape, self.rows = name, tuple(shape), rows
        super().__init__(f"output {name!r} has shape {list(self.shape)}, not one row per "
                         f"batch row ({rows} rows): it cannot become a column")


class HeteroPredictor:
    """A callable class for ``Dataset.map_batches``: numpy batches in, outputs added.

    >>> import numpy as np, onnx.helper as h
    >>> g = h.make_graph([h.make_node("Relu", ["x"], ["y"])], "g",
    ...     [h.make_tensor_value_info("x", 1, ["N", 2])],
    ...     [h.make_tensor_value_info("y", 1, ["N", 2])])
    >>> predict = HeteroPredictor(h.make_model(g))
    >>> out = predict({"id": np.array([7, 8]), "x": np.array([[-1, 1], [2, -2]], np.float32)})
    >>> sorted(out), out["y"].tolist()
    (['id', 'x', 'y'], [[0.0, 1.0], [2.0, 0.0]])
    """

    def __init__(self, model: Any, providers: Sequence[Any] | None = None, **session_options: Any):
        """``model``: a path, bytes, a ModelProto, or an ObjectRef of the model's bytes
        (what `infer` passes: Ray Data hands a replica a large constructor argument
        more slowly than a reference)."""
        ray = sys.modules.get("ray")
        if ray is not None and isinstance(model, ray.ObjectRef):
            model = ray.get(model)
        self.session = InferenceSession(model, providers, **session_options)
        self.inputs = [a.name for a in self.session.get_inputs()]
        self.overrides = [a.name for a in self.session.get_overridable_initializers()]
        self.outputs = [a.name for a in self.session.get_outputs()]
        log.info("HeteroPredictor: %s on %s", self.session.graph.name,
                 ", ".join(self.session.get_providers()))

    def __call__(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        feed = self.feed(batch)
        rows = _rows(batch)
        outs = self.session.run(self.outputs, feed)
        result = dict(batch)
        for name, value in zip(self.outputs, outs):
            if name in result and name not in feed:
                raise ColumnConflictError(name)
            if rows is not None and (np.ndim(value) == 0 or np.shape(value)[0] != rows):
                raise BatchShapeError(name, np.shape(value), rows)
            result[name] = value
        return result

    def feed(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """The batch's columns named like the model's inputs (overridable initializers
        too, when present), as arrays; a missing required column is named."""
        for name in self.inputs:
            if name not in batch:
                raise MissingColumnError(name, list(batch))
        return {n: _column(batch[n]) for n in self.inputs + self.overrides if n in batch}

    def __del__(self) -> None:
        session = getattr(self, "session", None)
        if session is not None:
            session.close()


def _column(col: Any) -> Any:
    """A column as one array: a batch of equal-shaped tensors in an object column (Ray
    Data's form for some variable-shaped tensor columns) is stacked, never cast."""
    if isinstance(col, np.ndarray) and col.dtype == object and col.size and all(
            isinstance(v, np.ndarray) for v in col):
        try:
            return np.stack(list(col))
        except ValueError:
            return col  # ragged: the session names the shape it expected
    return col


def _rows(batch: Mapping[str, Any]) -> int | None:
    for col in batch.values():
        if np.ndim(col):
            return len(col)
    return None


def infer(
    ds: Any,
    model: Any,
    *,
    providers: Sequence[Any] | None = None,
    batch_size: int = 64,
    concurrency: int | tuple[int, int] = 1,
    num_gpus: float = 0,
    num_cpus: float | None = None,
    **session_options: Any,
) -> Any:
    """``ds`` with the model's outputs as new columns (lazy, like every Ray Data step).

    ``concurrency`` replicas (an int, or a (min, max) pool), each reserving ``num_gpus``
    GPUs (and ``num_cpus`` CPUs, Ray Data's default when None); each holds one session
    built from ``model`` (a path readable where the replicas run, bytes or a ModelProto),
    ``providers`` and ``session_options``.

    >>> out = infer(ray.data.from_numpy(x), "model.onnx", providers=["cpu"])  # doctest: +SKIP
    """
    import ray

    if isinstance(concurrency, tuple):
        compute = ray.data.ActorPoolStrategy(min_size=concurrency[0], max_size=concurrency[1])
    else:
        compute = ray.data.ActorPoolStrategy(size=int(concurrency))
    kwargs: dict[str, Any] = {}
    if num_cpus is not None:
        kwargs["num_cpus"] = num_cpus
    if num_gpus:
        kwargs["num_gpus"] = num_gpus
    if not isinstance(model, (str, os.PathLike)):
        # the model's bytes in the object store once, each replica reading them from
        # there: as a constructor argument beside any other, Ray Data started each
        # replica 0.3 s later (17 MB: 15% of an 8192-row job; bench/README.md)
        model = ray.put(model.SerializeToString() if hasattr(model, "SerializeToString")
                        else bytes(model))
    return ds.map_batches(
        HeteroPredictor,
        fn_constructor_kwargs={"model": model, "providers": providers, **session_options},
        batch_size=batch_size,
        batch_format="numpy",
        zero_copy_batch=True,
        compute=compute,
        **kwargs,
    )
