"""The single-process trainer: the reference semantics the pipeline runtime must reproduce.

One step (`train_step`) walks the optimizer's declaration (pfcompile.formats.optimizers) as
one rank of a pipeline runs it: micro-batch ops after each micro-batch's forward and
backward on refresh steps, per-cycle ops on refresh steps, per-step ops every step, in
declared order; then clipping, K-FAC's KL-clip, and the optimizer step. What each op does is
its layer's method of that name (runtime.optimizers.registry); see runtime.optimizers.kfac
for the refresh cycle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from pfcompile.formats.optimizers import CYCLE, MICRO_BATCH
from runtime.io.data import Batch, split_micro_batches
from runtime.models import IGNORE_INDEX, lm_loss
from runtime.optimizers import registry
from runtime.optimizers.kfac import KfacConfig, apply_kl_clip, capturing
from runtime.optimizers.muon import MuonConfig
from runtime.optimizers.shampoo import ShampooConfig
from runtime.optimizers.stage import clip_coefficient, optim_config, raw_grad_norm_sq, scale_all_grads


def sample_targets(logits: torch.Tensor, targets: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Targets drawn from the model's own predictive distribution where the loss is defined
    (the Monte-Carlo Fisher); IGNORE_INDEX elsewhere."""
    probs = logits.detach().double().softmax(-1).reshape(-1, logits.shape[-1])
    drawn = torch.multinomial(probs, 1, generator=g).view(targets.shape)
    return torch.where(targets == IGNORE_INDEX, targets, drawn)


def _mc_generator(seed: int, step: int, mb: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((seed * 7919 + step) * 1009 + mb + 1)
    return g


def train_step(model: nn.Module, layers: list, optimizer, batch: Batch, step: int,
               micro_batches: int, cfg, *, kl_groups: list[list] | None = None,
               seed: int = 0, precision=None, max_grad_norm: float = 0.0, stats: dict | None = None) -> float:
    """One training step; returns the step's loss (mean over micro-batches of their mean loss).

    `cfg` is the optimizer's math config (KfacConfig, ShampooConfig, MuonConfig, ...: its
    registry entry is the one whose config it is; None: AdamW), `layers` its covered layers.
    The step walks the optimizer's declaration (pfcompile.formats.optimizers), as a pipeline
    runs it on one rank:
        refresh step (t % k == 0): activate() every layer (last cycle's results come into force)
        for each micro-batch m: forward; backward of loss_m / M; on refresh steps, with the
            layers capturing (K-FAC's hooks), each micro-batch op of every layer
        then in declared order every per-step op of every layer, and on refresh steps every
            per-cycle op of every layer and factor (collectives have nothing to do here)
        clip; KL-clip per group (an optimizer that KL-clips); optimizer step

    `kl_groups` partitions the layers for the KL clip (the pipeline runtime clips per stage);
    default: one group of all layers. `precision` (runtime.config.precision.Precision): bfloat16
    runs the forwards under autocast, as the runtime does (the backward follows their dtypes).
    `max_grad_norm` > 0 clips the back-propagated gradient to that global norm: after the
    per-step ops, which are linear in the gradient (K-FAC, Shampoo: the same by linearity),
    or before them for an entry that clips first (Muon: the gradient feeds its momentum and
    Newton-Schulz normalises its input). `stats`, if given, receives "grad_norm" (before
    clipping). K-FAC with fisher "mc" takes its output-gradient statistics from targets
    sampled from the model (the Monte-Carlo Fisher; `seed` seeds the draws).
    """
    import contextlib
    device_type = next(model.parameters()).device.type
    amp = (lambda: precision.autocast(device_type)) if precision is not None else contextlib.nullcontext
    entry = registry.entry_of_config(cfg)
    decl = entry.ops
    M = micro_batches
    active = list(layers) if cfg is not None else []
    k = getattr(cfg, "refresh_steps", 1) or 1
    refresh = bool(active) and decl.refreshes and step % k == 0
    capture = refresh and entry.captures
    mc = capture and getattr(cfg, "fisher", "empirical") == "mc"
    at = {"cycle_step": step % k}
    if refresh:
        for l in active:
            l.activate()
            if hasattr(l, "loss_divisor"):
                l.loss_divisor = M
    optimizer.zero_grad()
    losses = []
    for m, (tokens, targets) in enumerate(split_micro_batches(batch, M)):
        with capturing(active if entry.captures else [], m, on=capture):
            if mc:
                with amp():
                    logits = model(tokens)
                    loss = lm_loss(logits, targets)
                sampled = sample_targets(logits, targets, _mc_generator(seed, step, m))
                params = [p for p in model.parameters() if p.requires_grad]
                # Its own backward: only the hooks' captured output gradients are kept.
                torch.autograd.grad(lm_loss(logits, sampled) / M, params, retain_graph=True, allow_unused=True)
                for l in active:
                    l.skip_grad_capture = True
            else:
                with amp():
                    loss = model(tokens, targets)
            (loss / M).backward()
        losses.append(loss.detach())
        if refresh:
            for l in active:
                for d in decl.micro_batch_ops:
                    getattr(l, d.kind)(mb=m, factor=d.factor, **at)
    clip_first = entry.clip_first and bool(active)
    if clip_first:
        norm = float(raw_grad_norm_sq(model, [])) ** 0.5
        scale_all_grads(model, [], clip_coefficient(norm, max_grad_norm))
    for d in decl.ops:
        if d.collective or d.when == MICRO_BATCH or not active or (d.when == CYCLE and not refresh):
            continue
        for l in active:
            for f in (decl.factors if d.when == CYCLE else (None,)):
                getattr(l, d.kind)(mb=None, factor=f, **at)
    if not clip_first:
        norm = float(raw_grad_norm_sq(model, active)) ** 0.5
        scale_all_grads(model, active, clip_coefficient(norm, max_grad_norm))
    if stats is not None:
        stats["grad_norm"] = norm
    if entry.kl_clip and active:
        for group in kl_groups or [active]:
            apply_kl_clip(group, optimizer.lr, cfg.kl_clip)
    optimizer.step()
    return float(torch.stack(losses).mean())


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[Batch]) -> float:
    """Mean loss over fixed batches (each batch's mean over its target tokens)."""
    was = model.training
    model.eval()
    losses = [float(model(b.tokens, b.targets)) for b in batches]
    model.train(was)
    return sum(losses) / len(losses)


@dataclass
class RunConfig:
    model: str = "bert-tiny"
    steps: int = 200
    seed: int = 0
    batch_size: int = 32
    seq_len: int = 64
    micro_batches: int = 1
    eval_every: int = 50
    eval_batches: int = 8
    data_seed: int | None = None  # None: same as seed


@dataclass
class Curve:
    train: list[tuple[int, float]] = field(default_factory=list)
    val: list[tuple[int, float]] = field(default_factory=list)


def make_optimizer_layers(model: nn.Module, optimizer: str, cfg, micro_batches: int) -> list:
    """The covered layers (runtime.models.kfac_linears) of `optimizer` with its config, made by
    its registry entry (K-FAC's with hooks attached); none for one without layers (AdamW)."""
    from runtime.models import kfac_linears

    entry = registry.entry(optimizer)
    if entry.make_layer is None:
        return []
    return [entry.layer(name, linear, cfg, micro_batches) for name, linear in kfac_linears(model)]


def run_training(run: RunConfig, kfac: KfacConfig | None, optim_cfg, *,
                 progress: Callable[[int, float], None] | None = None,
                 second_order: ShampooConfig | MuonConfig | None = None) -> Curve:
    """Train a built-in model on the pydoc corpus; K-FAC if `kfac` is set, Shampoo or Muon if
    `second_order` is (then `kfac` must be None), else AdamW only."""
    from runtime.io.data import make_stream
    from runtime.models import build_model, resolve_config
    from runtime.optimizers.stage import build_optimizer

    if kfac is not None and second_order is not None:
        raise ValueError("run_training: give kfac or second_order, not both")
    step_cfg = kfac or second_order
    name = registry.entry_of_config(step_cfg).name
    cfg = resolve_config(run.model, seq_len=run.seq_len)
    model = build_model(cfg, seed=run.seed)
    layers = make_optimizer_layers(model, name, step_cfg, run.micro_batches)
    opt = build_optimizer(model, layers, optim_cfg, optimizer=name)
    data_seed = run.seed if run.data_seed is None else run.data_seed
    train = make_stream(cfg.kind, run.batch_size, run.seq_len, seed=data_seed)
    val = make_stream(cfg.kind, run.batch_size, run.seq_len, seed=0, split="val").fixed_batches(run.eval_batches)
    curve = Curve()
    for step in range(run.steps):
        loss = train_step(model, layers, opt, train.batch(step), step, run.micro_batches, step_cfg, seed=run.seed)
        curve.train.append((step, loss))
        if (step + 1) % run.eval_every == 0 or step + 1 == run.steps:
            curve.val.append((step + 1, evaluate(model, val)))
        if progress:
            progress(step, loss)
    return curve


def train_reference(spec, cfg, stream, micro_batches: int, *, kfac: bool = True, kl_groups_of=None,
                    dtype: torch.dtype | None = None, steps: int | None = None, precision=None,
                    optimizer: str | None = None):
    """The single-process run of a config (runtime.config.job.JobConfig with the plan-fixed
    keys filled): the same model seed, optimizer, schedule, K-FAC settings and clipping as
    `torchrun -m runtime` with that config. `optimizer` is the plan's choice (kfac | shampoo |
    muon | adamw; default: kfac if `kfac`, else adamw), its settings [kfac], [shampoo] or [muon].
    `kl_groups_of(layers)` groups the layers for the KL clip (the pipeline clips per stage).
    Returns (model, step losses)."""
    from runtime.models import build_model
    from runtime.optimizers.stage import build_optimizer

    name = optimizer or ("kfac" if kfac else "adamw")
    entry = registry.entry(name)
    seed = cfg.train.seed
    model = build_model(spec, seed=seed, dtype=dtype)
    step_cfg = entry.math_config(cfg)
    layers = make_optimizer_layers(model, name, step_cfg, micro_batches)
    groups = kl_groups_of(layers) if kl_groups_of and layers and entry.kl_clip else None
    opt = build_optimizer(model, layers, optim_config(cfg), optimizer=name)
    losses = []
    for step in range(cfg.train.steps if steps is None else steps):
        losses.append(train_step(model, layers, opt, stream.batch(step), step, micro_batches,
                                 step_cfg, kl_groups=groups, seed=seed,
                                 max_grad_norm=cfg.optimizer.max_grad_norm, precision=precision))
    return model, losses
