"""Does a runtime change leave training as it was? (not a test) A float64 pipelined run of
each optimizer (1F1B, 2 ranks, 6 steps, from profiles/bert-tiny-cpu-optimizers.json; K-FAC
also with gradient clipping), its losses and final parameters written to a JSON
snapshot; `--against SNAPSHOT` compares this tree's runs with an earlier snapshot's: max
|Δloss| and max |Δparam| over every run, which must be <= 1e-12.

    .venv/bin/python benchmarks/exactness_snapshot.py -o before.json      # at the old commit
    .venv/bin/python benchmarks/exactness_snapshot.py --against before.json

The plan and the runtime are this tree's (the script runs with its own root first on
PYTHONPATH), so a snapshot taken in a worktree of an older commit records that commit.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# benchmarks/runtime.py (the runtime benchmark) would shadow the runtime package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
from runtime import launch  # noqa: E402 (after the path fix above)

ROOT = Path(__file__).resolve().parents[1]
PROFILE = "profiles/bert-tiny-cpu-optimizers.json"
STEPS, STAGES, MICRO_BATCHES = 6, 2, 4
TOLERANCE = 1e-12
# (name, optimizer, extra runtime flags)
RUNS = [
    ("kfac", "kfac", []),
    ("shampoo", "shampoo", []),
    ("muon", "muon", []),
    ("adamw", "adamw", []),
    ("kfac-clip", "kfac", ["--set", "optimizer.max_grad_norm=0.5"]),
]


def _python_path() -> str:
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)


def run_one(work: Path, name: str, optimizer: str, flags: list[str]) -> dict:
    import torch

    work.mkdir(parents=True, exist_ok=True)
    plan = work / f"{name}.json"
    ckpt = work / f"{name}-ckpt"
    with launch.launch_env(PYTHONPATH=_python_path()) as env:  # the planner's and the run's
        subprocess.run([sys.executable, "-m", "pfcompile", "plan", PROFILE, "--schedule", "1f1b", "--stages",
                        str(STAGES), "--micro-batches", str(MICRO_BATCHES), "--optimizer", optimizer, "--method",
                        "greedy", "-o", str(plan)], cwd=ROOT, env=env, check=True, capture_output=True)
        r = subprocess.run(launch.torchrun(STAGES, "-m", "runtime", str(plan), "--dtype", "float64", "--data",
                                           "synthetic", "--steps", str(STEPS), "--checkpoint-dir", str(ckpt),
                                           "--checkpoint-every", str(STEPS), "--log-dir", str(work / f"{name}-log"),
                                           "--json", *flags),
                           cwd=work, env=env, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"exactness_snapshot: {name} failed (exit {r.returncode}):\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    summary = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("{")))
    params: dict[str, list[float]] = {}
    world = json.loads(plan.read_text())["config"]["world_size"]
    for q in range(world):
        state = torch.load(ckpt / f"step-{STEPS:08d}" / f"rank-{q}.pt", weights_only=True)
        for stage in state["stages"].values():
            for pname, t in stage["params"].items():
                params[pname] = t.double().flatten().tolist()
    k = json.loads(plan.read_text())["config"]["refresh_steps"]
    return {"optimizer": optimizer, "flags": flags, "refresh_steps": k, "losses": summary["losses"],
            "params": params}


def compare(now: dict, before: dict) -> list[tuple[str, float, float]]:
    rows = []
    for name, run in now.items():
        old = before[name]
        d_loss = max(abs(a - b) for a, b in zip(run["losses"], old["losses"], strict=True))
        if set(run["params"]) != set(old["params"]):
            sys.exit(f"exactness_snapshot: {name}: the parameter names differ")
        d_param = max(max((abs(a - b) for a, b in zip(v, old["params"][p], strict=True)), default=0.0)
                      for p, v in run["params"].items())
        rows.append((name, d_loss, d_param))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-o", "--output", type=Path, help="write the snapshot here (JSON)")
    ap.add_argument("--against", type=Path, help="compare with this snapshot; exit 1 above the tolerance")
    ap.add_argument("--smoke", action="store_true", help="K-FAC's run alone, compared with itself run twice (tests)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = {name: run_one(Path(tmp), name, opt, flags) for name, opt, flags in (RUNS[:1] if args.smoke else RUNS)}
        if args.smoke:
            again = {name: run_one(Path(tmp) / "again", name, opt, flags) for name, opt, flags in RUNS[:1]}
    print(f"{'run':<14}{'k':>3}  {'first loss':>22}  {'last loss':>22}")
    for name, run in runs.items():
        print(f"{name:<14}{run['refresh_steps']:>3}  {run['losses'][0]:>22.16f}  {run['losses'][-1]:>22.16f}")
    if args.output:
        args.output.write_text(json.dumps(runs))
        print(f"wrote {args.output}")
    if args.against or args.smoke:
        rows = compare(runs, again if args.smoke else json.loads(args.against.read_text()))
        print(f"\nagainst {'a second run' if args.smoke else args.against}:\n"
              f"{'run':<14}{'max |dloss|':>14}{'max |dparam|':>14}")
        for name, d_loss, d_param in rows:
            print(f"{name:<14}{d_loss:>14.3e}{d_param:>14.3e}")
        worst = max(max(d_l, d_p) for _, d_l, d_p in rows)
        print(f"worst {worst:.3e} (tolerance {TOLERANCE:g}): {'equal' if worst <= TOLERANCE else 'DIFFERENT'}")
        return 0 if worst <= TOLERANCE else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
