"""Train bert-tiny (masked LM) on the pydoc corpus with AdamW and with K-FAC; print both
loss curves (train and validation) side by side.

    python examples/train_kfac.py --steps 200 [--seed 0] [--model bert-tiny] [--json out.json]

Both runs see the same initial weights and the same batches. K-FAC covers every Linear in
the blocks (SGD-momentum on preconditioned gradients); AdamW trains the rest (embeddings,
LayerNorms, head) in both runs. Hyper-parameters are the ones benchmarks/convergence.py
tuned. Single process; the pipeline runtime runs the same step semantics across ranks.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from runtime.optimizers.kfac import KfacConfig
from runtime.optimizers.stage import OptimConfig
from runtime.train import RunConfig, run_training

# Tuned by benchmarks/convergence.py (bert-tiny, batch 32 x 64 characters; see its grid and
# benchmarks/results/2026-11-30-convergence.md).
ADAMW = OptimConfig(adam_lr=1e-3)
KFAC_OPTIM = OptimConfig(lr=0.1, momentum=0.9, adam_lr=1e-3)
KFAC = KfacConfig(damping=1e-4, ema=0.9, refresh_steps=5, kl_clip=1e-5)


def _mean_loss(curve, step: int, window: int) -> float:
    """The mean training loss over the `window` steps before `step`."""
    losses = [loss for _, loss in curve.train[max(0, step - window):step]]
    return sum(losses) / len(losses)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="bert-tiny")
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: fastest when the 2 cores are shared)")
    ap.add_argument("--json", metavar="PATH", help="also write both curves as JSON")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    torch.set_num_threads(args.threads)
    from runtime.models import ModelSpecError

    run = RunConfig(model=args.model, steps=args.steps, seed=args.seed, eval_every=args.eval_every)
    curves = {}
    try:
        from rich.progress import Progress

        with Progress(transient=True) as bar:
            for name, kfac, opt in (("adamw", None, ADAMW), ("kfac", KFAC, KFAC_OPTIM)):
                task = bar.add_task(f"{name:6s}", total=args.steps)
                t0 = time.perf_counter()
                curves[name] = run_training(run, kfac, opt, progress=lambda s, l, task=task: bar.update(task, advance=1))
                curves[name].seconds = time.perf_counter() - t0
    except ModelSpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    a, k = curves["adamw"], curves["kfac"]
    print(f"{args.model} MLM on pydoc topics, seed {args.seed}: "
          f"adamw {a.seconds:.1f}s, kfac {k.seconds:.1f}s")
    print(f"{'step':>6} {'adamw train':>12} {'kfac train':>11} {'adamw val':>10} {'kfac val':>9}")
    window = max(1, args.eval_every)
    for (step, va), (_, vk) in zip(a.val, k.val):
        print(f"{step:>6} {_mean_loss(a, step, window):>12.4f} {_mean_loss(k, step, window):>11.4f} "
              f"{va:>10.4f} {vk:>9.4f}")
    if args.json:
        from pfcompile.formats.jsonio import write_json

        write_json(args.json, {n: {"train": c.train, "val": c.val, "seconds": c.seconds} for n, c in curves.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
