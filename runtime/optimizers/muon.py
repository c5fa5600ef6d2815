"""Muon for the weights of nn.Linear layers: torch.optim.Muon's per-parameter math, split into
the unit of work a plan schedules (`orthogonalize`, per layer) and the update the optimizer
step applies (runtime.optimizers.stage.MuonOptimizer: decoupled weight decay, then the orthogonalised
update at the shape-adjusted learning rate).

Per step, for a weight with gradient g (as torch.optim.Muon):
    B <- lerp(B, g, 1 - μ)              (B = μ B + (1 - μ) g; B starts at 0)
    U <- lerp(g, B, μ) if nesterov else B
    O <- NS(U): X = U / max(‖U‖_F, eps) (transposed if tall), then ns_steps times
         X <- a X + (b A + c A²) X with A = X Xᵀ
    W <- W (1 - lr wd);  W <- W - adjust(lr, shape) O
`ns_dtype` is the dtype the iteration runs in: bfloat16 as torch.optim.Muon runs it (the
default), or float32 / float64 / None (the parameter's). The input is always copied before
the in-place normalisation, so it never writes into the momentum buffer (torch's own
`.bfloat16()` aliases it for a bfloat16 parameter without nesterov).

Clipping. The gradient feeds the momentum buffer and NS normalises its input, so global-norm
clipping must scale g before `orthogonalize` (as clip_grad_norm_ before torch's step does):
with max_grad_norm > 0 a pipeline runs orthogonalize after the step's global norm is known;
without clipping, as soon as the layer's gradient is final.

Biases, embeddings, norms and the head are not Muon's: they go to AdamW, as torch.optim.Muon's
documentation prescribes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

ADJUST_LR_FNS = ("original", "match_rms_adamw")
NS_DTYPES = ("bfloat16", "float32", "float64")


@dataclass
class MuonConfig:
    """torch.optim.Muon's arguments and defaults, plus the iteration's dtype."""
    lr: float = 1e-3
    weight_decay: float = 0.1
    momentum: float = 0.95
    nesterov: bool = True
    ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315)
    eps: float = 1e-7
    ns_steps: int = 5
    adjust_lr_fn: str | None = None   # None = "original": sqrt(max(1, out/in)); "match_rms_adamw": 0.2 sqrt(max)
    ns_dtype: str | None = "bfloat16"  # None: the parameter's dtype

    def __post_init__(self):
        self.ns_coefficients = tuple(float(c) for c in self.ns_coefficients)
        if len(self.ns_coefficients) != 3:
            raise ValueError("ns_coefficients must be three numbers (a, b, c)")
        if not (self.lr >= 0 and self.momentum >= 0 and self.weight_decay >= 0 and self.eps >= 0):
            raise ValueError("need lr, momentum, weight_decay, eps >= 0")
        if not 0 <= self.ns_steps < 100:
            raise ValueError(f"ns_steps must be in 0..99 (torch.optim.Muon's limit), got {self.ns_steps}")
        if self.adjust_lr_fn is not None and self.adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(f"adjust_lr_fn must be None or one of {', '.join(ADJUST_LR_FNS)}, got {self.adjust_lr_fn!r}")
        if self.ns_dtype is not None and self.ns_dtype not in NS_DTYPES:
            raise ValueError(f"ns_dtype must be None or one of {', '.join(NS_DTYPES)}, got {self.ns_dtype!r}")


def muon_config(job) -> MuonConfig:
    """MuonConfig of a JobConfig's [muon]."""
    m = job.muon
    return MuonConfig(lr=m.lr, weight_decay=m.weight_decay, momentum=m.momentum, nesterov=m.nesterov,
                      ns_coefficients=m.ns_coefficients, eps=m.eps, ns_steps=m.ns_steps,
                      adjust_lr_fn=m.adjust_lr_fn, ns_dtype=m.ns_dtype)


def newton_schulz(update: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """torch.optim.Muon's _zeropower_via_newtonschulz, op for op, in `dtype` (its own is bfloat16)."""
    a, b, c = coefficients
    x = update.to(dtype, copy=True)
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, gram_update, x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """torch.optim.Muon's _adjust_lr: the rate that gives the update a shape-independent RMS."""
    A, B = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, A / B))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(A, B))
    else:
        ratio = 1.0
    return lr * ratio


class MuonLayer:
    """Muon state of one nn.Linear's weight: its momentum buffer. Its bias is not covered."""

    def __init__(self, name: str, module: nn.Linear, cfg: MuonConfig):
        self.name, self.module, self.cfg = name, module, cfg
        self.covered = (module.weight,)
        self.momentum_buffer: torch.Tensor | None = None  # created at the first gradient, as torch's
        self.raw_grad_sq = None  # Σ g² of the gradient the last orthogonalize() replaced (logs)

    @property
    def ns_dtype(self) -> torch.dtype:
        return self.module.weight.dtype if self.cfg.ns_dtype is None else getattr(torch, self.cfg.ns_dtype)

    @torch.no_grad()
    def orthogonalize(self) -> None:
        """weight.grad <- NS(nesterov momentum update), updating the momentum buffer; a
        missing gradient is skipped (torch.optim.Muon skips the parameter)."""
        grad = self.module.weight.grad
        if grad is None:
            self.raw_grad_sq = None
            return
        self.raw_grad_sq = (grad * grad).sum()
        cfg = self.cfg
        if self.momentum_buffer is None:
            self.momentum_buffer = torch.zeros_like(grad, memory_format=torch.preserve_format)
        buf = self.momentum_buffer
        buf.lerp_(grad, 1 - cfg.momentum)
        update = grad.lerp(buf, cfg.momentum) if cfg.nesterov else buf
        grad.copy_(newton_schulz(update, cfg.ns_coefficients, cfg.ns_steps, cfg.eps, self.ns_dtype))

    def orth(self, **_) -> None:
        """The op kind of Muon's declaration (keywords of runtime.optimizers.registry.OpContext)."""
        self.orthogonalize()

    def adjusted_lr(self, lr: float) -> float:
        return adjusted_lr(lr, self.cfg.adjust_lr_fn, self.module.weight.shape)

    @torch.no_grad()
    def apply(self, lr: float) -> None:
        """The update of torch.optim.Muon's step with the orthogonalised weight.grad:
        decoupled weight decay at `lr`, then the update at the shape-adjusted rate."""
        p = self.module.weight
        if p.grad is None:
            return
        p.mul_(1 - lr * self.cfg.weight_decay)
        p.add_(p.grad, alpha=-self.adjusted_lr(lr))

    def state_bytes(self) -> int:
        b = self.momentum_buffer
        return 0 if b is None else b.numel() * b.element_size()

    def state_dict(self) -> dict:
        return {} if self.momentum_buffer is None else {"momentum_buffer": self.momentum_buffer.clone()}

    def load_state_dict(self, sd: dict) -> None:
        buf = sd.get("momentum_buffer")
        self.momentum_buffer = None if buf is None else buf.clone()


def make_layer(name: str, linear: nn.Linear, cfg: MuonConfig, micro_batches: int) -> MuonLayer:
    """The runtime registry's maker."""
    return MuonLayer(name, linear, cfg)


def make_layers(named_linears, cfg: MuonConfig) -> list[MuonLayer]:
    """MuonLayer for each (name, nn.Linear) of runtime.models.kfac_linears."""
    return [MuonLayer(n, m, cfg) for n, m in named_linears]
