"""`pfcompile render PLAN`: the command line of pfcompile.render."""

from __future__ import annotations

import json
import sys

from pfcompile.formats.errors import InputError
from pfcompile.formats.jsonio import check_output_path
from pfcompile.formats.plan import load_plan
from pfcompile.formats.verify import verify_plan
from pfcompile.render import render_files


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
            if b > 1_000_000:  # no plan has that many ranks, steps or layers; do not build the set
                raise InputError(flag, None, f"{b} is larger than any plan's index (at most 1000000)")
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
    p.add_argument("--layers", metavar="LIST", help="graph: only these covered layers (and their stages' pipeline work)")
    c = p.add_mutually_exclusive_group()
    c.add_argument("--collapse", nargs="?", const="layer", default=None, choices=("layer", "stage"),
                   help="graph: one node per stage and micro-batch, K-FAC work grouped per layer (default) or "
                        "per stage; automatic above 300 tasks (per stage above 400 nodes)")
    c.add_argument("--no-collapse", dest="collapse", action="store_false", help="graph: one node per task")
    p.add_argument("--json", action="store_true", help="print what was written as one JSON object")
    p.set_defaults(func=run)


def run(args) -> int:
    from pfcompile.render.graph import TaskFilter  # noqa: PLC0415

    if not any((args.graph, args.timeline, args.trace, args.torch_csv)):
        raise InputError(None, None, "nothing to render: give --graph, --timeline, --trace and/or --torch-csv")
    for flag, path in (("--graph", args.graph), ("--timeline", args.timeline), ("--trace", args.trace),
                       ("--torch-csv", args.torch_csv)):
        if path:
            check_output_path(path, flag)
    flt = TaskFilter(_int_set("--ranks", args.ranks), _int_set("--steps", args.steps),
                     _int_set("--layers", args.layers))
    plan = load_plan(args.plan)
    verify_plan(plan, args.plan)  # times finite and sane, ops where they belong: then drawable
    for flag, chosen, n, what in (("--ranks", flt.ranks, plan.world_size, "ranks"),
                                  ("--steps", flt.steps, plan.refresh_steps, "steps in its refresh cycle"),
                                  ("--layers", flt.layers, len(plan.layers), "covered layers")):
        if chosen and max(chosen) >= n:
            raise InputError(flag, None, f"{max(chosen)} is not in the plan, which has {n} {what} (0..{n - 1})")
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
