"""Render a plan: the schedule as pictures, a Perfetto trace and a torch schedule CSV.

    pfcompile render plan.json --graph g.svg --timeline t.png --trace t.json --torch-csv o.csv

Each output flag names its file (svg/png/pdf from the extension); any combination works in
one call. Everything is checked before anything is written, and each file is written
atomically, so a bad flag or a missing `dot` leaves no half-made outputs behind.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pfcompile.formats.errors import InputError
from pfcompile.formats.jsonio import write_atomic
from pfcompile.formats.ops import stream_of
from pfcompile.formats.plan import Plan
from pfcompile.formats.trace import TraceEvent, write_trace
from pfcompile.render.style import group_of, label_of

IMAGE_FORMATS = ("svg", "png", "pdf")


def plan_events(plan: Plan) -> list[TraceEvent]:
    """One trace event per planned op, with its fields, step and predicted times as args."""
    events = []
    for q, steps in enumerate(plan.ranks):
        for t, ops in enumerate(steps):
            for p in ops:
                args = {**p.op.to_dict(), "step": t, "start_ms": p.start, "end_ms": p.end,
                        "work": label_of(group_of(p.op.kind))}
                events.append(TraceEvent(q, stream_of(p.op.kind), str(p.op), p.start, p.end, args))
    return events


def _image_format(flag: str, path: str) -> str:
    fmt = Path(path).suffix.lower().lstrip(".")
    if fmt not in IMAGE_FORMATS:
        raise InputError(flag, None, f"{path!r}: the file name must end in .{', .'.join(IMAGE_FORMATS)}")
    return fmt


def render_files(plan: Plan, graph: str | None = None, timeline: str | None = None,
                 trace: str | None = None, torch_csv: str | None = None, *,
                 graph_filter=None, collapse: str | bool | None = None,
                 torch_csv_format: str = "compute_comms", status=None) -> dict[str, Any]:
    """Write the requested outputs; returns what was written (paths, counts, notes).

    The pictures are made in memory first, so a bad request (a file name, a filter that
    selects nothing, a missing `dot`) fails before any output is written."""
    from pfcompile.render import torch_csv as pipelining_csv  # noqa: PLC0415
    from pfcompile.render.graph import render_graph, require_dot  # noqa: PLC0415

    graph_fmt = _image_format("--graph", graph) if graph else None
    timeline_fmt = _image_format("--timeline", timeline) if timeline else None
    if graph:
        require_dot()
    if torch_csv_format not in pipelining_csv.FORMATS:
        raise InputError("--torch-csv-format", None, f"must be one of {', '.join(pipelining_csv.FORMATS)}")
    say = status or (lambda msg: None)
    done: dict[str, Any] = {"notes": []}

    pictures: list[tuple[str, bytes]] = []
    if graph:
        say(f"laying out the task graph with dot for {graph}")
        data, n_nodes, collapsed = render_graph(plan, graph_fmt, graph_filter, collapse)
        pictures.append((graph, data))
        done["graph"] = {"path": str(graph), "nodes": n_nodes, "collapsed": collapsed}
        if collapsed and collapse is None:
            grouping = "per layer" if collapsed == "layer" else "per stage (per layer would be too many nodes for dot)"
            done["notes"].append(f"graph collapsed automatically to {n_nodes} nodes: one per stage and micro-batch, "
                                 f"the optimizer's refresh work grouped {grouping}; --no-collapse for every task, "
                                 "or --ranks/--steps/--layers to draw less")
    if timeline:
        say(f"drawing the timeline for {timeline}")
        from pfcompile.render.timeline import render_timeline  # noqa: PLC0415

        pictures.append((timeline, render_timeline(plan, timeline_fmt)))
        done["timeline"] = {"path": str(timeline)}

    try:
        if trace:
            say(f"writing trace {trace}")
            tr = write_trace(trace, plan_events(plan), metadata={"source": "predicted", "plan": plan.config.to_json(), "stats": plan.stats})
            done["trace"] = {"path": str(trace), "events": sum(e["ph"] == "X" for e in tr["traceEvents"])}
        if torch_csv:
            say(f"writing torch schedule CSV {torch_csv}")
            paths, note = pipelining_csv.export(plan, torch_csv, torch_csv_format)
            done["torch_csv"] = {"paths": [str(p) for p in paths], "format": torch_csv_format}
            done["notes"].append(note)
        for path, data in pictures:
            write_atomic(path, data)
    except OSError as e:  # an output that cannot be written (no permission, disk full, ...)
        raise InputError(e.filename or "output", None, f"cannot write: {e.strerror or e}") from None
    return done
