"""The numerical half of benchmarks/gpu_check.sh: on the device under test, run the
single-process trainer, and compute K-FAC factors, inverses and the preconditioned gradient
of one batch; set them against the same computation on the CPU in float64 and print a table.

    python benchmarks/gpu_check.py --device cuda:0 --model bert-base --micro-batch 8 --seq-len 128

Both sides start from the same weights (built once in float64, copied to the device dtype) and
see the same batch. The error of each layer is relative, in the Frobenius norm:
|X_device - X_cpu64| / |X_cpu64|, for the factors A and B, and for the preconditioned
gradient B^-1 G A^-1 (damping as the runtime's KfacConfig).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

import torch

# benchmarks/runtime.py would shadow the runtime package when this runs as a script
sys.path[:] = [p for p in sys.path if not p.rstrip("/").endswith("benchmarks")]


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--model", default="bert-base")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="single-process trainer steps (default 3)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--show", type=int, default=8, help="layers shown in the table (worst first; default 8)")
    return p.parse_args(argv)


def kfac_pass(model, layers, batch, micro_batches: int, precision) -> None:
    """One refresh step's K-FAC work without the optimizer: capture, curvature, invert both
    factors, activate, precondition (the gradients are replaced by preconditioned ones)."""
    from runtime.io.data import split_micro_batches
    from runtime.optimizers.kfac import capturing

    device_type = next(model.parameters()).device.type
    model.zero_grad(set_to_none=True)
    for m, (tokens, targets) in enumerate(split_micro_batches(batch, micro_batches)):
        with capturing(layers, m):
            with precision.autocast(device_type):
                loss = model(tokens, targets)
            (loss / micro_batches).backward()
        for l in layers:
            l.curv_a(m)
            l.curv_b(m)
    for l in layers:
        l.invert("A")
        l.invert("B")
        l.activate()
        l.precondition()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def main(argv=None) -> int:
    args = parse(argv)
    from runtime.config.precision import precision
    from runtime.io.data import make_stream
    from runtime.models import build_model, kfac_linears, resolve_config
    from runtime.optimizers.kfac import KfacConfig, make_layers
    from runtime.optimizers.stage import build_optimizer
    from runtime.train import train_step

    torch.set_num_threads(1)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"gpu_check: error: --device {args.device}: no CUDA device here", file=sys.stderr)
        return 2
    prec = precision(args.dtype)
    cfg = resolve_config(args.model, seq_len=args.seq_len)
    M = args.micro_batches
    batch = make_stream(cfg.kind, args.micro_batch * M, args.seq_len, seed=0, synthetic=True,
                        vocab=cfg.vocab).batch(0)
    to = lambda b, dev: type(b)(b.tokens.to(dev), b.targets.to(dev))  # noqa: E731

    # --- the single-process trainer on the device --------------------------------------------
    kcfg = KfacConfig(refresh_steps=1)
    model = build_model(cfg, seed=0, dtype=prec.param_dtype).to(device)
    layers = make_layers(kfac_linears(model), kcfg, M)
    opt = build_optimizer(model, layers)
    stream = make_stream(cfg.kind, args.micro_batch * M, args.seq_len, seed=0, synthetic=True, vocab=cfg.vocab)
    losses, times = [], []
    for step in range(args.steps):
        b = to(stream.batch(step), device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        losses.append(train_step(model, layers, opt, b, step, M, kcfg, precision=prec if prec.mixed else None))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    finite = all(l == l and abs(l) != float("inf") for l in losses)
    print(f"trainer on {device} ({args.model}, {args.dtype}, {M} x {args.micro_batch} x {args.seq_len}): "
          f"loss {' -> '.join(f'{l:.4f}' for l in losses)}; step ms {', '.join(f'{t:.1f}' for t in times)}"
          f" (first includes warm-up){'' if finite else '  NON-FINITE LOSS'}")

    # --- K-FAC on the device vs CPU float64 ---------------------------------------------------
    ref = build_model(cfg, seed=0, dtype=torch.float64)
    dev_model = copy.deepcopy(ref).to(device=device, dtype=prec.param_dtype)
    ref_layers = make_layers(kfac_linears(ref), KfacConfig(), M)
    dev_layers = make_layers(kfac_linears(dev_model), KfacConfig(), M)
    kfac_pass(ref, ref_layers, batch, M, precision("float64"))
    kfac_pass(dev_model, dev_layers, to(batch, device), M, prec)
    rows = []
    for r, d in zip(ref_layers, dev_layers):
        rows.append((r.name, rel(d.factors["A"], r.factors["A"]), rel(d.factors["B"], r.factors["B"]),
                     rel(d.grad_matrix(), r.grad_matrix())))
    worst = sorted(rows, key=lambda row: -max(row[1:]))
    print(f"\nK-FAC on {device} ({args.dtype}) vs CPU float64, relative error |dev - cpu64| / |cpu64| "
          f"({len(rows)} layers, {min(args.show, len(rows))} worst shown)")
    print(f"{'layer':<22} {'factor A':>10} {'factor B':>10} {'precond grad':>13}")
    for name, ea, eb, ep in worst[: args.show]:
        print(f"{name:<22} {ea:>10.2e} {eb:>10.2e} {ep:>13.2e}")
    print(f"{'max over layers':<22} {max(r[1] for r in rows):>10.2e} {max(r[2] for r in rows):>10.2e} "
          f"{max(r[3] for r in rows):>13.2e}")
    return 0 if finite else 1


if __name__ == "__main__":
    sys.exit(main())
