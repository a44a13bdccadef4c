"""Chrome-trace profiles (chrome://tracing, Perfetto): one lane per actor.

The coordinator records a span per request on its own lane; each actor records a
span per segment run and per seam fetch. `write_trace` merges them into one JSON
file, as ``onnxruntime``'s ``end_profiling()`` does, and returns its path.
"""

from __future__ import annotations

import datetime
import json
import os
import threading
import time
from typing import Any, Iterable, Sequence

DRIVER_LANE = 0


class SpanRecorder:
    """Spans of one lane (the driver's), safe to record from several threads.

    >>> rec = SpanRecorder()
    >>> t0 = time.time_ns(); rec.record("request 1", t0, "request", {})
    >>> rec.take()[0]["name"]
    'request 1'
    """

    def __init__(self) -> None:
        self._spans: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def record(self, name: str, start_ns: int, cat: str, args: dict[str, Any]) -> None:
        end = time.time_ns()
        span = {
            "name": name,
            "cat": cat,
            "ts": start_ns / 1e3,
            "dur": (end - start_ns) / 1e3,
            "args": args,
        }
        with self._lock:
            self._spans.append(span)

    def take(self) -> list[dict[str, Any]]:
        with self._lock:
            spans, self._spans = self._spans, []
        return spans


def trace_events(lanes: Sequence[tuple[str, Iterable[dict[str, Any]]]], pid: int = 1) -> list[dict]:
    """Chrome-trace events: a thread-name record per lane, then its complete ("X") spans."""
    events: list[dict[str, Any]] = [
        {
            "name": "process_name",
            "ph": "M",
            "pid": pid,
            "tid": 0,
            "args": {"name": "hetero_exec ray session"},
        }
    ]
    for tid, (lane, spans) in enumerate(lanes):
        events.append(
            {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": lane}}
        )
        events.append(
            {
                "name": "thread_sort_index",
                "ph": "M",
                "pid": pid,
                "tid": tid,
                "args": {"sort_index": tid},
            }
        )
        for s in spans:
            events.append({"ph": "X", "pid": pid, "tid": tid, **s})
    return events


def write_trace(
    lanes: Sequence[tuple[str, Iterable[dict[str, Any]]]], prefix: str, directory: str | None = None
) -> str:
    """Write the lanes as ``<prefix>_<timestamp>.json``; returns the path.

    >>> import tempfile
    >>> path = write_trace([("driver", [])], "p", tempfile.mkdtemp())
    >>> json.load(open(path))["traceEvents"][1]["args"]["name"]
    'driver'
    """
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S_%f")
    path = os.path.join(directory or os.getcwd(), f"{prefix}_{stamp}.json")
    with open(path, "w") as f:
        json.dump({"traceEvents": trace_events(lanes), "displayTimeUnit": "ms"}, f)
    return path
