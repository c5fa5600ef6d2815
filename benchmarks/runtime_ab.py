"""The same plans run by two commits' runtimes, interleaved (not a test: it times).

Each plan runs once per round under the runtime of COMMIT (its tree exported with `git
archive`, first on PYTHONPATH) and once under this working tree's, the order reversed every
other round, `--rounds` rounds of `--steps` steps (synthetic tokens, 2 ranks x 1 thread,
gloo). Per plan: each side's step time (the runtime's Summary.step_ms, median over rounds,
min-max) and the paired ratio this tree / COMMIT per round. The plans must be readable by
both (the plan format did not change between them).

    .venv/bin/python benchmarks/runtime_ab.py COMMIT PLAN [PLAN ...] [--rounds 5] [--steps 40]
    .venv/bin/python benchmarks/runtime_ab.py --smoke   # HEAD against this tree, one bert-tiny plan (tests)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# benchmarks/runtime.py (the runtime benchmark) would shadow the runtime package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
from runtime import launch  # noqa: E402 (after the path fix above)

ROOT = Path(__file__).resolve().parents[1]


def export(commit: str, into: Path) -> Path:
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", commit], capture_output=True)
    if archive.returncode:
        sys.exit(f"runtime_ab: {commit}: {archive.stderr.decode(errors='replace').strip()}")
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def run(tree: Path, plan: Path, steps: int, warmup: int, flags: list[str]) -> float:
    cmd = launch.torchrun(2, "-m", "runtime", str(plan.resolve()), "--steps", str(steps), "--warmup", str(warmup),
                          "--data", "synthetic", "--json", *flags)
    with launch.launch_env(PYTHONPATH=str(tree)) as env:
        r = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=900)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode or not lines:
        sys.exit(f"runtime_ab: {plan} under {tree} failed:\n{(r.stdout + r.stderr)[-2000:]}")
    return json.loads(lines[-1])["step_ms"]


def smoke_plan(folder: Path) -> Path:
    path = folder / "bert-tiny-1f1b-adamw.json"
    r = subprocess.run([sys.executable, "-m", "pfcompile", "plan", "profiles/bert-tiny-cpu.json", "--schedule", "1f1b",
                        "--stages", "2", "--micro-batches", "4", "--optimizer", "adamw", "--method", "none",
                        "-o", str(path)], cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"runtime_ab: planning the smoke plan failed:\n{r.stderr[-2000:]}")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("commit", nargs="?", default="HEAD")
    ap.add_argument("plans", nargs="*", type=Path)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=40, help="steps per run, warm-up included")
    ap.add_argument("--set", action="append", default=[], help="a runtime --set for every run (repeatable)")
    ap.add_argument("--smoke", action="store_true", help="HEAD against this tree: one bert-tiny 1F1B plan, 1 round of 4 steps")
    a = ap.parse_args()
    flags = [x for s in a.set for x in ("--set", s)]
    with tempfile.TemporaryDirectory(prefix="pfcompile-ab-") as tmp:
        if a.smoke:
            a.commit, a.rounds, a.steps, a.plans = "HEAD", 1, 4, [smoke_plan(Path(tmp))]
        if not a.plans:
            ap.error("give the plans to run (or --smoke)")
        tree = Path(tmp) / "tree"
        tree.mkdir()
        sides = {a.commit: export(a.commit, tree), "this tree": ROOT}
        times: dict[tuple[str, str], list[float]] = {}
        for r in range(a.rounds):
            for plan in a.plans:
                k = json.loads(plan.read_text())["config"]["refresh_steps"]
                warmup = max(2, k)
                order = list(sides) if r % 2 == 0 else list(sides)[::-1]
                for side in order:
                    ms = run(sides[side], plan, max(a.steps, warmup + 2 * k), warmup, flags)
                    times.setdefault((plan.stem, side), []).append(ms)
                    print(f"round {r + 1}: {plan.stem} under {side}: {ms:.1f} ms/step", file=sys.stderr, flush=True)
    print(f"\n{a.rounds} interleaved rounds of {a.steps} steps; load average {', '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    print(f"| plan | {a.commit} ms (median) | min–max | this tree ms (median) | min–max | this tree / {a.commit} "
          "(paired median) | min–max |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for plan in a.plans:
        old, new = times[(plan.stem, a.commit)], times[(plan.stem, "this tree")]
        ratios = [n / o for n, o in zip(new, old)]
        print(f"| {plan.stem} | {statistics.median(old):.1f} | {min(old):.1f}–{max(old):.1f} | "
              f"{statistics.median(new):.1f} | {min(new):.1f}–{max(new):.1f} | {statistics.median(ratios):.3f} | "
              f"{min(ratios):.3f}–{max(ratios):.3f} |")


if __name__ == "__main__":
    main()
