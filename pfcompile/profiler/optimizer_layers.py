"""The other optimizers' per-layer ops timed as the runtime runs them, and estimated where
they cannot be timed.

Timed (`measure_optimizer_layer`): Shampoo's `update_stats`, `compute_root` of L and of R
and `precondition` (runtime.optimizers.shampoo), Muon's `orthogonalize` (runtime.optimizers.muon), each on the
layer's real gradient of one step of the profiled micro-batch.

Estimated (`estimated_optimizer_ms`, for reference profiles, which have nothing to time):
each op's floating-point operations, as its declaration gives them (`OpDecl.flops`,
pfcompile.formats.optimizers), at the profile's own GEMM rate, the forward FLOPs of a block
over its published forward time. With m = out_features, n = in_features:

| op | FLOPs |
|---|---|
| Shampoo stats: G G^T and G^T G | 2 m^2 n + 2 m n^2 |
| Shampoo inverse root of an d x d statistic: eigendecomposition and Q diag Q^T | 9 d^3 + 2 d^3 |
| Shampoo precond: L^-1/4 G R^-1/4 | 2 m^2 n + 2 m n^2 |
| Muon orth: 5 Newton-Schulz iterations on the p x q update (p <= q): X X^T, a A + b A^2, (..) X | 5 (4 p^2 q + 2 p^3) |

The eigendecomposition rarely runs at GEMM rate, so its estimate is a lower bound.
"""

from __future__ import annotations

import torch

from pfcompile.formats.optimizers import OPTIMIZERS, optimizer
from pfcompile.profiler.clocks import Clock, Timing


def measure_optimizer_layer(optimizer: str, name: str, linear: torch.nn.Linear, clock: Clock,
                            muon_ns_dtype: str = "bfloat16") -> tuple[dict[str, float], dict[str, Timing]]:
    """-> ({cost key: median ms}, {cost key: Timing}) of one covered layer's ops of `optimizer`
    ("shampoo" or "muon", its Newton-Schulz iteration in `muon_ns_dtype`), on the gradient
    `linear.weight.grad` holds (left as it was)."""
    w = linear.weight
    grad = w.grad.detach().clone()

    def fresh_grad():  # the ops replace the gradient: each run starts from the same one
        w.grad = grad.clone()

    t: dict[str, Timing] = {}
    if optimizer == "shampoo":
        from runtime.optimizers.shampoo import ShampooConfig, ShampooLayer

        layer = ShampooLayer(name, linear, ShampooConfig(refresh_steps=2))  # k > 1: the snapshot is a copy
        fresh_grad()
        t["stats"] = clock.time(lambda: layer.update_stats(snapshot=True), setup=fresh_grad)
        for f in ("L", "R"):
            t[f"inv_{f}"] = clock.time(lambda f=f: layer.compute_root(f))
        layer.activate()
        t["precond"] = clock.time(layer.precondition, setup=fresh_grad)
    elif optimizer == "muon":
        from runtime.optimizers.muon import MuonConfig, MuonLayer

        layer = MuonLayer(name, linear, MuonConfig(ns_dtype=muon_ns_dtype))
        t["orth"] = clock.time(layer.orthogonalize, setup=fresh_grad)
    else:
        raise ValueError(f"no per-layer ops to time for {optimizer!r}")
    fresh_grad()
    return {k: v.median for k, v in t.items()}, t


def gemm_rate_flops_per_ms(model: dict, fwd_ms: float) -> float:
    """A transformer block's forward FLOPs over its measured forward time: the rate at which
    the profile's device ran GEMM-dominated work (model: hidden, ffn, seq_len, micro_batch)."""
    h, f, s, b = model["hidden"], model["ffn"], model["seq_len"], model["micro_batch"]
    tokens = b * s
    flops = 2 * tokens * (4 * h * h + 2 * h * f) + 2 * 2 * b * s * s * h  # projections, then scores and mixing
    return flops / fwd_ms


def estimable_optimizers() -> tuple[str, ...]:
    """The declared optimizers whose every costed op declares its FLOPs, bar K-FAC (whose
    reference costs are published): those a reference profile estimates."""
    return tuple(name for name, o in OPTIMIZERS.items() if name != "kfac" and o.cost_keys()
                 and all(d.flops is not None for d in o.ops if d.cost is not None))


def estimated_optimizer_ms(name: str, in_features: int, out_features: int, rate: float) -> dict[str, float]:
    """The declared FLOPs (module docstring) of one covered layer's ops of optimizer `name` at
    `rate` (FLOPs per ms), one entry per cost key."""
    spec = optimizer(name)
    m, n = out_features, in_features
    out: dict[str, float] = {}
    for d in spec.ops:
        if d.cost is None:
            continue
        if d.flops is None:
            raise ValueError(f"no per-layer ops to estimate for {name!r}: {d.kind} declares no FLOPs")
        for f in (spec.factors if "{factor}" in d.cost else (None,)):
            out[d.cost.format(factor=f, inverse=None)] = d.flops(m, n, f) / rate
    if not out:
        raise ValueError(f"no per-layer ops to estimate for {name!r}")
    return out
