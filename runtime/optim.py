"""The optimizer of one stage (or the whole model): SGD with momentum on the K-FAC layers'
preconditioned gradients, AdamW on everything K-FAC does not cover (embeddings, LayerNorms,
the head). Without K-FAC layers it is plain AdamW, the first-order baseline."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn


@dataclass
class OptimConfig:
    lr: float = 0.05             # SGD on K-FAC layers (preconditioned gradients)
    momentum: float = 0.9
    weight_decay: float = 0.0    # SGD weight decay on K-FAC layers
    adam_lr: float = 1e-3        # AdamW on the rest (and on everything in the baseline)
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_weight_decay: float = 0.01
    warmup_steps: int = 0        # linear warm-up of both learning rates


class KfacOptimizer:
    """SGD-momentum for K-FAC-covered parameters + AdamW for the rest, stepped together."""

    def __init__(self, module: nn.Module, kfac_layers, cfg: OptimConfig):
        self.cfg = cfg
        covered = {id(p) for l in kfac_layers for p in l.module.parameters()}
        kfac_params = [p for p in module.parameters() if id(p) in covered and p.requires_grad]
        other = [p for p in module.parameters() if id(p) not in covered and p.requires_grad]
        self.sgd = torch.optim.SGD(kfac_params, lr=cfg.lr, momentum=cfg.momentum,
                                   weight_decay=cfg.weight_decay) if kfac_params else None
        self.adamw = torch.optim.AdamW(other, lr=cfg.adam_lr, betas=cfg.adam_betas,
                                       weight_decay=cfg.adam_weight_decay) if other else None
        self.steps = 0

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [o for o in (self.sgd, self.adamw) if o is not None]

    def warmup_factor(self, step: int | None = None) -> float:
        s = self.steps if step is None else step
        w = self.cfg.warmup_steps
        return min(1.0, (s + 1) / w) if w > 0 else 1.0

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


def build_optimizer(stage_module: nn.Module, kfac_layers, cfg: OptimConfig | None = None) -> KfacOptimizer:
    """The optimizer of one stage: pass the stage's own K-FAC layers (or [] for AdamW only)."""
    return KfacOptimizer(stage_module, list(kfac_layers), cfg or OptimConfig())
