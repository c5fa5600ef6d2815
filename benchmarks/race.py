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
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

# benchmarks/runtime.py (the runtime benchmark) would shadow the runtime package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "profiles" / "bert-tiny-cpu-optimizers.json"
OPTIMIZERS = ("adamw", "kfac", "shampoo", "muon")
LICENSES_DIR = Path("/usr/share/common-licenses")
COST_WARMUP = 10  # steps of a step-cost run left untimed: start-up, the first refresh cycles

# The key each optimizer's learning-rate grid varies: the rate of the weights it covers.
LR_KEY = {"adamw": "optimizer.adam_lr", "kfac": "optimizer.lr", "shampoo": "optimizer.lr", "muon": "muon.lr"}
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
    """The CP-SAT plan of `optimizer` (AdamW's has nothing to place: the family's order)."""
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
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "runtime",
           str(plan), *data, "--log-dir", str(log_dir)]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    load_before = load_avg()
    t0 = time.perf_counter()
    with open(log_dir / "output.log", "w") as out:
        # its own session: stopping it at the target ends torchrun and both ranks together
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=out,
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
def step_cost(args, state: dict, plans: dict[str, Path], work: Path) -> None:
    """Each optimizer's mean step time in short runs one after another, the order rotated every
    round: on a shared machine the load drifts over a race's minutes, and a ratio of two runs
    seconds apart is the per-step cost the race's seconds ratio mixes with its steps ratio."""
    data, _ = corpus_data(work, "pydoc")
    rounds = state.setdefault("cost", {"steps": args.cost_steps, "warmup": COST_WARMUP, "rounds": []})
    for r in range(args.cost_rounds):
        order = args.optimizers[r % len(args.optimizers):] + args.optimizers[:r % len(args.optimizers)]
        record = {}
        for opt in order:
            res = run(plans[opt], TUNED[opt], 0, args.cost_steps, data, work / "cost" / f"{len(rounds['rounds'])}-{opt}",
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


if __name__ == "__main__":
    sys.exit(main())
