"""Convergence through the pipeline runtime: K-FAC against AdamW, both run by
`torchrun --nproc-per-node 2 -m runtime` (1F1B, 2 stages, 4 micro-batches of 8 x 64
characters = the 32 x 64 batch of benchmarks/convergence.py), bert-tiny masked LM.

The hyper-parameters are the ones benchmarks/convergence.py tuned (the trainer's defaults):
AdamW lr 1e-3; K-FAC lr 0.1, momentum 0.9, damping 1e-4, EMA 0.9, KL clip 1e-5, AdamW 1e-3 on
the parameters K-FAC does not cover, refresh every 5 steps (the plan's k, fixed with
`pfcompile plan --refresh-steps 5`). Both see the same initial weights and batches. Target:
AdamW's validation loss at its last step; reported: K-FAC's steps and wall time (rank 0's
summed step times) to reach it. Corpora: the pydoc corpus, and any text file through
`python -m runtime.prepare_data` (--text; e.g. Debian's /usr/share/vim/vim90/doc/options.txt).

    python benchmarks/convergence_pipeline.py [--seeds 0 1 2] [--steps 1000] [--text FILE [--no-pydoc]] [--json OUT]
    python benchmarks/convergence_pipeline.py --smoke    # seed 0, 2 steps, CP-SAT 1 s: the script runs (tests)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# benchmarks/runtime.py (the runtime benchmark) would shadow the runtime package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
from runtime import launch  # noqa: E402 (after the path fix above)

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "profiles" / "bert-tiny-cpu.json"  # micro-batch 8 x 64 tokens


def make_plans(out: Path, time_limit: float = 10.0) -> dict[str, Path]:
    plans = {}
    # A fixed k is CP-SAT's (the greedy's k is what its first fit needs).
    for name, extra in (("kfac", ["--method", "cpsat", "--refresh-steps", "5", "--time-limit", str(time_limit),
                                  "--workers", "1"]),
                        ("adamw", ["--method", "greedy", "--no-kfac"])):
        plans[name] = out / f"{name}.json"
        subprocess.run([sys.executable, "-m", "pfcompile", "plan", str(PROFILE), "--schedule", "1f1b", "--stages", "2",
                        "--micro-batches", "4", *extra, "-o", str(plans[name])],
                       cwd=ROOT, check=True, capture_output=True, text=True)
    return plans


def train(plan: Path, seed: int, steps: int, data: list[str], log_dir: Path, eval_every: int, eval_batches: int) -> dict:
    cmd = launch.torchrun(2, "-m", "runtime", str(plan), *data, "--log-dir", str(log_dir), "--set", f"train.steps={steps}", "--set", f"train.seed={seed}",
           "--set", f"eval.every={eval_every}", "--set", f"eval.batches={eval_batches}", "--set", f"log.every={eval_every}")
    t0 = time.perf_counter()
    with launch.launch_env() as env:
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"run failed ({plan.name}, seed {seed}):\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = {row["step"]: row for row in rows if not row.get("eval")}
    return {"val": [(row["step"], row["loss"]) for row in rows if row.get("eval")],
            "step_ms": [train_rows[s]["step_ms"] for s in sorted(train_rows)], "seconds": time.perf_counter() - t0}


def run_all(args, work: Path) -> tuple[list, list]:
    """Every corpus and seed, AdamW then K-FAC, in `work`; prints the table row by row."""
    plans = make_plans(work, 1.0 if args.smoke else 10.0)
    corpora = {} if args.no_pydoc else {"pydoc": []}
    if args.text:
        subprocess.run([sys.executable, "-m", "runtime.prepare_data", args.text, "-o", str(work / "text.bin"),
                        "--val-fraction", "0.1"], cwd=ROOT, check=True, capture_output=True)
        corpora[Path(args.text).name] = ["--data", str(work / "text.bin"), "--val-data", str(work / "text.val.bin")]
    rows, runs = [], []
    print(f"{'corpus':>12} {'seed':>4} {'adamw val':>9} {'kfac steps':>10} {'ratio':>6} {'adamw s':>8} "
          f"{'kfac s to target':>16} {'time ratio':>10}")
    for corpus, data in corpora.items():
        for seed in args.seeds:
            res = {}
            for kind in ("adamw", "kfac"):
                res[kind] = train(plans[kind], seed, args.steps, data, work / f"{corpus}-{kind}-{seed}",
                                  args.eval_every, args.eval_batches)
            target = res["adamw"]["val"][-1][1]
            reached = next((s for s, v in res["kfac"]["val"] if v <= target), None)
            adam_s = sum(res["adamw"]["step_ms"]) / 1000
            kfac_s = sum(res["kfac"]["step_ms"][:reached]) / 1000 if reached else None
            row = {"corpus": corpus, "seed": seed, "adamw_val": target, "kfac_steps": reached,
                   "ratio": reached / args.steps if reached else None, "adamw_seconds": adam_s,
                   "kfac_seconds_to_target": kfac_s, "time_ratio": kfac_s / adam_s if reached else None}
            rows.append(row)
            runs.append({"corpus": corpus, "seed": seed, **res})
            ratio = f"{row['ratio']:.2f}" if reached else "-"
            to_target = f"{kfac_s:.1f}" if reached else "-"
            time_ratio = f"{row['time_ratio']:.2f}" if reached else "-"
            print(f"{corpus:>12} {seed:>4} {target:>9.4f} {reached or '>' + str(args.steps):>10} {ratio:>6} "
                  f"{adam_s:>8.1f} {to_target:>16} {time_ratio:>10}", flush=True)
    return rows, runs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--eval-batches", type=int, default=12)
    ap.add_argument("--text", default=None, help="a second corpus: a text file (character level)")
    ap.add_argument("--no-pydoc", action="store_true", help="only the --text corpus")
    ap.add_argument("--json", metavar="PATH", help="also write the curves and the table as JSON")
    ap.add_argument("--smoke", action="store_true",
                    help="the smallest run: seed 0, 2 steps, CP-SAT 1 s (tests/test_benchmarks_smoke.py)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.seeds, args.steps, args.eval_every, args.eval_batches = [0], 2, 1, 1
    with tempfile.TemporaryDirectory(prefix="convergence-pipeline-") as work:
        rows, runs = run_all(args, Path(work))
    if args.json:
        from pfcompile.formats.jsonio import write_json
        write_json(args.json, {"rows": rows, "runs": runs, "args": vars(args)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
