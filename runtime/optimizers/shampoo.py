"""Shampoo for the weights of nn.Linear layers, one function per unit of work a plan schedules,
with Distributed Shampoo's (facebookresearch/optimizers) options; ShampooConfig has the defaults.

A weight W (out x in) is split into blocks of at most max_preconditioner_dim rows and columns
(the last of a dimension takes the remainder), each with its own statistics of its gradient G
    L <- β₂ L + (1 - β₂) G Gᵀ,   R <- β₂ R + (1 - β₂) Gᵀ G
(β₂ = 1: the plain sums of the original Shampoo), both starting at 0, and roots (Ŝ + ε I)^(-1/p)
(absolute ε, S's eigenvalues clamped at 0 first) or (Ŝ + ε λ_max I)^(-1/p) (relative), Ŝ the
statistic bias-corrected. Each block's direction L_root m̂ R_root, m̂ β1's average of the
gradient, is rescaled to the Frobenius norm of the graft's direction on that block
(precondition() says which); β1's average and the graft's second moment are elementwise.

Cycle semantics (refresh every k steps), the same as runtime.optimizers.kfac's:
  * a refresh step t0 (t0 % k == 0) starts with `activate()`: the roots computed during the
    previous cycle come into force;
  * every step `update_stats(snapshot)` folds the step's gradient into L and R; at t0 it also
    snapshots them (snapshot=True), so the roots of this cycle use the statistics through t0,
    G_t0 included, wherever in the cycle the plan places them;
  * `compute_root(factor)` (any time before t0 + k) puts the snapshot's root into the PENDING
    slot; it is in force from t0 + k to t0 + 2k - 1;
  * every step `precondition()` applies the roots in force (none in cycle 0: the gradient
    passes through unchanged). With k = 1, step t is preconditioned with the roots of the
    statistics through step t - 1.

Deferred statistics (defer_stats): `precondition()` keeps the raw gradient before it
overwrites it, and the next step's `update_stats` folds that one instead of its own step's
(KeptGradient). The statistics of step t then hold G_0 .. G_{t-1}, and a plan may run them
anywhere in step t: before its backward passes, in its bubbles.

The statistics use the gradient as back-propagated and synchronised, before global-norm
clipping: update_stats then needs nothing from other layers. Preconditioning and grafting are
positively homogeneous of degree 1 in G, so clipping the preconditioned gradient afterwards
equals clipping G first (with the same statistics).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn

from runtime.optimizers.kfac import NonFiniteFactorError

FACTORS = ("L", "R")
GRAFTS = ("adam", "adagrad", "rmsprop", "sgd", "none")
EPSILON_MODES = ("absolute", "relative")


@dataclass
class ShampooConfig:
    """Defaults: Distributed Shampoo's recommended replacement of AdamW (Adam grafting, β1
    averaging with bias correction, absolute ε 1e-12, decoupled weight decay, no momentum)."""
    beta2: float = 0.999        # EMA of the statistics; 1.0: plain sums (original Shampoo)
    epsilon: float = 1e-12      # damping added before the root
    epsilon_mode: str = "absolute"  # "absolute": S + ε I | "relative": S + ε λ_max(S) I
    refresh_steps: int = 1      # k, fixed by the plan
    graft: str = "adam"         # whose direction's norm, per layer, the step takes (module doc)
    graft_beta2: float = 0.999  # the graft's second-moment EMA (rmsprop, adam)
    graft_epsilon: float = 1e-8
    beta1: float = 0.9          # EMA of the gradient (bias-corrected), preconditioned instead of it; 0: off
    bias_correction: bool = True  # the average and the statistics divided by 1 - β^t (Distributed Shampoo's)
    exponent_override: float = 0.0  # p of the root S^(-1/p); 0: 4 (a matrix's two factors)
    start_preconditioning_step: int = 0  # before it, the graft's direction alone
    momentum: float | None = 0.0      # the step's heavy-ball momentum; None: [optimizer] momentum
    weight_decay: float | None = 0.0  # decoupled; None: [optimizer] weight_decay, added to the gradient
    max_preconditioner_dim: int = 1024  # a weight is split into blocks of at most this many rows and columns
    lr: float | None = None           # the covered weights' rate; None: [optimizer] lr
    defer_stats: bool = False         # fold each step's gradient in the next step (module doc)

    def __post_init__(self):
        if self.graft not in GRAFTS:
            raise ValueError(f"graft must be one of {', '.join(GRAFTS)}, got {self.graft!r}")
        if self.epsilon_mode not in EPSILON_MODES:
            raise ValueError(f"epsilon_mode must be one of {', '.join(EPSILON_MODES)}, got {self.epsilon_mode!r}")
        if not (0 < self.beta2 <= 1 and self.epsilon > 0 and self.refresh_steps >= 1 and 0 <= self.beta1 < 1
                and 0 < self.graft_beta2 <= 1 and self.graft_epsilon > 0 and self.exponent_override >= 0
                and self.start_preconditioning_step >= 0 and self.max_preconditioner_dim >= 1):
            raise ValueError("need 0 < beta2 <= 1, epsilon > 0, refresh_steps >= 1, 0 <= beta1 < 1, "
                             "0 < graft_beta2 <= 1, graft_epsilon > 0, exponent_override >= 0, "
                             "start_preconditioning_step >= 0, max_preconditioner_dim >= 1")

    @property
    def root_exponent(self) -> float:
        return -1.0 / (self.exponent_override or 4.0)


def shampoo_config(job) -> ShampooConfig:
    """ShampooConfig of a JobConfig's [shampoo]; its refresh period is the plan's
    (kfac.refresh_steps once apply_plan has filled it in; 1 before)."""
    s = job.shampoo
    return ShampooConfig(beta2=s.beta2, epsilon=s.epsilon, epsilon_mode=s.epsilon_mode, graft=s.graft,
                         graft_beta2=s.graft_beta2, graft_epsilon=s.graft_epsilon, beta1=s.beta1,
                         bias_correction=s.bias_correction,
                         exponent_override=s.exponent_override,
                         start_preconditioning_step=s.start_preconditioning_step, momentum=s.momentum,
                         weight_decay=s.weight_decay, max_preconditioner_dim=s.max_preconditioner_dim,
                         refresh_steps=job.kfac.refresh_steps or 1, lr=s.lr, defer_stats=s.defer_stats)


class KeptGradient:
    """What a layer's statistics fold: its weight's gradient of the step, or, with deferred
    statistics, the raw gradient the previous step's update kept before overwriting it (None
    at the first step, or after a step without a gradient: nothing to fold)."""

    def __init__(self, weight: nn.Parameter, defer: bool):
        self.weight, self.defer = weight, defer
        self.kept: torch.Tensor | None = None
        self._buffer: torch.Tensor | None = None  # reused from step to step

    def for_stats(self) -> torch.Tensor | None:
        return self.kept if self.defer else self.weight.grad

    def keep(self) -> None:
        """Called by the update before it overwrites weight.grad."""
        if not self.defer:
            return
        G = self.weight.grad
        if G is None:
            self.kept = None
            return
        if self._buffer is None or self._buffer.shape != G.shape or self._buffer.dtype != G.dtype:
            self._buffer = torch.empty_like(G)
        self.kept = self._buffer.copy_(G)

    def nbytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel() * self._buffer.element_size()

    def state_dict(self) -> dict:
        return {} if self.kept is None else {"kept_grad": self.kept.clone()}

    def load_state_dict(self, sd: dict) -> None:
        self.kept = self._buffer = sd["kept_grad"].clone() if "kept_grad" in sd else None


def block_sizes(n: int, most: int) -> list[int]:
    """n split into pieces of `most`, the last the remainder (Distributed Shampoo's blocks)."""
    return [most] * (n // most) + ([n % most] if n % most else [])


def stage_optimizer(module: nn.Module, layers, cfg):
    """Shampoo's directions applied by SGD at Shampoo's rate, with its momentum and decoupled
    weight decay (each where set; else the [optimizer] section's); AdamW on the rest."""
    from runtime.optimizers.stage import SgdOnCoveredOptimizer

    layers = list(layers)
    s = layers[0].cfg if layers else None
    if s is not None and s.lr is not None:
        cfg = dataclasses.replace(cfg, lr=s.lr)
    if s is not None and s.momentum is not None:
        cfg = dataclasses.replace(cfg, momentum=s.momentum)
    if s is not None and s.weight_decay is not None:
        cfg = dataclasses.replace(cfg, weight_decay=s.weight_decay, decoupled_weight_decay=True)
    return SgdOnCoveredOptimizer(module, layers, cfg)


class ShampooLayer:
    """Shampoo state of one nn.Linear's weight: statistics, snapshots, roots, one of each per
    block (max_preconditioner_dim), each a list over the blocks; β1's average and the graft's
    second moment of the whole weight.

    Its bias is not covered (it goes to AdamW with the other vectors). A factor's pending roots
    travel (pending / set_pending, bcast_inv) as one tensor: the root itself with one block,
    else the blocks' roots flattened and concatenated."""

    def __init__(self, name: str, module: nn.Linear, cfg: ShampooConfig):
        self.name, self.module, self.cfg = name, module, cfg
        self.covered = (module.weight,)
        self.dims = {"L": module.out_features, "R": module.in_features}
        rows = block_sizes(module.out_features, cfg.max_preconditioner_dim)
        cols = block_sizes(module.in_features, cfg.max_preconditioner_dim)
        row0 = [sum(rows[:i]) for i in range(len(rows))]
        col0 = [sum(cols[:j]) for j in range(len(cols))]
        # (rows, columns) of each block, row-major
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
        self.raw_grad_sq = None  # Σ g² of the gradient the last precondition() replaced (clipping, logs)
        self.stat_steps = 0      # gradients folded into the statistics (their bias correction)
        self._snapshot_steps = 0
        self.steps = 0           # precondition() calls with a gradient: β1's and the graft's bias correction
        self.exp_avg: torch.Tensor | None = None  # β1's EMA of the gradient
        self.graft_sq: torch.Tensor | None = None  # the graft's sum or EMA of g²
        self.gradient = KeptGradient(module.weight, cfg.defer_stats)  # what update_stats folds

    def _allocate_stats(self) -> None:
        if not self.statistics:
            like = dict(dtype=self.module.weight.dtype, device=self.module.weight.device)
            self.statistics = {f: [torch.zeros(d, d, **like) for d in ds] for f, ds in self.block_dims.items()}
            if self._alias:
                self.snapshots = dict(self.statistics)

    def update_stats(self, snapshot: bool) -> None:
        """Fold weight.grad into every block's L and R; on the first step of a cycle also snapshot them
        (a missing gradient, as torch's optimizers skip one, leaves the statistics as they are)."""
        self._allocate_stats()
        G = self.gradient.for_stats()
        if G is not None:
            G = G.to(self.statistics["L"][0].dtype)
            b = self.cfg.beta2
            alpha = 1.0 if b == 1 else 1 - b
            for (rs, cs), L, R in zip(self.blocks, self.statistics["L"], self.statistics["R"]):
                Gb = G[rs, cs]
                L.addmm_(Gb, Gb.t(), beta=b, alpha=alpha)
                R.addmm_(Gb.t(), Gb, beta=b, alpha=alpha)
            self.stat_steps += 1
        if snapshot:
            self._snapshot_steps = self.stat_steps
        if snapshot and not self._alias:
            for f, stats in self.statistics.items():
                if f in self.snapshots:
                    for snap, S in zip(self.snapshots[f], stats):
                        snap.copy_(S)
                else:
                    self.snapshots[f] = [S.clone() for S in stats]

    def compute_root(self, factor: str) -> None:
        """(Ŝ + ε I)^(-1/p) (absolute ε) or (Ŝ + ε λ_max I)^(-1/p) (relative) of this cycle's
        snapshot of `factor`, every block's, Ŝ the snapshot bias-corrected (β₂ < 1), into the
        pending slot."""
        roots = [self._root(factor, S) for S in self.snapshots[factor]]
        spare = self._spare.pop(factor, None)
        self._pending[factor] = [t.copy_(r) for t, r in zip(spare, roots)] if spare is not None else roots

    def _root(self, factor: str, S: torch.Tensor) -> torch.Tensor:
        if not bool(torch.isfinite(S.sum(dtype=torch.float64))):  # a NaN/inf anywhere makes the sum one
            raise NonFiniteFactorError(f"Shampoo layer {self.name}: statistic {factor} has non-finite values "
                                       f"(NaN/Inf gradients); lower the learning rate")
        evals, Q = torch.linalg.eigh(S)
        evals = evals.clamp_min(0)
        c = self.cfg
        if c.bias_correction and c.beta2 < 1 and self._snapshot_steps:
            evals = evals / (1 - c.beta2 ** self._snapshot_steps)
        top = float(evals[-1])  # eigh sorts ascending
        if top > 0:
            eps = c.epsilon * top if c.epsilon_mode == "relative" else c.epsilon
            root = (Q * (evals + eps).pow(c.root_exponent)) @ Q.t()
        else:
            root = torch.eye(S.shape[0], dtype=S.dtype, device=S.device)
        if not torch.isfinite(root).all():
            raise NonFiniteFactorError(f"Shampoo layer {self.name}: root of statistic {factor} is not finite")
        return root

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
        if spare is not None and all(t.shape == b.shape and t.dtype == b.dtype for t, b in zip(spare, blocks)):
            blocks = [t.copy_(b) for t, b in zip(spare, blocks)]
        self._pending[factor] = blocks

    def activate(self) -> None:
        """Cycle boundary: the pending roots come into force."""
        for f, root in self._pending.items():
            old = self.roots.get(f)
            if old is not None:
                self._spare[f] = old
            self.roots[f] = root
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
        """weight.grad <- the update direction: the gradient's β1 average m̂ (bias-corrected),
        preconditioned L_root m̂ R_root with the roots in force and rescaled to the norm of
        the graft's direction (sgd: m̂; adagrad: m̂ / (√Σg² + ε); rmsprop: m̂ / (√v + ε);
        adam: m̂ / (√v̂ + ε), v̂ bias-corrected); without roots in force, or before
        start_preconditioning_step, the graft's direction itself (none: m̂ preconditioned,
        or m̂)."""
        self.gradient.keep()
        G = self.module.weight.grad
        if G is None:
            self.raw_grad_sq = None
            return
        c = self.cfg
        self.raw_grad_sq = (G * G).sum()
        self.steps += 1
        if c.graft in ("adagrad", "rmsprop", "adam"):
            if self.graft_sq is None:
                self.graft_sq = torch.zeros_like(G)
            if c.graft == "adagrad":
                self.graft_sq.addcmul_(G, G)
            else:
                self.graft_sq.mul_(c.graft_beta2).addcmul_(G, G, value=1 - c.graft_beta2)
        m = G
        if c.beta1 > 0:
            if self.exp_avg is None:
                self.exp_avg = torch.zeros_like(G)
            self.exp_avg.mul_(c.beta1).add_(G, alpha=1 - c.beta1)
            m = self.exp_avg / (1 - c.beta1 ** self.steps) if c.bias_correction else self.exp_avg
        if self.graft_sq is not None:
            v = self.graft_sq
            if c.graft == "adam" and c.bias_correction and c.graft_beta2 < 1:
                v = v / (1 - c.graft_beta2 ** self.steps)
            graft = m / (v.sqrt() + c.graft_epsilon)
        else:
            graft = m
        if not ("L" in self.roots and "R" in self.roots) or self.steps <= c.start_preconditioning_step:
            G.copy_(graft)
            return
        if m is G:  # G's blocks are overwritten below
            m = G.clone()
            graft = m if graft is G else graft
        tiny = torch.finfo(G.dtype).tiny
        for (rs, cs), Lr, Rr in zip(self.blocks, self.roots["L"], self.roots["R"]):
            P = Lr.to(G.dtype) @ m[rs, cs] @ Rr.to(G.dtype)
            if c.graft != "none":
                # per block, as Distributed Shampoo grafts; roots are positive definite, so
                # P = 0 only where m = 0, and then 0 / tiny = 0
                P.mul_(graft[rs, cs].norm() / P.norm().clamp_min(tiny))
            G[rs, cs] = P

    def state_bytes(self) -> int:
        """Bytes of the resident state: statistics, snapshots (none with k = 1), roots in
        force, pending and spare, β1's average and the graft's second moment."""
        seen, total = set(), 0
        lists = [*self.statistics.values(), *self.snapshots.values(), *self.roots.values(),
                 *self._pending.values(), *self._spare.values()]
        for t in [t for ts in lists for t in ts] + [self.exp_avg, self.graft_sq]:
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
        return total + self.gradient.nbytes()

    # --- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        pack = lambda ts: self._pack(ts).clone()  # noqa: E731
        sd = {f"stat_{f}": pack(t) for f, t in self.statistics.items()}
        if not self._alias:
            sd.update({f"snapshot_{f}": pack(t) for f, t in self.snapshots.items()})
        sd.update({f"root_{f}": pack(t) for f, t in self.roots.items()})
        sd.update({f"pending_{f}": pack(t) for f, t in self._pending.items()})
        sd.update({n: t.clone() for n, t in (("exp_avg", self.exp_avg), ("graft_sq", self.graft_sq)) if t is not None})
        sd["counts"] = torch.tensor([self.stat_steps, self._snapshot_steps, self.steps])
        sd.update(self.gradient.state_dict())
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
        self.exp_avg = sd["exp_avg"].clone() if "exp_avg" in sd else None
        self.graft_sq = sd["graft_sq"].clone() if "graft_sq" in sd else None
        if "counts" in sd:
            self.stat_steps, self._snapshot_steps, self.steps = (int(v) for v in sd["counts"])
        self.gradient.load_state_dict(sd)


def make_layer(name: str, linear: nn.Linear, cfg: ShampooConfig, micro_batches: int) -> ShampooLayer:
    """The runtime registry's maker."""
    return ShampooLayer(name, linear, cfg)


def make_layers(named_linears, cfg: ShampooConfig) -> list[ShampooLayer]:
    """ShampooLayer for each (name, nn.Linear) of runtime.models.kfac_linears."""
    return [ShampooLayer(n, m, cfg) for n, m in named_linears]
