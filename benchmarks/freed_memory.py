"""Freed memory kept or given back: each optimizer plan's overhead over its first-order base
in one launch, with the ranks' malloc keeping what torch frees (the default,
runtime.keep_freed_memory) and without. Not a test: it times.

glibc maps a large block afresh and hands a freed heap top back to the OS, so a tensor
allocated again page-faults its memory in. An optimizer's temporaries move glibc's
thresholds, and a plan's passes fault where its base's do not. Per PLAN and per round, two
launches of `benchmarks/interleaved.py`'s pair (BASE and PLAN in alternating blocks, one
launch), one per setting, their order swapped every round: the overhead PLAN/BASE - 1,
each plan's passes measured/planned, and its minor page faults per step (the ranks' sum).

    .venv/bin/python benchmarks/freed_memory.py BASE PLAN [PLAN ...] [--rounds 3]
    .venv/bin/python benchmarks/freed_memory.py --smoke   # bert-tiny AdamW against K-FAC, 1 round (tests)
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

# the one-launch pair (runtime.interleave) and its helpers
_spec = importlib.util.spec_from_file_location("bench_interleaved", Path(__file__).with_name("interleaved.py"))
interleaved = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(interleaved)
SETTINGS = {"kept": "true", "given back": "false"}  # runtime.keep_freed_memory


def level(ops: dict) -> float:
    measured, planned = ops["passes"]
    return measured / planned


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base", type=Path, nargs="?", help="the first-order plan")
    ap.add_argument("plans", nargs="*", type=Path, help="plans of the same model and layout with optimizer work")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--blocks", type=int, default=interleaved.BLOCKS)
    ap.add_argument("--min-steps", type=int, default=interleaved.MIN_STEPS)
    ap.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if a.smoke:
            (a.base, plan), a.rounds, a.blocks, a.min_steps = interleaved.smoke(Path(tmp)), 1, 2, 2
            a.plans = [plan]
        if a.base is None or not a.plans:
            ap.error("give BASE and at least one PLAN")
        table(a)


def table(a) -> None:
    print(f"load average before: {', '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    print("| plan | freed memory | planned | overhead in one launch (median) | min–max | "
          "passes measured/planned: BASE, PLAN | page faults per step: BASE, PLAN |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for plan in a.plans:
        n = interleaved.block_steps([a.base, plan], a.min_steps)
        got: dict[str, list] = {name: [] for name in SETTINGS}
        for r in range(a.rounds):
            for name in (list(SETTINGS) if r % 2 == 0 else list(SETTINGS)[::-1]):
                got[name].append(interleaved.launch_pair(a.base, plan, a.blocks, n, r % 2 == 0,
                                                         [f"runtime.keep_freed_memory={SETTINGS[name]}"]))
        for name, pairs in got.items():
            over = [p.overhead for p in pairs]
            med = lambda xs: statistics.median(xs)  # noqa: E731
            print(f"| {plan.stem} | {name} | {interleaved.planned_overhead(a.base, plan):+.1%} | {med(over):+.1%} | "
                  f"{min(over):+.1%}–{max(over):+.1%} | {med(level(p.base_ops) for p in pairs):.3f}, "
                  f"{med(level(p.plan_ops) for p in pairs):.3f} | {med(p.base_os[0] for p in pairs):.0f}, "
                  f"{med(p.plan_os[0] for p in pairs):.0f} |", flush=True)
    print(f"load average after: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
