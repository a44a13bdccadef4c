"""How Ray's workers import this checkout's ``hetero_exec`` and ``actors``: the job's
runtime env of a local Ray started here (`actors.connect`), and the stage actors' own
when the job does not provide it (`actors.reservation`)."""

from __future__ import annotations

import os
from typing import Any

import ray


def checkout_root() -> str:
    """The folder holding the ``hetero_exec`` and ``actors`` packages."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def default_runtime_env() -> dict[str, Any] | None:
    """What the actors need to import hetero_exec and actors from this checkout.

    Nothing when the job already provides it (a ``working_dir``, or PYTHONPATH naming
    the checkout): actors then reuse the job's pre-started workers. Otherwise
    PYTHONPATH with the checkout.
    """
    try:
        job_env = dict(ray.get_runtime_context().runtime_env or {})
    except Exception:  # not connected yet, or an older Ray
        job_env = {}
    job_path = (job_env.get("env_vars") or {}).get("PYTHONPATH", "")
    if job_env.get("working_dir") or checkout_root() in job_path.split(os.pathsep):
        return None
    return {"env_vars": {"PYTHONPATH": checkout_pythonpath()}}


def checkout_pythonpath() -> str:
    """PYTHONPATH with the checkout first, then this process's own entries.

    >>> checkout_pythonpath().split(os.pathsep)[0] == checkout_root()
    True
    """
    root = checkout_root()
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != root]
    return os.pathsep.join([root, *rest])
