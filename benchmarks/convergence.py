"""Convergence: how many steps K-FAC needs to reach AdamW's validation loss at step 1000.

bert-tiny masked LM on the pydoc corpus (batch 32 x 64 characters), same initial weights
and same batches for both optimizers. Not a test: it prints a table.

1. Tune on seeds not used for the comparison (100, 101; score = mean validation loss at
   the end): AdamW learning rate in ADAMW_GRID for the full --steps (a strong baseline);
   K-FAC damping x KL-clip in KFAC_GRID for --tune-steps steps (lr 0.1,
   momentum 0.9, refresh every 5 steps, EMA 0.9; the KL clip bounds the step on almost every
   step, so it, not the lr, sets the step size). K-FAC runs train the embeddings, LayerNorms
   and head with AdamW at the tuned AdamW lr. Single-seed tuning proved noisy (the loss
   drops in phases whose timing varies by seed), hence two seeds.
2. For each seed: AdamW for --steps steps; target = its validation loss at the last step;
   K-FAC until its validation loss (evaluated every --eval-every steps) reaches the target.

    python benchmarks/convergence.py [--seeds 0 1 2] [--steps 1000] [--tune-steps 400] [--jobs 2]
    python benchmarks/convergence.py --smoke    # one point of each grid, 2 steps: the script runs (tests)
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

# benchmarks/runtime.py (the runtime benchmark) would shadow the runtime package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

ADAMW_GRID = [5e-4, 1e-3, 2e-3, 4e-3]
KFAC_GRID = {"damping": [1e-4, 1e-3, 1e-2], "kl_clip": [1e-5, 3e-5, 1e-4]}
KFAC_FIXED = dict(lr=0.1, momentum=0.9, refresh_steps=5, ema=0.9)
TUNE_SEEDS = (100, 101)


def run_one(job: dict) -> dict:
    """One training run in a worker process (one thread, so that --jobs runs side by side
    do not oversubscribe the cores)."""
    import torch

    torch.set_num_threads(1)
    from runtime.io.data import make_stream
    from runtime.models import build_model, kfac_linears, resolve_config
    from runtime.optimizers.kfac import KfacConfig, make_layers
    from runtime.optimizers.stage import OptimConfig, build_optimizer
    from runtime.train import evaluate, train_step

    cfg = resolve_config("bert-tiny", seq_len=64)
    model = build_model(cfg, seed=job["seed"])
    kfac = KfacConfig(damping=job["damping"], ema=KFAC_FIXED["ema"], refresh_steps=KFAC_FIXED["refresh_steps"],
                      kl_clip=job["kl_clip"]) if job["kind"] == "kfac" else None
    layers = make_layers(kfac_linears(model), kfac) if kfac else []
    opt = build_optimizer(model, layers, OptimConfig(lr=KFAC_FIXED["lr"], momentum=KFAC_FIXED["momentum"],
                                                     adam_lr=job["adam_lr"]))
    train = make_stream("bert", 32, 64, seed=job["seed"])
    val = make_stream("bert", 32, 64, seed=0, split="val").fixed_batches(job["eval_batches"])
    curve, t0 = [], time.perf_counter()
    for step in range(job["steps"]):
        train_step(model, layers, opt, train.batch(step), step, 1, kfac)
        if (step + 1) % job["eval_every"] == 0 or step + 1 == job["steps"]:
            v = evaluate(model, val)
            curve.append((step + 1, v))
            if job.get("target") is not None and v <= job["target"]:
                break
    return {**job, "val": curve, "seconds": time.perf_counter() - t0}


def run_all(jobs: list[dict], n_workers: int, title: str) -> list[dict]:
    from rich.progress import Progress

    with Progress() as bar, ProcessPoolExecutor(n_workers) as pool:
        task = bar.add_task(title, total=len(jobs))
        futures = [pool.submit(run_one, j) for j in jobs]
        out = []
        for f in futures:
            out.append(f.result())
            bar.advance(task)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--tune-steps", type=int, default=400)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--eval-batches", type=int, default=12)
    ap.add_argument("--jobs", type=int, default=2, help="worker processes, one thread each")
    ap.add_argument("--json", metavar="PATH", help="also write all curves and the table as JSON")
    ap.add_argument("--smoke", action="store_true",
                    help="the smallest run: one point of each grid, seed 0, 2 steps, 1 job (tests/test_benchmarks_smoke.py)")
    args = ap.parse_args(argv)
    adamw_grid, kfac_grid = ADAMW_GRID, KFAC_GRID
    if args.smoke:
        adamw_grid, kfac_grid = ADAMW_GRID[:1], {k: v[:1] for k, v in KFAC_GRID.items()}
        args.seeds, args.steps, args.tune_steps, args.eval_every, args.eval_batches, args.jobs = [0], 2, 2, 1, 1, 1
    base = dict(eval_every=args.eval_every, eval_batches=args.eval_batches, damping=None, kl_clip=None)
    t_start = time.perf_counter()

    # 1. tuning: one config = one run per tuning seed, scored by the mean final validation loss
    def tune(kind, steps, configs, title):
        jobs = [{**base, "kind": kind, "seed": seed, "steps": steps, **c} for c in configs for seed in TUNE_SEEDS]
        runs = run_all(jobs, args.jobs, title)
        n = len(TUNE_SEEDS)
        return [(c, [r["val"][-1][1] for r in runs[i * n:(i + 1) * n]]) for i, c in enumerate(configs)]

    score = lambda item: sum(item[1]) / len(item[1])  # noqa: E731
    tuned_adam = tune("adamw", args.steps, [{"adam_lr": lr} for lr in adamw_grid], "tune adamw")
    adam_lr = min(tuned_adam, key=score)[0]["adam_lr"]
    tuned_kfac = tune("kfac", args.tune_steps, [{"adam_lr": adam_lr, "damping": d, "kl_clip": c} for d, c in
                                                itertools.product(kfac_grid["damping"], kfac_grid["kl_clip"])], "tune kfac")
    best_kfac = min(tuned_kfac, key=score)[0]

    print(f"\nTuning (seeds {', '.join(map(str, TUNE_SEEDS))}; validation loss after {args.steps} steps for "
          f"AdamW, {args.tune_steps} for K-FAC)")
    print(f"{'optimizer':10} {'adam lr':>8} {'damping':>8} {'kl_clip':>8} {'per seed':>16} {'mean':>7}")
    for kind, items in (("adamw", tuned_adam), ("kfac", tuned_kfac)):
        best = min(items, key=score)
        for item in items:
            c, vals = item
            per_seed = " ".join(f"{v:.3f}" for v in vals)
            print(f"{kind:10} {c['adam_lr']:>8g} {c.get('damping') or '-':>8} {c.get('kl_clip') or '-':>8} "
                  f"{per_seed:>16} {score(item):>7.4f}{' *' if item is best else ''}")

    # 2. comparison per seed: AdamW first (its final loss is K-FAC's target)
    adam_runs = run_all([{**base, "kind": "adamw", "seed": s, "steps": args.steps, "adam_lr": adam_lr}
                         for s in args.seeds], args.jobs, "adamw")
    kfac_runs = run_all([{**base, "kind": "kfac", "seed": a["seed"], "steps": args.steps, "adam_lr": adam_lr,
                          "damping": best_kfac["damping"], "kl_clip": best_kfac["kl_clip"],
                          "target": a["val"][-1][1]} for a in adam_runs], args.jobs, "kfac")

    print(f"\nbert-tiny MLM, pydoc corpus; AdamW lr {adam_lr:g}; K-FAC damping {best_kfac['damping']:g}, "
          f"kl_clip {best_kfac['kl_clip']:g}, lr {KFAC_FIXED['lr']}, refresh every {KFAC_FIXED['refresh_steps']}")
    print(f"{'seed':>4} {'adamw val@' + str(args.steps):>15} {'kfac steps to reach':>20} {'ratio':>6} "
          f"{'kfac val@same step':>19} {'adamw s/step':>12} {'kfac s/step':>11}")
    rows = []
    for a, k in zip(adam_runs, kfac_runs):
        target = a["val"][-1][1]
        reached = next((s for s, v in k["val"] if v <= target), None)
        steps_done = k["val"][-1][0]
        ratio = reached / args.steps if reached else None
        rows.append({"seed": a["seed"], "adamw_val": target, "kfac_steps": reached, "ratio": ratio})
        print(f"{a['seed']:>4} {target:>15.4f} {reached if reached else '>' + str(steps_done):>20} "
              f"{(f'{ratio:.2f}' if ratio else '-'):>6} {k['val'][-1][1]:>19.4f} "
              f"{a['seconds'] / a['val'][-1][0]:>12.4f} {k['seconds'] / steps_done:>11.4f}")
    done = [r["ratio"] for r in rows if r["ratio"]]
    if done:
        print(f"mean ratio {sum(done) / len(done):.2f} over {len(done)} of {len(rows)} seeds "
              f"(aim: <= 0.60); total {time.perf_counter() - t_start:.0f}s")
    if args.json:
        from pfcompile.formats.jsonio import write_json

        write_json(args.json, {"rows": rows, "tuning": [{"config": c, "val": v} for c, v in tuned_adam + tuned_kfac],
                               "adamw": adam_runs, "kfac": kfac_runs,
                               "args": vars(args)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
