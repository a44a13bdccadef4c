"""Which code a process runs: a digest of the ``hetero_exec`` and ``actors`` sources it
imports. A driver compares its own with each stage actor's when the actor starts, so
that a driver and actors importing different checkouts (an editable install against a
job's PYTHONPATH, nodes with different installs) fail at once with an error naming both,
rather than exchanging frames or calls that one side reads differently (a ring of
generation stages waited out its timeout).

Ray's runtime environments (``working_dir``, a PYTHONPATH naming one checkout) keep a
cluster on one version; this only names the case where they did not."""

from __future__ import annotations

import functools
import hashlib
import os
from typing import Any

import ray

from actors.runtime_env import checkout_root
from hetero_exec.errors import ActorError

#: the packages whose sources make up the digest (the code on both ends of a ring)
PACKAGES = ("hetero_exec", "actors")


class CodeMismatchError(ActorError):
    """A stage actor runs other hetero_exec sources than its driver."""


@functools.lru_cache(maxsize=1)
def code_identity() -> dict[str, str]:
    """This process's sources: ``digest`` (sha1 over the packages' ``.py`` files, by
    relative path and content; ~12 ms once) and ``root``, the folder they come from."""
    root = checkout_root()
    h = hashlib.sha1()
    for package in PACKAGES:
        for folder, dirs, files in os.walk(os.path.join(root, package)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(folder, name)
                with open(path, "rb") as f:
                    data = f.read()
                h.update(os.path.relpath(path, root).encode())
                h.update(b"\0")
                h.update(data)
    return {"digest": h.hexdigest()[:16], "root": root}


def check_same_code(what: str, theirs: object) -> None:
    """Raise `CodeMismatchError` when ``theirs`` (an actor's `code_identity`, or what an
    actor of another version sent in its place) is not this process's.

    >>> check_same_code("stage#0", code_identity())
    >>> check_same_code("stage#1", {"digest": "0" * 16, "root": "/elsewhere"})
    Traceback (most recent call last):
    ...
    actors.code_version.CodeMismatchError: stage#1 runs other hetero_exec sources than this driver: ...
    """
    ours = code_identity()
    if isinstance(theirs, dict) and theirs.get("digest") == ours["digest"]:
        return
    where = theirs.get("root", "?") if isinstance(theirs, dict) else "?"
    digest = theirs.get("digest", "none") if isinstance(theirs, dict) else "none"
    raise CodeMismatchError(
        f"{what} runs other hetero_exec sources than this driver: {where} (digest {digest}) "
        f"against {ours['root']} (digest {ours['digest']}); give the job one checkout "
        f"(a runtime_env working_dir, or PYTHONPATH naming it) or install the same version "
        f"on every node")


def check_failed_actor(what: str, handle: Any, timeout_s: float = 10.0) -> None:
    """After an actor's start failed: raise `CodeMismatchError` when the actor answers
    (its ``code`` call) with other sources than this process's, since a start of another
    version may fail on what the driver sent; nothing when it cannot say (gone, or a
    version without the call), so the caller reports the failure itself."""
    try:
        theirs = ray.get(handle.code.remote(), timeout=timeout_s)
    except Exception:  # any failure means: no answer
        return
    check_same_code(what, theirs)
