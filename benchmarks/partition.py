"""Partition benchmark (not a test): where the stages are cut, planned and measured.

For each profile, family (1F1B, Chimera) and pipeline depth D (2, 4 and 8), with K-FAC and N
micro-batches, three cuts are planned by CP-SAT:

  even     each stage the same number of blocks, the embedding with the first stage and
           the head with the last (torchtitan's default);
  compute  the cut that minimises the slowest stage's forward + backward (the compute-only
           dynamic programme of the auto-partitioning proposals; pfcompile's default);
  auto     `--partition auto`: the cut whose plan is fastest, K-FAC in the bubbles.

auto plans several cuts, the compute cut first with half its time: it runs under twice the
others' `--time-limit`, so its compute cut gets the time `--partition compute` gets alone.

With `--measure`, the first profile's plans at each D of `--measure-stages` (default 2 and 4)
run with `torchrun -m runtime` on D CPU ranks, every cut once per round, the order reversed
every other round, and their measured step times are compared side by side. On a 2-core
machine 4 ranks share the cores: there the step is bound by the total work more than by the
schedule, which no cut changes.

    .venv/bin/python benchmarks/partition.py [--profiles P.json ...] [--stages 4 8]
        [--time-limit 30] [--measure] [--measure-stages 2 4] [--rounds 3] [--steps 8] [--json FILE]

The default profiles: profiles/llama-small-cpu.json (a Llama with a 32k vocabulary,
profiled on this CPU) and profiles/bert-large-p100-ref.json (PipeFisher's BERT-Large).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
# the runtime benchmark's launcher (benchmarks/runtime.py, loaded by path: its name is the package's)
_spec = importlib.util.spec_from_file_location("runtime_benchmark", Path(__file__).with_name("runtime.py"))
runtime_benchmark = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(runtime_benchmark)

CUTS = ("even", "compute", "auto")
FAMILIES = ("1f1b", "chimera")
DEFAULT_PROFILES = ("profiles/llama-small-cpu.json", "profiles/bert-large-p100-ref.json")


def plan(profile: str, out: Path, schedule: str, stages: int, micro_batches: int, cut: str,
         time_limit: float) -> tuple[Path, dict, float]:
    """One plan; -> (path, the plan's JSON, seconds)."""
    path = out / f"{Path(profile).stem}-{schedule}-D{stages}-{cut}.json"
    limit = 2 * time_limit if cut == "auto" else time_limit
    cmd = [PY, "-m", "pfcompile", "plan", profile, "--schedule", schedule, "--stages", str(stages),
           "--micro-batches", str(micro_batches), "--partition", cut, "--time-limit", str(limit), "-o", str(path)]
    t0 = time.monotonic()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"benchmark: {' '.join(cmd[3:])} failed:\n{r.stderr[-2000:]}")
    return path, json.loads(path.read_text()), time.monotonic() - t0


def sizes(p: dict) -> str:
    return " ".join(str(len(g)) for g in p["partition"])


def planned_table(rows: list[dict]) -> None:
    print("\n| profile | family | D | N | even ms (k) | compute ms (k) | auto ms (k) | auto / even | auto / compute "
          "| parts per stage: even; compute; auto | auto's finalists | seconds: even, compute, auto |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|")
    for r in rows:
        p = r["plans"]
        ms = {c: p[c]["stats"]["step_time_ms"] for c in CUTS}
        cell = {c: f"{ms[c]:.1f} ({p[c]['config']['refresh_steps']}{'' if p[c]['stats'].get('solver_status') == 'OPTIMAL' else ', ' + str(p[c]['stats'].get('solver_status'))})" for c in CUTS}
        fin = p["auto"]["stats"]["partition_search"]
        print(f"| {r['profile']} | {r['schedule']} | {r['stages']} | {r['micro_batches']} | {cell['even']} | "
              f"{cell['compute']} | {cell['auto']} | {ms['auto'] / ms['even']:.3f} | {ms['auto'] / ms['compute']:.3f} | "
              f"{sizes(p['even'])}; {sizes(p['compute'])}; {sizes(p['auto'])} | {len(fin['finalists'])} planned "
              f"({fin['chosen']} chosen), {fin['screened']} screened | "
              f"{r['seconds']['even']:.0f}, {r['seconds']['compute']:.0f}, {r['seconds']['auto']:.0f} |")


def measured_table(a, measured: dict) -> None:
    print(f"\nMeasured: `torchrun -m runtime` on D CPU ranks x 1 thread (gloo), {os.cpu_count()} cores, "
          f"{a.steps} steps ({a.warmup} of warm-up) per launch, {a.rounds} rounds; the load average after each "
          "family in the last column\n")
    print("| family | cut | parts per stage | measured ms/step (median) | min–max | predicted ms/step "
          "| measured / predicted | vs even, measured (paired median) | vs compute, measured (paired median) "
          "| vs even, planned | vs compute, planned | load |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for schedule, m in measured.items():
        times, pred, parts = m["times"], m["predicted"], m["parts"]
        for c in CUTS:
            med = statistics.median(times[c])
            ve = runtime_benchmark.Paired.of(times[c], times["even"]).median
            vc = runtime_benchmark.Paired.of(times[c], times["compute"]).median
            print(f"| {schedule} | {c} | {parts[c]} | {med:.1f} | {min(times[c]):.1f}–{max(times[c]):.1f} | "
                  f"{pred[c]:.1f} | {med / pred[c]:.3f} | {ve:.3f} | {vc:.3f} | {pred[c] / pred['even']:.3f} | "
                  f"{pred[c] / pred['compute']:.3f} | {m['load']:.1f} |")
    print("\nRaw ms/step per round:", json.dumps({s: m["times"] for s, m in measured.items()}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profiles", nargs="+", default=list(DEFAULT_PROFILES))
    ap.add_argument("--stages", nargs="+", type=int, default=[2, 4, 8], metavar="D")
    ap.add_argument("--micro-batches", type=int, default=8, metavar="N")
    ap.add_argument("--time-limit", type=float, default=30.0, help="CP-SAT seconds per plan (auto: twice this)")
    ap.add_argument("--measure", action="store_true", help="run the first profile's plans at --measure-stages")
    ap.add_argument("--measure-stages", type=int, nargs="+", default=[2, 4], metavar="D",
                    help="the depths whose plans run, each on D CPU ranks (default 2 and 4)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per launch")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default="out/partition")
    ap.add_argument("--json", default=None, metavar="FILE", help="write every plan's figures and times here")
    a = ap.parse_args()
    from rich.console import Console

    console = Console(stderr=True)
    out = ROOT / a.out
    out.mkdir(parents=True, exist_ok=True)
    rows, paths = [], {}
    for profile in a.profiles:
        for schedule in FAMILIES:
            for D in a.stages:
                plans, seconds = {}, {}
                for cut in CUTS:
                    with console.status(f"planning {Path(profile).stem} {schedule} D={D} {cut}"):
                        paths[(profile, schedule, D, cut)], plans[cut], seconds[cut] = plan(
                            profile, out, schedule, D, a.micro_batches, cut, a.time_limit)
                rows.append({"profile": Path(profile).stem, "schedule": schedule, "stages": D,
                             "micro_batches": a.micro_batches, "plans": plans, "seconds": seconds})
                console.print(f"{Path(profile).stem} {schedule} D={D}: " + ", ".join(
                    f"{c} {plans[c]['stats']['step_time_ms']:.1f} ms" for c in CUTS))
    print(f"\nPlanned: K-FAC, CP-SAT (`--time-limit {a.time_limit:g}`, auto {2 * a.time_limit:g}), "
          f"{a.micro_batches} micro-batches")
    planned_table(rows)
    measured = {}
    if a.measure:
        profile = a.profiles[0]
        for D in a.measure_stages:
            for schedule in FAMILIES:
                if (profile, schedule, D, "even") not in paths:
                    for cut in CUTS:
                        paths[(profile, schedule, D, cut)], _, _ = plan(profile, out, schedule, D, a.micro_batches,
                                                                        cut, a.time_limit)
                plan_paths = {cut: paths[(profile, schedule, D, cut)] for cut in CUTS}
                runs = {cut: (lambda p=p: runtime_benchmark.run_ours(p, a.steps, a.warmup))
                        for cut, p in plan_paths.items()}
                launches = runtime_benchmark.alternate(runs, a.rounds, a.steps, console)
                loaded = {cut: json.loads(p.read_text()) for cut, p in plan_paths.items()}
                measured[f"{schedule} D={D}"] = {"times": {c: [x.step_ms for x in launches[c]] for c in CUTS},
                                                 "predicted": {c: loaded[c]["stats"]["step_time_ms"] for c in CUTS},
                                                 "parts": {c: sizes(loaded[c]) for c in CUTS},
                                                 "load": os.getloadavg()[0]}
        measured_table(a, measured)
    if a.json:
        record = {"planned": [{**{k: v for k, v in r.items() if k != "plans"},
                               **{c: {"step_time_ms": r["plans"][c]["stats"]["step_time_ms"],
                                      "refresh_steps": r["plans"][c]["config"]["refresh_steps"],
                                      "partition": r["plans"][c]["partition"]} for c in CUTS}} for r in rows],
                  "measured": measured}
        Path(a.json).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
