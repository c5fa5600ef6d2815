"""The other optimizers' per-layer ops timed as the runtime runs them, and estimated where
they cannot be timed.

Timed (`measure_optimizer_layer`): Shampoo's `update_stats`, `compute_root` of L and of R
and `precondition` (runtime.shampoo), Muon's `orthogonalize` (runtime.muon), each on the
layer's real gradient of one step of the profiled micro-batch.

Estimated (`estimated_optimizer_ms`, for reference profiles, which have nothing to time):
each op's floating-point operations at the profile's own GEMM rate, the forward FLOPs of a
block over its published forward time. With m = out_features, n = in_features:

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

from pfcompile.profiler.clocks import Clock, Timing

# FLOPs of a symmetric eigendecomposition with eigenvectors (LAPACK syevd, about 9 d^3) and of
# rebuilding the root from it (Q diag Q^T, 2 d^3)
EIGH_FLOPS_PER_D3 = 9 + 2
NS_STEPS = 5  # torch.optim.Muon's default


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


def estimated_optimizer_ms(optimizer: str, in_features: int, out_features: int, rate: float) -> dict[str, float]:
    """The module docstring's FLOP model of one covered layer's ops at `rate` (FLOPs per ms)."""
    m, n = out_features, in_features
    if optimizer == "shampoo":
        two_sided = 2 * m * m * n + 2 * m * n * n
        return {"stats": two_sided / rate, "inv_L": EIGH_FLOPS_PER_D3 * m ** 3 / rate,
                "inv_R": EIGH_FLOPS_PER_D3 * n ** 3 / rate, "precond": two_sided / rate}
    if optimizer == "muon":
        p, q = min(m, n), max(m, n)
        return {"orth": NS_STEPS * (4 * p * p * q + 2 * p ** 3) / rate}
    raise ValueError(f"no per-layer ops to estimate for {optimizer!r}")
