"""The single-process trainer: the reference semantics the pipeline runtime must reproduce.

One step (see runtime.optimizers.kfac for the refresh cycle):
    refresh step (t % k == 0): activate() every layer (last cycle's inverses come into force)
    for each micro-batch m: forward; backward of loss_m / M; on refresh steps capture and
        run curv_a(m), curv_b(m)
    refresh step: invert A and B of every layer (pending until step t + k)
    precondition every layer; KL-clip per group; optimizer step

Shampoo (runtime.optimizers.shampoo) and Muon (runtime.optimizers.muon) steps, by the cfg passed:
    Shampoo: refresh step: activate() every layer; forward/backward of every micro-batch;
        update_stats (snapshot on refresh steps); refresh step: compute_root L and R
        (pending until step t + k); precondition; clip; optimizer step
    Muon: forward/backward of every micro-batch; clip; orthogonalize; optimizer step
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from runtime.io.data import Batch, split_micro_batches
from runtime.models import IGNORE_INDEX, lm_loss
from runtime.optimizers.kfac import KfacConfig, KfacLayer, apply_kl_clip, capturing, kfac_config
from runtime.optimizers.muon import MuonConfig, muon_config
from runtime.optimizers.shampoo import ShampooConfig, shampoo_config
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


def train_step(model: nn.Module, covered_layers: list[KfacLayer], optimizer, batch: Batch, step: int,
               micro_batches: int, cfg: KfacConfig | None, *, kl_groups: list[list[KfacLayer]] | None = None,
               seed: int = 0, precision=None, max_grad_norm: float = 0.0, stats: dict | None = None) -> float:
    """One training step; returns the step's loss (mean over micro-batches of their mean loss).

    `kl_groups` partitions covered_layers for the KL clip (the pipeline runtime clips per stage);
    default: one group of all layers. `precision` (runtime.config.precision.Precision): bfloat16 runs
    the forwards under autocast, as the runtime does (the backward follows their dtypes).
    `max_grad_norm` > 0 clips the back-propagated gradient to that global norm (before
    preconditioning; applied after it, which is the same by linearity). `stats`, if given,
    receives "grad_norm" (before clipping).

    With a ShampooConfig or MuonConfig as `cfg`, `covered_layers` are that optimizer's layers
    (runtime.optimizers.shampoo.ShampooLayer,
    runtime.optimizers.muon.MuonLayer); `kl_groups` and `seed` are unused.
    """
    import contextlib
    device_type = next(model.parameters()).device.type
    amp = (lambda: precision.autocast(device_type)) if precision is not None else contextlib.nullcontext
    if isinstance(cfg, (ShampooConfig, MuonConfig)):
        return _matrix_step(model, covered_layers, optimizer, batch, step, micro_batches, cfg, amp,
                            max_grad_norm, stats)
    M = micro_batches
    use_kfac = bool(covered_layers) and cfg is not None
    refresh = use_kfac and step % cfg.refresh_steps == 0
    if refresh:
        for l in covered_layers:
            l.activate()
            l.loss_divisor = M
    optimizer.zero_grad()
    losses = []
    for m, (tokens, targets) in enumerate(split_micro_batches(batch, M)):
        with capturing(covered_layers, m, on=refresh):
            if refresh and cfg.fisher == "mc":
                with amp():
                    logits = model(tokens)
                    loss = lm_loss(logits, targets)
                sampled = sample_targets(logits, targets, _mc_generator(seed, step, m))
                params = [p for p in model.parameters() if p.requires_grad]
                # Its own backward: only the hooks' captured output gradients are kept.
                torch.autograd.grad(lm_loss(logits, sampled) / M, params, retain_graph=True, allow_unused=True)
                for l in covered_layers:
                    l.skip_grad_capture = True
            else:
                with amp():
                    loss = model(tokens, targets)
            (loss / M).backward()
        losses.append(loss.detach())
        if refresh:
            for l in covered_layers:
                l.curv_a(m)
                l.curv_b(m)
    if refresh:
        for l in covered_layers:
            l.invert("A")
            l.invert("B")
    if use_kfac:
        for l in covered_layers:
            l.precondition()
    active = covered_layers if use_kfac else []
    norm = float(raw_grad_norm_sq(model, active)) ** 0.5
    scale_all_grads(model, active, clip_coefficient(norm, max_grad_norm))
    if stats is not None:
        stats["grad_norm"] = norm
    if use_kfac:
        for group in kl_groups or [covered_layers]:
            apply_kl_clip(group, optimizer.lr, cfg.kl_clip)
    optimizer.step()
    return float(torch.stack(losses).mean())


def _matrix_step(model, layers, optimizer, batch, step: int, M: int, cfg, amp, max_grad_norm: float,
                 stats: dict | None) -> float:
    """One Shampoo or Muon step (train_step with its cfg), in the order a pipeline runs it."""
    shampoo = isinstance(cfg, ShampooConfig)
    refresh = shampoo and step % cfg.refresh_steps == 0
    if refresh:
        for l in layers:
            l.activate()
    optimizer.zero_grad()
    losses = []
    for tokens, targets in split_micro_batches(batch, M):
        with amp():
            loss = model(tokens, targets)
        (loss / M).backward()
        losses.append(loss.detach())
    if shampoo:
        for l in layers:
            l.update_stats(snapshot=refresh)
        if refresh:
            for l in layers:
                l.compute_root("L")
                l.compute_root("R")
        for l in layers:
            l.precondition()
        # The preconditioned gradient is homogeneous in G: clipping it equals clipping G.
        norm = float(raw_grad_norm_sq(model, layers)) ** 0.5
        scale_all_grads(model, [], clip_coefficient(norm, max_grad_norm))
    else:
        # G feeds the momentum buffer and NS normalises its input: clip before orthogonalising.
        norm = float(raw_grad_norm_sq(model, [])) ** 0.5
        scale_all_grads(model, [], clip_coefficient(norm, max_grad_norm))
        for l in layers:
            l.orthogonalize()
    if stats is not None:
        stats["grad_norm"] = norm
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
    """The covered layers (runtime.models.kfac_linears) of `optimizer` with its config: K-FAC's
    with hooks attached, Shampoo's, Muon's; none for AdamW."""
    from runtime.models import kfac_linears
    from runtime.optimizers import muon, shampoo
    from runtime.optimizers.kfac import make_layers

    if optimizer == "adamw":
        return []
    make = {"kfac": lambda named: make_layers(named, cfg, micro_batches),
            "shampoo": lambda named: shampoo.make_layers(named, cfg),
            "muon": lambda named: muon.make_layers(named, cfg)}[optimizer]
    return make(kfac_linears(model))


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
    name = ("kfac" if kfac else "shampoo" if isinstance(second_order, ShampooConfig)
            else "muon" if isinstance(second_order, MuonConfig) else "adamw")
    step_cfg = kfac or second_order
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
    seed = cfg.train.seed
    model = build_model(spec, seed=seed, dtype=dtype)
    step_cfg = {"kfac": kfac_config, "shampoo": shampoo_config, "muon": muon_config,
                "adamw": lambda job: None}[name](cfg)
    layers = make_optimizer_layers(model, name, step_cfg, micro_batches)
    groups = kl_groups_of(layers) if kl_groups_of and layers and name == "kfac" else None
    opt = build_optimizer(model, layers, optim_config(cfg), optimizer=name)
    losses = []
    for step in range(cfg.train.steps if steps is None else steps):
        losses.append(train_step(model, layers, opt, stream.batch(step), step, micro_batches,
                                 step_cfg, kl_groups=groups, seed=seed,
                                 max_grad_norm=cfg.optimizer.max_grad_norm, precision=precision))
    return model, losses
