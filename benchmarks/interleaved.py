"""An optimizer's overhead over AdamW with both plans in one launch (not a test: it times).

Two launches a minute apart run at different speeds on a VM whose speed moves within
minutes, so the overhead of two separate launches (promise.py's paired ratio) carries that
drift. Here one torchrun builds both plans of a model on every rank (`-m runtime.interleave`:
the same stages, data and settings as `-m runtime` builds) and runs their steps in
alternating blocks, A B A B ..., a second or two each. Each block skips its first step
(the switch leaves the other plan's tensors in the caches) and times the next n steps,
n a multiple of both plans' refresh cycles, as the steady step period: (start of the
step after the last timed one - start of the first timed one) / n on each rank, averaged
over the ranks (runtime.observe.measure.step_period's definition). The first block of each
plan warms up and is dropped. A launch's overhead is the mean period of PLAN's blocks over
BASE's, minus 1; `--rounds` launches, the order of the two reversed every other one.

    .venv/bin/python benchmarks/interleaved.py BASE PLAN [--rounds 5] [--blocks 6] [--min-steps 8]
        [--set SECTION.KEY=VALUE ...]   (PLAN's settings, e.g. muon.ns_dtype=float32)
        [--check-losses]   (each plan alone too: its losses must equal those in the shared launch)
        [--traces DIR [--profile PROFILE]]   (each timed block of each plan as a measured
                          trace, for `pfcompile inspect TRACE --against PLAN`; with the plans'
                          profile, the overhead split cause by cause over those blocks)
    .venv/bin/python benchmarks/interleaved.py --smoke   # bert-tiny AdamW against K-FAC, 1 round (tests)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
# the runtime benchmark's launch and plan helpers (torchrun, plan)
_spec = importlib.util.spec_from_file_location("bench_runtime", Path(__file__).with_name("runtime.py"))
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

BLOCKS, MIN_STEPS = 6, 8  # the defaults: ~1-2 s blocks on the tiny models here


class Pair(NamedTuple):
    """One launch: each plan's step period (ms) per timed block, in run order, each plan's
    loss at every step, and its compute ops' time per step by class, [measured, planned]
    summed over the ranks (runtime.interleave.op_time)."""
    base_ms: list[float]
    plan_ms: list[float]
    base_losses: list[float]
    plan_losses: list[float]
    base_ops: dict
    plan_ops: dict
    base_os: list[float]  # minor page faults and involuntary context switches per step, the ranks' sum
    plan_os: list[float]

    @property
    def overhead(self) -> float:
        return statistics.fmean(self.plan_ms) / statistics.fmean(self.base_ms) - 1


def block_steps(plans: list[Path], min_steps: int) -> int:
    """n: the timed steps of a block, whole refresh cycles of every plan, at least min_steps."""
    k = math.lcm(*(json.loads(p.read_text())["config"]["refresh_steps"] for p in plans))
    return k * math.ceil(min_steps / k)


def launch_pair(base: Path, plan: Path, blocks: int, n: int, base_first: bool, settings: list[str],
                trace_prefix: Path | None = None) -> Pair:
    plans, labels = ([base, plan], "base,plan") if base_first else ([plan, base], "plan,base")
    args = ["-m", "runtime.interleave", *map(str, plans), "--blocks", str(blocks), "--timed", str(n),
            "--labels", labels, "--set-for", "1" if base_first else "0"]
    if trace_prefix:
        args += ["--trace-prefix", str(trace_prefix)]
    args += [x for s in settings for x in ("--set", s)]
    out = bench.torchrun(args, json.loads(plan.read_text())["config"]["world_size"])
    periods, losses, ops, events = out["periods_ms"], out["losses"], out["op_ms"], out["os_per_step"]
    if not base_first:
        periods, losses, ops, events = periods[::-1], losses[::-1], ops[::-1], events[::-1]
    return Pair(*periods, *losses, *ops, *events)


def losses_alone(plan: Path, steps: int, settings: list[str], log_dir: str) -> list[float]:
    """The plan's losses in a launch of its own (`-m runtime`), the same steps."""
    args = ["-m", "runtime", str(plan), "--steps", str(steps), "--data", "synthetic", "--json", "--log-dir", log_dir,
            *[x for s in settings for x in ("--set", s)]]
    return bench.torchrun(args, json.loads(plan.read_text())["config"]["world_size"])["losses"]


def rounds(base: Path, plan: Path, count: int, blocks: int = BLOCKS, min_steps: int = MIN_STEPS,
           settings: tuple[str, ...] = (), say=None, trace_dir: Path | None = None) -> list[Pair]:
    """`count` launches of the pair, BASE's blocks first in even rounds, PLAN's in odd ones;
    with `trace_dir`, each timed block of each plan as a measured trace there
    (runtime.interleave.block_trace_path, labelled base and plan)."""
    n = block_steps([base, plan], min_steps)
    out = []
    for r in range(count):
        prefix = trace_dir / f"round{r + 1}" if trace_dir else None
        out.append(launch_pair(base, plan, blocks, n, r % 2 == 0, list(settings), prefix))
        if say:
            say(f"round {r + 1}: {plan.stem} over {base.stem}, in one launch: {out[-1].overhead:+.1%}")
    return out


# the plan replayed with a block's own op times (pfcompile.calibrate.compare.replayed_with_measured),
# each row adding one cause to the one before
SPLIT_ROWS = (("predicted", None, "the plans' step times replayed from the profile"),
              ("planned_work_step_ms", "the op times' level", "each op at its mean time in the block"),
              ("mean_ops_step_ms", "the runtime's work beyond the plan", "with the runtime's work between ops"),
              ("level_ops_step_ms", "a rank's slow spells", "each rank's level in each step"),
              ("own_ops_step_ms", "each op's spread beyond its rank's level", "each step's own op times"),
              ("measured_step_ms", "messages and collectives beyond the model", "measured"))


def split_overhead(folder: Path, base: Path, plan: Path, profile_path: Path) -> dict[str, list[float]] | None:
    """Each plan's step (ms) at every row of SPLIT_ROWS, the mean over all the traced blocks
    in `folder` (`--traces`): the overhead PLAN/BASE - 1 row by row says which cause adds
    what to the planned overhead, in the same launches (no drift between the two plans).
    None when a plan has no block with two whole refresh cycles (`--traces` makes n >= 3 k)."""
    from pfcompile.calibrate.compare import replayed_with_measured
    from pfcompile.calibrate.measured import load_measured
    from pfcompile.check.replay import replay
    from pfcompile.formats.plan import load_plan
    from pfcompile.formats.profile import load_profile

    profile = load_profile(str(profile_path))
    out = {}
    for which, path in (("base", base), ("plan", plan)):
        p = load_plan(str(path))
        predicted = replay(p, profile, cycles=max(3, 16 // p.refresh_steps), check_memory=False).step_time_ms
        rows = [replayed_with_measured(load_measured(str(t)), p, profile)
                for t in sorted(folder.glob(f"round*-block*-{which}-{path.stem}.trace.json"))]
        rows = [r for r in rows if r]
        if not rows:
            return None
        out[which] = [predicted] + [statistics.fmean(r[key] for r in rows) for key, _, _ in SPLIT_ROWS[1:]]
        out[which + "_blocks"] = len(rows)
    return out


def format_split(split: dict[str, list[float]] | None) -> str:
    if split is None:
        return "the overhead, cause by cause: n/a (no traced block holds two whole refresh cycles)"
    lines = [f"the overhead, cause by cause (each plan replayed with its blocks' own op times; "
             f"the mean over {split['base_blocks']} BASE and {split['plan_blocks']} PLAN blocks):",
             "| row | BASE ms/step | PLAN ms/step | overhead | added (points) | cause |",
             "|---|---:|---:|---:|---:|---|"]
    prev = None
    for (_, cause, name), b, p in zip(SPLIT_ROWS, split["base"], split["plan"]):
        over = p / b - 1
        added = f"{100 * (over - prev):+.1f}" if prev is not None else ""
        lines.append(f"| {name} | {b:.2f} | {p:.2f} | {over:+.1%} | {added} | {cause or ''} |")
        prev = over
    return "\n".join(lines)


def planned_overhead(base: Path, plan: Path) -> float:
    step = lambda p: json.loads(p.read_text())["stats"]["step_time_ms"]  # noqa: E731
    return step(plan) / step(base) - 1


def smoke(folder: Path) -> tuple[Path, Path]:
    return tuple(bench.plan("profiles/bert-tiny-cpu.json", folder, f"bert-tiny-1f1b-{opt}", "--schedule", "1f1b",
                            "--micro-batches", "4", "--optimizer", opt, "--method", method)
                 for opt, method in (("adamw", "none"), ("kfac", "greedy")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plans", nargs="*", type=Path, help="BASE PLAN (both of one model, stage layout and world)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--blocks", type=int, default=BLOCKS, help="blocks of each plan per launch, the first a warm-up")
    ap.add_argument("--min-steps", type=int, default=MIN_STEPS, help="timed steps per block, at least (whole refresh cycles)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="a setting of PLAN's run")
    ap.add_argument("--check-losses", action="store_true",
                    help="also run each plan in a launch of its own and check its losses equal those of the first "
                         "round's, step by step (that the two in one process leave each other alone)")
    ap.add_argument("--traces", type=Path, default=None, metavar="DIR",
                    help="write each timed block of each plan as a measured trace in DIR "
                         "(`pfcompile inspect TRACE --against PLAN` splits its step time)")
    ap.add_argument("--profile", type=Path, default=None,
                    help="with --traces: the plans' profile, to split the overhead cause by cause (split_overhead)")
    ap.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.blocks < 2:
        ap.error("--blocks: at least 2 (the first of each plan is a warm-up)")
    if a.profile and not a.traces:
        ap.error("--profile: only with --traces (it splits the traced blocks' overhead)")
    with tempfile.TemporaryDirectory(prefix="interleaved-") as tmp:
        if a.smoke:
            a.plans, a.rounds, a.blocks, a.min_steps, a.check_losses = list(smoke(Path(tmp))), 1, 2, 2, True
            a.traces, a.profile = Path(tmp) / "traces", ROOT / "profiles" / "bert-tiny-cpu.json"
        if len(a.plans) != 2:
            ap.error("give two plans: BASE PLAN")
        base, plan = a.plans
        print(f"{plan.name} over {base.name}: {a.rounds} launches of {a.blocks} blocks each of "
              f"{block_steps([base, plan], a.min_steps)} timed steps; load average {os.getloadavg()}", flush=True)
        if a.traces:
            a.traces.mkdir(parents=True, exist_ok=True)
            # two whole refresh cycles in every block, wherever it starts, for the split
            a.min_steps = max(a.min_steps, 3 * max(json.loads(p.read_text())["config"]["refresh_steps"]
                                                   for p in (base, plan)))
        pairs = rounds(base, plan, a.rounds, a.blocks, a.min_steps, tuple(a.set), say=print, trace_dir=a.traces)
        over = [p.overhead for p in pairs]
        planned = planned_overhead(base, plan)
        print(f"\nload average after: {os.getloadavg()}\n")
        print("| round | first | BASE ms/step (blocks' mean, min–max) | PLAN ms/step | overhead "
              "| passes, measured/planned: BASE, PLAN | update and optimizer ops: BASE, PLAN "
              "| page faults per step: BASE, PLAN | preemptions per step: BASE, PLAN |")
        print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
        for r, p in enumerate(pairs):
            level = lambda ops, c: ops[c][0] / ops[c][1] if ops[c][1] else float("nan")  # noqa: E731
            print(f"| {r + 1} | {'BASE' if r % 2 == 0 else 'PLAN'} | {statistics.fmean(p.base_ms):.1f} "
                  f"({min(p.base_ms):.1f}–{max(p.base_ms):.1f}) | {statistics.fmean(p.plan_ms):.1f} "
                  f"({min(p.plan_ms):.1f}–{max(p.plan_ms):.1f}) | {p.overhead:+.1%} | "
                  f"{level(p.base_ops, 'passes'):.3f}, {level(p.plan_ops, 'passes'):.3f} | "
                  + ", ".join(f"{ops['update and optimizer'][0]:.1f} / {ops['update and optimizer'][1]:.1f} ms"
                              for ops in (p.base_ops, p.plan_ops))
                  + f" | {p.base_os[0]:.0f}, {p.plan_os[0]:.0f} | {p.base_os[1]:.1f}, {p.plan_os[1]:.1f} |")
        if a.check_losses:  # the two plans in one process train as each does alone
            same = [losses_alone(base, len(pairs[0].base_losses), [], f"{tmp}/base-alone") == pairs[0].base_losses,
                    losses_alone(plan, len(pairs[0].plan_losses), list(a.set), f"{tmp}/plan-alone")
                    == pairs[0].plan_losses]
            print(f"losses step by step as in launches of their own: BASE {'equal' if same[0] else 'DIFFERENT'}, "
                  f"PLAN {'equal' if same[1] else 'DIFFERENT'}")
            if not all(same):
                sys.exit(1)
        if a.traces and a.profile:
            print("\n" + format_split(split_overhead(a.traces, base, plan, a.profile)))
        mid = statistics.median(over)
        print(f"\noverhead in one launch: median {mid:+.1%} ({min(over):+.1%} to {max(over):+.1%}); planned "
              f"{planned:+.1%}; measured - planned {100 * (mid - planned):+.1f} points")


if __name__ == "__main__":
    main()
