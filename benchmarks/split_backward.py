"""Split backward cost (not a test): one stage of bert-mini on this CPU, one thread.

Times, per micro-batch, the whole backward (autograd), and the split B + W two ways:
ours (runtime.pipeline.split_backward: B asks autograd for the input, non-Linear parameter and
Linear-output gradients; W forms the Linear weight gradients from the kept input and
output gradient) and torch.distributed.pipelining's stage_backward_input /
stage_backward_weight (B keeps the autograd graph's weight branches, W walks them). Also
checks both give the whole backward's gradients. Median of --repeats, after --warmup.

    .venv/bin/python benchmarks/split_backward.py [--model bert-mini] [--parts block0,block1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bert-mini")
    ap.add_argument("--parts", default="block0,block1")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    a = ap.parse_args()

    import torch
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from runtime.models import Stage, resolve_config
    from runtime.pipeline.split_backward import WeightPasses

    torch.set_num_threads(1)
    cfg = resolve_config(a.model, seq_len=a.seq_len)
    module = Stage(cfg, a.parts.split(","), seed=0)
    params = list(module.parameters())
    x0 = torch.randn(a.micro_batch, a.seq_len, cfg.hidden)
    gy = torch.randn(a.micro_batch, a.seq_len, cfg.hidden)

    def fresh():
        module.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_(True)
        return x

    def full():
        x = fresh()
        out = module(x)
        t0 = time.perf_counter()
        out.backward(gy)
        return (time.perf_counter() - t0, 0.0), x

    split = WeightPasses(module)

    def ours():
        x = fresh()
        with split.recording(0):
            out = module(x)
        t0 = time.perf_counter()
        split.backward_input(0, out, gy, x)
        t1 = time.perf_counter()
        split.backward_weight(0)
        return (t1 - t0, time.perf_counter() - t1), x

    def torchs():
        x = fresh()
        out = module(x)
        t0 = time.perf_counter()
        _, groups = stage_backward_input([out], [gy], [x], iter(params))
        t1 = time.perf_counter()
        stage_backward_weight(iter(params), groups)
        return (t1 - t0, time.perf_counter() - t1), x

    variants = {"whole backward": full, "ours: B + W": ours, "torch: stage_backward_input + _weight": torchs}
    times: dict[str, list] = {name: [] for name in variants}
    results = {}
    ref = ref_x = None
    # round-robin, so a shared machine's load drifts over all variants alike
    for i in range(a.warmup + a.repeats):
        for name, fn in variants.items():
            (b, w), x = fn()
            if i >= a.warmup:
                times[name].append((b, w))
            grads = [p.grad.clone() for p in params]
            if ref is None:
                ref, ref_x = grads, x.grad.clone()
            elif i == 0:
                err = max(float((g - r).abs().max() / r.abs().max().clamp_min(1e-30)) for g, r in zip(grads, ref))
                results[name + " max rel. diff"] = max(err, float((x.grad - ref_x).abs().max() / ref_x.abs().max()))
    for name, ts in times.items():
        results[name] = (statistics.median(t[0] for t in ts) * 1e3, statistics.median(t[1] for t in ts) * 1e3)
    print(f"{a.model} parts {a.parts}, micro-batch {a.micro_batch} x {a.seq_len}, 1 thread, median of {a.repeats}; "
          f"load average {os.getloadavg()[0]:.1f}")
    print("| backward | B ms | W ms | B + W ms | max rel. diff to the whole backward |")
    print("|---|---:|---:|---:|---:|")
    for name in ("whole backward", "ours: B + W", "torch: stage_backward_input + _weight"):
        b, w = results[name]
        diff = results.get(name + " max rel. diff")
        print(f"| {name} | {b:.2f} | {w:.2f} | {b + w:.2f} | {'-' if diff is None else f'{diff:.1e}'} |")


if __name__ == "__main__":
    main()
