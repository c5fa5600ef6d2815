"""`pfcompile calibrate PROFILE MEASURED_TRACE... -o PROFILE2`: fit a profile to measured runs
(pfcompile.calibrate.fit); the new profile records what it was calibrated from."""

from __future__ import annotations

import sys

from pfcompile.formats.errors import InputError


def register(sub) -> None:
    p = sub.add_parser(
        "calibrate", help="fit a profile's entries to measured traces of plans made from it",
        description="Replace each profile entry (fwd/bwd/step per part, curvature/inversion/preconditioning "
                    "per covered layer, the runtime's overheads per op, per step, per send and per receive, "
                    "point-to-point latency and bandwidth) by what the runtime measured "
                    "in the given traces (`torchrun -m runtime PLAN --trace T`); the traces must be runs of "
                    "plans made from PROFILE. Writes a new profile whose provenance names the traces.")
    p.add_argument("profile", help="the profile the traced plans were made from")
    p.add_argument("traces", nargs="+", metavar="MEASURED_TRACE", help="measured traces written by the runtime")
    p.add_argument("--statistic", choices=("mean", "median"), default="mean",
                   help="of each entry's measured occupancies (default mean: a step is a sum of op times, and "
                        "sums add means)")
    p.add_argument("-o", "--output", required=True, metavar="PROFILE2", help="write the calibrated profile here")
    p.set_defaults(func=run)


def run(args) -> int:
    from pfcompile.calibrate.compare import against_fitted_run, format_fitted_run
    from pfcompile.calibrate.fit import calibrate
    from pfcompile.calibrate.measured import load_measured
    from pfcompile.formats.profile import load_profile

    profile = load_profile(args.profile)
    traces = [load_measured(t) for t in args.traces]
    new, counts = calibrate(profile, traces, args.statistic)
    if args.output == args.profile:
        raise InputError("-o", None, "must differ from PROFILE (the calibrated profile names its parent by hash)")
    new.save(args.output)
    fitted = ", ".join(f"{k} {n}" for k, n in sorted(counts.items()))
    print(f"wrote {args.output} ({new.hash}), calibrated from {len(traces)} trace(s) of {profile.hash[:19]}...: "
          f"{fitted}", file=sys.stderr)
    # The model's own error, apart from the machine's: a later run's error beyond this is
    # how that run differs from these.
    for tr in traces:
        print(format_fitted_run(tr, against_fitted_run(tr, new)), file=sys.stderr)
    return 0
