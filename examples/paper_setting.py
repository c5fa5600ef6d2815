"""PipeFisher's headline results, reproduced with pfcompile's own tools.

From the bert-base and bert-large P100 reference profiles (PipeFisher's published
per-block measurements), for GPipe, 1F1B and Chimera with D = 4 and 8 stages and N = D and
2D micro-batches: the utilization of the pipeline without K-FAC, and with K-FAC placed by
PipeFisher's greedy and by CP-SAT (utilization, step overhead, refresh interval k).

Then the simulated time to a target loss. How the two measurements are combined:

    time_kfac / time_first_order = (steps_kfac / steps_first_order) * (step_kfac / step_first_order)

- steps_kfac / steps_first_order: the median, over seeds, of the steps K-FAC needs to reach
  AdamW's validation loss at step 1000, measured by benchmarks/convergence.py on bert-tiny
  MLM (read from its --json output). ASSUMED to carry over to BERT phase-1 pre-training: the
  paper takes its ratio from real BERT-Large runs (NVIDIA's LAMB baseline vs K-FAC), far
  beyond what a CPU can train.
- step_kfac / step_first_order = 1 + step overhead of the plan (CP-SAT's), measured here by
  the planner's replay on the reference profile. The planned step includes the refresh
  cycle's K-FAC work amortised over its k steps.

    python examples/paper_setting.py [--time-limit 20] [--quick] [-o out/paper]

Then the zero-bubble families (ZB-H1, ZB-V, DualPipeV: split backward, W passes and K-FAC
sharing the bubbles) next to 1F1B and Chimera on bert-large, D = 8 (`--zero-bubble-only`:
just that table, to out/paper/zero_bubble.md).

Writes out/paper/paper_setting.md (the tables) and timeline pictures of the baseline and
the filled Chimera plans of the paper's setting (bert-large, D = 8, N = 8).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAPER = {"baseline_utilization": 0.598, "kfac_utilization": 0.976, "step_overhead": 0.065,
         "time_to_target": "0.50-0.75"}


def plan_row(profile, schedule: str, stages: int, micro_batches: int, time_limit: float):
    from pfcompile.graph.schedules import PipelineConfig
    from pfcompile.place.build import build_plan
    from pfcompile.place.options import PlanOptions

    cfg = PipelineConfig(schedule=schedule, stages=stages, micro_batches=micro_batches,
                         replicas=2 if schedule == "chimera" else 1)
    base, _, _ = build_plan(profile, replace(cfg, optimizer="adamw"), PlanOptions("none"))
    greedy, _, _ = build_plan(profile, cfg, PlanOptions("greedy"))
    t0 = time.perf_counter()
    cpsat, _, _ = build_plan(profile, cfg, PlanOptions("cpsat", time_limit=time_limit, workers=2, fixed_order=True))
    wall = time.perf_counter() - t0
    return {"plans": (base, greedy, cpsat), "baseline": base.stats, "greedy": greedy.stats, "cpsat": cpsat.stats,
            "cpsat_wall_s": wall}


ZB_SCHEDULES = ("1f1b", "chimera", "zb-h1", "zb-v", "dualpipev")


def zero_bubble_table(profile, depth: int, time_limit: float) -> list[str]:
    """Which pipeline trains fastest with and without K-FAC: the zero-bubble families
    (split backward, W passes competing with K-FAC for the bubbles) next to 1F1B and
    Chimera, on one profile and depth, N = D and 2D (DualPipeV: N = 2D only, as it needs
    N >= 2D). Step times are the steady state;
    utilization both ways: PipeFisher's (per step, mean over the cycle) and the strict one
    (compute time over the steady cycle)."""
    from pfcompile.graph.schedules import V_SCHEDULES

    rows = ["| schedule | D | N | baseline ms/step | baseline util. (PipeFisher / strict) "
            "| greedy ms/step | greedy overhead | greedy util. (PipeFisher / strict) | greedy k (lb) "
            "| CP-SAT ms/step | CP-SAT overhead | CP-SAT util. (PipeFisher / strict) | CP-SAT k (lb) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for schedule in ZB_SCHEDULES:
        if schedule in V_SCHEDULES and len(profile.parts) < 2 * depth:
            continue  # two chunks per device need 2D parts
        for n in (depth, 2 * depth) if schedule != "dualpipev" else (2 * depth,):
            print(f"zero bubble table: {schedule} D={depth} N={n} ...", file=sys.stderr, flush=True)
            r = plan_row(profile, schedule, depth, n, time_limit)
            b, g, c = r["baseline"], r["greedy"], r["cpsat"]

            def util(st):
                return f"{pct(st.get('utilization_pipefisher_mean'))} / {pct(st.get('utilization_strict'))}"

            rows.append(f"| {schedule} | {depth} | {n} | {b['step_time_ms']:.1f} | {util(b)} "
                        f"| {g['step_time_ms']:.1f} | {pct(g['step_overhead'])} | {util(g)} "
                        f"| {g['refresh_steps']} ({g['refresh_steps_lower_bound']}) "
                        f"| {c['step_time_ms']:.1f} | {pct(c['step_overhead'])} | {util(c)} "
                        f"| {c['refresh_steps']} ({c['refresh_steps_lower_bound']}) |")
            print(rows[-1], flush=True)
    rows += ["", "DualPipeV has no N = D row: it needs N >= 2D micro-batches (torch's ScheduleDualPipeV too)."]
    return rows


def steps_ratio(path: Path):
    """Median over seeds of K-FAC steps / AdamW steps to AdamW's final validation loss.

    A seed where K-FAC did not reach the target within the run counts as its run length
    over AdamW's (a lower bound on its ratio), so a miss pulls the median up, not out."""
    if not path.exists():
        return None, f"{path} not found: run `python benchmarks/convergence.py --json {path}` first"
    data = json.loads(path.read_text())
    steps = data["args"]["steps"]
    ratios, parts = [], []
    for row, run in zip(data["rows"], data["kfac"]):
        if row.get("ratio"):
            ratios.append(row["ratio"])
            parts.append(f"{row['ratio']:.2f}")
        else:
            ran = run["val"][-1][0] / steps
            ratios.append(ran)
            parts.append(f">{ran:.2f} (target not reached)")
    return statistics.median(ratios), f"median of {len(ratios)} seeds: {', '.join(parts)}"


def pct(x):
    return "—" if x is None else f"{100 * x:.1f}%"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=20.0, help="CP-SAT seconds per refresh length tried")
    ap.add_argument("--quick", action="store_true", help="bert-large only, D = 8 only")
    ap.add_argument("--convergence", type=Path, default=ROOT / "benchmarks" / "results" / "convergence.json")
    ap.add_argument("-o", "--output", type=Path, default=Path("out/paper"))
    ap.add_argument("--zero-bubble-only", action="store_true",
                    help="only the zero-bubble table (bert-large, D = 8): ZB-H1, ZB-V, DualPipeV next to 1F1B "
                         "and Chimera")
    args = ap.parse_args()
    if args.zero_bubble_only:
        from pfcompile.formats.jsonio import write_atomic
        from pfcompile.formats.profile import load_profile

        args.output.mkdir(parents=True, exist_ok=True)
        rows = zero_bubble_table(load_profile(str(ROOT / "profiles" / "bert-large-p100-ref.json")), 8, args.time_limit)
        text = "\n".join(["## Zero bubble with K-FAC (bert-large P100 reference, D = 8)", "", *rows, ""])
        write_atomic(args.output / "zero_bubble.md", text)
        print(text)
        return 0

    from pfcompile.formats.profile import load_profile
    from pfcompile.render import render_files

    args.output.mkdir(parents=True, exist_ok=True)
    models = ["bert-large"] if args.quick else ["bert-base", "bert-large"]
    depths = [8] if args.quick else [4, 8]
    lines = ["| model | schedule | D | N | baseline util. | greedy util. | greedy overhead | greedy k (lb) "
             "| CP-SAT util. | CP-SAT overhead | CP-SAT k (lb) | CP-SAT status, gap | solve s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    headline = None
    for model in models:
        profile = load_profile(str(ROOT / "profiles" / f"{model}-p100-ref.json"))
        for schedule in ("gpipe", "1f1b", "chimera"):
            for d in depths:
                for n in (d, 2 * d):
                    print(f"{model} {schedule} D={d} N={n} ...", file=sys.stderr, flush=True)
                    r = plan_row(profile, schedule, d, n, args.time_limit)
                    b, g, c = r["baseline"], r["greedy"], r["cpsat"]
                    gap = c.get("gap")
                    lines.append(
                        f"| {model} | {schedule} | {d} | {n} | {pct(b['utilization'])} | {pct(g['utilization'])} "
                        f"| {pct(g['step_overhead'])} | {g['refresh_steps']} ({g['refresh_steps_lower_bound']}) "
                        f"| {pct(c['utilization'])} | {pct(c['step_overhead'])} "
                        f"| {c['refresh_steps']} ({c['refresh_steps_lower_bound']}) "
                        f"| {c['solver_status']}, {pct(gap) if gap is not None else '—'} | {r['cpsat_wall_s']:.0f} |")
                    print(lines[-1], flush=True)
                    if model == "bert-large" and schedule == "chimera" and d == 8 and n == 8:
                        headline = r

    out = ["# PipeFisher's setting, planned by pfcompile", "",
           "Reference profiles: PipeFisher's published P100 per-block measurements (micro-batch 32, "
           "sequence 128). Utilization = busy time of all devices / (devices x cycle time); overhead = "
           "step time with K-FAC / step time without - 1; k = steps per K-FAC refresh (lb: its lower bound).",
           "", *lines, ""]
    ratio, how = steps_ratio(args.convergence)
    if headline is not None:
        c, g, b = headline["cpsat"], headline["greedy"], headline["baseline"]
        for name, plan in zip(("baseline", "greedy", "cpsat"), headline["plans"]):
            render_files(plan, timeline=str(args.output / f"chimera8-{name}.png"))
        t_cpsat = None if ratio is None else ratio * (1 + c["step_overhead"])
        t_greedy = None if ratio is None else ratio * (1 + g["step_overhead"])
        out += ["## Side by side with the paper (bert-large, Chimera, D = 8, N = 8)", "",
                "| | PipeFisher (paper) | pfcompile greedy | pfcompile CP-SAT |", "|---|---|---|---|",
                f"| utilization without K-FAC | {pct(PAPER['baseline_utilization'])} | {pct(b['utilization'])} | {pct(b['utilization'])} |",
                f"| utilization with K-FAC | {pct(PAPER['kfac_utilization'])} | {pct(g['utilization'])} | {pct(c['utilization'])} |",
                f"| step overhead | ~{pct(PAPER['step_overhead'])} | {pct(g['step_overhead'])} | {pct(c['step_overhead'])} |",
                f"| refresh interval k | — | {g['refresh_steps']} | {c['refresh_steps']} |",
                f"| time to target vs first order | {PAPER['time_to_target']} | "
                f"{'—' if t_greedy is None else f'{t_greedy:.2f}'} | {'—' if t_cpsat is None else f'{t_cpsat:.2f}'} |",
                "", f"Steps ratio (K-FAC / AdamW, bert-tiny MLM): {how}.",
                "Time to target = steps ratio x (1 + step overhead); see this script's docstring for what is assumed.",
                "", "Timelines: chimera8-baseline.png, chimera8-greedy.png, chimera8-cpsat.png", ""]
    out += ["## Zero bubble with K-FAC (bert-large, D = 8)", "",
            *zero_bubble_table(load_profile(str(ROOT / "profiles" / "bert-large-p100-ref.json")), 8, args.time_limit), ""]
    text = "\n".join(out)
    from pfcompile.formats.jsonio import write_atomic

    write_atomic(args.output / "paper_setting.md", text)
    print(text)
    print(f"wrote {args.output / 'paper_setting.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
