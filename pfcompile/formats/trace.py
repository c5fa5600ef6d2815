"""Chrome-trace / Perfetto JSON: the one trace format for predicted and measured timelines.

The renderer writes a plan's predicted timeline with it and the runtime its measured one,
so the two open side by side in https://ui.perfetto.dev. An event is a plain tuple
`(rank, stream, name, start_ms, end_ms, args)`; a rank becomes a process, a stream a
thread. Imports nothing heavy: the runtime imports this module on every rank.

Format: https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU
("ph": "X" complete events with ts/dur in microseconds, "M" metadata for names, "C"
counters: a measured trace's per-step page faults and peak memory, one track per series).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any, NamedTuple

from pfcompile.formats.jsonio import write_atomic

# Streams in display order (pfcompile.formats.ops). Point-to-point and collective
# communication get their own rows because a runtime may overlap them with compute; in one
# row Perfetto would nest overlapping slices and misdraw them.
from pfcompile.formats.ops import STREAMS, stream_of  # noqa: F401  (stream_of: re-exported for the runtime)


class TraceEvent(NamedTuple):
    rank: int
    stream: str
    name: str
    start_ms: float
    end_ms: float
    args: dict[str, Any]


def _tid(stream: str) -> int:
    # Fixed ids keep rows in the same order in every trace; unknown streams go after.
    return STREAMS.index(stream) if stream in STREAMS else len(STREAMS) + sum(map(ord, stream)) % 1000


def chrome_trace(events: Iterable[TraceEvent | tuple], *, process_label: str = "rank",
                 metadata: dict[str, Any] | None = None, counters: Iterable[tuple] = ()) -> dict[str, Any]:
    """The trace as a JSON-ready dict: one complete event per op, names for ranks and streams,
    and `counters` as (rank, name, at_ms, {series: value}): each series is a track of the
    rank's process (Perfetto names it "NAME SERIES") holding its value until the next."""
    out: list[dict[str, Any]] = []
    seen: set[tuple[int, str]] = set()
    for ev in events:
        rank, stream, name, start_ms, end_ms, args = ev
        if end_ms < start_ms:
            raise ValueError(f"event {name!r} on rank {rank} ends before it starts")
        tid = _tid(stream)
        if (rank, stream) not in seen:
            if not any(r == rank for r, _ in seen):
                out.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                            "args": {"name": f"{process_label} {rank}"}})
                out.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0,
                            "args": {"sort_index": rank}})
            out.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": stream}})
            out.append({"name": "thread_sort_index", "ph": "M", "pid": rank, "tid": tid,
                        "args": {"sort_index": tid}})
            seen.add((rank, stream))
        out.append({
            "name": name, "cat": stream, "ph": "X", "pid": rank, "tid": tid,
            "ts": start_ms * 1000.0, "dur": (end_ms - start_ms) * 1000.0, "args": dict(args),
        })
    for rank, name, at_ms, values in counters:
        out.append({"name": name, "ph": "C", "pid": rank, "tid": 0, "ts": at_ms * 1000.0, "args": dict(values)})
    trace: dict[str, Any] = {"traceEvents": out, "displayTimeUnit": "ms"}
    if metadata:
        trace["otherData"] = metadata
    return trace


def write_trace(path: str | os.PathLike, events: Iterable[TraceEvent | tuple], **kw) -> dict[str, Any]:
    """Write the trace atomically; returns what was written."""
    trace = chrome_trace(events, **kw)
    write_atomic(path, json.dumps(trace, separators=(",", ":")) + "\n")
    return trace
