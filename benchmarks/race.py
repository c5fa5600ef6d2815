"""A race to AdamW's validation loss through the pipeline runtime: AdamW, K-FAC, Shampoo and
Muon, each planned by CP-SAT for 1F1B on 2 stages with 4 micro-batches of 8 x 64 (the 32 x 64
batch of benchmarks/convergence.py) and trained by `torchrun --nproc-per-node 2 -m runtime`.

The model is bert-tiny (masked LM), as in the other convergence benchmarks: their K-FAC
defaults were tuned on it, its committed profile holds every optimizer's measured costs
(profiles/bert-tiny-cpu-optimizers.json), and it is the cheapest model on a 2-core CPU.

Parts (--only):
  tune   pydoc, seed 0, --tune-steps steps: a small learning-rate grid per optimizer (AdamW
         first; the others' AdamW part takes AdamW's chosen rate); reported: the final
         validation loss of each point and the best one.
  race   per corpus and seed: AdamW runs --steps steps and its validation loss at the last step
         is the target; each other optimizer runs until an evaluation first reaches it (the
         run is stopped there) or --cap steps. Settings: TUNED below (frozen after tuning).
  cost   the per-step cost, paired: --cost-rounds rounds of one --cost-steps run per optimizer,
         the order rotated every round; per round each mean step_ms over AdamW's, and the
         median over rounds (a race's runs lie minutes apart, under whatever load then was).
  report the tables of every run recorded in WORK/race.json.

Measures per optimizer: steps to the target (evaluated every --eval-every steps on fixed
held-out batches); seconds to it, the sum of rank 0's step_ms up to that step (training
only: evaluation, start-up and shutdown excluded); the run's wall clock from launch until
the evaluation that reached it was logged; the ratios of each to AdamW's; and the mean
step_ms over AdamW's (the per-step cost ratio: seconds ratio = steps ratio x per-step ratio);
and the steps ratio times the paired per-step ratio of `cost` (the seconds ratio with the
load's drift between the race's runs taken out) or times the plans' predicted step-time ratio
(what a quiet machine should give).

Corpora: "pydoc" (the runtime's built-in corpus, CPython's pydoc_data.topics, its own 10%
held out) and "licenses": every regular file (symlinks skipped) of /usr/share/common-licenses
in name order (Debian's base-files package), joined with one newline, through
`python -m runtime.prepare_data` (character level, the last 10% held out). The text's
sha256 is recorded, so a run elsewhere can tell whether it trained on the same text.

    python benchmarks/race.py [--only tune|race|cost|report] [--corpus pydoc licenses] [--seeds 0 1 2]
                              [--optimizers adamw kfac shampoo muon] [--work out/race]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

# benchmarks/runtime.py (the runtime benchmark) would shadow the runtime package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
from runtime import launch  # noqa: E402 (after the path fix above)

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "profiles" / "bert-tiny-cpu-optimizers.json"
OPTIMIZERS = ("adamw", "kfac", "shampoo", "muon", "soap")
LICENSES_DIR = Path("/usr/share/common-licenses")
COST_WARMUP = 10  # steps of a step-cost run left untimed: start-up, the first refresh cycles

# The key each optimizer's learning-rate grid varies: the rate of the weights it covers.
LR_KEY = {"adamw": "optimizer.adam_lr", "kfac": "optimizer.lr", "shampoo": "shampoo.lr", "muon": "muon.lr"}
GRID = {"adamw": (5e-4, 1e-3, 2e-3, 4e-3),
        "kfac": (0.05, 0.1, 0.2),
        "shampoo": (0.1, 0.3, 1.0),
        "muon": (1e-3, 3e-3, 1e-2, 3e-2)}
# Every run of an optimizer has these besides its rate. Muon's Newton-Schulz iteration runs in
# float32: bfloat16 (torch's default, for GPUs) is many times slower on a CPU without bfloat16
# matrix units (results/2026-12-01-race.md).
FIXED = {"adamw": {}, "kfac": {}, "shampoo": {}, "muon": {"muon.ns_dtype": "float32"}}
# The settings the race runs, chosen by `--only tune` (results/2026-12-01-race.md): each
# optimizer's best rate; the others' AdamW part at AdamW's.
TUNED = {"adamw": {"optimizer.adam_lr": 2e-3},
         "kfac": {"optimizer.lr": 0.1, "optimizer.adam_lr": 2e-3},
         "shampoo": {"optimizer.lr": 0.3, "optimizer.adam_lr": 2e-3},
         "muon": {"muon.lr": 1e-2, "optimizer.adam_lr": 2e-3, "muon.ns_dtype": "float32"}}


def load_avg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def commit() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    return r.stdout.strip() + (" (with uncommitted changes)" if dirty else "")


def make_plan(work: Path, optimizer: str, time_limit: float) -> tuple[Path, dict]:
    """The CP-SAT plan of `optimizer` (AdamW's, on 1F1B with one replica: the family's order)."""
    plan = work / "plans" / f"{optimizer}.json"
    plan.parent.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([sys.executable, "-m", "pfcompile", "plan", str(PROFILE), "--schedule", "1f1b", "--stages", "2",
                        "--micro-batches", "4", "--optimizer", optimizer, "--method", "cpsat",
                        "--time-limit", str(time_limit), "-o", str(plan), "--json"],
                       cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"planning {optimizer} failed:\n{r.stderr[-2000:]}")
    stats = json.loads(r.stdout)
    keep = ("step_time_ms", "baseline_step_time_ms", "step_overhead", "refresh_steps", "solver_status", "gap")
    return plan, {k: stats.get(k) for k in keep}


def licenses_text() -> bytes:
    files = sorted(p for p in LICENSES_DIR.iterdir() if p.is_file() and not p.is_symlink())
    if not files:
        raise SystemExit(f"{LICENSES_DIR}: no license texts (the second corpus is built from them)")
    return b"\n".join(p.read_bytes() for p in files)


def corpus_data(work: Path, corpus: str) -> tuple[list[str], dict]:
    """The runtime's data flags of a corpus and what it is (name, size, sha256)."""
    if corpus == "pydoc":
        return ["--data", "pydoc"], {"corpus": "pydoc", "source": "pydoc_data.topics (the runtime's built-in)"}
    text = licenses_text()
    src = work / "data" / "licenses.txt"
    src.parent.mkdir(parents=True, exist_ok=True)
    src.write_bytes(text)
    train = work / "data" / "licenses.bin"
    subprocess.run([sys.executable, "-m", "runtime.prepare_data", str(src), "-o", str(train), "--val-fraction", "0.1"],
                   cwd=ROOT, check=True, capture_output=True)
    return (["--data", str(train), "--val-data", str(train.with_name("licenses.val.bin"))],
            {"corpus": "licenses", "source": f"{LICENSES_DIR}/* (regular files, name order, joined by a newline)",
             "bytes": len(text), "sha256": hashlib.sha256(text).hexdigest()})


def run(plan: Path, settings: dict, seed: int, steps: int, data: list[str], log_dir: Path, eval_every: int,
        eval_batches: int, target: float | None = None) -> dict:
    """One torchrun job; with `target`, stopped at the first evaluation whose loss is <= it."""
    log_dir.mkdir(parents=True, exist_ok=True)
    metrics = log_dir / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    sets = {"train.steps": steps, "train.seed": seed, "eval.every": eval_every, "eval.batches": eval_batches,
            "log.every": eval_every or steps, **settings}
    cmd = launch.torchrun(2, "-m", "runtime", str(plan), *data, "--log-dir", str(log_dir))
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    load_before = load_avg()
    t0 = time.perf_counter()
    with open(log_dir / "output.log", "w") as out, launch.launch_env() as env:
        # its own session: stopping it at the target ends torchrun and both ranks together
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        reached_at, seen, eval_wall = None, 0, {}
        while reached_at is None:
            done = proc.poll() is not None
            lines = metrics.read_text().splitlines() if metrics.exists() else []
            for line in lines[seen:]:
                if not line.endswith("}"):
                    break  # a line still being written
                seen += 1
                row = json.loads(line)
                if row.get("eval"):
                    eval_wall[str(row["step"])] = time.perf_counter() - t0  # when it was logged (to 0.2 s)
                    if target is not None and row["loss"] <= target:
                        reached_at = row["step"]
                        os.killpg(proc.pid, signal.SIGTERM)
                        proc.wait()
                        break
            if done:
                break
            time.sleep(0.2)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.endswith("}")] \
        if metrics.exists() else []
    failed = reached_at is None and proc.returncode != 0
    train_rows = {row["step"]: row for row in rows if not row.get("eval")}
    return {"settings": settings, "seed": seed, "val": [(row["step"], row["loss"]) for row in rows if row.get("eval")],
            "step_ms": [train_rows[s]["step_ms"] for s in sorted(train_rows)],
            "reached_step": reached_at, "eval_wall_s": eval_wall, "wall_s": wall,
            "failed": (open(log_dir / "output.log").read()[-1500:] if failed else None),
            "load_before": load_before, "load_after": load_avg()}


def load_state(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {"tune": {}, "race": {}, "plans": {}, "corpora": {}}


def save_state(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(path)


def fmt(v, spec: str = ".4f") -> str:
    return "-" if v is None else format(v, spec)


# --- tuning ---------------------------------------------------------------------------------------
def tune(args, state: dict, plans: dict[str, Path], work: Path) -> None:
    data, _ = corpus_data(work, "pydoc")
    part = state["tune"]
    if part.get("steps") != args.tune_steps:  # a grid point recorded with these steps is not run again
        part.clear()
        part.update({"steps": args.tune_steps, "runs": {}, "best": {}})
    part.update({"load_before": load_avg(), "commit": commit()})
    adam_lr = (part["best"].get("adamw") or [None])[0]  # the others' AdamW part: AdamW's rate
    for opt in args.optimizers:
        best = None
        for lr in GRID[opt]:
            settings = {**FIXED[opt], LR_KEY[opt]: lr}
            if opt != "adamw" and adam_lr is not None:
                settings["optimizer.adam_lr"] = adam_lr
            res = part["runs"].get(f"{opt} {lr:g}")
            if res and res["settings"] == settings:
                final = res["final_val"]
                if final is not None and (best is None or final < best[1]):
                    best = (lr, final)
                continue
            res = run(plans[opt], settings, 0, args.tune_steps, data, work / "tune" / f"{opt}-{lr:g}",
                      args.tune_steps // 4, args.eval_batches)
            final = res["val"][-1][1] if res["val"] and res["val"][-1][0] == args.tune_steps else None
            res["final_val"] = final
            part["runs"][f"{opt} {lr:g}"] = res
            save_state(args.state, state)
            print(f"tune {opt:8} {LR_KEY[opt]}={lr:g}: final val. loss {fmt(final)} "
                  f"({res['wall_s']:.0f} s, load {res['load_before']} -> {res['load_after']})", flush=True)
            if final is not None and (best is None or final < best[1]):
                best = (lr, final)
        part["best"][opt] = best
        if opt == "adamw" and best:
            adam_lr = best[0]
    part["load_after"] = load_avg()
    save_state(args.state, state)


def tune_table(state: dict) -> str:
    part = state.get("tune") or {}
    if not part.get("runs"):
        return "(no tuning recorded)\n"
    lines = [f"Tuning: pydoc, seed 0, {part['steps']} steps, final validation loss.", "",
             "| optimizer | key | value | other settings | final val. loss | chosen | wall s | load (1 min) |",
             "|---|---|---|---|---|---|---|---|"]
    for name, res in part["runs"].items():
        opt, lr = name.split()
        others = ", ".join(f"{k}={v}" for k, v in res["settings"].items() if k != LR_KEY[opt]) or "defaults"
        best = part.get("best", {}).get(opt)
        chosen = "**yes**" if best and f"{best[0]:g}" == lr else ""
        final = fmt(res["final_val"]) if res["final_val"] is not None else "failed"
        lines.append(f"| {opt} | {LR_KEY[opt]} | {lr} | {others} | {final} | {chosen} | {res['wall_s']:.0f} | "
                     f"{res['load_before'][0]} -> {res['load_after'][0]} |")
    return "\n".join(lines) + "\n"


# --- the per-step cost, paired --------------------------------------------------------------------
def step_cost(args, state: dict, plans: dict[str, Path], work: Path, settings: dict | None = None) -> None:
    """Each optimizer's mean step time in short runs one after another, the order rotated every
    round: on a shared machine the load drifts over a race's minutes, and a ratio of two runs
    seconds apart is the per-step cost the race's seconds ratio mixes with its steps ratio.
    `settings`: each optimizer's (default TUNED, the constant-rate race's)."""
    data, _ = corpus_data(work, "pydoc")
    rounds = state.setdefault("cost", {"steps": args.cost_steps, "warmup": COST_WARMUP, "rounds": []})
    for r in range(args.cost_rounds):
        order = args.optimizers[r % len(args.optimizers):] + args.optimizers[:r % len(args.optimizers)]
        record = {}
        for opt in order:
            res = run(plans[opt], (settings or TUNED)[opt], 0, args.cost_steps, data, work / "cost" / f"{len(rounds['rounds'])}-{opt}",
                      0, 1)
            timed = res["step_ms"][COST_WARMUP:]
            if not timed:
                raise SystemExit(f"step cost: {opt} logged no steps after the warm-up ({work / 'cost'})")
            record[opt] = {"mean_ms": statistics.mean(timed), "median_ms": statistics.median(timed),
                           "load_before": res["load_before"], "load_after": res["load_after"]}
            print(f"cost round {len(rounds['rounds'])}: {opt:8} mean {record[opt]['mean_ms']:.1f} ms/step, load "
                  f"{res['load_before'][0]} -> {res['load_after'][0]}", flush=True)
        rounds["rounds"].append(record)
        save_state(args.state, state)


def cost_ratios(state: dict) -> dict[str, float]:
    """Each optimizer's median over rounds of its mean step time / AdamW's in the same round."""
    rounds = [r for r in (state.get("cost") or {}).get("rounds", []) if "adamw" in r]
    ratios = {}
    for opt in OPTIMIZERS:
        per_round = [r[opt]["mean_ms"] / r["adamw"]["mean_ms"] for r in rounds if opt in r]
        if per_round:
            ratios[opt] = statistics.median(per_round)
    return ratios


def cost_table(state: dict) -> str:
    cost = state.get("cost") or {}
    rounds = [r for r in cost.get("rounds", []) if "adamw" in r]
    if not rounds:
        return "(no paired step cost recorded)\n"
    plans = state.get("plans", {})
    base = (plans.get("adamw") or {}).get("step_time_ms")
    lines = [f"Per-step cost, paired: {len(rounds)} rounds, each optimizer {cost['steps']} steps a run (the first "
             f"{cost['warmup']} not timed), the order rotated every round; mean step_ms.", "",
             "| optimizer | mean ms per round | ratio to AdamW per round | median ratio | planned ratio | load (1 min) |",
             "|---|---|---|---|---|---|"]
    ratios = cost_ratios(state)
    for opt in OPTIMIZERS:
        if opt not in ratios:
            continue
        means = ", ".join(f"{r[opt]['mean_ms']:.1f}" for r in rounds if opt in r)
        per = ", ".join(f"{r[opt]['mean_ms'] / r['adamw']['mean_ms']:.2f}" for r in rounds if opt in r)
        planned = (plans.get(opt) or {}).get("step_time_ms")
        loads = ", ".join(f"{r[opt]['load_before'][0]}" for r in rounds if opt in r)
        lines.append(f"| {opt} | {means} | {per} | {ratios[opt]:.2f} | "
                     f"{fmt(planned / base if planned and base else None, '.3f')} | {loads} |")
    return "\n".join(lines) + "\n"


# --- the race -------------------------------------------------------------------------------------
def race(args, state: dict, plans: dict[str, Path], work: Path) -> None:
    for corpus in args.corpus:
        data, info = corpus_data(work, corpus)
        state["corpora"][corpus] = info
        for seed in args.seeds:
            key = f"{corpus} {seed}"
            entry = state["race"].setdefault(key, {"runs": {}})
            entry["commit"] = commit()
            entry["load_before"] = load_avg()
            for opt in args.optimizers:
                if opt == "adamw":
                    res = run(plans[opt], TUNED[opt], seed, args.steps, data, work / "race" / key.replace(" ", "-") / opt,
                              args.eval_every, args.eval_batches)
                else:
                    adamw = entry["runs"].get("adamw")
                    if not adamw or not adamw["val"] or adamw["val"][-1][0] != args.steps:
                        raise SystemExit(f"{key}: no AdamW run of {args.steps} steps to take the target from "
                                         "(run --optimizers adamw first)")
                    target = adamw["val"][-1][1]
                    res = run(plans[opt], TUNED[opt], seed, args.cap, data, work / "race" / key.replace(" ", "-") / opt,
                              args.eval_every, args.eval_batches, target=target)
                entry["runs"][opt] = res
                save_state(args.state, state)
                reached = "is the target" if opt == "adamw" else f"reached at {res['reached_step']}"
                print(f"race {key}: {opt:8} {reached}, best "
                      f"{fmt(min((v for _, v in res['val']), default=None))}, {res['wall_s']:.0f} s, load "
                      f"{res['load_before']} -> {res['load_after']}", flush=True)
            entry["load_after"] = load_avg()
            save_state(args.state, state)


def race_rows(state: dict, steps: int) -> list[dict]:
    rows = []
    for key, entry in state["race"].items():
        corpus, seed = key.split()
        adamw = entry["runs"].get("adamw")
        if not adamw or not adamw["val"] or adamw["val"][-1][0] != steps:
            continue
        target = adamw["val"][-1][1]
        adam_s, adam_mean = sum(adamw["step_ms"]) / 1000, statistics.mean(adamw["step_ms"])
        for opt in OPTIMIZERS:
            res = entry["runs"].get(opt)
            if res is None:
                continue
            reached = steps if opt == "adamw" else res["reached_step"]
            seconds = sum(res["step_ms"][:reached]) / 1000 if reached else None
            wall = res["eval_wall_s"].get(str(reached)) if reached else None  # launch to that evaluation
            mean_ms = statistics.mean(res["step_ms"][:reached] if reached else res["step_ms"]) if res["step_ms"] else None
            rows.append({"corpus": corpus, "seed": int(seed), "optimizer": opt, "target": target, "steps": reached,
                         "best": min((v for _, v in res["val"]), default=None), "steps_run": len(res["step_ms"]),
                         "failed": bool(res.get("failed")),
                         "seconds": seconds, "wall": wall, "steps_ratio": reached / steps if reached else None,
                         "seconds_ratio": seconds / adam_s if seconds else None,
                         "wall_ratio": wall / adamw["eval_wall_s"][str(steps)] if wall else None,
                         "step_ms": mean_ms, "step_cost_ratio": mean_ms / adam_mean if mean_ms else None,
                         "load": f"{res['load_before'][0]} -> {res['load_after'][0]}"})
    return rows


def race_table(state: dict, steps: int) -> str:
    rows = race_rows(state, steps)
    if not rows:
        return "(no race recorded)\n"
    lines = [f"| corpus | seed | optimizer | target (AdamW val. loss @{steps}) | steps to target | steps ratio | "
             "s to target (step_ms sum) | s ratio | mean step ms | per-step ratio | wall s to target | wall ratio | "
             "load (1 min) |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["steps"] is None:
            missed = "failed" if r["failed"] else "not reached"
            steps_cell = f"{missed} in {r['steps_run']} (best {fmt(r['best'])})"
        else:
            steps_cell = str(r["steps"])
        lines.append(f"| {r['corpus']} | {r['seed']} | {r['optimizer']} | {r['target']:.4f} | {steps_cell} | "
                     f"{fmt(r['steps_ratio'], '.2f')} | {fmt(r['seconds'], '.1f')} | {fmt(r['seconds_ratio'], '.2f')} | "
                     f"{fmt(r['step_ms'], '.1f')} | {fmt(r['step_cost_ratio'], '.2f')} | {fmt(r['wall'], '.0f')} | "
                     f"{fmt(r['wall_ratio'], '.2f')} | {r['load']} |")
    lines += ["", "Medians over seeds (a run that missed counts as missed; its median is shown only when every "
              "seed reached):", "",
              "| corpus | optimizer | seeds reached | median steps ratio | median s ratio | median per-step ratio | "
              "median wall ratio | steps ratio x paired per-step ratio | steps ratio x planned per-step ratio |",
              "|---|---|---|---|---|---|---|---|---|"]
    paired = cost_ratios(state)
    plans = state.get("plans", {})
    base = (plans.get("adamw") or {}).get("step_time_ms")
    planned = {opt: p["step_time_ms"] / base for opt, p in plans.items() if base and p.get("step_time_ms")}
    for corpus in dict.fromkeys(r["corpus"] for r in rows):
        for opt in OPTIMIZERS:
            sel = [r for r in rows if r["corpus"] == corpus and r["optimizer"] == opt]
            if not sel:
                continue
            ok = [r for r in sel if r["steps"] is not None]

            def med(k, sel=sel, ok=ok):
                return fmt(statistics.median(r[k] for r in ok), ".2f") if len(ok) == len(sel) else "-"

            per_step = fmt(statistics.median(r["step_cost_ratio"] for r in sel), ".2f")
            steps_ratio = statistics.median(r["steps_ratio"] for r in ok) if len(ok) == len(sel) else None
            estimates = [fmt(steps_ratio * ratios[opt] if steps_ratio and opt in ratios else None, ".2f")
                         for ratios in (paired, planned)]
            lines.append(f"| {corpus} | {opt} | {len(ok)}/{len(sel)} | {med('steps_ratio')} | {med('seconds_ratio')} | "
                         f"{per_step} | {med('wall_ratio')} | {' | '.join(estimates)} |")
    return "\n".join(lines) + "\n"


def compact(state: dict, steps: int) -> dict:
    """race.json without the per-step times (a race holds ~25 runs of up to 1500 steps): the
    validation curves, each run's summed and mean step times, and the tables' rows."""
    def run_summary(res: dict) -> dict:
        ms = res["step_ms"]
        keep = ("settings", "seed", "val", "reached_step", "eval_wall_s", "wall_s", "load_before", "load_after",
                "final_val")
        return {**{k: res[k] for k in keep if k in res}, "steps_run": len(ms), "step_ms_sum": sum(ms),
                "step_ms_mean": statistics.mean(ms) if ms else None, "failed": bool(res.get("failed"))}

    return {"plans": state.get("plans"), "corpora": state.get("corpora"), "cost": state.get("cost"),
            "tune": {**{k: v for k, v in (state.get("tune") or {}).items() if k != "runs"},
                     "runs": {n: run_summary(r) for n, r in (state.get("tune") or {}).get("runs", {}).items()}},
            "race": {key: {**{k: v for k, v in e.items() if k != "runs"},
                           "runs": {o: run_summary(r) for o, r in e["runs"].items()}}
                     for key, e in state.get("race", {}).items()},
            "rows": race_rows(state, steps)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=FAIR_PARTS, default=None,
                    help="the fair race of issue 38 (see fair_main): tune, target, horizon, cost or fair-report")
    ap.add_argument("--jobs", type=int, default=2, help="--part: runs at once (one thread each)")
    ap.add_argument("--run-one", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--only", choices=("tune", "race", "cost", "report"), default=None,
                    help="one part (default: tune, race, cost, then the report)")
    ap.add_argument("--corpus", nargs="+", choices=("pydoc", "licenses"), default=["pydoc", "licenses"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--optimizers", nargs="+", choices=OPTIMIZERS, default=list(OPTIMIZERS),
                    help="the race needs AdamW's run of a corpus and seed first (it sets the target)")
    ap.add_argument("--steps", type=int, default=1000, help="AdamW's steps: its last validation loss is the target")
    ap.add_argument("--cap", type=int, default=1500, help="the most steps another optimizer runs")
    ap.add_argument("--tune-steps", type=int, default=400)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--eval-batches", type=int, default=12)
    ap.add_argument("--cost-rounds", type=int, default=3, help="rounds of the paired per-step cost")
    ap.add_argument("--cost-steps", type=int, default=60, help="steps of each per-step cost run")
    ap.add_argument("--time-limit", type=float, default=30, help="CP-SAT seconds per plan")
    ap.add_argument("--work", type=Path, default=ROOT / "out" / "race",
                    help="plans, data, run logs and race.json (every run recorded; the report reads it)")
    ap.add_argument("--json", type=Path, default=None, help="also write the record without per-step times here")
    args = ap.parse_args(argv)
    if args.run_one:
        return run_one(args.run_one)
    if args.part:
        return fair_main(args)
    if "soap" in args.optimizers:
        if args.optimizers != list(OPTIMIZERS):
            raise SystemExit("SOAP runs in the fair race only (--part); the constant-rate race has no grid for it")
        args.optimizers.remove("soap")
    if "adamw" not in args.optimizers and args.only != "report":
        print("note: without adamw, the race takes the target from an AdamW run recorded earlier", file=sys.stderr)
    args.work.mkdir(parents=True, exist_ok=True)
    args.state = args.work / "race.json"
    state = load_state(args.state)
    plans = {}
    if args.only != "report":
        for opt in args.optimizers:
            plans[opt], state["plans"][opt] = make_plan(args.work, opt, args.time_limit)
        save_state(args.state, state)
    if args.only in (None, "tune"):
        tune(args, state, plans, args.work)
    if args.only in (None, "race"):
        race(args, state, plans, args.work)
    if args.only in (None, "cost"):
        step_cost(args, state, plans, args.work)
    print(f"commit {commit()}, load average now {load_avg()}\n")
    print("Plans (CP-SAT, 1F1B, D = 2, N = 4):\n")
    print("| optimizer | predicted step ms | overhead vs AdamW's plan | k | status |\n|---|---|---|---|---|")
    for opt, p in state["plans"].items():
        print(f"| {opt} | {p['step_time_ms']:.1f} | {100 * (p['step_overhead'] or 0):.1f}% | {p['refresh_steps']} | "
              f"{p['solver_status']} |")
    print()
    print(tune_table(state))
    print(cost_table(state))
    for corpus, info in state["corpora"].items():
        print(f"corpus {corpus}: {info}")
    print()
    print(race_table(state, args.steps))
    if args.json:
        args.json.write_text(json.dumps(compact(state, args.steps), indent=1) + "\n")
    return 0


# --- the fair race (issue 38): warm-up and decay to each run's horizon ----------------------------
FAIR_PARTS = ("tune", "target", "horizon", "cost", "fair-report")
# Every run: linear warm-up over 5% of its horizon, then cosine decay to 0.1 of the peak at its
# last step (schedule.decay_steps 0), the same shape for every optimizer and horizon.
WARMUP_FRACTION, FINAL_LR_RATIO = 0.05, 0.1
# The tuning budget, the same for every optimizer: 4 rates (the constant-rate race's tuned rate
# x 0.5, 1, 2, 4; Shampoo and SOAP on Adam's scale, AdamW's) x 2 values of one knob of its own
# = 8 runs of T steps on pydoc, seed 0. The fourth rate: AdamW's first 3 x 2 grid chose its top
# edge (results/2026-12-03-race.md), so every grid got one rate more.
FAIR_GRID = {"adamw": ("optimizer.adam_lr", (1e-3, 2e-3, 4e-3, 8e-3), "optimizer.adam_betas",
                       ([0.9, 0.99], [0.9, 0.999])),
             "kfac": ("optimizer.lr", (0.05, 0.1, 0.2, 0.4), "kfac.damping", (1e-4, 1e-3)),
             "muon": ("muon.lr", (5e-3, 1e-2, 2e-2, 4e-2), "muon.momentum", (0.9, 0.95)),
             "shampoo": ("shampoo.lr", (1e-3, 2e-3, 4e-3, 8e-3), "shampoo.beta2", (0.99, 0.999)),
             "soap": ("soap.lr", (1e-3, 2e-3, 4e-3, 8e-3), "soap.beta2", (0.95, 0.99))}
HORIZONS = tuple(round(0.3 + 0.05 * i, 2) for i in range(15))  # H/T searched by bisection


def schedule_settings(horizon: int) -> dict:
    return {"train.steps": horizon, "schedule.warmup_steps": max(1, round(WARMUP_FRACTION * horizon)),
            "schedule.decay": "cosine", "schedule.decay_steps": 0, "schedule.final_lr_ratio": FINAL_LR_RATIO}


def run_key(opt: str, settings: dict, corpus: str, seed: int, horizon: int) -> str:
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]
    return f"{opt}-{corpus}-s{seed}-H{horizon}-{digest}"


def run_one(spec_path: Path) -> int:
    """One single-process run (runtime.train.train_step, the pipeline's proven reference) of a
    spec: the plan's k and partition, the config's settings; evaluated as the pipeline
    evaluates (runtime.evaluate.evaluate_model, stage by stage, mean over micro-batches)."""
    import torch

    from pfcompile.formats.plan import load_plan
    from runtime.config import job as job_config
    from runtime.config.precision import flush_denormals
    from runtime.evaluate import evaluate_model
    from runtime.io.data import make_stream, open_token_file
    from runtime.models import build_model, resolve_config, resolve_model
    from runtime.optimizers import registry
    from runtime.optimizers.stage import build_optimizer, optim_config
    from runtime.train import make_optimizer_layers, train_step

    torch.set_num_threads(1)
    spec = json.loads(spec_path.read_text())
    plan = load_plan(spec["plan"])
    cfg = job_config.load(None, [f"{k}={job_config.toml_value(v)}" for k, v in spec["settings"].items()])
    flush_denormals("cpu", cfg.runtime.flush_denormal)  # as the runtime's ranks
    job_config.apply_plan(cfg, plan, spec["plan"])
    n, seq = plan.config.micro_batches, plan.model["seq_len"]
    batch = plan.model["micro_batch"] * n
    model_spec = resolve_model(resolve_config(plan.model["name"], seq_len=seq))
    kind = model_spec.cfg.kind
    if spec["data"]:
        stream = make_stream(kind, batch, seq, seed=cfg.train.seed,
                             token_file=open_token_file(spec["data"], model_spec.cfg.vocab, batch, seq))
        val = make_stream(kind, batch, seq, seed=0,
                          token_file=open_token_file(spec["val_data"], model_spec.cfg.vocab, batch, seq))
    else:
        stream = make_stream(kind, batch, seq, seed=cfg.train.seed)
        val = make_stream(kind, batch, seq, seed=0, split="val")
    val_batches = val.fixed_batches(spec["eval_batches"])
    name = plan.config.optimizer
    entry = registry.entry(name)
    model = build_model(model_spec, seed=cfg.train.seed)
    step_cfg = entry.math_config(cfg)
    layers = make_optimizer_layers(model, name, step_cfg, n)
    stage_of = dict(zip(plan.layers, plan.layer_stage))
    groups = ([g for g in ([l for l in layers if stage_of[l.name] == s] for s in range(plan.num_stages)) if g]
              if layers and entry.kl_clip else None)  # the pipeline KL-clips per stage
    opt = build_optimizer(model, layers, optim_config(cfg), optimizer=name)
    steps, every = cfg.train.steps, spec["eval_every"]
    val_curve, t0 = [], time.perf_counter()
    for step in range(steps):
        train_step(model, layers, opt, stream.batch(step), step, n, step_cfg, kl_groups=groups, seed=cfg.train.seed,
                   max_grad_norm=cfg.optimizer.max_grad_norm)
        if step + 1 == steps or (every and (step + 1) % every == 0):
            loss = evaluate_model(model, val_batches, n, partition=plan.partition)
            model.train()
            if not math.isfinite(loss):
                val_curve.append((step + 1, None))
                break
            val_curve.append((step + 1, loss))
    final = val_curve[-1][1] if val_curve and val_curve[-1][0] == steps else None
    out = {**{k: spec[k] for k in ("optimizer", "settings", "corpus", "seed", "horizon")}, "engine": "single-process",
           "val": val_curve, "final_val": final, "wall_s": time.perf_counter() - t0, "commit": commit()}
    tmp = Path(spec["out"]).with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=1))
    tmp.replace(spec["out"])
    return 0


class FairRace:
    """Per-run JSON results under WORK/runs (keyed by optimizer, settings, corpus, seed,
    horizon): a finished run is never run again, so every part resumes where it stopped."""

    def __init__(self, args):
        self.args, self.work = args, args.work
        (self.work / "runs").mkdir(parents=True, exist_ok=True)
        self.plans: dict[str, Path] = {}
        self.data: dict[str, tuple] = {}

    def plan(self, opt: str) -> Path:
        if opt not in self.plans:
            path = self.work / "plans" / f"{opt}.json"
            if not path.exists():
                make_plan(self.work, opt, self.args.time_limit)
            self.plans[opt] = path
        return self.plans[opt]

    def corpus(self, corpus: str) -> tuple:
        if corpus not in self.data:
            if corpus == "pydoc":
                self.data[corpus] = (None, None)
            else:
                train = self.work / "data" / "licenses.bin"
                if not train.exists():
                    corpus_data(self.work, corpus)
                self.data[corpus] = (str(train), str(train.with_name("licenses.val.bin")))
        return self.data[corpus]

    def result(self, opt, settings, corpus, seed, horizon) -> dict | None:
        path = self.work / "runs" / (run_key(opt, settings, corpus, seed, horizon) + ".json")
        return json.loads(path.read_text()) if path.exists() else None

    def run(self, opt: str, settings: dict, corpus: str, seed: int, horizon: int) -> dict:
        done = self.result(opt, settings, corpus, seed, horizon)
        if done:
            return done
        key = run_key(opt, settings, corpus, seed, horizon)
        out = self.work / "runs" / f"{key}.json"
        data, val_data = self.corpus(corpus)
        spec = {"optimizer": opt, "settings": {**settings, **schedule_settings(horizon), "train.seed": seed},
                "corpus": corpus, "seed": seed, "horizon": horizon, "plan": str(self.plan(opt)), "data": data,
                "val_data": val_data, "eval_every": self.args.eval_every, "eval_batches": self.args.eval_batches,
                "out": str(out)}
        spec_path = self.work / "runs" / f"{key}.spec.json"
        spec_path.write_text(json.dumps(spec, indent=1))
        load0 = load_avg()
        with open(self.work / "runs" / f"{key}.log", "w") as log:
            r = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--run-one", str(spec_path)], cwd=ROOT,
                               env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log, stderr=subprocess.STDOUT)
        if r.returncode != 0 or not out.exists():
            raise SystemExit(f"run {key} failed: see {self.work / 'runs' / (key + '.log')}")
        res = json.loads(out.read_text())
        res.update({"settings": settings, "load_before": load0, "load_after": load_avg()})
        out.write_text(json.dumps(res, indent=1))
        print(f"{key}: final val. loss {fmt(res['final_val'])} ({res['wall_s']:.0f} s, load {load0} -> "
              f"{res['load_after']})", flush=True)
        return res

    # --- tuning -----------------------------------------------------------------------------
    def grid(self, opt: str) -> list[dict]:
        lr_key, rates, knob, values = FAIR_GRID[opt]
        base = {} if opt == "adamw" else self.adamw_part()
        return [{**FIXED.get(opt, {}), **base, lr_key: lr, knob: v} for lr in rates for v in values]

    def adamw_part(self) -> dict:
        """The hybrids' AdamW part takes AdamW's tuned rate and betas."""
        best = self.tuned("adamw")
        if best is None:
            raise SystemExit("AdamW's tuning is not finished (run --part tune --optimizers adamw first)")
        return {k: best[k] for k in ("optimizer.adam_lr", "optimizer.adam_betas")}

    def tuned(self, opt: str) -> dict | None:
        """The grid point with the lowest final validation loss at T (None until every point ran)."""
        if opt != "adamw" and self.tuned("adamw") is None:
            return None
        finished = [(self.result(opt, s, "pydoc", 0, self.args.steps), s) for s in self.grid(opt)]
        if any(r is None for r, _ in finished):
            return None
        ok = [(r["final_val"], s) for r, s in finished if r["final_val"] is not None]
        return min(ok, key=lambda x: x[0])[1] if ok else None

    def target(self, corpus: str, seed: int) -> float | None:
        best = self.tuned("adamw")
        res = best and self.result("adamw", best, corpus, seed, self.args.steps)
        return res["final_val"] if res else None

    def horizon(self, opt: str, corpus: str, seed: int) -> dict:
        """Bisection on HORIZONS for the shortest H whose final loss reaches the target
        (reaching assumed monotone in H); H = None: not reached even at T."""
        target, settings, T = self.target(corpus, seed), self.tuned(opt), self.args.steps
        lo, hi = 0, len(HORIZONS)
        while lo < hi:
            mid = (lo + hi) // 2
            res = self.run(opt, settings, corpus, seed, round(HORIZONS[mid] * T))
            if res["final_val"] is not None and res["final_val"] <= target:
                hi = mid
            else:
                lo = mid + 1
        return {"H": round(HORIZONS[hi] * T) if hi < len(HORIZONS) else None}


def parallel(tasks, jobs: int) -> None:
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for f in [pool.submit(t) for t in tasks]:
            f.result()


def fair_main(args) -> int:
    race_ = FairRace(args)
    opts = [o for o in args.optimizers if o in FAIR_GRID]
    if args.part == "tune":
        for opt in opts:  # AdamW first: the others' AdamW part takes its tuned settings
            parallel([lambda s=s, o=opt: race_.run(o, s, "pydoc", 0, args.steps) for s in race_.grid(opt)], args.jobs)
    elif args.part == "target":
        best = race_.tuned("adamw")
        if best is None:
            raise SystemExit("AdamW's tuning is not finished (run --part tune --optimizers adamw first)")
        parallel([lambda c=c, s=s: race_.run("adamw", best, c, s, args.steps) for c in args.corpus for s in args.seeds],
                 args.jobs)
    elif args.part == "horizon":
        parallel([lambda o=o, c=c, s=s: race_.horizon(o, c, s) for o in opts if o != "adamw" and race_.tuned(o)
                  for c in args.corpus for s in args.seeds if race_.target(c, s) is not None], args.jobs)
    elif args.part == "cost":  # the paired per-step cost of the tuned settings, on the race's 2-rank plans
        tuned = {o: race_.tuned(o) for o in dict.fromkeys(["adamw", *opts])}
        args.optimizers = [o for o, t in tuned.items() if t is not None]
        args.state = args.work / "race.json"
        state = load_state(args.state)
        plans = {o: race_.plan(o) for o in args.optimizers}
        for o, p in plans.items():
            stats = json.loads(p.read_text())["stats"]
            state["plans"][o] = {k: stats.get(k) for k in ("step_time_ms", "step_overhead", "refresh_steps",
                                                           "solver_status", "gap")}
        step_cost(args, state, plans, args.work, settings={o: {**FIXED.get(o, {}), **t} for o, t in tuned.items()
                                                             if t is not None})
    print(fair_report(race_, args))
    return 0


def fair_report(race_: FairRace, args) -> str:
    T = args.steps
    lines = [f"commit {commit()}, load average now {load_avg()}", "",
             f"Schedule: warm-up {WARMUP_FRACTION:.0%} of the horizon, cosine to {FINAL_LR_RATIO} of the peak at its "
             f"last step. Tuning: pydoc, seed 0, T = {T}, final validation loss.", "",
             "| optimizer | settings | final val. loss | chosen |", "|---|---|---|---|"]
    for opt in FAIR_GRID:
        try:
            grid = race_.grid(opt)
        except SystemExit:
            continue
        chosen = race_.tuned(opt)
        done = 0
        for s in grid:
            r = race_.result(opt, s, "pydoc", 0, T)
            done += r is not None
            shown = ", ".join(f"{k}={v}" for k, v in s.items())
            lines.append(f"| {opt} | {shown} | {fmt(r and r['final_val'])} | {'**yes**' if s == chosen else ''} |")
        lines.append(f"| {opt} | ({done}/{len(grid)} grid points done) | | |")
    figures: dict = {}  # (corpus, optimizer) -> per seed: settled H/T, "missed", or None (unfinished)
    lines += ["", "| corpus | seed | target (AdamW @T) | optimizer | H/T | runs (H: final loss) |", "|---|---|---|---|---|---|"]
    for corpus in args.corpus:
        for seed in args.seeds:
            target = race_.target(corpus, seed)
            for opt in FAIR_GRID:
                if opt == "adamw":
                    continue
                settings = race_.tuned(opt) if target is not None else None
                if settings is None:
                    lines.append(f"| {corpus} | {seed} | {fmt(target)} | {opt} | not run | |")
                    continue
                runs = {h: race_.result(opt, settings, corpus, seed, round(h * T)) for h in HORIZONS}
                runs = {h: r for h, r in runs.items() if r}
                reached = [h for h, r in runs.items() if r["final_val"] is not None and r["final_val"] <= target]
                missed = [h for h, r in runs.items() if h not in reached]
                best = min(reached, default=None)
                settled = best is not None and (best == HORIZONS[0] or round(best - 0.05, 2) in missed)
                cell = (f"{best:.2f}" if settled else f"<= {best:.2f} (search unfinished)" if best else
                        "not reached" if 1.0 in missed else "unfinished")
                shown = ", ".join(f"{h:.2f}: {fmt(r['final_val'])}" for h, r in sorted(runs.items()))
                lines.append(f"| {corpus} | {seed} | {fmt(target)} | {opt} | {cell} | {shown} |")
                figures.setdefault((corpus, opt), []).append(best if settled else "missed" if cell == "not reached"
                                                             else None)
    # seconds = H x its per-step cost over T x AdamW's: the paired cost of `--only cost` in this work dir
    state = load_state(race_.work / "race.json")
    paired = cost_ratios(state)
    lines += ["", f"Medians and worst over seeds ({len(args.seeds)} seeds a corpus; a missed seed is worst = missed; "
              "seconds ratio = H/T x the paired per-step cost ratio of --part cost, '-' until it ran):", "",
              "| corpus | optimizer | seeds done | median H/T | worst H/T | median s ratio | worst s ratio |",
              "|---|---|---|---|---|---|---|"]
    for (corpus, opt), hs in figures.items():
        done = [h for h in hs if h is not None]
        vals = [1e9 if h == "missed" else h for h in done]
        med = statistics.median(vals) if done else None
        worst = max(vals) if done else None

        def show(v, ratio=1.0):
            return "-" if v is None or ratio is None else "missed" if v >= 1e9 else f"{v * ratio:.2f}"
        lines.append(f"| {corpus} | {opt} | {len(done)}/{len(hs)} | {show(med)} | {show(worst)} | "
                     f"{show(med, paired.get(opt))} | {show(worst, paired.get(opt))} |")
    lines += ["", cost_table(state)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
