"""The other optimizers' per-layer ops timed as the runtime runs them, and estimated where
they cannot be timed.

Timed (`measure_optimizer_layer`): each per-step and per-cycle op an optimizer declares, as
its layer's method of that kind (runtime.optimizers.registry: Shampoo's `stats`, `inv` of L
and of R and `precond`, Muon's `orth`, a plugin's own), on the layer's real gradient of one
step of the profiled micro-batch.

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
| SOAP activation (`Optimizer.activation`): the first moment out of the old basis, into the new | 2 (2 m^2 n + 2 m n^2) |

The eigendecomposition rarely runs at GEMM rate, so its estimate is a lower bound.
"""

from __future__ import annotations

import torch

from pfcompile.formats.optimizers import CYCLE, MICRO_BATCH, OPTIMIZERS, STEP, optimizer
from pfcompile.formats.optimizers import optimizer as optimizer_spec
from pfcompile.profiler.clocks import Clock, Timing


def measure_optimizer_layer(optimizer: str, name: str, linear: torch.nn.Linear, clock: Clock,
                            muon_ns_dtype: str = "bfloat16", x: torch.Tensor | None = None,
                            gy: torch.Tensor | None = None) -> tuple[dict[str, float], dict[str, Timing]]:
    """-> ({cost key: median ms}, {cost key: Timing}) of one covered layer's per-step and
    per-cycle ops of `optimizer` (any registered one but K-FAC, whose micro-batch ops
    pfcompile.profiler.kfac_ops times on the part's own tensors), run as the runtime runs
    them: the layer its registry entry makes (runtime.optimizers.registry), each op the
    layer's method of the kind's name, on the gradient `linear.weight.grad` holds (left as it
    was). A micro-batch op runs on what the layer captured of a forward and backward of the
    micro-batch's input `x` and output gradient `gy` (redone before each run, untimed). In
    the order of a refresh cycle's first step: the per-step statistics, the micro-batch ops,
    the refresh of each factor, then the update with the refresh in force; then, where the
    optimizer declares an `activation`, a second refresh and its activation (the moments
    rotated out of the basis in force into the new one). Muon's Newton-Schulz iteration runs
    in `muon_ns_dtype`."""
    from runtime.config.job import JobConfig
    from runtime.optimizers.registry import entry

    spec, runtime_entry = optimizer_spec(optimizer), entry(optimizer)
    if not spec.cost_keys():
        raise ValueError(f"no per-layer ops to time for {optimizer!r}")
    if x is None and any(d.when == MICRO_BATCH for d in spec.ops):
        raise ValueError(f"{optimizer!r} has micro-batch ops: time them on the layer's input (x, gy)")
    job = JobConfig()
    job.kfac.refresh_steps = 2  # k > 1: a snapshot is a copy of the statistics, as in most plans
    job.muon.ns_dtype = muon_ns_dtype
    layer = runtime_entry.layer(name, linear, runtime_entry.math_config(job), 1)
    w = linear.weight
    grad = w.grad.detach().clone()

    def fresh_grad():  # the ops replace the gradient: each run starts from the same one
        w.grad = grad.clone()

    def run(kind: str, factor: str | None = None):
        return lambda: getattr(layer, kind)(mb=None, factor=factor, cycle_step=0)

    costed = [d for d in spec.ops if d.cost is not None and not d.collective]
    # each refresh op once per factor it names in its cost key
    refreshes = [(d, f) for d in costed if d.when == CYCLE for f in (spec.factors if "{factor}" in d.cost else (None,))]
    t: dict[str, Timing] = {}
    fresh_grad()
    for d in (d for d in costed if d.when == STEP and d.kind != spec.update):
        t[d.cost.format(factor=None, inverse=None)] = clock.time(run(d.kind), setup=fresh_grad)
    def capture():  # a micro-batch's forward and backward, the layer capturing as in a refresh step
        layer.capturing, layer.mb = True, 0
        try:
            y = linear(x.detach())
            if gy is not None:
                y.backward(gy)
        finally:
            layer.capturing = False

    for d in (d for d in costed if d.when == MICRO_BATCH):
        t[d.cost.format(factor=d.factor, inverse=None)] = clock.time(lambda d=d: getattr(layer, d.kind)(
            mb=0, factor=d.factor, cycle_step=0), setup=capture)
    fresh_grad()
    for d, f in refreshes:
        t[d.cost.format(factor=f, inverse=None)] = clock.time(run(d.kind, f))
    if hasattr(layer, "activate"):
        layer.activate()
    update = spec.op(spec.update) if spec.update is not None else None
    if update is not None and update.cost is not None:
        t[update.cost.format(factor=None, inverse=None)] = clock.time(run(update.kind), setup=fresh_grad)
    if spec.activation is not None:
        # as at a later cycle's start: a basis in force, moments kept in it, a refreshed one pending
        fresh_grad()
        if update is not None:
            run(update.kind)()
        for d, f in refreshes:
            run(d.kind, f)()
        before = layer.state_dict()
        t[spec.activation] = clock.time(layer.activate, setup=lambda: layer.load_state_dict(before))
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
    if spec.activation is not None and spec.activation_flops is not None:
        out[spec.activation] = spec.activation_flops(m, n, None) / rate
    if not out:
        raise ValueError(f"no per-layer ops to estimate for {name!r}")
    return out
