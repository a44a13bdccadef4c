"""run_async's two contracts: our Future, and onnxruntime's callback
``callback(outputs, user_data, error_text)`` (outputs ``[]`` and the error's text on
failure, ``""`` on success)."""

from __future__ import annotations

import concurrent.futures
import logging
from typing import Any, Callable

from hetero_exec.run_options import RunOptions, raise_if_terminated

log = logging.getLogger(__name__)


def answer(callback: Callable[[list[Any], Any, str], None], fut: concurrent.futures.Future,
           user_data: Any) -> None:
    err = fut.exception()
    try:
        if err is not None:
            callback([], user_data, str(err) or type(err).__name__)
        else:
            callback(fut.result(), user_data, "")
    except Exception:  # the caller's callback failed: nothing to hand it to but the log
        log.exception("run_async callback raised")


def terminable(inner: concurrent.futures.Future, ro: RunOptions) -> concurrent.futures.Future:
    """``inner``'s outcome, unless ``ro.terminate`` was set meanwhile."""
    outer: concurrent.futures.Future = concurrent.futures.Future()

    def settle(f: concurrent.futures.Future) -> None:
        try:
            result = f.result()
            raise_if_terminated(ro)
            outer.set_result(result)
        except BaseException as e:
            outer.set_exception(e)

    inner.add_done_callback(settle)
    return outer
