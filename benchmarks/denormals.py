"""Subnormal floats at run time: each plan with the ranks flushing them to zero (the
default, runtime.flush_denormal) and without, interleaved. Not a test: it times.

x86 runs an arithmetic instruction that meets a subnormal float (below 1.2e-38 in float32)
through microcode, many times slower. A run whose values drift toward zero slows step
after step; a profile of fresh weights never sees it. Per plan (bert-tiny, 2 stages of
1F1B, 4 micro-batches, every optimizer: AdamW in the family's order, the others by
CP-SAT) and per setting, `--rounds` traced launches of `--steps` steps on synthetic tokens,
the two settings' order swapped every round. Per launch, from its trace: the mean step
(the runtime's step_ms) and the mean wall time of the steps in the first and the last
quarter of the run, so a slowdown that grows shows as late / early.

    .venv/bin/python benchmarks/denormals.py [--profile P] [--optimizers ...] [--rounds 3]
        [--steps 200] [--out out/denormals]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
from pathlib import Path

from rich.console import Console

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]


# promise.py's plans, launches and table helpers (and through it race.py's and runtime.py's)
_spec = importlib.util.spec_from_file_location("bench_promise", Path(__file__).with_name("promise.py"))
promise = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(promise)
race, bench = promise.race, promise.bench
SETTINGS = {"flushed": "true", "kept": "false"}  # runtime.flush_denormal


def launch(plan: Path, steps: int, opt: str, setting: str, trace: Path) -> dict:
    """One traced run: the runtime's mean step and the first and last quarter's mean step."""
    from pfcompile.calibrate.measured import load_measured

    out = bench.run_ours(plan, steps, 1, "--trace", str(trace), "--set", f"runtime.flush_denormal={setting}",
                         *promise.flags_of(opt))
    t = load_measured(str(trace))
    walls = t.step_times_ms()
    q = max(1, len(walls) // 4)
    return {"step_ms": out.step_ms, "early_ms": statistics.mean(walls[:q]), "late_ms": statistics.mean(walls[-q:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=str(ROOT / "profiles" / "bert-tiny-cpu-optimizers.json"))
    ap.add_argument("--optimizers", nargs="+", choices=promise.OPTIMIZERS, default=list(promise.OPTIMIZERS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--time-limit", type=float, default=5.0, help="CP-SAT seconds per plan")
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "denormals")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    console = Console(stderr=True)
    prof = Path(a.profile)
    with console.status("planning"):
        plans = {o: promise.make_plan(prof, a.out, "1f1b", o, a.time_limit) for o in a.optimizers}
    load0 = os.getloadavg()
    got: dict[tuple[str, str], list[dict]] = {(o, s): [] for o in plans for s in SETTINGS}
    order = list(SETTINGS)
    for r in range(a.rounds):
        for o, p in plans.items():
            for s in (order if r % 2 == 0 else order[::-1]):
                with console.status(f"round {r + 1}/{a.rounds}: {o}, subnormals {s}"):
                    got[(o, s)].append(launch(p, a.steps, o, SETTINGS[s], a.out / f"{o}-{s}-{r}.trace.json"))
    load1 = os.getloadavg()
    print(f"\nCommit {race.commit()}; bert-tiny 1F1B, 2 ranks x 1 thread, gloo, synthetic tokens; {a.rounds} rounds of "
          f"{a.steps} steps per plan and setting, interleaved. Load average (1, 5, 15 min) before "
          f"{promise.fmt_load(load0)}, after {promise.fmt_load(load1)}.\n")
    print("| optimizer | ms/step, flushed (median) | min–max | ms/step, kept (median) | min–max "
          "| kept / flushed (paired median) | min–max | late / early quarter, flushed | late / early quarter, kept |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for o in plans:
        f, k = got[(o, "flushed")], got[(o, "kept")]
        paired = [b["step_ms"] / x["step_ms"] for x, b in zip(f, k)]
        drift = [statistics.median(x["late_ms"] / x["early_ms"] for x in runs) for runs in (f, k)]
        fs, ks = [x["step_ms"] for x in f], [x["step_ms"] for x in k]
        print(f"| {o} | {statistics.median(fs):.2f} | {promise.spread(fs, '.2f')} | {statistics.median(ks):.2f} | "
              f"{promise.spread(ks, '.2f')} | {statistics.median(paired):.3f} | {promise.spread(paired, '.3f')} | "
              f"{drift[0]:.3f} | {drift[1]:.3f} |")


if __name__ == "__main__":
    main()
