"""SOAP (Vyas et al. 2024, arXiv 2409.11321) for the weights of nn.Linear layers: Adam run in
the eigenbasis of Shampoo's statistics, one function per unit of work a plan schedules.

For a weight W (out x in) with gradient G:
  * statistics, every step:  L <- b L + (1 - b) G Gᵀ,  R <- b R + (1 - b) Gᵀ G  (b = shampoo_beta);
  * the eigenbasis Q_L, Q_R, once per refresh cycle, per factor: the first time the
    eigenvectors of the statistic (eigh, columns by descending eigenvalue), afterwards one
    step of power iteration, Q <- QR(S Q_prev[:, order]), with `order` sorting the columns
    by their estimated eigenvalues diag(Q_prevᵀ S Q_prev), descending (the paper's
    Algorithm 4, as its authors' code runs it);
  * the update direction, every step: Adam in the rotated basis,
        G' = Q_Lᵀ G Q_R,   M' <- β₁ M' + (1 - β₁) G',   V <- β₂ V + (1 - β₂) G'²,
        N  = Q_L (M' / (√V + ε)) Q_Rᵀ · √(1 - β₂ᵗ) / (1 - β₁ᵗ),
    which the stage optimizer applies as W <- W (1 - lr wd) - lr N (decoupled weight decay,
    no momentum of its own: `stage_optimizer`).

When a new basis comes into force the first moment M' (linear in G) is rotated into it
exactly; the second moment V cannot be rotated and is only reordered with its basis'
columns, as the authors' code does. Before the first basis is in force the basis is the
identity: the update is AdamW's.

Cycle semantics (refresh every k steps) and deferred statistics (defer_stats) are Shampoo's
(runtime.optimizers.shampoo): the
statistics are snapshotted on the refresh step t0, the basis computed from them (anywhere in
the cycle) is in force from t0 + k. Power iteration starts from the basis in force when it
runs, the one computed in the previous cycle. A pending basis travels as one (d + 1) x d
tensor, its last row the column order, so a replica that did not compute it (bcast_inv)
reorders its V the same way.

The update normalises the gradient (as Adam does) and folds it into M' and V: gradient
clipping scales the gradient before the per-step ops (the registry entry's clip_first).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn

from runtime.optimizers.kfac import NonFiniteFactorError
from runtime.optimizers.shampoo import KeptGradient

FACTORS = ("L", "R")


@dataclass
class SoapConfig:
    lr: float = 3e-3             # the covered weights' peak rate (the schedule scales it)
    beta1: float = 0.95
    beta2: float = 0.95
    shampoo_beta: float = -1.0   # EMA of the statistics; < 0: beta2 (the authors' default)
    eps: float = 1e-8
    weight_decay: float = 0.01   # decoupled, as AdamW's
    tie_break: float = 1e-6      # a fixed distinct diagonal, relative to the mean eigenvalue (see refresh_basis)
    refresh_steps: int = 1       # k, fixed by the plan
    defer_stats: bool = False    # fold each step's gradient in the next step (runtime.optimizers.shampoo)

    def __post_init__(self):
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1 and self.shampoo_beta < 1 and self.eps > 0
                and self.lr > 0 and self.weight_decay >= 0 and self.tie_break >= 0 and self.refresh_steps >= 1):
            raise ValueError("need 0 <= beta1, beta2 < 1, shampoo_beta < 1, eps > 0, lr > 0, weight_decay >= 0, "
                             "refresh_steps >= 1")

    @property
    def statistics_beta(self) -> float:
        return self.beta2 if self.shampoo_beta < 0 else self.shampoo_beta


def soap_config(job) -> SoapConfig:
    """SoapConfig of a JobConfig's [soap]; its refresh period is the plan's (kfac.refresh_steps
    once apply_plan has filled it in; 1 before)."""
    s = job.soap
    return SoapConfig(lr=s.lr, beta1=s.beta1, beta2=s.beta2, shampoo_beta=s.shampoo_beta, eps=s.eps,
                      weight_decay=s.weight_decay, tie_break=s.tie_break, refresh_steps=job.kfac.refresh_steps or 1,
                      defer_stats=s.defer_stats)


def eigenbasis(S: torch.Tensor) -> torch.Tensor:
    """The eigenvectors of the symmetric S, columns by descending eigenvalue."""
    _, Q = torch.linalg.eigh(S)
    return Q.flip(1)


def power_iteration(S: torch.Tensor, Q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of power iteration from the basis Q: (QR(S Q[:, order]), order), `order` the
    columns sorted by their estimated eigenvalues diag(Qᵀ S Q), descending."""
    SQ = S @ Q
    order = torch.argsort((Q * SQ).sum(0), descending=True, stable=True)
    Qn, _ = torch.linalg.qr(SQ[:, order])
    return Qn, order


class SoapLayer:
    """SOAP state of one nn.Linear's weight: statistics, snapshots, bases, Adam's moments.

    Its bias is not covered (it goes to AdamW with the other vectors)."""

    def __init__(self, name: str, module: nn.Linear, cfg: SoapConfig):
        self.name, self.module, self.cfg = name, module, cfg
        self.covered = (module.weight,)
        self.dims = {"L": module.out_features, "R": module.in_features}
        # made at first use: a replica that does not own the layer never holds them
        self.statistics: dict[str, torch.Tensor] = {}
        self._alias = cfg.refresh_steps == 1  # k = 1: the snapshot is the statistic itself
        self.snapshots: dict[str, torch.Tensor] = {}
        self.bases: dict[str, torch.Tensor] = {}      # in force
        self._pending: dict[str, torch.Tensor] = {}   # [Q; order] of this cycle
        self.exp_avg: torch.Tensor | None = None      # M', in the basis in force
        self.exp_avg_sq: torch.Tensor | None = None   # V
        self.t = 0                                    # Adam's step count (bias correction)
        self.raw_grad_sq = None
        self.gradient = KeptGradient(module.weight, cfg.defer_stats)  # what update_stats folds

    def _like(self) -> dict:
        w = self.module.weight
        return dict(dtype=w.dtype, device=w.device)

    def update_stats(self, snapshot: bool) -> None:
        """Fold weight.grad into L and R; on a cycle's first step also snapshot them."""
        if not self.statistics:
            self.statistics = {f: torch.zeros(d, d, **self._like()) for f, d in self.dims.items()}
            if self._alias:
                self.snapshots = dict(self.statistics)
        G = self.gradient.for_stats()
        if G is not None:
            G = G.to(self.statistics["L"].dtype)
            b = self.cfg.statistics_beta
            self.statistics["L"].addmm_(G, G.t(), beta=b, alpha=1 - b)
            self.statistics["R"].addmm_(G.t(), G, beta=b, alpha=1 - b)
        if snapshot and not self._alias:
            for f, S in self.statistics.items():
                self.snapshots[f] = self.snapshots[f].copy_(S) if f in self.snapshots else S.clone()

    def refresh_basis(self, factor: str) -> None:
        """This cycle's basis of `factor` from its snapshot, into the pending slot."""
        S = self.snapshots[factor]
        if not bool(torch.isfinite(S.sum(dtype=torch.float64))):
            raise NonFiniteFactorError(f"SOAP layer {self.name}: statistic {factor} has non-finite values "
                                       f"(NaN/Inf gradients); lower the learning rate")
        d = S.shape[0]
        if not bool(S.any()):  # nothing folded yet (deferred statistics' first step): no basis, none in force
            self._pending[factor] = torch.cat([torch.eye(d, **self._like()), torch.full((1, d), -1.0, **self._like())])
            return
        # A statistic of fewer gradients than its size is singular: its null space is one
        # degenerate eigenspace whose basis eigh picks from rounding, so two runs that sum
        # the same gradient in another order (replicas) would diverge. A fixed diagonal
        # tie_break * mean eigenvalue * (1..d)/d makes every eigenvalue distinct.
        if self.cfg.tie_break > 0:
            ramp = torch.arange(1, d + 1, dtype=S.dtype, device=S.device) / d
            S = S + torch.diag(ramp * (self.cfg.tie_break * float(S.diagonal().sum()) / d))
        if factor in self.bases:
            Q, order = power_iteration(S, self.bases[factor])
        else:
            Q, order = eigenbasis(S), torch.arange(d, device=S.device)
        if not torch.isfinite(Q).all():
            raise NonFiniteFactorError(f"SOAP layer {self.name}: basis of statistic {factor} is not finite")
        self._pending[factor] = torch.cat([Q, order.to(Q.dtype).unsqueeze(0)])

    def pending(self, factor: str) -> torch.Tensor:
        return self._pending[factor]

    def pending_shape(self, factor: str) -> tuple[int, int]:
        d = self.dims[factor]
        return (d + 1, d)

    def set_pending(self, factor: str, tensor: torch.Tensor) -> None:
        self._pending[factor] = tensor

    def activate(self) -> None:
        """Cycle boundary: the pending bases come into force; M' is rotated into them and V
        reordered with their columns."""
        if not self._pending:
            return
        old = {f: self.bases.get(f) for f in FACTORS}
        new = dict(old)
        for f, packed in self._pending.items():
            order = packed[-1].round().long()
            if order[0] < 0:  # refreshed from an empty statistic: the basis stays as it is
                continue
            new[f] = packed[:-1]
            if self.exp_avg_sq is not None:
                self.exp_avg_sq = self.exp_avg_sq.index_select(0 if f == "L" else 1, order)
        if self.exp_avg is not None:
            M = self._rotate_back(self.exp_avg, old)
            self.exp_avg = self._rotate(M, new)
        self.bases = {f: Q for f, Q in new.items() if Q is not None}
        self._pending = {}

    @staticmethod
    def _rotate(X: torch.Tensor, bases: dict) -> torch.Tensor:
        """Q_Lᵀ X Q_R (an absent basis is the identity)."""
        if bases.get("L") is not None:
            X = bases["L"].t() @ X
        if bases.get("R") is not None:
            X = X @ bases["R"]
        return X

    @staticmethod
    def _rotate_back(X: torch.Tensor, bases: dict) -> torch.Tensor:
        """Q_L X Q_Rᵀ."""
        if bases.get("L") is not None:
            X = bases["L"] @ X
        if bases.get("R") is not None:
            X = X @ bases["R"].t()
        return X

    # The op kinds of SOAP's declaration (pfcompile.formats.optimizers.SOAP), called with the
    # keywords of runtime.optimizers.registry.OpContext.
    def stats(self, cycle_step: int, **_) -> None:
        self.update_stats(snapshot=cycle_step == 0)

    def inv(self, factor: str, **_) -> None:
        self.refresh_basis(factor)

    def precond(self, **_) -> None:
        self.precondition()

    def precondition(self) -> None:
        """weight.grad <- Adam's direction in the basis in force (unchanged if no gradient)."""
        self.gradient.keep()
        G = self.module.weight.grad
        if G is None:
            self.raw_grad_sq = None
            return
        self.raw_grad_sq = (G * G).sum()
        c = self.cfg
        if self.exp_avg is None:
            self.exp_avg, self.exp_avg_sq = torch.zeros_like(G), torch.zeros_like(G)
        bases = {f: Q.to(G.dtype) for f, Q in self.bases.items()}
        Gr = self._rotate(G, bases)
        self.t += 1
        self.exp_avg.mul_(c.beta1).add_(Gr, alpha=1 - c.beta1)
        self.exp_avg_sq.mul_(c.beta2).addcmul_(Gr, Gr, value=1 - c.beta2)
        step = (1 - c.beta2 ** self.t) ** 0.5 / (1 - c.beta1 ** self.t)
        N = self._rotate_back(self.exp_avg / (self.exp_avg_sq.sqrt() + c.eps), bases)
        G.copy_(N.mul_(step))

    def state_bytes(self) -> int:
        """Bytes of the resident state."""
        seen, total = set(), 0
        for t in [*self.statistics.values(), *self.snapshots.values(), *self.bases.values(),
                  *self._pending.values(), self.exp_avg, self.exp_avg_sq]:
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
        return total + self.gradient.nbytes()

    # --- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        sd = {f"stat_{f}": t.clone() for f, t in self.statistics.items()}
        if not self._alias:
            sd.update({f"snapshot_{f}": t.clone() for f, t in self.snapshots.items()})
        sd.update({f"basis_{f}": t.clone() for f, t in self.bases.items()})
        sd.update({f"pending_{f}": t.clone() for f, t in self._pending.items()})
        if self.exp_avg is not None:
            sd.update(exp_avg=self.exp_avg.clone(), exp_avg_sq=self.exp_avg_sq.clone())
        sd["t"] = torch.tensor(self.t)
        sd.update(self.gradient.state_dict())
        return sd

    def load_state_dict(self, sd: dict) -> None:
        pick = lambda prefix: {f: sd[f"{prefix}_{f}"].clone() for f in FACTORS if f"{prefix}_{f}" in sd}  # noqa: E731
        self.statistics = pick("stat")
        self.snapshots = dict(self.statistics) if self._alias else pick("snapshot")
        self.bases, self._pending = pick("basis"), pick("pending")
        self.exp_avg = sd["exp_avg"].clone() if "exp_avg" in sd else None
        self.exp_avg_sq = sd["exp_avg_sq"].clone() if "exp_avg_sq" in sd else None
        self.t = int(sd.get("t", 0))
        self.gradient.load_state_dict(sd)


def make_layer(name: str, linear: nn.Linear, cfg: SoapConfig, micro_batches: int) -> SoapLayer:
    """The runtime registry's maker."""
    return SoapLayer(name, linear, cfg)


def stage_optimizer(module: nn.Module, layers, cfg):
    """SOAP's directions applied at SOAP's rate with decoupled weight decay and no momentum of
    the step's own (Adam's moments are the layers'); AdamW on the rest."""
    from runtime.optimizers.stage import SgdOnCoveredOptimizer

    layers = list(layers)
    if layers:
        s = layers[0].cfg
        cfg = dataclasses.replace(cfg, lr=s.lr, momentum=0.0, weight_decay=s.weight_decay,
                                  decoupled_weight_decay=True)
    return SgdOnCoveredOptimizer(module, layers, cfg)
