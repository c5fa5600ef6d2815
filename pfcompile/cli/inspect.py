"""`pfcompile inspect FILE`: a profile or a plan as tables (or `--json`).

Dispatches on the file's `schema`; the tables themselves are drawn by
`pfcompile.formats.profile.format_profile` and `pfcompile.render.text.format_plan`, which
import no torch.
"""

from __future__ import annotations

import json

from pfcompile.formats.errors import InputError, echo, printable_table
from pfcompile.formats.jsonio import read_json


def register(sub) -> None:
    p = sub.add_parser("inspect", help="print a profile or a plan as tables",
                       description="Print a profile's per-layer costs, or a plan's statistics and "
                                   "each rank's ops in compact text form.")
    p.add_argument("file", help="a profile JSON (pfcompile profile) or a plan JSON (pfcompile plan)")
    p.add_argument("--json", action="store_true", help="print the statistics as one JSON object")
    p.add_argument("--ops", type=int, default=None, metavar="N",
                   help="plans: show at most N ops per rank and step (default: all)")
    p.add_argument("--against", default=None, metavar="PLAN",
                   help="FILE is a measured trace (torchrun -m runtime --trace): per op kind, predicted against "
                        "measured (median, p90) and the step-time error each kind explains")
    p.add_argument("--profile", default=None, metavar="PROFILE",
                   help="the profile the plan was made from: a plan FILE is checked against it (the profile's "
                        "hash, each field of the model spec); with --against, adds the plan replayed with the "
                        "run's own op times, splitting the step-time error into the op times' level, the "
                        "runtime's work between ops beyond the plan, their spread from step to step, and the "
                        "messages")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.against:
        return _against(args)
    obj = read_json(args.file)
    schema = obj.get("schema") if isinstance(obj, dict) else None
    if schema == "pfcompile-profile":
        from pfcompile.formats.profile import format_profile, profile_from_json

        if args.profile:
            raise InputError("--profile", None, "is for a plan FILE, or a measured trace with --against PLAN")
        prof = profile_from_json(obj, args.file)
        if args.json:
            print(json.dumps(prof.to_json()))
        else:
            print(printable_table(format_profile(prof)))
        return 0
    if schema == "pfcompile-plan":
        from pfcompile.formats.plan import plan_from_json
        from pfcompile.formats.verify import verify_plan
        from pfcompile.render.text import format_plan

        plan = plan_from_json(obj, args.file)
        if args.profile:  # the plan against the costs it says it was made from
            from pfcompile.formats.profile import load_profile

            prof = load_profile(args.profile)
            verify_plan(plan, args.file, profile_model=prof.model, profile_hash=prof.hash)
        else:
            verify_plan(plan, args.file)
        if args.json:
            print(json.dumps(plan.stats))
        else:
            print(printable_table(format_plan(plan, max_ops=args.ops)))
        return 0
    raise InputError(args.file, "schema", f"expected 'pfcompile-profile' or 'pfcompile-plan', got {echo(schema)}")


def _against(args) -> int:
    from pfcompile.calibrate.compare import (
        beside_the_work,
        format_against,
        format_replayed,
        per_kind_rows,
        replayed_with_measured,
    )
    from pfcompile.calibrate.measured import check_against_plan, check_against_profile, load_measured
    from pfcompile.formats.plan import load_plan

    trace = load_measured(args.file)
    plan = load_plan(args.against)
    check_against_plan(trace, args.against)
    replayed, profile = None, None
    if args.profile:
        from pfcompile.formats.profile import load_profile

        profile = load_profile(args.profile)
        check_against_profile(trace, profile)
        replayed = replayed_with_measured(trace, plan, profile)
    if args.json:
        rows, total = per_kind_rows(trace, plan, profile)
        print(json.dumps({"kinds": rows, **total, "beside_work": beside_the_work(trace),
                          **({"replayed": replayed} if args.profile else {})}))
    else:
        print(format_against(trace, args.against, plan, profile))  # (checked above)
        if args.profile:
            print(format_replayed(replayed, float(plan.stats.get("step_time_ms") or 0.0)))
    return 0
