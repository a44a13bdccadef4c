"""Carrying hetero_exec's typed errors out of an actor, and telling them from faults.

hetero_exec's errors take several constructor arguments, so the default exception
pickling (``cls(*args)``) cannot rebuild them. `SegmentRunError` carries one across
Ray by class, args and attributes, and the coordinator re-raises the original.
Everything else Ray raises (actor died, unavailable, object lost...) is a *fault*:
the coordinator recovers from those by replaying the request.
"""

from __future__ import annotations

from typing import Any

import ray.exceptions

from actors.transport.base import SeamUnreachable


def _rebuild(cls: type[BaseException], args: tuple, state: dict[str, Any]) -> BaseException:
    exc = cls.__new__(cls)
    exc.args = args
    exc.__dict__.update(state)
    return exc


def _rebuild_carrier(segment: str, error: BaseException) -> "SegmentRunError":
    return SegmentRunError(segment, error)


class SegmentRunError(Exception):
    """An error a segment raised on purpose (a kernel failure, an input it refused).

    >>> import pickle
    >>> from hetero_exec.errors import KernelError
    >>> err = KernelError("graph/node#2", "ai.onnx::Div", "boom", "segment#1")
    >>> e = SegmentRunError("segment#1 (cpu)", err)
    >>> type(pickle.loads(pickle.dumps(e)).error).__name__
    'KernelError'
    """

    def __init__(self, segment: str, error: BaseException):
        super().__init__(f"{segment}: {error}")
        self.segment = segment
        self.error = error

    def __reduce__(self):
        err = self.error
        return (_rebuild_carrier, (self.segment, _Portable(err)))


class _Portable:
    """Pickles any exception as (class, args, attributes), rebuilt without __init__."""

    def __init__(self, error: BaseException):
        self.error = error

    def __reduce__(self):
        e = self.error
        state = {k: v for k, v in e.__dict__.items() if not k.startswith("__")}
        return (_rebuild, (type(e), e.args, state))


class FailedValue:
    """What a request's outputs are in a group task when its own run failed on purpose.

    The other requests of the group keep their results; later segments pass this on
    without running, and the coordinator raises ``error`` (a `SegmentRunError`) for
    that request only.

    >>> import pickle
    >>> from hetero_exec.errors import KernelError
    >>> err = SegmentRunError("segment#0 (cpu)", KernelError("g/n", "ai.onnx::Gather", "bad", ""))
    >>> type(pickle.loads(pickle.dumps(FailedValue(err))).error.error).__name__
    'KernelError'
    """

    __slots__ = ("error",)

    def __init__(self, error: SegmentRunError):
        self.error = error

    def __reduce__(self):
        return (FailedValue, (self.error,))


#: Ray errors after which the request is replayed (the actor or the object is gone)
class StageNotLoaded(RuntimeError):
    """A stage actor that Ray restarted has no stage yet: its constructor takes none when
    the stage is too large to travel inline, and the coordinator sends it again
    (`actors.replay`). A fault: what ran there is replayed."""


FAULTS: tuple[type[BaseException], ...] = (
    ray.exceptions.RayActorError,  # ActorDiedError, ActorUnavailableError
    ray.exceptions.ObjectLostError,  # OwnerDiedError, ObjectReconstructionFailedError...
    ray.exceptions.WorkerCrashedError,
    ray.exceptions.NodeDiedError,
    ray.exceptions.LocalRayletDiedError,
    ray.exceptions.ObjectFetchTimedOutError,
    SeamUnreachable,  # a carried value went with its writer (a restarted one, say)
    StageNotLoaded,  # restarted, its stage not sent again yet
)


def root_cause(exc: BaseException) -> BaseException:
    """The error under Ray's RayTaskError wrappers (a task that failed because its
    argument failed carries the argument's error)."""
    seen = 0
    while isinstance(exc, ray.exceptions.RayTaskError) and seen < 16:
        cause = getattr(exc, "cause", None)
        if cause is None or cause is exc:
            break
        exc, seen = cause, seen + 1
    return exc


def user_error(exc: BaseException) -> BaseException | None:
    """The typed error a segment raised, or None when ``exc`` is not one."""
    cause = root_cause(exc)
    if isinstance(cause, SegmentRunError):
        return cause.error
    return None


def is_fault(exc: BaseException) -> bool:
    """Whether ``exc`` means an actor or an object was lost (so a replay can succeed)."""
    cause = root_cause(exc)
    return isinstance(cause, FAULTS) or isinstance(exc, FAULTS)
