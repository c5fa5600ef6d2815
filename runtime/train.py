"""The single-process trainer: the reference semantics the pipeline runtime must reproduce.

One step (see runtime.kfac for the refresh cycle):
    refresh step (t % k == 0): activate() every layer (last cycle's inverses come into force)
    for each micro-batch m: forward; backward of loss_m / M; on refresh steps capture and
        run curv_a(m), curv_b(m)
    refresh step: invert A and B of every layer (pending until step t + k)
    precondition every layer; KL-clip per group; optimizer step
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from runtime.data import Batch, split_micro_batches
from runtime.kfac import KfacConfig, KfacLayer, apply_kl_clip, capturing
from runtime.models import IGNORE_INDEX, lm_loss
from runtime.optim import clip_coefficient, raw_grad_norm_sq, scale_all_grads


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


def train_step(model: nn.Module, kfac_layers: list[KfacLayer], optimizer, batch: Batch, step: int,
               micro_batches: int, cfg: KfacConfig | None, *, kl_groups: list[list[KfacLayer]] | None = None,
               seed: int = 0, precision=None, max_grad_norm: float = 0.0, stats: dict | None = None) -> float:
    """One training step; returns the step's loss (mean over micro-batches of their mean loss).

    `kl_groups` partitions kfac_layers for the KL clip (the pipeline runtime clips per stage);
    default: one group of all layers. `precision` (runtime.precision.Precision): bfloat16 runs
    the forwards under autocast, as the runtime does (the backward follows their dtypes).
    `max_grad_norm` > 0 clips the back-propagated gradient to that global norm (before
    preconditioning; applied after it, which is the same by linearity). `stats`, if given,
    receives "grad_norm" (before clipping).
    """
    import contextlib
    device_type = next(model.parameters()).device.type
    amp = (lambda: precision.autocast(device_type)) if precision is not None else contextlib.nullcontext
    M = micro_batches
    use_kfac = bool(kfac_layers) and cfg is not None
    refresh = use_kfac and step % cfg.refresh_steps == 0
    if refresh:
        for l in kfac_layers:
            l.activate()
            l.loss_divisor = M
    optimizer.zero_grad()
    losses = []
    for m, (tokens, targets) in enumerate(split_micro_batches(batch, M)):
        with capturing(kfac_layers, m, on=refresh):
            if refresh and cfg.fisher == "mc":
                with amp():
                    logits = model(tokens)
                    loss = lm_loss(logits, targets)
                sampled = sample_targets(logits, targets, _mc_generator(seed, step, m))
                params = [p for p in model.parameters() if p.requires_grad]
                # Its own backward: only the hooks' captured output gradients are kept.
                torch.autograd.grad(lm_loss(logits, sampled) / M, params, retain_graph=True, allow_unused=True)
                for l in kfac_layers:
                    l.skip_grad_capture = True
            else:
                with amp():
                    loss = model(tokens, targets)
            (loss / M).backward()
        losses.append(loss.detach())
        if refresh:
            for l in kfac_layers:
                l.curv_a(m)
                l.curv_b(m)
    if refresh:
        for l in kfac_layers:
            l.invert("A")
            l.invert("B")
    if use_kfac:
        for l in kfac_layers:
            l.precondition()
    active = kfac_layers if use_kfac else []
    norm = float(raw_grad_norm_sq(model, active)) ** 0.5
    scale_all_grads(model, active, clip_coefficient(norm, max_grad_norm))
    if stats is not None:
        stats["grad_norm"] = norm
    if use_kfac:
        for group in kl_groups or [kfac_layers]:
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


def run_training(run: RunConfig, kfac: KfacConfig | None, optim_cfg, *,
                 progress: Callable[[int, float], None] | None = None) -> Curve:
    """Train a built-in model on the pydoc corpus; K-FAC if `kfac` is set, else AdamW only."""
    from runtime.data import make_stream
    from runtime.kfac import make_layers
    from runtime.models import build_model, kfac_linears, resolve_config
    from runtime.optim import build_optimizer

    cfg = resolve_config(run.model, seq_len=run.seq_len)
    model = build_model(cfg, seed=run.seed)
    layers = make_layers(kfac_linears(model), kfac, run.micro_batches) if kfac else []
    opt = build_optimizer(model, layers, optim_cfg)
    data_seed = run.seed if run.data_seed is None else run.data_seed
    train = make_stream(cfg.kind, run.batch_size, run.seq_len, seed=data_seed)
    val = make_stream(cfg.kind, run.batch_size, run.seq_len, seed=0, split="val").fixed_batches(run.eval_batches)
    curve = Curve()
    for step in range(run.steps):
        loss = train_step(model, layers, opt, train.batch(step), step, run.micro_batches, kfac, seed=run.seed)
        curve.train.append((step, loss))
        if (step + 1) % run.eval_every == 0 or step + 1 == run.steps:
            curve.val.append((step + 1, evaluate(model, val)))
        if progress:
            progress(step, loss)
    return curve


def train_reference(spec, cfg, stream, micro_batches: int, *, kfac: bool = True, kl_groups_of=None,
                    dtype: torch.dtype | None = None, steps: int | None = None, precision=None):
    """The single-process run of a config (runtime.job_config.JobConfig with the plan-fixed
    keys filled): the same model seed, optimizer, schedule, K-FAC settings and clipping as
    `torchrun -m runtime` with that config. `kl_groups_of(layers)` groups the layers for
    the KL clip (the pipeline clips per stage). Returns (model, step losses)."""
    from runtime.kfac import make_layers
    from runtime.models import build_model, kfac_linears
    from runtime.optim import build_optimizer

    seed = cfg.train.seed
    model = build_model(spec, seed=seed, dtype=dtype)
    kcfg = cfg.kfac_config()
    layers = make_layers(kfac_linears(model), kcfg, micro_batches) if kfac else []
    groups = kl_groups_of(layers) if kl_groups_of and layers else None
    opt = build_optimizer(model, layers, cfg.optim_config())
    losses = []
    for step in range(cfg.train.steps if steps is None else steps):
        losses.append(train_step(model, layers, opt, stream.batch(step), step, micro_batches,
                                 kcfg if kfac else None, kl_groups=groups, seed=seed,
                                 max_grad_norm=cfg.optimizer.max_grad_norm, precision=precision))
    return model, losses
