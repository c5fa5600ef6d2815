"""Planner benchmark: PipeFisher's setting, a memory limit, scaling, optimizers. Prints markdown tables.

Not a test (nothing is asserted): every ratio is measured side by side in one run, the
baseline, PipeFisher's greedy and CP-SAT on the same instance. All plans are replayed
(pfcompile.check.replay): the step times, utilizations and peaks below are the replay's.

    .venv/bin/python benchmarks/planner.py            # paper, memory, scaling up to 32x32, optimizers (~20 min)
    .venv/bin/python benchmarks/planner.py --quick    # a small scaling table
    .venv/bin/python benchmarks/planner.py --only scaling --big   # adds 32 stages x 128 micro-batches
    .venv/bin/python benchmarks/planner.py --only scaling --sizes 32x128 --instance-limit 100
    .venv/bin/python benchmarks/planner.py --only optimizers --time-limit 60   # K-FAC, Shampoo, Muon (~3 min)

Scaling uses a 32-block model with BERT-Large's per-block costs
(profiles/bert-large-p100-ref.json has 24 blocks; 32 stages need at least 32 parts), so
every D cuts it evenly.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pfcompile.check.replay import replay  # noqa: E402
from pfcompile.formats.errors import InputError  # noqa: E402
from pfcompile.formats.ops import PASS_KINDS  # noqa: E402
from pfcompile.formats.optimizers import OPTIMIZER_KINDS  # noqa: E402
from pfcompile.formats.optimizers import optimizer as optimizer_decl  # noqa: E402
from pfcompile.formats.plan import plan_from_json  # noqa: E402
from pfcompile.formats.profile import Profile, load_profile  # noqa: E402
from pfcompile.formats.verify import verify_plan  # noqa: E402
from pfcompile.graph.schedules import PipelineConfig  # noqa: E402
from pfcompile.place.budget import Budget  # noqa: E402
from pfcompile.place.build import build_plan  # noqa: E402
from pfcompile.place.options import Planning, PlanOptions  # noqa: E402
from pfcompile.place.solver import solve_plan  # noqa: E402

PAPER = REPO / "profiles" / "bert-large-p100-ref.json"


def scaled_profile(blocks: int) -> Profile:
    """BERT-Large's block costs, `blocks` blocks (a synthetic model for scaling only)."""
    prof = load_profile(str(PAPER))
    b0 = prof.part("block0")
    lay0 = [l for l in prof.covered_layers if l.part == "block0"]
    prof.parts = [prof.parts[0], *(replace(b0, name=f"block{b}") for b in range(blocks)), prof.parts[-1]]
    prof.covered_layers = [replace(l, name=f"block{b}.{l.name.split('.', 1)[1]}", part=f"block{b}")
                        for b in range(blocks) for l in lay0]
    prof.model = {**prof.model, "name": f"bert-large-{blocks}-blocks", "layers": blocks}
    prof.provenance = {**prof.provenance, "note": f"benchmark: bert-large block costs x {blocks} blocks"}
    prof.to_json()
    return prof


def table(headers: list[str], rows: list[list]) -> str:
    def cell(v):
        if isinstance(v, float):
            return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.0f}"
        return str(v)
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def pct(x) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def row(name: str, plan, base_step: float, t: float) -> list:
    st = plan.stats
    return [name, st["refresh_steps"], st.get("refresh_steps_lower_bound", "-"), round(st["step_time_ms"], 2),
            pct(st["step_time_ms"] / base_step - 1), pct(st["utilization"]), st.get("solver_status", "-"),
            pct(st.get("gap")), round(t, 1), f"{max(st['peak_memory_bytes']) / 2**30:.2f}"]


HEAD = ["method", "k", "k lower bound", "step ms", "step overhead", "utilization", "status", "gap", "seconds",
        "peak GiB"]


PAPER_HEAD = ["method", "inversion", "precond", "k (lower bound)", "step ms (steady)", "overhead vs canonical",
              "overhead vs tight", "util. PipeFisher per step", "util. PipeFisher mean", "util. strict", "status",
              "gap", "seconds"]


def paper_row(name: str, plan, t: float) -> list:
    st = plan.stats
    per_step = "/".join(f"{100 * u:.1f}" for u in st["utilization_pipefisher"])
    return [name, plan.config.inversion, plan.config.precond_division,
            f"{st['refresh_steps']} ({st.get('refresh_steps_lower_bound', '-')})", f"{st['step_time_ms']:.1f}",
            pct(st["step_overhead"]), pct(st.get("step_overhead_tight")), per_step,
            pct(st["utilization_pipefisher_mean"]), pct(st["utilization_strict"]), st.get("solver_status", "-"),
            pct(st.get("gap")), round(t, 1)]


def paper(time_limit: float, pareto_division: tuple[str, str] = ("pipefisher", "split")):
    """Every division of work (--inversion x --precond) by the greedy (PipeFisher's method)
    and CP-SAT (fixed and free order); then the Pareto table (k against step time) of
    CP-SAT, fixed order, on `pareto_division`. Rows print as they finish."""
    from pfcompile.place.build import pareto

    prof = load_profile(str(PAPER))
    cfg = PipelineConfig(schedule="chimera", stages=8, micro_batches=8)
    print("## PipeFisher's setting: BERT-Large (P100 reference), Chimera, D = 8, N = 8, micro-batch 32\n")
    print(f"CP-SAT: {time_limit:.0f} s per k tried, 2 workers; step times are the steady state (the cycle as it "
          f"repeats); overhead against the canonical first-order plan and against the tight one (the same order "
          f"with its syncs placed by CP-SAT); utilization by PipeFisher's definition (one step window, "
          f"collectives busy; per step of the cycle and their mean) and the strict one (compute only, cycle "
          f"mean).\n", flush=True)
    base, _, _ = build_plan(prof, replace(cfg, optimizer="adamw", defer_stats=False), PlanOptions("none"))
    print(f"Baseline (no K-FAC): {base.stats['step_time_ms']:.1f} ms/step, utilization (strict) "
          f"{pct(base.stats['utilization_strict'])}, PipeFisher's {pct(base.stats['utilization_pipefisher_mean'])}\n",
          flush=True)
    print("| " + " | ".join(PAPER_HEAD) + " |\n|" + "|".join("---" for _ in PAPER_HEAD) + "|", flush=True)
    greedy = None
    for inversion in ("balanced", "pipefisher", "all"):
        for precond in ("all", "split", "layers"):
            c = replace(cfg, inversion=inversion, precond=precond)
            for name, method, fixed in (("greedy (PipeFisher)", "greedy", True), ("cpsat fixed order", "cpsat", True),
                                        ("cpsat free order", "cpsat", False)):
                t0 = time.perf_counter()
                plan, _, _ = build_plan(prof, c, PlanOptions(method, time_limit=time_limit, fixed_order=fixed))
                print("| " + " | ".join(str(v) for v in paper_row(name, plan, time.perf_counter() - t0)) + " |",
                      flush=True)
                if greedy is None and method == "greedy":
                    greedy = plan
    inversion, precond = pareto_division
    print(f"\n### Pareto: CP-SAT fixed order, --inversion {inversion} --precond {precond}, k from its lower bound "
          f"until the step time stops falling\n", flush=True)
    head = ["k", "step ms (steady)", "overhead vs canonical", "overhead vs tight", "status", "gap",
            "util. PipeFisher mean", "util. strict"]
    print("| " + " | ".join(head) + " |\n|" + "|".join("---" for _ in head) + "|", flush=True)
    for plan in pareto(prof, replace(cfg, inversion=inversion, precond=precond), PlanOptions(time_limit=time_limit)):
        st = plan.stats
        print(f"| {st['refresh_steps']} | {st['step_time_ms']:.1f} | {pct(st['step_overhead'])} | "
              f"{pct(st.get('step_overhead_tight'))} | {st['solver_status']} | {pct(st.get('gap'))} | "
              f"{pct(st['utilization_pipefisher_mean'])} | {pct(st['utilization_strict'])} |", flush=True)
    print()
    return greedy


def memory(greedy, time_limit: float) -> None:
    """A limit 20% below the greedy's peak; if the family's order cannot meet it, the free
    order is tried, and the tightest limit the family's order can meet is shown too."""
    prof = load_profile(str(PAPER))
    peak = max(greedy.stats["peak_memory_bytes"])
    base_step = greedy.stats["baseline_step_time_ms"]
    print(f"## Memory limit 20% below the greedy plan's peak ({peak / 2**30:.2f} GiB -> {0.8 * peak / 2**30:.2f} GiB)\n")
    rows = [row("greedy (no memory model)", greedy, base_step, 0.0)]
    tried = [(int(0.8 * peak), True), (int(0.8 * peak), False)]
    while tried:
        limit, fixed = tried.pop(0)
        cfg = PipelineConfig(schedule="chimera", stages=8, micro_batches=8, memory_limit_bytes=limit)
        name = f"cpsat {'fixed' if fixed else 'free'} order, limit {limit / 2**30:.2f} GiB"
        t0 = time.perf_counter()
        try:
            plan = solve_plan(prof, cfg, PlanOptions(time_limit=time_limit, fixed_order=fixed))
            rows.append(row(name, plan, base_step, time.perf_counter() - t0))
        except InputError as e:
            print(f"- {name}: `{e}`")
            if fixed and "smallest feasible limit under the family's order is " in str(e):
                smallest = int(str(e).split("smallest feasible limit under the family's order is ")[1].split()[0])
                tried.append((smallest, True))
    print()
    print(table(HEAD, rows))
    print()


OPTIMIZER_SCHEDULES = ("chimera", "1f1b", "zb-v")
OPTIMIZER_NAMES = ("kfac", "shampoo", "soap", "muon")
# the aims the optimizers table is read against: Muon in the bubbles at most half its
# appended overhead; Shampoo and SOAP at most 2% over the first-order step at their chosen k
MUON_AIM_RATIO = 0.5
SHAMPOO_AIM_OVERHEAD = 0.02
DEFERRED = "cpsat, deferred stats"  # the method column of CP-SAT's plan with --defer-stats

OPTIMIZER_HEAD = ["optimizer", "method", "precond", "k (lb)", "step ms", "overhead vs canonical",
                  "overhead vs best first-order", "CP-SAT bound ms", "status, gap", "peak GiB",
                  "stage 0's rank: work after its last pass, ms/step", "seconds"]


def exposed_after_last_pass(plan) -> float:
    """The optimizer work stage 0's first rank runs after its last pass of each step (mean ms
    per step). Stage 0's last backward ends the step's longest chain and its next forward
    starts the next step's, so work placed between them lengthens the step one for one."""
    steps = plan.ranks[plan.rank_of(0, 0)]
    total = 0.0
    for ops in steps:
        last = max(p.end for p in ops if p.op.kind in PASS_KINDS)
        total += sum(p.end - p.start for p in ops if p.op.kind in OPTIMIZER_KINDS and p.start >= last)
    return total / len(steps)


def best_first_order(prof: Profile, cfg: PipelineConfig, time_limit: float) -> tuple[float, float, str]:
    """(canonical, best, status): the family's first-order step as its order posts it, and the
    best first-order plan CP-SAT finds with the same limit as the plans it is compared with
    (the plans' own tight baseline gets 10 s, which a zero-bubble family does not always
    prove optimal in)."""
    first_order = replace(cfg, optimizer="adamw", defer_stats=False)
    canonical = build_plan(prof, first_order, PlanOptions("none"))[0].stats["step_time_ms"]
    tight = solve_plan(prof, first_order, PlanOptions(time_limit=time_limit), Planning(budget=Budget(time_limit)))
    return canonical, min(canonical, tight.stats["step_time_ms"]), tight.stats.get("solver_status", "-")


def optimizers(time_limit: float, names: tuple[str, ...] = OPTIMIZER_NAMES) -> None:
    """K-FAC, Shampoo and Muon on PipeFisher's profile, D = 8, N = 8, in three families:
    appended (the family's order, every step's work after its last pass), PipeFisher's
    greedy and CP-SAT, each under `time_limit` seconds of wall time (as `pfcompile plan
    --time-limit`). Appended is `--method none`, which does every layer's work on every
    replica (`--precond all`) and refreshes every step (k = 1); with replicas it is also
    shown with the work divided (`--precond layers`). The greedy and CP-SAT rows plan each
    division and keep the fastest (`--precond auto`). An optimizer with per-step
    statistics (Shampoo, SOAP) is also planned by CP-SAT with them deferred (`--defer-stats`)."""
    prof = load_profile(str(PAPER))
    print(f"## Optimizers in the bubbles: {PAPER.name}, D = 8, N = 8\n")
    print(f"Each plan under a {time_limit:.0f} s wall-clock limit, Python included (`pfcompile plan --time-limit`), "
          f"2 workers. Load average at the start: {load_average()}\n", flush=True)
    for schedule in OPTIMIZER_SCHEDULES:
        cfg = PipelineConfig(schedule=schedule, stages=8, micro_batches=8, replicas=2 if schedule == "chimera" else 1)
        canonical, tight, tight_status = best_first_order(prof, cfg, time_limit)
        print(f"### {schedule}\n\nFirst-order (AdamW) step: canonical {canonical:.1f} ms, best plan {tight:.1f} ms "
              f"({tight_status})\n", flush=True)
        print("| " + " | ".join(OPTIMIZER_HEAD) + " |\n|" + "|".join("---" for _ in OPTIMIZER_HEAD) + "|", flush=True)
        methods = [("appended", "none", "auto", False)]
        if cfg.replicas > 1:
            methods.append(("appended", "none", "layers", False))
        methods += [("greedy", "greedy", "auto", False), ("cpsat", "cpsat", "auto", False),
                    (DEFERRED, "cpsat", "auto", True)]
        steps: dict[tuple[str, str], float] = {}
        for name in names:
            for label, method, precond, defer in methods:
                if defer and not optimizer_decl(name).can_defer_stats:
                    continue
                t0 = time.perf_counter()
                plan, _, _ = build_plan(prof, replace(cfg, optimizer=name, defer_stats=defer),
                                        PlanOptions(method, time_limit=time_limit, precond=precond),
                                        planning=Planning(budget=Budget(time_limit)))
                st = plan.stats
                division = plan.config.precond_division
                steps[(name, f"{label} ({division})" if label == "appended" else label)] = st["step_time_ms"]
                bound = st.get("best_bound_step_time_ms")
                status = st.get("solver_status", "-") + ("" if st.get("gap") is None else f", {pct(st['gap'])}")
                print("| " + " | ".join(str(v) for v in [
                    name, label, division, f"{st['refresh_steps']} ({st.get('refresh_steps_lower_bound', '-')})",
                    f"{st['step_time_ms']:.1f}", pct(st["step_time_ms"] / canonical - 1), pct(st["step_time_ms"] / tight - 1),
                    "-" if bound is None else f"{bound:.1f}", status, f"{max(st['peak_memory_bytes']) / 2**30:.2f}",
                    f"{exposed_after_last_pass(plan):.1f}", round(time.perf_counter() - t0, 1)]) + " |", flush=True)
        print()
        for line in aims(steps, canonical, tight):
            print(f"- {line}")
        print(flush=True)
    print(f"Load average at the end: {load_average()}\n")


def aims(steps: dict[tuple[str, str], float], canonical: float, tight: float) -> list[str]:
    """The two aims, each against both first-order steps."""
    lines = []
    for ref_name, ref in (("canonical", canonical), ("best first-order", tight)):
        planned = steps.get(("muon", "cpsat"), 0.0) / ref - 1
        for (name, label), step in steps.items():
            if name == "muon" and label.startswith("appended"):
                appended = step / ref - 1
                ratio = planned / appended if appended > 0 else float("inf")
                lines.append(f"Muon vs {ref_name}: CP-SAT {pct(planned)} / {label} {pct(appended)} = {ratio:.2f} "
                             f"(aim <= {MUON_AIM_RATIO}: {'met' if ratio <= MUON_AIM_RATIO else 'NOT met'})")
        for name, title in (("shampoo", "Shampoo"), ("soap", "SOAP")):
            for label, how in (("cpsat", "CP-SAT"), (DEFERRED, "CP-SAT, statistics deferred")):
                if (name, label) in steps:
                    over = steps[(name, label)] / ref - 1
                    lines.append(f"{title} vs {ref_name}: {how} {pct(over)} (aim <= {pct(SHAMPOO_AIM_OVERHEAD)}: "
                                 f"{'met' if over <= SHAMPOO_AIM_OVERHEAD else 'NOT met'})")
    return lines


def scaling(quick: bool, instance_limit: float, big: bool, sizes: list[tuple[int, int]] | None = None) -> None:
    prof = scaled_profile(32)
    Ds = (4, 8) if quick else (4, 8, 16, 32)
    if sizes:
        grid = sizes
    else:
        grid = [(D, N) for D in Ds for N in ((D,) if quick else (D, 4 * D) if D < 32 or big else (D,))]
    print(f"## Scaling ({prof.name}; {instance_limit:.0f} s of wall time per instance, Python included, shared by the k tried; "
          f"2 workers)\n")
    rows = []
    for D, N in grid:
        for family in ("1f1b", "chimera"):
            cfg = PipelineConfig(schedule=family, stages=D, micro_batches=N)
            greedy, _, _ = build_plan(prof, cfg, PlanOptions("greedy"))
            # the instance limit is a hard wall-clock limit for the whole planning, Python
            # included; the time kept for the replays at the end is estimated, as `pfcompile
            # plan` does from its baseline's replay, from one replay of the greedy's plan per op
            t_replay = time.perf_counter()
            replay(greedy, prof)
            budget = Budget(instance_limit)
            budget.replay_s_per_op = (time.perf_counter() - t_replay) / max(1, greedy.stats["tasks"])
            t0 = time.perf_counter()
            plan = solve_plan(prof, cfg, PlanOptions(total_time_limit=instance_limit), Planning(budget=budget))
            t_verify = time.perf_counter()  # what `pfcompile plan` does before writing: verify the file's form
            verify_plan(plan_from_json(plan.to_json(), "<plan>"), "<plan>", profile_model=prof.model, profile_hash=prof.hash)
            t = time.perf_counter() - t0
            st = plan.stats
            stage = {**st.get("stage_seconds", {}), "verify": time.perf_counter() - t_verify}
            rows.append([family, D, N, st["tasks"], st["tasks_model"], "yes" if st["curvature_grouped"] else "no",
                         f"{st['refresh_steps']} / {greedy.stats['refresh_steps']}",
                         round(st["step_time_ms"], 1), f"{st['step_time_ms'] / greedy.stats['step_time_ms']:.4f}",
                         st["solver_status"].split(" ")[0], pct(st["gap"]), round(t, 1),
                         *(round(stage.get(k, 0.0), 1) for k in STAGES), peak_rss_mib()])
            print(f"  {family} D={D} N={N}: {rows[-1]}", file=sys.stderr, flush=True)
    print(table(["family", "D", "N", "plan ops", "model tasks", "curv grouped", "k cpsat / greedy", "step ms",
                 "cpsat / greedy step", "status", "gap", "seconds", *(f"{k} s" for k in STAGES),
                 "peak RSS MiB"], rows))
    print(f"\n(per-stage seconds are the CP-SAT planner's: {', '.join(STAGES)} (the plan's check before "
          f"writing, as `pfcompile plan` does); the greedy and the first-order baseline run before and are not "
          f"counted. Load average at the end: {load_average()})\n")


STAGES = ("graph", "warm start", "solve", "replay", "verify")


def peak_rss_mib() -> int:
    """The process's peak resident set so far (Linux ru_maxrss is in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


def load_average() -> str:
    import os

    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small scaling table, shorter limits")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="paper/memory: CP-SAT seconds per k tried; optimizers: wall-clock seconds per plan")
    ap.add_argument("--instance-limit", type=float, default=None, help="scaling: CP-SAT seconds per instance")
    ap.add_argument("--only", choices=("paper", "memory", "scaling", "optimizers"), default=None)
    ap.add_argument("--optimizers", nargs="+", choices=OPTIMIZER_NAMES, default=OPTIMIZER_NAMES,
                    help="optimizers: only these (default all)")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="profile the Python side with cProfile and print its N most expensive functions")
    ap.add_argument("--big", action="store_true",
                    help="scaling: also 32 stages x 128 micro-batches (minutes of Python per k tried)")
    ap.add_argument("--sizes", nargs="+", default=None, metavar="DxN",
                    help="scaling: only these stages x micro-batches, e.g. 32x128")
    args = ap.parse_args()
    sizes = None
    if args.sizes:
        try:
            sizes = [tuple(int(x) for x in s.lower().split("x")) for s in args.sizes]
            assert all(len(t) == 2 for t in sizes)
        except (ValueError, AssertionError):
            ap.error(f"--sizes: expected DxN like 32x128, got {' '.join(args.sizes)}")
    tl = args.time_limit or (10.0 if args.quick else 60.0)
    il = args.instance_limit or (15.0 if args.quick else 30.0)
    if args.cprofile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.runcall(run, args, tl, il, sizes)
        print(f"## Python profile (cProfile, {args.cprofile} most expensive by own time; CP-SAT's search is "
              f"the native `solve`)\n\n```")
        pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(args.cprofile)
        print("```")
        return
    run(args, tl, il, sizes)


def run(args, tl: float, il: float, sizes) -> None:
    greedy = None
    if args.only in (None, "paper", "memory"):
        greedy = paper(tl) if args.only != "memory" else build_plan(load_profile(str(PAPER)), PipelineConfig(schedule="chimera", stages=8, micro_batches=8), PlanOptions("greedy"))[0]
    if args.only in (None, "memory"):
        memory(greedy, tl)
    if args.only in (None, "scaling"):
        scaling(args.quick, il, args.big, sizes)
    if args.only in (None, "optimizers"):
        optimizers(tl, tuple(args.optimizers))


if __name__ == "__main__":
    main()
