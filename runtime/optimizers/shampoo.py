"""Shampoo for the weights of nn.Linear layers, one function per unit of work a plan schedules,
with the semantics of Distributed Shampoo (facebookresearch/optimizers).

A weight W (out x in) is split into blocks of at most max_preconditioner_dim rows and columns
(the last block of a dimension takes the remainder). For each block's gradient G the statistics are
    L <- β₂ L + (1 - β₂) G Gᵀ,   R <- β₂ R + (1 - β₂) Gᵀ G
(β₂ = 1: the plain sums of the original Shampoo), both starting at 0. The direction is
    P = L^(-p) M R^(-p)   (p = 1/4, or exponent_override)
of the filtered gradient M = m / (1 - β₁^t), m <- β₁ m + (1 - β₁) G (β₁ = 0: M = G), and each
block's P is rescaled to the Frobenius norm of the graft's direction D of the same block:
  * sgd: D = M;   none: no rescaling;
  * adagrad: D = M / (√A + ε_g),          A <- A + G²;
  * rmsprop: D = M / (√A + ε_g),          A <- β₂g A + (1 - β₂g) G²;
  * adam:    D = M / (√(A/(1-β₂g^t)) + ε_g), A as rmsprop's
(the graft's statistic is of the raw gradient, its direction of the filtered one, as Distributed
Shampoo has it). Before start_preconditioning_step, and while no roots are in force, the update
is D alone. The stage optimizer (stage_optimizer below) then applies SGD with [shampoo]'s momentum
(default 0) and decoupled weight decay.

Damping: absolute, (S + ε I)^(-p) with S's eigenvalues clamped at 0 first (S is PSD; negative
values are rounding), Distributed Shampoo's; or relative, (S + ε λ_max(S) I)^(-p), as the
scalable Shampoo of Anil et al. damps, with the identity as the root of an all-zero statistic.

Cycle semantics (refresh every k steps), the same as runtime.optimizers.kfac's:
  * a refresh step t0 (t0 % k == 0) starts with `activate()`: the roots computed during the
    previous cycle come into force;
  * every step `update_stats(snapshot)` folds the step's gradient into L and R; at t0 it also
    snapshots them (snapshot=True), so the roots of this cycle use the statistics through t0,
    G_t0 included, wherever in the cycle the plan places them;
  * `compute_root(factor)` (any time before t0 + k) puts the snapshot's roots (every block's)
    into the PENDING slot; they are in force from t0 + k to t0 + 2k - 1;
  * every step `precondition()` updates the graft's statistic and m and applies the roots in
    force. With k = 1, step t is preconditioned with the roots of the statistics through t - 1.

The statistics use the gradient as back-propagated and synchronised, before global-norm
clipping. With graft sgd or none and β₁ = 0 the update is positively homogeneous of degree 1 in G,
so clipping it afterwards equals clipping G first; with the other grafts or β₁ > 0 it does not.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn

from runtime.optimizers.kfac import NonFiniteFactorError

FACTORS = ("L", "R")
GRAFTS = ("sgd", "adagrad", "rmsprop", "adam", "none")
EPSILON_MODES = ("absolute", "relative")


@dataclass
class ShampooConfig:
    beta2: float = 0.99        # EMA of the statistics; 1.0: plain sums (original Shampoo)
    epsilon: float = 1e-12     # damping added before the root (see epsilon_mode)
    epsilon_mode: str = "absolute"  # absolute: S + ε I | relative: S + ε λ_max(S) I
    refresh_steps: int = 1     # k, fixed by the plan
    graft: str = "adam"        # whose per-block norm the step has: one of GRAFTS
    graft_beta2: float = 0.999  # EMA of the graft's G² (rmsprop, adam)
    graft_epsilon: float = 1e-8
    beta1: float = 0.9         # EMA of the gradient that is preconditioned (0: the gradient itself)
    momentum: float = 0.0      # the stage optimizer's SGD momentum on the covered weights
    weight_decay: float = 0.0  # the stage optimizer's decoupled weight decay on the covered weights
    exponent_override: float = 0.0  # p of the roots L^(-p), R^(-p); 0: 1/4
    start_preconditioning_step: int = 0  # steps before it use the graft's direction alone
    max_preconditioner_dim: int = 1024   # the largest block side

    def __post_init__(self):
        if self.graft not in GRAFTS:
            raise ValueError(f"graft must be one of {', '.join(GRAFTS)}, got {self.graft!r}")
        if self.epsilon_mode not in EPSILON_MODES:
            raise ValueError(f"epsilon_mode must be one of {', '.join(EPSILON_MODES)}, got {self.epsilon_mode!r}")
        if not (0 < self.beta2 <= 1 and self.epsilon > 0 and self.refresh_steps >= 1):
            raise ValueError("need 0 < beta2 <= 1, epsilon > 0, refresh_steps >= 1")
        if not (0 < self.graft_beta2 < 1 and self.graft_epsilon > 0 and 0 <= self.beta1 < 1):
            raise ValueError("need 0 < graft_beta2 < 1, graft_epsilon > 0, 0 <= beta1 < 1")
        if not (self.momentum >= 0 and self.weight_decay >= 0 and self.exponent_override >= 0
                and self.start_preconditioning_step >= 0 and self.max_preconditioner_dim >= 1):
            raise ValueError("need momentum, weight_decay, exponent_override, start_preconditioning_step >= 0 "
                             "and max_preconditioner_dim >= 1")

    @property
    def root_exponent(self) -> float:
        return self.exponent_override or 0.25


def shampoo_config(job) -> ShampooConfig:
    """ShampooConfig of a JobConfig's [shampoo]; its refresh period is the plan's
    (kfac.refresh_steps once apply_plan has filled it in; 1 before)."""
    s = job.shampoo
    names = {f.name for f in dataclasses.fields(ShampooConfig)} - {"refresh_steps"}
    return ShampooConfig(**{f.name: getattr(s, f.name) for f in dataclasses.fields(s) if f.name in names},
                         refresh_steps=job.kfac.refresh_steps or 1)


def stage_optimizer(module: nn.Module, layers, cfg):
    """SGD on the covered weights' Shampoo updates with [shampoo]'s momentum and decoupled
    weight decay (read from the layers' ShampooConfig; cfg as is without layers), AdamW on the rest."""
    from runtime.optimizers.stage import SgdOnCoveredOptimizer

    if layers:
        sc = layers[0].cfg
        cfg = dataclasses.replace(cfg, momentum=sc.momentum, weight_decay=sc.weight_decay,
                                  decoupled_weight_decay=True)
    return SgdOnCoveredOptimizer(module, layers, cfg)


def block_sizes(n: int, most: int) -> list[int]:
    """n split into pieces of `most`, the last the remainder."""
    return [most] * (n // most) + ([n % most] if n % most else [])


class ShampooLayer:
    """Shampoo state of one nn.Linear's weight: per block statistics, snapshots, roots; the
    graft's statistic and the filtered gradient m (whole-weight tensors).

    Its bias is not covered (it goes to AdamW with the other vectors). A factor's pending roots
    travel (pending / set_pending) as one tensor: the root itself with one block, else every
    block's root flattened and concatenated."""

    def __init__(self, name: str, module: nn.Linear, cfg: ShampooConfig):
        self.name, self.module, self.cfg = name, module, cfg
        self.covered = (module.weight,)
        self.dims = {"L": module.out_features, "R": module.in_features}
        rows = block_sizes(module.out_features, cfg.max_preconditioner_dim)
        cols = block_sizes(module.in_features, cfg.max_preconditioner_dim)
        row0 = [sum(rows[:i]) for i in range(len(rows))]
        col0 = [sum(cols[:j]) for j in range(len(cols))]
        # (row slice, column slice) of each block, row-major
        self.blocks = [(slice(r0, r0 + r), slice(c0, c0 + c)) for r0, r in zip(row0, rows) for c0, c in zip(col0, cols)]
        self.block_dims = {"L": [r for r in rows for _ in cols], "R": [c for _ in rows for c in cols]}
        # Made at the first update_stats: a replica that does not own the layer (the work
        # divided between replicas) never holds them.
        self.statistics: dict[str, list[torch.Tensor]] = {}
        # With k = 1 every root is computed within the step that snapshots, before the next
        # update_stats, so the snapshot is the statistic itself: no copy, no memory.
        self._alias = cfg.refresh_steps == 1
        self.snapshots: dict[str, list[torch.Tensor]] = {}
        self.roots: dict[str, list[torch.Tensor]] = {}      # in force
        self._pending: dict[str, list[torch.Tensor]] = {}
        self._spare: dict[str, list[torch.Tensor]] = {}     # out-of-force roots, the next pending ones' storage
        self.graft_state = None   # the graft's Σ G² or EMA of G² (adagrad, rmsprop, adam)
        self.filtered = None      # m, the EMA of the gradient (β₁ > 0)
        self.steps = 0            # precondition() calls with a gradient: t of the bias corrections
        self.raw_grad_sq = None  # Σ g² of the gradient the last precondition() replaced (clipping, logs)

    def _like(self) -> dict:
        return dict(dtype=self.module.weight.dtype, device=self.module.weight.device)

    def _allocate_stats(self) -> None:
        if not self.statistics:
            self.statistics = {f: [torch.zeros(d, d, **self._like()) for d in ds] for f, ds in self.block_dims.items()}
            if self._alias:
                self.snapshots = dict(self.statistics)

    def update_stats(self, snapshot: bool) -> None:
        """Fold weight.grad into every block's L and R; on the first step of a cycle also
        snapshot them (a missing gradient, as torch's optimizers skip one, leaves the
        statistics as they are)."""
        self._allocate_stats()
        G = self.module.weight.grad
        if G is not None:
            G = G.to(self.statistics["L"][0].dtype)
            b = self.cfg.beta2
            alpha = 1.0 if b == 1 else 1 - b
            for (rs, cs), L, R in zip(self.blocks, self.statistics["L"], self.statistics["R"]):
                Gb = G[rs, cs]
                L.addmm_(Gb, Gb.t(), beta=b, alpha=alpha)
                R.addmm_(Gb.t(), Gb, beta=b, alpha=alpha)
        if snapshot and not self._alias:
            for f, stats in self.statistics.items():
                if f in self.snapshots:
                    for snap, S in zip(self.snapshots[f], stats):
                        snap.copy_(S)
                else:
                    self.snapshots[f] = [S.clone() for S in stats]

    def _root(self, factor: str, S: torch.Tensor) -> torch.Tensor:
        if not bool(torch.isfinite(S.sum(dtype=torch.float64))):  # a NaN/inf anywhere makes the sum one
            raise NonFiniteFactorError(f"Shampoo layer {self.name}: statistic {factor} has non-finite values "
                                       f"(NaN/Inf gradients); lower the learning rate")
        evals, Q = torch.linalg.eigh(S)
        evals = evals.clamp_min(0)
        eps, p = self.cfg.epsilon, self.cfg.root_exponent
        if self.cfg.epsilon_mode == "absolute":
            root = (Q * (evals + eps).pow(-p)) @ Q.t()
        else:
            top = float(evals[-1])  # eigh sorts ascending
            if top > 0:
                root = (Q * (evals + eps * top).pow(-p)) @ Q.t()
            else:
                root = torch.eye(S.shape[0], dtype=S.dtype, device=S.device)
        if not torch.isfinite(root).all():
            raise NonFiniteFactorError(f"Shampoo layer {self.name}: root of statistic {factor} is not finite")
        return root

    def compute_root(self, factor: str) -> None:
        """The damped roots of this cycle's snapshots of `factor` (every block) into the pending slot."""
        roots = [self._root(factor, S) for S in self.snapshots[factor]]
        spare = self._spare.pop(factor, None)
        self._pending[factor] = [s.copy_(r) for s, r in zip(spare, roots)] if spare is not None else roots

    def _pack(self, blocks: list[torch.Tensor]) -> torch.Tensor:
        return blocks[0] if len(blocks) == 1 else torch.cat([b.reshape(-1) for b in blocks])

    def _unpack(self, factor: str, tensor: torch.Tensor) -> list[torch.Tensor]:
        dims = self.block_dims[factor]
        if len(dims) == 1:
            return [tensor.reshape(dims[0], dims[0])]
        return [t.reshape(d, d) for t, d in zip(tensor.split([d * d for d in dims]), dims)]

    def pending(self, factor: str) -> torch.Tensor:
        """The pending roots as one tensor (for a broadcast to replicas that did not compute them)."""
        return self._pack(self._pending[factor])

    def pending_shape(self, factor: str) -> tuple[int, ...]:
        dims = self.block_dims[factor]
        return (dims[0], dims[0]) if len(dims) == 1 else (sum(d * d for d in dims),)

    def set_pending(self, factor: str, tensor: torch.Tensor) -> None:
        blocks = self._unpack(factor, tensor)
        spare = self._spare.pop(factor, None)
        if spare is not None and all(s.shape == b.shape and s.dtype == b.dtype for s, b in zip(spare, blocks)):
            blocks = [s.copy_(b) for s, b in zip(spare, blocks)]
        self._pending[factor] = blocks

    def activate(self) -> None:
        """Cycle boundary: the pending roots come into force."""
        for f, roots in self._pending.items():
            old = self.roots.get(f)
            if old is not None:
                self._spare[f] = old
            self.roots[f] = roots
        self._pending = {}

    # The op kinds of Shampoo's declaration (pfcompile.formats.optimizers.SHAMPOO), called
    # with the keywords of runtime.optimizers.registry.OpContext.
    def stats(self, cycle_step: int, **_) -> None:
        self.update_stats(snapshot=cycle_step == 0)

    def inv(self, factor: str, **_) -> None:
        self.compute_root(factor)

    def precond(self, **_) -> None:
        self.precondition()

    def precondition(self) -> None:
        """weight.grad <- the update: the graft's direction, or the roots in force applied to
        the filtered gradient, each block rescaled to the graft's norm."""
        G = self.module.weight.grad
        if G is None:
            self.raw_grad_sq = None
            return
        cfg = self.cfg
        self.raw_grad_sq = (G * G).sum()
        self.steps += 1
        t = self.steps
        if cfg.graft in ("adagrad", "rmsprop", "adam"):
            if self.graft_state is None:
                self.graft_state = torch.zeros_like(G)
            if cfg.graft == "adagrad":
                self.graft_state.addcmul_(G, G)
            else:
                self.graft_state.mul_(cfg.graft_beta2).addcmul_(G, G, value=1 - cfg.graft_beta2)
        if cfg.beta1 > 0:
            if self.filtered is None:
                self.filtered = torch.zeros_like(G)
            self.filtered.mul_(cfg.beta1).add_(G, alpha=1 - cfg.beta1)
            M = self.filtered / (1 - cfg.beta1 ** t)
        else:
            M = G.clone()
        if cfg.graft in ("adagrad", "rmsprop"):
            D = M / (self.graft_state.sqrt() + cfg.graft_epsilon)
        elif cfg.graft == "adam":
            D = M / ((self.graft_state / (1 - cfg.graft_beta2 ** t)).sqrt() + cfg.graft_epsilon)
        else:
            D = M
        if not ("L" in self.roots and "R" in self.roots) or t - 1 < cfg.start_preconditioning_step:
            G.copy_(D)
            return
        tiny = torch.finfo(G.dtype).tiny
        for (rs, cs), Lr, Rr in zip(self.blocks, self.roots["L"], self.roots["R"]):
            P = Lr.to(G.dtype) @ M[rs, cs] @ Rr.to(G.dtype)
            if cfg.graft != "none":
                # Roots are positive definite, so P = 0 only where M = 0, and then 0 / tiny = 0.
                P.mul_(D[rs, cs].norm() / P.norm().clamp_min(tiny))
            G[rs, cs] = P

    def state_bytes(self) -> int:
        """Bytes of the resident state: statistics, snapshots (none with k = 1), roots in
        force, pending and spare, the graft's statistic and m."""
        seen, total = set(), 0
        lists = [*self.statistics.values(), *self.snapshots.values(), *self.roots.values(),
                 *self._pending.values(), *self._spare.values()]
        extra = [t for t in (self.graft_state, self.filtered) if t is not None]
        for t in [t for ts in lists for t in ts] + extra:
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
        return total

    # --- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        pack = lambda ts: self._pack(ts).clone()  # noqa: E731
        sd = {f"stat_{f}": pack(t) for f, t in self.statistics.items()}
        if not self._alias:
            sd.update({f"snapshot_{f}": pack(t) for f, t in self.snapshots.items()})
        sd.update({f"root_{f}": pack(t) for f, t in self.roots.items()})
        sd.update({f"pending_{f}": pack(t) for f, t in self._pending.items()})
        sd["steps"] = self.steps
        for key, t in (("graft", self.graft_state), ("filtered", self.filtered)):
            if t is not None:
                sd[key] = t.clone()
        return sd

    def load_state_dict(self, sd: dict) -> None:
        if f"stat_{FACTORS[0]}" in sd:
            self._allocate_stats()
            for f in FACTORS:
                for S, saved in zip(self.statistics[f], self._unpack(f, sd[f"stat_{f}"])):
                    S.copy_(saved)
        pick = lambda prefix: {f: [t.clone() for t in self._unpack(f, sd[f"{prefix}_{f}"])]  # noqa: E731
                               for f in FACTORS if f"{prefix}_{f}" in sd}
        self.snapshots = dict(self.statistics) if self._alias else pick("snapshot")
        self.roots, self._pending, self._spare = pick("root"), pick("pending"), {}
        self.steps = int(sd.get("steps", 0))
        self.graft_state = sd["graft"].clone() if "graft" in sd else None
        self.filtered = sd["filtered"].clone() if "filtered" in sd else None


def make_layer(name: str, linear: nn.Linear, cfg: ShampooConfig, micro_batches: int) -> ShampooLayer:
    """The runtime registry's maker."""
    return ShampooLayer(name, linear, cfg)


def make_layers(named_linears, cfg: ShampooConfig) -> list[ShampooLayer]:
    """ShampooLayer for each (name, nn.Linear) of runtime.models.kfac_linears."""
    return [ShampooLayer(n, m, cfg) for n, m in named_linears]
