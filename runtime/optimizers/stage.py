"""The optimizer of one stage (or the whole model), as the optimizer's registry entry names it
(runtime.optimizers.registry): SGD with momentum on the covered layers' update directions
(SgdOnCoveredOptimizer: K-FAC's and Shampoo's preconditioned gradients), AdamW on everything
they do not cover (embeddings, LayerNorms, the head). Without covered layers it is plain
AdamW, the first-order baseline. AdamW decays neither biases, norms nor embeddings by
default (adam_no_decay), as torchtitan and nanoGPT set it up. Muon's layers (runtime.optimizers.muon) take their own update
(MuonOptimizer). Shampoo and Muon cover only the weights: the layers' biases go to AdamW with
the rest.

Both learning rates follow one schedule (`lr_factor`): linear warm-up over warmup_steps,
then constant, linear, cosine or polynomial decay to final_lr_ratio over decay_steps.
Gradient clipping by global norm (`clip_coefficient`) scales every gradient of the model by
one factor; the single-process trainer and the pipeline runtime both use it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from runtime.config.job import DECAYS, no_decay_kinds  # names live with their config sections
from runtime.optimizers import registry


@dataclass
class OptimConfig:
    lr: float = 0.05             # SGD on K-FAC layers (preconditioned gradients)
    momentum: float = 0.9
    weight_decay: float = 0.0    # SGD weight decay on K-FAC layers
    decoupled_weight_decay: bool = False  # p <- p (1 - lr wd) before the SGD step, as AdamW decays
    adam_lr: float = 1e-3        # AdamW on the rest (and on everything in the baseline)
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_weight_decay: float = 0.01
    adam_no_decay: str = "bias,norm,embedding"  # AdamW's parameters without weight decay
    warmup_steps: int = 0        # linear warm-up of both learning rates
    decay: str = "constant"      # after warm-up: constant | linear | cosine | polynomial
    decay_steps: int = 0         # steps from the end of warm-up to the final rate (0: no decay)
    final_lr_ratio: float = 0.0  # the decayed rate as a fraction of the peak
    power: float = 1.0           # polynomial decay exponent (BERT: 1.0)

    def __post_init__(self):
        if self.decay not in DECAYS:
            raise ValueError(f"decay must be one of {', '.join(DECAYS)}, got {self.decay!r}")
        if self.warmup_steps < 0 or self.decay_steps < 0:
            raise ValueError("warmup_steps and decay_steps must be >= 0")
        if not 0.0 <= self.final_lr_ratio <= 1.0:
            raise ValueError(f"final_lr_ratio must be in [0, 1], got {self.final_lr_ratio}")

    def lr_factor(self, step: int) -> float:
        """Multiplier of both peak learning rates for the update of step `step` (0-based)."""
        w = self.warmup_steps
        if w > 0 and step < w:
            return (step + 1) / w
        if self.decay == "constant" or self.decay_steps == 0:
            return 1.0
        p = min(1.0, (step - w) / self.decay_steps)
        r = self.final_lr_ratio
        if self.decay == "linear":
            return 1.0 - (1.0 - r) * p
        if self.decay == "cosine":
            return r + (1.0 - r) * 0.5 * (1.0 + math.cos(math.pi * p))
        return r + (1.0 - r) * (1.0 - p) ** self.power


def optim_config(job) -> OptimConfig:
    """OptimConfig of a JobConfig's [optimizer] and [schedule] (max_grad_norm is the update's:
    runtime.pipeline.build.Update); decay_steps 0 is until the last step of [train]."""
    o, s = job.optimizer, job.schedule
    decay_steps = s.decay_steps or max(1, job.train.steps - s.warmup_steps)
    return OptimConfig(lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay,
                       decoupled_weight_decay=o.decoupled_weight_decay, adam_lr=o.adam_lr,
                       adam_betas=o.adam_betas, adam_weight_decay=o.adam_weight_decay,
                       adam_no_decay=o.adam_no_decay,
                       warmup_steps=s.warmup_steps, decay=s.decay, decay_steps=decay_steps,
                       final_lr_ratio=s.final_lr_ratio, power=s.power)


def covered_parameters(layer) -> tuple[torch.Tensor, ...]:
    """The parameters a layer's optimizer covers: a K-FAC layer all of its Linear's (weight
    and bias), a Shampoo or Muon layer its `covered` (the weight)."""
    covered = getattr(layer, "covered", None)
    return tuple(layer.module.parameters()) if covered is None else covered


def _is_norm(module: nn.Module) -> bool:
    """LayerNorm, RMSNorm, GroupNorm and the like, torch's or a model's own (by class name)."""
    return isinstance(module, (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)) or "norm" in type(module).__name__.lower()


def no_decay_ids(module: nn.Module, kinds: str) -> set[int]:
    """ids of the module's parameters of the kinds named in `kinds` ("bias,norm,embedding"):
    a bias is any parameter of fewer than two dimensions, a norm any parameter of a
    normalisation layer, an embedding an nn.Embedding's weight."""
    wanted = set(no_decay_kinds(kinds))
    ids = set()
    for m in module.modules():
        for p in m.parameters(recurse=False):
            if (("bias" in wanted and p.ndim < 2) or ("norm" in wanted and _is_norm(m))
                    or ("embedding" in wanted and isinstance(m, nn.Embedding))):
                ids.add(id(p))
    return ids


def make_adamw(module: nn.Module, params: list, cfg: OptimConfig) -> torch.optim.AdamW | None:
    """torch AdamW over `params` (None if empty) in two groups: weight decay on the
    parameters outside cfg.adam_no_decay, none on those inside (an empty group is left out)."""
    if not params:
        return None
    exempt = no_decay_ids(module, cfg.adam_no_decay)
    groups = [{"params": [p for p in params if id(p) not in exempt], "weight_decay": cfg.adam_weight_decay},
              {"params": [p for p in params if id(p) in exempt], "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.adam_lr, betas=cfg.adam_betas)


class SgdOnCoveredOptimizer:
    """SGD-momentum on the covered parameters' update directions (K-FAC's and Shampoo's
    preconditioned gradients) + AdamW for the rest, stepped together. Weight decay on the
    covered parameters is SGD's (added to the gradient) or, with decoupled_weight_decay,
    AdamW's: p <- p (1 - lr wd) before the update, with the scheduled lr."""

    def __init__(self, module: nn.Module, covered_layers, cfg: OptimConfig):
        self.cfg = cfg
        covered = {id(p) for l in covered_layers for p in covered_parameters(l)}
        covered_params = [p for p in module.parameters() if id(p) in covered and p.requires_grad]
        other = [p for p in module.parameters() if id(p) not in covered and p.requires_grad]
        coupled = 0.0 if cfg.decoupled_weight_decay else cfg.weight_decay
        self.sgd = torch.optim.SGD(covered_params, lr=cfg.lr, momentum=cfg.momentum,
                                   weight_decay=coupled) if covered_params else None
        self.adamw = make_adamw(module, other, cfg)
        self.steps = 0

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [o for o in (self.sgd, self.adamw) if o is not None]

    def warmup_factor(self, step: int | None = None) -> float:
        """The schedule's factor for the next update (or for step `step`)."""
        return self.cfg.lr_factor(self.steps if step is None else step)

    @property
    def lr(self) -> float:
        """The SGD learning rate in effect for the next step (used by the KL clip)."""
        return self.cfg.lr * self.warmup_factor()

    def zero_grad(self) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=True)

    def step(self) -> None:
        f = self.warmup_factor()
        if self.sgd:
            for g in self.sgd.param_groups:
                g["lr"] = self.cfg.lr * f
                if self.cfg.decoupled_weight_decay and self.cfg.weight_decay:
                    # only where a gradient is: torch's optimizers leave a gradient-less parameter alone
                    decayed = [p for p in g["params"] if p.grad is not None]
                    if decayed:
                        with torch.no_grad():
                            torch._foreach_mul_(decayed, 1.0 - g["lr"] * self.cfg.weight_decay)
        if self.adamw:
            for g in self.adamw.param_groups:
                g["lr"] = self.cfg.adam_lr * f
        for o in self.optimizers:
            o.step()
        self.steps += 1

    def state_dict(self) -> dict:
        return {"steps": self.steps,
                "sgd": self.sgd.state_dict() if self.sgd else None,
                "adamw": self.adamw.state_dict() if self.adamw else None}

    def load_state_dict(self, sd: dict) -> None:
        self.steps = int(sd["steps"])
        if self.sgd:
            self.sgd.load_state_dict(sd["sgd"])
        if self.adamw:
            self.adamw.load_state_dict(sd["adamw"])


class MuonOptimizer:
    """Muon's update on the covered weights (their gradients orthogonalised by the layers'
    `orthogonalize`) + AdamW for the rest, stepped together; both rates follow the schedule."""

    def __init__(self, module: nn.Module, muon_layers, cfg: OptimConfig):
        self.cfg = cfg
        self.layers = list(muon_layers)
        covered = {id(p) for l in self.layers for p in l.covered}
        other = [p for p in module.parameters() if id(p) not in covered and p.requires_grad]
        self.adamw = make_adamw(module, other, cfg)
        self.steps = 0

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers inside (AdamW's; Muon's momentum is the layers' state)."""
        return [self.adamw] if self.adamw is not None else []

    def warmup_factor(self, step: int | None = None) -> float:
        """The schedule's factor for the next update (or for step `step`)."""
        return self.cfg.lr_factor(self.steps if step is None else step)

    @property
    def lr(self) -> float:
        """The Muon learning rate in effect for the next step (before the shape adjustment)."""
        return self.layers[0].cfg.lr * self.warmup_factor() if self.layers else 0.0

    def zero_grad(self) -> None:
        for l in self.layers:
            l.module.weight.grad = None
        if self.adamw:
            self.adamw.zero_grad(set_to_none=True)

    def step(self) -> None:
        f = self.warmup_factor()
        for l in self.layers:
            l.apply(l.cfg.lr * f)
        if self.adamw:
            for g in self.adamw.param_groups:
                g["lr"] = self.cfg.adam_lr * f
            self.adamw.step()
        self.steps += 1

    def state_dict(self) -> dict:
        """The step count and AdamW's state; the momentum buffers are the layers' (state_dict)."""
        return {"steps": self.steps, "adamw": self.adamw.state_dict() if self.adamw else None}

    def load_state_dict(self, sd: dict) -> None:
        self.steps = int(sd["steps"])
        if self.adamw:
            self.adamw.load_state_dict(sd["adamw"])


def clip_coefficient(norm: float, max_norm: float) -> float:
    """The factor that clips a gradient of global norm `norm` to `max_norm` (torch's
    clip_grad_norm_ rule); 1.0 when clipping is off (max_norm <= 0) or not needed."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))


def raw_grad_norm_sq(module: nn.Module, covered_layers) -> torch.Tensor:
    """Σ g² over the module's gradient as back-propagated, before K-FAC preconditioning:
    a K-FAC layer reports its own (its precondition() replaced the gradient), the other
    parameters are read from .grad. Each gradient's norm in its own dtype, all of them in
    one multi-tensor kernel (torch._foreach_norm, as clip_grad_norm_ computes them), their
    squares summed in float64, one device->host copy: a norm per tensor in float64 would
    convert every gradient, every step, for a difference of ~1e-6 relative in the norm."""
    covered = {id(p) for l in covered_layers for p in covered_parameters(l)}
    parts = [l.raw_grad_sq.detach().double().reshape(()) for l in covered_layers if l.raw_grad_sq is not None]
    grads = [p.grad.detach() for p in module.parameters() if id(p) not in covered and p.grad is not None]
    if grads:
        parts += [n.double().square() for n in torch._foreach_norm(grads)]
    if not parts:
        return torch.zeros((), dtype=torch.float64)
    return torch.stack([t.to(parts[0].device) for t in parts]).sum().cpu()


def scale_all_grads(module: nn.Module, covered_layers, c: float) -> None:
    """Multiply every gradient of the module by c. Preconditioning is linear, so scaling the
    preconditioned gradient equals preconditioning the scaled one; the KL-clip term
    <g̃, g> scales by c²."""
    if c == 1.0:
        return
    for p in module.parameters():
        if p.grad is not None:
            p.grad.mul_(c)
    for l in covered_layers:
        if getattr(l, "kl_term", None) is not None:  # K-FAC's; other optimizers keep none
            l.kl_term = l.kl_term * (c * c)


def build_optimizer(stage_module: nn.Module, layers, cfg: OptimConfig | None = None, optimizer: str = "kfac"):
    """The optimizer of one stage: pass the stage's own layers of `optimizer` (its registry
    entry's, runtime.optimizers.registry; [] for AdamW only, which any optimizer without
    layers also is)."""
    try:
        entry = registry.entry(optimizer)
    except ValueError as e:
        raise ValueError(f"optimizer must be one of {', '.join(registry.names())}: {e}") from None
    layers = list(layers)
    kinds = [d.kind for d in entry.ops.ops if not d.collective]
    wrong = [l.name for l in layers if not all(callable(getattr(l, k, None)) for k in kinds)]
    if wrong:
        raise ValueError(f"optimizer {optimizer!r} got layers of another kind (without its op methods "
                         f"{', '.join(kinds)}): {', '.join(wrong)}")
    return entry.build_stage_optimizer(stage_module, layers, cfg or OptimConfig())
