"""Does a run keep its plan's promise? (issue 39). Not a test: it times.

For each model in turn (default bert-tiny, bert-mini, llama-tiny) a fresh profile is made on
this machine just before its own rounds (`pfcompile profile --ranks 2 --cold-cache`, every
optimizer's ops, the demo's short budget), then every optimizer is planned on 1F1B and on a zero-bubble
family (ZB-H1), 2 stages, 4 micro-batches: AdamW as the family's order (`--method none`;
`--adamw-method cpsat`: CP-SAT's first-order plan, its W passes placed as the optimizers'
are, a second definition of the baseline), the others by CP-SAT. Every plan runs once per
round with `torchrun --nproc-per-node 2 -m runtime`, the order reversed every other round,
for `--rounds` interleaved rounds. Nothing is calibrated. Per cell (model, schedule, optimizer):

- measured / predicted step time (median over rounds, min-max beside it), and measured /
  expected (the plan replayed with the profile's op-time spread, `expected_step_time_ms`:
  a run's mean step sees the stalls a spread makes, the plan's step time does not);
- "schedule alone": each run's measured/predicted divided by its compute ops' measured /
  profiled time (the runtime's op_ratio), median over rounds: a second definition, the
  step's error less the machine's speed at the run; the aim is the first;
- the optimizer's overhead over AdamW, measured minus planned, in points: per round the
  paired ratio of the optimizer's run to AdamW's run of that round (same model and
  schedule), its median over rounds, and the rounds' min-max;
- with `--interleaved`, the same overhead with both plans in one launch per round
  (benchmarks/interleaved.py: alternating blocks of steps, so the machine's drift between
  two launches does not enter it), against the planned one too: a second definition of the
  measured overhead, reported beside the first; and beside the planned overhead (the plans'
  step times), the one of their expected step times (a second definition of the planned
  overhead: a plan with less slack pays more for the same spread), and the same without the
  profile's runtime.busy (every plan varying as the probe's base run did);
- where the time went: one more traced run per cell (at least two whole refresh cycles after
  its warm-up, for the replay), through `pfcompile inspect TRACE --against PLAN --profile
  PROFILE --json` (each op kind's share of the step error, the time
  between ops with the runtime's own work in it (the trace's runtime row) against what the
  plan counts for it, the plan replayed with the run's own op times (first with the
  runtime's work between ops as the plan counts it, then as the run did it), its level split
  by op kind, and, within that one run, the pipeline ops and messages beside the optimizer's
  work against the same ones beside pipeline ops). Its measured step is the
  median of the per-step spans, the rounds' the run's mean (the runtime's step_ms): both
  definitions are reported, each over predicted.

With `--control`, each model and schedule gets one more cell: AdamW's plan run again as if it
were an optimizer's (the same file), its overhead 0 in truth. Its measured overheads are
the floor of both measurements on this machine, and the table ends with how often a cell
whose truth is its plan would land within ±2 points, were its rounds spread as the control's.

The machine's own speed is timed too (benchmarks/drift.py's fixed kernel, --kernel-seconds)
before profiling, before the rounds and after them: a profile predicts the speed the
machine had when it was made, and a table whose machine drifted says so beside it.

    .venv/bin/python benchmarks/promise.py [--models bert-tiny bert-mini llama-tiny]
        [--optimizers adamw kfac shampoo soap muon] [--schedules 1f1b zb-h1] [--rounds 5]
        [--steps 30] [--seconds 8] [--out out/promise] [--profile MODEL=PATH ...] [--kernel-seconds 10] [--interleaved] [--control]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

from rich.console import Console

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]


def _sibling(name: str):
    """Another benchmark script of this folder, as a module (its launch and table helpers)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench, race, drift, interleaved = (_sibling("runtime"), _sibling("race"), _sibling("drift"),
                                  _sibling("interleaved"))

PY = sys.executable
MODELS = ("bert-tiny", "bert-mini", "llama-tiny")
OPTIMIZERS = ("adamw", "kfac", "shampoo", "soap", "muon")
SCHEDULES = ("1f1b", "zb-h1")
# --control's cell: AdamW's plan file as a cell of its own, run as an optimizer's plan is
CONTROL = "control"
NS_DTYPE = "float32"  # Muon's Newton-Schulz iteration: float32 on a CPU (bfloat16 is a GPU's choice)


def profile(model: str, out: Path, reuse: str | None) -> Path:
    path = out / f"{model}.json"
    if reuse is not None:
        path.write_bytes(Path(reuse).read_bytes())
        return path
    cmd = [PY, "-m", "pfcompile", "profile", "--model", model, "--repeats", "10", "--warmup", "3",
           "--entry-budget", "0.5", "--ranks", "2", "--cold-cache", "--muon-ns-dtype", NS_DTYPE, "--quiet",
           *[x for o in OPTIMIZERS if o not in ("adamw", "kfac") for x in ("--optimizer", o)], "-o", str(path)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"promise: profiling {model} failed:\n{r.stderr[-2000:]}")
    return path


def make_plan(prof: Path, out: Path, schedule: str, opt: str, time_limit: float, adamw_method: str = "none") -> Path:
    method = ["--method", "none"] if opt == "adamw" and adamw_method == "none" else \
        ["--method", "cpsat", "--time-limit", str(time_limit), "--workers", "2"]
    return bench.plan(str(prof), out, f"{prof.stem}-{schedule}-{opt}", "--schedule", schedule, "--micro-batches", "4",
                      "--optimizer", opt, *method)


def flags_of(opt: str) -> tuple[str, ...]:
    return ("--set", f"muon.ns_dtype={NS_DTYPE}") if opt == "muon" else ()


def where_it_went(plan: Path, prof: Path, steps: int, warmup: int, opt: str, out: Path) -> dict:
    trace = out / f"{plan.stem}.trace.json"
    # inspect's replay needs two whole refresh cycles after the warm-up: a plan refreshing
    # rarely gets the steps for them
    k = json.loads(plan.read_text())["config"]["refresh_steps"]
    steps = max(steps, (-(-warmup // k) + 2) * k)
    bench.run_ours(plan, steps, warmup, "--trace", str(trace), *flags_of(opt))
    r = subprocess.run([PY, "-m", "pfcompile", "inspect", str(trace), "--against", str(plan), "--profile", str(prof),
                        "--json"], cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        return {"error": r.stderr.strip()[-300:]}
    return json.loads(r.stdout)


def print_aims(rows: list[dict]) -> None:
    """The issue's aims, counted over the cells, each by both definitions of its prediction."""
    def count(pairs) -> str:
        pairs = [(x, lim) for x, lim in pairs if x is not None]
        return f"{sum(abs(x) <= lim for x, lim in pairs)} of {len(pairs)}"

    def cell(row, measured: str, planned: str):
        if planned not in row or row[planned] is None or measured not in row:
            return None
        return statistics.median(row[measured]) - row[planned]

    controls = [r for r in rows if r["optimizer"] == CONTROL]
    rows = [r for r in rows if r["optimizer"] != CONTROL]
    over = [r for r in rows if r["optimizer"] != "adamw"]
    print("\nThe aims, cells met (measured/predicted within ±10%; overheads within ±2 points):\n")
    print(f"- measured/predicted: {count((r['ratio'] - 1, 0.10) for r in rows)}; against the expected step: "
          f"{count((statistics.median(r['measured_ms']) / r['expected_ms'] - 1 if r['expected_ms'] else None, 0.10) for r in rows)}")
    for label, measured in (("two launches", "overhead_measured"), ("one launch", "overhead_one_launch")):
        if any(measured in r for r in over):
            print(f"- overhead, {label}: against the plans' step times {count((cell(r, measured, 'overhead_planned'), 0.02) for r in over)}; "
                  f"against their expected_step_overhead {count((cell(r, measured, 'overhead_planned_expected'), 0.02) for r in over)}")
    if controls:
        print("\nThe floor: AdamW's plan against itself (0 in truth), measured as the cells are; beside each, how "
              "often a cell whose truth is its plan lands within ±2 points by this measure (its rounds resampled, "
              f"{FLOOR_DRAWS} draws of a median of as many rounds):\n")
        for r in controls:
            sides = [f"{label} {statistics.median(r[k]):+.1%} ({spread(r[k], '+.1%')}; within ±2 points "
                     f"{within_floor(r[k]):.0%})" for label, k in (("two launches", "overhead_measured"),
                                                                    ("one launch", "overhead_one_launch")) if k in r]
            print(f"- {r['model']} {r['schedule']}: " + "; ".join(sides))


FLOOR_DRAWS = 10_000


def within_floor(values: list[float], points: float = 0.02) -> float:
    """The share of medians of len(values) draws (with replacement) from a control's rounds that
    fall within ±points of 0: how often a cell whose truth is its plan meets the aim, were its
    rounds spread as the control's are (a bootstrap; seeded, so a table reprints the same)."""
    import random

    rng, n = random.Random(0), len(values)
    hits = sum(abs(statistics.median(rng.choices(values, k=n))) <= points for _ in range(FLOOR_DRAWS))
    return hits / FLOOR_DRAWS


def spread(v: list[float], fmt: str) -> str:
    return f"{format(min(v), fmt)}–{format(max(v), fmt)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--optimizers", nargs="+", choices=OPTIMIZERS, default=list(OPTIMIZERS))
    ap.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30, help="steps per run, warm-up included")
    ap.add_argument("--seconds", type=float, default=0.0,
                    help="raise a model's steps per run to this many seconds at its AdamW plan's predicted step "
                         "(0: --steps for every model)")
    ap.add_argument("--warmup", type=int, default=2, help="raised to one refresh cycle of the slowest-refreshing plan")
    ap.add_argument("--time-limit", type=float, default=10.0, help="CP-SAT seconds per plan")
    ap.add_argument("--adamw-method", choices=("none", "cpsat"), default="none",
                    help="AdamW's plan: the family's order (none), or CP-SAT's first-order plan, its free ops "
                         "(a zero-bubble family's W passes) placed as the optimizers' plans place theirs")
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "promise")
    ap.add_argument("--profile", action="append", default=[], metavar="MODEL=PATH",
                    help="reuse this profile for MODEL instead of profiling it (repeatable)")
    ap.add_argument("--no-traces", action="store_true", help="skip the traced run per cell")
    ap.add_argument("--interleaved", action="store_true",
                    help="also measure each optimizer's overhead with AdamW's plan in the same launch, in alternating "
                         "blocks of steps (benchmarks/interleaved.py), one launch per cell and round")
    ap.add_argument("--control", action="store_true",
                    help="add a control cell per model and schedule: AdamW's plan against itself, its overhead 0 in "
                         "truth, measured as every optimizer's is (two launches, and one with --interleaved): the "
                         "floor under the overhead aim on this machine")
    ap.add_argument("--kernel-seconds", type=float, default=10.0,
                    help="time benchmarks/drift.py's fixed kernel this long before profiling, before the rounds and "
                         "after them: how far the machine itself drifted (0: skip)")
    a = ap.parse_args()
    if "adamw" not in a.optimizers:
        a.optimizers.insert(0, "adamw")  # every overhead is over AdamW's run of the same round
    a.out.mkdir(parents=True, exist_ok=True)
    reuse = dict(x.split("=", 1) for x in a.profile)
    console = Console(stderr=True)
    from pfcompile.formats.jsonio import write_json

    print(f"\nCommit {race.commit()}; {a.rounds} interleaved rounds per model, each model profiled just before "
          f"its own rounds; 2 ranks x 1 thread, gloo; no calibration; AdamW's plan "
          f"{'in the family order' if a.adamw_method == 'none' else 'by CP-SAT (its W passes placed)'}.")
    rows, traced, facts = [], {}, {}
    for m in a.models:
        m_rows, m_traced, facts[m] = one_model(m, a, reuse.get(m), console)
        rows += m_rows
        traced.update({"/".join(k): v for k, v in m_traced.items()})
        # written after every model: a long table's finished models survive a stop
        write_json(a.out / "promise.json", {"rows": rows, "traced": traced, "models": facts})
    print_aims(rows)


def one_model(m: str, a, reuse: str | None, console) -> tuple[list[dict], dict, dict]:
    """One model's part of the table: a fresh profile, its plans, its interleaved rounds
    (separate launches, then one launch per cell with --interleaved) and its traced runs,
    right after one another, so the profile is minutes old at the rounds (the host's speed
    moves in spells of minutes); prints the model's tables and returns its rows, its traced
    runs' inspections and its load and speed."""
    load0, speed = os.getloadavg(), [machine_speed(a.kernel_seconds)]
    with console.status(f"profiling {m} (2 ranks, cold caches)"):
        prof = profile(m, a.out, reuse)
    plans = {}
    with console.status(f"planning {m}"):
        for s in a.schedules:
            for o in a.optimizers:
                plans[(m, s, o)] = make_plan(prof, a.out, s, o, a.time_limit, a.adamw_method)
            if a.control:
                plans[(m, s, CONTROL)] = plans[(m, s, "adamw")]
    load1 = os.getloadavg()
    speed.append(machine_speed(a.kernel_seconds))
    # each plan file read (and below, replayed) once: the control's is AdamW's
    read = {p: json.loads(p.read_text()) for p in set(plans.values())}
    made = {key: read[p] for key, p in plans.items()}
    warmup, steps = bench.run_length(a, {str(k): p for k, p in plans.items()})
    steps = launch_steps(steps, warmup, a.seconds, made[(m, a.schedules[0], "adamw")]["stats"]["step_time_ms"])
    launches = bench.alternate({key: (lambda p=p, o=key[2]: bench.run_ours(p, steps, warmup, *flags_of(o)))
                                for key, p in plans.items()}, a.rounds, steps, console)
    one_launch = in_one_launch(plans, a.rounds, console) if a.interleaved else {}
    load2 = os.getloadavg()
    speed.append(machine_speed(a.kernel_seconds))
    traced = {}
    if not a.no_traces:
        for key, p in plans.items():
            if key[2] == CONTROL:
                continue  # AdamW's own run, traced above
            with console.status(f"traced run of {p.stem}"):
                traced[key] = where_it_went(p, prof, steps, warmup, key[2], a.out)
    times = {key: [x.step_ms for x in v] for key, v in launches.items()}
    op_ratios = {key: [x.op_ratio for x in v if x.op_ratio] for key, v in launches.items()}
    pred = {key: d["stats"]["step_time_ms"] for key, d in made.items()}
    ks = {key: d["config"]["refresh_steps"] for key, d in made.items()}
    expected = {key: d["stats"].get("expected_step_time_ms") for key, d in made.items()}
    expected_over = {key: d["stats"].get("expected_step_overhead") for key, d in made.items()}
    from pfcompile.check.replay import expected_step_time
    from pfcompile.formats.plan import load_plan

    busyless = without_busy(prof)
    replays = {p: expected_step_time(load_plan(str(p)), busyless) for p in set(plans.values())}
    calm = {key: replays[p] for key, p in plans.items()}

    print(f"\n### {m}\n\n{a.rounds} rounds of {steps} steps ({warmup} warm-up). Load average (1, 5, 15 min): "
          f"before profiling {fmt_load(load0)}, before the rounds {fmt_load(load1)}, after them {fmt_load(load2)}.")
    if speed[0] is not None:
        print(f"The machine's speed (benchmarks/drift.py's kernels, median ms over {a.kernel_seconds:g} s, matmuls / "
              f"memory-bound updates): before profiling {speed[0][0]:.1f} / {speed[0][1]:.1f}, before the rounds "
              f"{speed[1][0]:.1f} / {speed[1][1]:.1f}, after them {speed[2][0]:.1f} / {speed[2][1]:.1f} (matmuls after / "
              f"before profiling: {speed[2][0] / speed[0][0]:.3f}; a profile predicts the speed it was made at).")
    print()
    print("| model | schedule | optimizer | k | predicted ms | measured ms (median) | min–max | measured/predicted "
          "| within ±10%? | measured/expected | the same without runtime.busy | compute ops measured/profiled "
          "| schedule alone (min–max) | overhead measured (paired median) | min–max | planned | measured − planned "
          "| within ±2 pts? | planned with the op times' spread | measured − it |")
    print("|---|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    rows = []
    for (m, s, o), t in times.items():
        med = statistics.median(t)
        ratio = med / pred[(m, s, o)]
        row = {"model": m, "schedule": s, "optimizer": o, "k": ks[(m, s, o)], "predicted_ms": pred[(m, s, o)],
               "measured_ms": t, "ratio": ratio, "op_ratio": op_ratios[(m, s, o)]}
        e = expected[(m, s, o)]
        row["expected_ms"], row["expected_without_busy_ms"] = e, calm[(m, s, o)]
        # each run's measured/predicted over its own compute ops' level: the step's error
        # with the machine's speed at the run (which the profile cannot know) taken out
        alone = [x / pred[(m, s, o)] / q for x, q in zip(t, op_ratios[(m, s, o)])] \
            if len(op_ratios[(m, s, o)]) == len(t) else []
        row["schedule_alone"] = alone
        cells = [m, s, o, str(ks[(m, s, o)]), f"{pred[(m, s, o)]:.1f}", f"{med:.1f}", spread(t, ".1f"), f"{ratio:.3f}",
                 "yes" if abs(ratio - 1) <= 0.10 else "**no**", "-" if not e else f"{med / e:.3f}",
                 "-" if not calm[(m, s, o)] else f"{med / calm[(m, s, o)]:.3f}",
                 f"{statistics.median(op_ratios[(m, s, o)]):.3f}" if op_ratios[(m, s, o)] else "-",
                 f"{statistics.median(alone):.3f} ({spread(alone, '.3f')})" if alone else "-"]
        if o == "adamw":
            cells += ["", "", "", "", "", "", ""]
        else:
            base = times[(m, s, "adamw")]
            paired = [x / b - 1 for x, b in zip(t, base)]
            planned = pred[(m, s, o)] / pred[(m, s, "adamw")] - 1
            over = statistics.median(paired)
            # a second definition of the planned overhead: the plan's own expected_step_overhead
            # (its expected step over its baseline's, each rank's level and each op drawn from
            # the profile's spread; None where the plan has no expected step), over AdamW's own
            # where AdamW's plan is CP-SAT's (both are over the family's order)
            planned_e = expected_over[(m, s, o)]
            if planned_e is not None:
                planned_e = (1 + planned_e) / (1 + (expected_over[(m, s, "adamw")] or 0.0)) - 1
            row.update(overhead_measured=paired, overhead_planned=planned, overhead_planned_expected=planned_e)
            cells += [f"{over:+.1%}", spread(paired, "+.1%"), f"{planned:+.1%}", f"{100 * (over - planned):+.1f}",
                      "yes" if abs(over - planned) <= 0.02 else "**no**",
                      "-" if planned_e is None else f"{planned_e:+.1%}",
                      "-" if planned_e is None else f"{100 * (over - planned_e):+.1f}"]
        print("| " + " | ".join(cells) + " |")
        rows.append(row)
    if one_launch:
        print("\nThe overhead over AdamW with both plans in one launch (benchmarks/interleaved.py: alternating blocks "
              "of whole refresh cycles, each plan's mean step period over AdamW's, one launch per round; the table's "
              "paired ratio above is of two launches):\n")
        print("| model | schedule | optimizer | planned | two launches (paired median) | in one launch (median) | min–max "
              "| measured − planned | within ±2 pts? | planned with the op times' spread | measured − it "
              "| the same without runtime.busy | measured − it "
              "| passes measured/planned: AdamW's, its (median) "
              "| update and optimizer ops: measured / planned ms per step (median) |")
        print("|---|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|")
        for row in rows:
            key = (row["model"], row["schedule"], row["optimizer"])
            if key not in one_launch:
                continue
            over, planned = [p.overhead for p in one_launch[key]], row["overhead_planned"]
            row["overhead_one_launch"] = over
            mid = statistics.median(over)
            pairs = one_launch[key]
            passes = [statistics.median(ops["passes"][0] / ops["passes"][1] for ops in side)
                      for side in ([p.base_ops for p in pairs], [p.plan_ops for p in pairs])]
            work = [statistics.median(p.plan_ops["update and optimizer"][i] for p in pairs) for i in (0, 1)]
            planned_e = row["overhead_planned_expected"]
            with_spread = "- | -" if planned_e is None else f"{planned_e:+.1%} | {100 * (mid - planned_e):+.1f}"
            c, c_base = calm[key], calm[key[:2] + ("adamw",)]
            planned_c = c / c_base - 1 if c and c_base else None
            row["overhead_planned_expected_without_busy"] = planned_c
            with_spread += " | - | -" if planned_c is None else f" | {planned_c:+.1%} | {100 * (mid - planned_c):+.1f}"
            print(f"| {' | '.join(key)} | {planned:+.1%} | {statistics.median(row['overhead_measured']):+.1%} | "
                  f"{mid:+.1%} | {spread(over, '+.1%')} | {100 * (mid - planned):+.1f} | "
                  f"{'yes' if abs(mid - planned) <= 0.02 else '**no**'} | {with_spread} | "
                  f"{passes[0]:.3f}, {passes[1]:.3f} | {work[0]:.1f} / {work[1]:.1f} |")
    if traced:
        print("\nWhere the time went (one traced run per cell; ms per step; `pfcompile inspect --against --profile`):\n")
        print("| model | schedule | optimizer | measured (median step) | predicted | median/predicted | error "
              "| largest op kinds (ms) | between ops | runtime's work: measured / planned (per rank) "
              "| longest runtime stall | replay: the run's mean op times, its work as planned | level by op kind (alone) "
              "| with its work between ops | each step's own "
              "| measured (cycles) | beside the work: after / during | lag after the work / after pipeline ops (ms) |")
        print("|---|---|---|---:|---:|---:|---:|---|---:|---:|---|---:|---|---:|---:|---:|---:|---:|")
        for (m, s, o), d in traced.items():
            if "error" in d:
                print(f"| {m} | {s} | {o} | inspect failed: {d['error']} |")
                continue
            kinds = sorted(d["kinds"], key=lambda r: -abs(r["explains_ms"]))[:3]
            shown = ", ".join(f"{r['kind']} {r['explains_ms']:+.1f}" for r in kinds)
            rp = d.get("replayed") or {}
            ratio = d["measured_step_ms"] / d["predicted_step_ms"] if d["predicted_step_ms"] else float("nan")
            spans = d.get("runtime_spans") or {}
            work = sum(v["per_step_ms"] for v in spans.values())
            stall = max(spans.items(), key=lambda kv: kv[1]["max_ms"], default=None)
            stall = f"{stall[0]} {stall[1]['max_ms']:.1f}" if stall else "-"
            level = ", ".join(f"{kind} {ms:+.1f}" for kind, ms in list((rp.get("level_by_kind_ms") or {}).items())[:3])
            print(f"| {m} | {s} | {o} | {d['measured_step_ms']:.1f} | {d['predicted_step_ms']:.1f} | {ratio:.3f} | "
                  f"{d['error_ms']:+.1f} | {shown} | {d['between_ops_ms']:+.1f} | "
                  f"{work:.2f} / {d.get('runtime_planned_ms', float('nan')):.2f} | {stall} | "
                  f"{replayed(rp, 'planned_work_step_ms')} | {level or '-'} | {replayed(rp, 'mean_ops_step_ms')} | "
                  f"{replayed(rp, 'own_ops_step_ms')} | {replayed(rp, 'measured_step_ms')} | "
                  f"{beside_cells(d.get('beside_work'))} |")
        if any(not d.get("replayed") for d in traced.values() if "error" not in d):
            print("\nn/a: the traced run has fewer than two whole refresh cycles after its warm-up, "
                  "too few for `inspect`'s replay.")
    return rows, traced, {"load": [load0, load1, load2], "kernel_ms": speed, "steps": steps, "warmup": warmup}


def launch_steps(steps: int, warmup: int, seconds: float, step_ms: float) -> int:
    """A model's steps per launch: `steps`, raised to `seconds` of its AdamW plan's predicted
    step (`step_ms`) after the warm-up (0: `steps`), so a model of 30-ms steps and one of 400-ms steps
    both run long enough to average over the host's slow spells, neither for minutes."""
    if seconds <= 0:
        return steps
    return max(steps, warmup + math.ceil(seconds * 1e3 / step_ms))


def replayed(rp: dict, key: str) -> str:
    """One figure of a traced run's replay (ms per step), or n/a where it has none."""
    return f"{rp[key]:.1f}" if rp.get(key) is not None else "n/a"


def without_busy(prof: Path):
    """The profile less runtime.busy (every plan varying as the probe's base run did): its
    plans' expected step times are a second definition beside the plans' own, which have it
    (and may be shorter replays: the planner's time limit caps them)."""
    from pfcompile.formats.profile import load_profile

    profile = load_profile(str(prof))
    profile.runtime.busy = None
    return profile


def in_one_launch(plans: dict, rounds: int, console) -> dict:
    """Each optimizer's plan with AdamW's of its model and schedule in one launch per round
    (benchmarks/interleaved.py), the cells in the same order each round, the two plans'
    order reversed every other round."""
    cells = [key for key in plans if key[2] != "adamw"]
    out: dict = {key: [] for key in cells}
    for r in range(rounds):
        for m, s, o in cells:
            base, plan = plans[(m, s, "adamw")], plans[(m, s, o)]
            with console.status(f"round {r + 1}/{rounds}: {m}-{s}-{o} with AdamW's plan in one launch"):
                n = interleaved.block_steps([base, plan], interleaved.MIN_STEPS)
                pair = interleaved.launch_pair(base, plan, interleaved.BLOCKS, n, r % 2 == 0, list(flags_of(o)[1::2]))
            out[(m, s, o)].append(pair)
            console.print(f"round {r + 1}: {m}-{s}-{o} in one launch with AdamW's: {pair.overhead:+.1%} "
                          f"({bench.ended()})")
    return out


def beside_cells(b: dict | None) -> str:
    """`inspect --against --json`'s beside_work as two cells: the pipeline ops' ratios right
    after the optimizer's work and beside it on the other rank; the messages' mean lag."""
    if not b:
        return "- | -"

    def ratio(x):
        return f"{x['ratio']:.3f}" if x else "-"

    def lag(v):
        return f"{v['mean_ms']:.2f}" if v["messages"] else "-"

    return f"{ratio(b['after'])} / {ratio(b['during'])} | {lag(b['lag']['optimizer'])} / {lag(b['lag']['pipeline'])}"


def machine_speed(seconds: float) -> tuple[float, float] | None:
    """The medians of drift.py's two kernels over `seconds` (None when 0): the machine's own
    speed, with no runtime in it, at compute-bound work (matmuls) and at memory-bound work
    (AdamW-like updates). A machine that slows one and not the other moves an optimizer's
    overhead over AdamW: its work is more compute-bound than AdamW's update."""
    if seconds <= 0:
        return None
    mm, st = drift.kernel_pairs(seconds)
    return statistics.median(mm), statistics.median(st)


def fmt_load(load) -> str:
    return ", ".join(f"{x:.2f}" for x in load)


if __name__ == "__main__":
    main()
