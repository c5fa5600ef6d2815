"""`pfcompile render PLAN`: the schedule as pictures, a Perfetto trace and a torch schedule CSV.

    pfcompile render plan.json --graph g.svg --timeline t.png --trace t.json --torch-csv o.csv

Each output flag names its file (svg/png/pdf from the extension); any combination works in
one call. Everything is checked before anything is written, and each file is written
atomically, so a bad flag or a missing `dot` leaves no half-made outputs behind.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from pfcompile.errors import InputError
from pfcompile.jsonio import write_atomic
from pfcompile.plan import Plan, load_plan
from pfcompile.render_style import label_of, group_of
from pfcompile.trace import TraceEvent, stream_of, write_trace

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
    from pfcompile import pipelining_csv  # noqa: PLC0415
    from pfcompile.render_graph import render_graph, require_dot  # noqa: PLC0415

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
                                 f"K-FAC work grouped {grouping}; --no-collapse for every task, "
                                 "or --ranks/--steps/--layers to draw less")
    if timeline:
        say(f"drawing the timeline for {timeline}")
        from pfcompile.render_timeline import render_timeline  # noqa: PLC0415

        pictures.append((timeline, render_timeline(plan, timeline_fmt)))
        done["timeline"] = {"path": str(timeline)}

    try:
        if trace:
            say(f"writing trace {trace}")
            tr = write_trace(trace, plan_events(plan), metadata={"source": "predicted", "plan": plan.config, "stats": plan.stats})
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


# --- CLI ---------------------------------------------------------------------------------

def _int_set(flag: str, text: str | None) -> set[int] | None:
    """`0,2,5-7` -> {0, 2, 5, 6, 7}."""
    if text is None:
        return None
    out: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            a, b = int(lo), int(hi) if hi else int(lo)
            if a < 0 or b < a:
                raise ValueError
            out.update(range(a, b + 1))
    except ValueError:
        raise InputError(flag, None, f"expected numbers and ranges like 0,2,5-7, got {text!r}") from None
    return out


def register(sub) -> None:
    p = sub.add_parser("render", help="draw a plan: task graph, timeline, Perfetto trace, torch CSV",
                       description="Draw a plan's task graph (graphviz dot) and per-device timeline, and "
                                   "export it as a Chrome/Perfetto trace and as torch.distributed.pipelining's "
                                   "schedule CSV. Each flag names its output file.")
    p.add_argument("plan", help="a plan JSON (pfcompile plan)")
    p.add_argument("--graph", metavar="FILE", help="task graph picture (.svg, .png or .pdf); needs graphviz's dot")
    p.add_argument("--timeline", metavar="FILE", help="per-device timeline picture (.svg, .png or .pdf)")
    p.add_argument("--trace", metavar="FILE", help="Chrome-trace JSON; open in https://ui.perfetto.dev")
    p.add_argument("--torch-csv", metavar="FILE",
                   help="forward/backward/send/recv order per rank as torch.distributed.pipelining's CSV "
                        "(one file per replica pipeline, x.replicaR.csv, when stages are replicated)")
    p.add_argument("--torch-csv-format", default="compute_comms", choices=("compute_comms", "compute_only"),
                   help="compute_comms keeps the plan's send/recv order (default); compute_only lets torch add them")
    p.add_argument("--ranks", metavar="LIST", help="graph: only these devices, e.g. 0,1 or 0-3")
    p.add_argument("--steps", metavar="LIST", help="graph: only these steps of the refresh cycle")
    p.add_argument("--layers", metavar="LIST", help="graph: only these K-FAC layers (and their stages' pipeline work)")
    c = p.add_mutually_exclusive_group()
    c.add_argument("--collapse", nargs="?", const="layer", default=None, choices=("layer", "stage"),
                   help="graph: one node per stage and micro-batch, K-FAC work grouped per layer (default) or "
                        "per stage; automatic above 300 tasks (per stage above 400 nodes)")
    c.add_argument("--no-collapse", dest="collapse", action="store_false", help="graph: one node per task")
    p.add_argument("--json", action="store_true", help="print what was written as one JSON object")
    p.set_defaults(func=run)


def run(args) -> int:
    from pfcompile.render_graph import TaskFilter  # noqa: PLC0415

    if not any((args.graph, args.timeline, args.trace, args.torch_csv)):
        raise InputError(None, None, "nothing to render: give --graph, --timeline, --trace and/or --torch-csv")
    flt = TaskFilter(_int_set("--ranks", args.ranks), _int_set("--steps", args.steps),
                     _int_set("--layers", args.layers))
    plan = load_plan(args.plan)
    from rich.console import Console  # noqa: PLC0415

    console = Console(stderr=True)
    with console.status("rendering") as status:
        done = render_files(plan, args.graph, args.timeline, args.trace, args.torch_csv,
                            graph_filter=flt, collapse=args.collapse, torch_csv_format=args.torch_csv_format,
                            status=lambda msg: status.update(msg))
    if args.json:
        print(json.dumps(done))
        return 0
    for what in ("graph", "timeline", "trace", "torch_csv"):
        if what in done:
            d = done[what]
            paths = ", ".join(d.get("paths", [d.get("path")]))
            extra = f" ({d['nodes']} nodes{', collapsed per ' + d['collapsed'] if d['collapsed'] else ''})" \
                if what == "graph" else ""
            extra = f" ({d['events']} events)" if what == "trace" else extra
            print(f"{what}: {paths}{extra}")
    for note in done["notes"]:
        print(f"note: {note}", file=sys.stderr)
    return 0
