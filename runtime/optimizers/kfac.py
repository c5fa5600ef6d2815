"""K-FAC for nn.Linear layers, one function per unit of work the planner schedules.

For y = W x + b the Fisher block of the bias-augmented weight [W, b] is approximated by
A ⊗ B, A = E[a aᵀ] over tokens with a = [x, 1], B = E[g gᵀ] with g the output gradient
of the per-token loss; the preconditioned gradient is B⁻¹ G A⁻¹.

Cycle semantics shared by the single-process trainer, the profiler and the pipeline runtime
(refresh every k steps):
  * a refresh step t (t % k == 0) starts with `activate()`: the inverses computed during
    the previous cycle come into force, the accumulators are emptied;
  * during step t each micro-batch's inputs / output gradients are captured by hooks and
    folded into the accumulators by `curv_a(mb)` / `curv_b(mb)`;
  * `invert(factor)` (any time before step t + k) EMA-updates its factor and puts a
    damped inverse into the PENDING slot; it is not used before step t + k. Each inversion
    updates only its own factor (the other's EMA is its own inversion's work, or the cycle
    boundary's on a replica that inverted neither): the planner costs an inversion as one
    fixed op, whichever of the layer's two it places first;
  * every step `precondition()` applies the inverses in force (none in cycle 0: the
    gradient passes through unchanged).

Scaling. The loss of a step is the mean over its M micro-batches of each micro-batch's mean
loss, and each micro-batch's backward is of loss_m / M (`loss_divisor` = M). An output
gradient captured for a micro-batch of n rows is scaled by M·n, which makes it the gradient
of the per-row loss; the accumulator keeps Σ g gᵀ and the row count, so the sum over
micro-batches (and over replicas: all-reduce SUM of the packed buffer) divided by the total
count is exactly the full-batch factor. A is accumulated the same way from [x, 1].

Fisher: "empirical" captures the gradient of the training loss; "mc" (single-process
trainer only) captures the gradient of a loss on targets sampled from the model's own
predictive distribution, from a separate backward. The pipeline runtime uses empirical.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn

FACTORS = ("A", "B")


class NonFiniteFactorError(FloatingPointError):
    """A K-FAC factor or inverse holds NaN/Inf; the message names the layer."""


@dataclass
class KfacConfig:
    damping: float = 1e-3          # λ
    ema: float = 0.95              # factor <- ema * factor + (1 - ema) * new
    damping_mode: str = "pi"       # "pi": A + π√λ I, B + √λ/π I;  "plain": (A⊗B + λI)⁻¹ (eigen only)
    inverse: str = "cholesky"      # "cholesky" | "eigen"
    fisher: str = "empirical"      # "empirical" | "mc"
    kl_clip: float | None = 1e-3
    refresh_steps: int = 1         # k

    def __post_init__(self):
        if self.damping_mode not in ("pi", "plain"):
            raise ValueError(f"damping_mode must be 'pi' or 'plain', got {self.damping_mode!r}")
        if self.inverse not in ("cholesky", "eigen"):
            raise ValueError(f"inverse must be 'cholesky' or 'eigen', got {self.inverse!r}")
        if self.damping_mode == "plain" and self.inverse != "eigen":
            raise ValueError("damping_mode 'plain' needs inverse 'eigen' (A⊗B + λI has no Kronecker Cholesky)")
        if self.fisher not in ("empirical", "mc"):
            raise ValueError(f"fisher must be 'empirical' or 'mc', got {self.fisher!r}")
        if not (self.damping > 0 and 0 <= self.ema < 1 and self.refresh_steps >= 1):
            raise ValueError("need damping > 0, 0 <= ema < 1, refresh_steps >= 1")


def kfac_config(job) -> KfacConfig:
    """KfacConfig of a runtime.config.job.JobConfig's [kfac] (kl_clip 0: off; before apply_plan,
    the plan-fixed keys' defaults: cholesky, refresh every step)."""
    k = job.kfac
    return KfacConfig(damping=k.damping, ema=k.ema, damping_mode=k.damping_mode, inverse=k.inverse or "cholesky",
                      fisher=k.fisher, kl_clip=k.kl_clip if k.kl_clip > 0 else None,
                      refresh_steps=k.refresh_steps or 1)


class KfacLayer:
    """K-FAC state of one nn.Linear: saved tensors, accumulators, factors, inverses."""

    def __init__(self, name: str, module: nn.Linear, cfg: KfacConfig, loss_divisor: float = 1.0):
        self.name, self.module, self.cfg = name, module, cfg
        self.loss_divisor = loss_divisor  # M: each micro-batch's backward is of loss_m / M
        self.capturing = False            # forwards run while True save inputs and output grads
        self.skip_grad_capture = False
        self.mb = 0                       # micro-batch the hooks file what they capture under
        self.bias = module.bias is not None
        d_a = module.in_features + (1 if self.bias else 0)
        d_b = module.out_features
        self.dims = {"A": d_a, "B": d_b}
        like = dict(dtype=module.weight.dtype, device=module.weight.device)
        # Packed accumulator: Σ outer products (d*d) followed by the row count.
        self._acc = {f: torch.zeros(d * d + 1, **like) for f, d in self.dims.items()}
        self._saved = {"A": {}, "B": {}}
        self.factors: dict[str, torch.Tensor] = {}
        self.inverses: dict[str, torch.Tensor] = {}   # in force
        self._pending: dict[str, torch.Tensor] = {}
        # The inverses that went out of force at the last activate(), reused as the next pending
        # inverses' storage: a layer holds in-force + pending inverses all the time, as the
        # planner's memory model says, instead of reallocating every cycle.
        self._spare: dict[str, torch.Tensor] = {}
        self._ema_done: set[str] = set()  # factors EMA-updated from this cycle's accumulators
        self.kl_term = None     # <g̃, g> of the last precondition(), for the KL clip
        self.raw_grad_sq = None  # Σ g² of the gradient the last precondition() replaced (clipping, logs)
        self._hooks = []

    # --- capture ----------------------------------------------------------------------------
    # Captures are kept as the tensors autograd hands over, not reshaped: a reshape of a
    # non-contiguous one (the attention's k projection's output gradient) would copy it,
    # and the split backward's W keeps these very tensors (runtime.pipeline.split_backward): one
    # storage, counted once by the planner and runtime.observe.memory. curv_* flattens them.
    def save_input(self, mb: int, x: torch.Tensor) -> None:
        self._saved["A"][mb] = x.detach()

    def save_grad(self, mb: int, gy: torch.Tensor) -> None:
        self._saved["B"][mb] = gy.detach()

    def _forward_hook(self, module, inputs, output):
        if not self.capturing or not torch.is_grad_enabled():
            return
        mb = self.mb
        self.save_input(mb, inputs[0])
        # Whether to capture is decided at forward time, so a pipeline may run this
        # micro-batch's backward later without the flag. `skip_grad_capture` lets the
        # Monte-Carlo trainer keep the sampled backward's gradient, not the training one's.
        output.register_hook(lambda g, mb=mb: None if self.skip_grad_capture else self.save_grad(mb, g))

    def attach(self) -> None:
        if not self._hooks:
            self._hooks.append(self.module.register_forward_hook(self._forward_hook))

    def detach(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # --- curvature ----------------------------------------------------------------------------
    def _take(self, factor: str, mb: int) -> torch.Tensor:
        try:
            t = self._saved[factor].pop(mb)
            return t.reshape(-1, t.shape[-1])
        except KeyError:
            what = "input" if factor == "A" else "output gradient"
            raise RuntimeError(f"K-FAC layer {self.name}: no saved {what} for micro-batch {mb} "
                               f"(was it captured? capturing must be on during its fwd/bwd)") from None

    def _add(self, factor: str, rows: torch.Tensor) -> None:
        d = self.dims[factor]
        acc = self._acc[factor]
        rows = rows.to(acc.dtype)
        acc[: d * d].view(d, d).addmm_(rows.t(), rows)
        acc[d * d] += rows.shape[0]

    # The op kinds of K-FAC's declaration (pfcompile.formats.optimizers.KFAC), each called by
    # the interpreter and the single-process trainer with the keywords of
    # runtime.optimizers.registry.OpContext.
    def curv_a(self, mb: int, **_) -> None:
        x = self._take("A", mb)
        if self.bias:
            x = torch.cat([x, x.new_ones(x.shape[0], 1)], dim=1)
        self._add("A", x)

    def curv_b(self, mb: int, **_) -> None:
        gy = self._take("B", mb)
        self._add("B", gy * (self.loss_divisor * gy.shape[0]))

    def accumulator(self, factor: str) -> torch.Tensor:
        """The packed buffer [Σ outer products (d*d), row count]; all-reduce it in place with
        SUM (or AVG: the ratio is unchanged) to combine replicas."""
        return self._acc[factor]

    def update_factor(self, factor: str) -> None:
        """EMA one factor from this cycle's accumulator, once per cycle: in place, with the
        count folded into the weight (two passes over d², not the six of acc / n, a finite
        check, old * ema, new * (1 - ema) and their sum, which for a large factor cost as
        much as its inverse)."""
        if factor in self._ema_done:
            return
        d = self.dims[factor]
        acc = self._acc[factor]
        count = float(acc[d * d])
        if count <= 0:
            raise RuntimeError(f"K-FAC layer {self.name}: factor {factor} has no curvature this cycle "
                               f"(no curv_{factor.lower()} ran)")
        new = acc[: d * d].view(d, d)
        if not bool(torch.isfinite(new.sum(dtype=torch.float64))):  # a NaN/inf anywhere makes the sum one
            raise self._non_finite(factor)
        old = self.factors.get(factor)
        if old is None:
            self.factors[factor] = new / count
        else:
            old.mul_(self.cfg.ema).add_(new, alpha=(1 - self.cfg.ema) / count)
        self._ema_done.add(factor)

    def _non_finite(self, factor: str) -> NonFiniteFactorError:
        what = "inputs" if factor == "A" else "output gradients"
        return NonFiniteFactorError(f"K-FAC layer {self.name}: factor {factor} has non-finite values (NaN/Inf in the "
                                    f"captured {what}); lower the learning rate or raise damping")

    def undo_update_mark(self, factor: str) -> None:
        """Let the next inversion of `factor` EMA-update it again (the profiler times an
        inversion with its update, repeat after repeat)."""
        self._ema_done.discard(factor)

    def update_factors(self) -> None:
        """EMA both factors from this cycle's accumulators (those not updated yet)."""
        for f in FACTORS:
            self.update_factor(f)

    def _diagonal_mean(self, factor: str) -> float:
        """tr(F)/dim of the factor as this cycle's EMA makes it, without making it: the
        diagonal is all π needs, and the other factor's EMA is its own inversion's work."""
        if factor in self._ema_done or float(self._acc[factor][-1]) <= 0:
            return float(self.factors[factor].diagonal().mean())
        d = self.dims[factor]
        acc = self._acc[factor]
        new = float(acc[: d * d].view(d, d).diagonal().mean()) / float(acc[d * d])
        old = self.factors.get(factor)
        value = new if old is None else self.cfg.ema * float(old.diagonal().mean()) + (1 - self.cfg.ema) * new
        if not math.isfinite(value):
            raise self._non_finite(factor)
        return value

    # --- inversion ----------------------------------------------------------------------------
    def pi(self) -> float:
        """π = sqrt((tr A / dim A) / (tr B / dim B)): splits damping so both factors get a
        share proportional to their scale."""
        ta, tb = self._diagonal_mean("A"), self._diagonal_mean("B")
        return math.sqrt(ta / tb) if ta > 0 and tb > 0 else 1.0

    def factor_damping(self, factor: str) -> float:
        s, p = math.sqrt(self.cfg.damping), self.pi()
        return s * p if factor == "A" else s / p

    def invert(self, factor: str) -> None:
        """Damped inverse of `factor` into the pending slot (EMA-updating the factor first if
        this cycle's update has not happened yet)."""
        self.update_factor(factor)
        F_ = self.factors[factor]
        eye = torch.eye(F_.shape[0], dtype=F_.dtype, device=F_.device)
        if self.cfg.inverse == "cholesky":
            L, info = torch.linalg.cholesky_ex(F_ + self.factor_damping(factor) * eye)
            if int(info) != 0:
                raise NonFiniteFactorError(f"K-FAC layer {self.name}: damped factor {factor} is not positive definite; raise damping")
            inv = torch.cholesky_inverse(L)
        else:
            evals, Q = torch.linalg.eigh(F_)
            evals = evals.clamp_min(0)  # a PSD matrix; negative values are rounding
            if self.cfg.damping_mode == "pi":
                evals = evals + self.factor_damping(factor)
            inv = torch.cat([Q, evals[:, None]], dim=1)  # packed [Q | eigenvalues]
        if not torch.isfinite(inv).all():
            raise NonFiniteFactorError(f"K-FAC layer {self.name}: inverse of factor {factor} is not finite")
        self.set_pending(factor, inv)

    def pending(self, factor: str) -> torch.Tensor:
        """The pending inverse as one tensor (eigen: [Q | eigenvalues]) for broadcast."""
        return self._pending[factor]

    def pending_shape(self, factor: str) -> tuple[int, int]:
        d = self.dims[factor]
        return (d, d + 1) if self.cfg.inverse == "eigen" else (d, d)

    def set_pending(self, factor: str, tensor: torch.Tensor) -> None:
        spare = self._spare.pop(factor, None)
        if spare is not None and spare.shape == tensor.shape and spare.dtype == tensor.dtype:
            tensor = spare.copy_(tensor)
        self._pending[factor] = tensor

    def activate(self) -> None:
        """Cycle boundary: pending inverses come into force; the accumulators are emptied.
        A replica that received both inverses instead of computing them still EMA-updates its
        factors here, so every replica keeps the same factors."""
        if any(float(self._acc[f][-1]) > 0 for f in FACTORS) and len(self._ema_done) < len(FACTORS):
            self.update_factors()
        for f, inv in self._pending.items():
            old = self.inverses.get(f)
            if old is not None:
                self._spare[f] = old
            self.inverses[f] = inv
        self._pending = {}
        for acc in self._acc.values():
            acc.zero_()
        self._saved = {"A": {}, "B": {}}
        self._ema_done = set()

    # --- preconditioning -------------------------------------------------------------------------
    def grad_matrix(self) -> torch.Tensor:
        w = self.module.weight.grad
        if w is None:
            w = torch.zeros_like(self.module.weight)
        if not self.bias:
            return w
        b = self.module.bias.grad
        b = torch.zeros_like(self.module.bias) if b is None else b
        return torch.cat([w, b[:, None]], dim=1)

    def set_grad_matrix(self, G: torch.Tensor) -> None:
        n = self.module.in_features
        self.module.weight.grad = G[:, :n].contiguous()
        if self.bias:
            self.module.bias.grad = G[:, n].contiguous()

    def inv(self, factor: str, **_) -> None:
        self.invert(factor)

    def precond(self, **_) -> None:
        self.precondition()

    def precondition(self) -> None:
        """weight.grad / bias.grad <- B⁻¹ G A⁻¹ with the inverses in force (unchanged if none)."""
        G = self.grad_matrix()
        self.raw_grad_sq = (G * G).sum()
        if not ("A" in self.inverses and "B" in self.inverses):
            self.kl_term = None
            return
        IA, IB = self.inverses["A"].to(G.dtype), self.inverses["B"].to(G.dtype)
        if self.cfg.inverse == "cholesky":
            P = IB @ G @ IA
        else:
            QA, ea = IA[:, :-1], IA[:, -1]
            QB, eb = IB[:, :-1], IB[:, -1]
            V = QB.t() @ G @ QA
            if self.cfg.damping_mode == "plain":
                V = V / (eb[:, None] * ea[None, :] + self.cfg.damping)
            else:
                V = V / (eb[:, None] * ea[None, :])
            P = QB @ V @ QA.t()
        self.kl_term = (P * G).sum()
        self.set_grad_matrix(P)

    def kept_tensors(self, factor: str) -> list[torch.Tensor]:
        """The captured tensors of one factor waiting for their curv op."""
        return list(self._saved[factor].values())

    def kept_of(self, mb: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Micro-batch mb's captured input and output gradient waiting for their curv op (None where not)."""
        return self._saved["A"].get(mb), self._saved["B"].get(mb)

    def kept_micro_batches(self) -> set[int]:
        return set(self._saved["A"]) | set(self._saved["B"])

    def state_bytes(self) -> int:
        """Bytes of the layer's resident state: accumulators, factors, inverses (in force,
        pending, spare). The planner's model counts accumulator + factor + 2 inverses."""
        tensors = [*self._acc.values(), *self.factors.values(), *self.inverses.values(),
                   *self._pending.values(), *self._spare.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    # --- checkpoints --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        sd = {f"acc_{f}": t.clone() for f, t in self._acc.items()}
        sd.update({f"factor_{f}": t.clone() for f, t in self.factors.items()})
        sd.update({f"inverse_{f}": t.clone() for f, t in self.inverses.items()})
        sd.update({f"pending_{f}": t.clone() for f, t in self._pending.items()})
        sd["ema_done"] = torch.tensor([f in self._ema_done for f in FACTORS])
        return sd

    def load_state_dict(self, sd: dict) -> None:
        for f in FACTORS:
            self._acc[f].copy_(sd[f"acc_{f}"])
        pick = lambda prefix: {f: sd[f"{prefix}_{f}"].clone() for f in FACTORS if f"{prefix}_{f}" in sd}  # noqa: E731
        self.factors, self.inverses, self._pending = pick("factor"), pick("inverse"), pick("pending")
        done = sd["ema_done"]  # per factor; a 0-d flag (older checkpoints): both or neither
        self._ema_done = {f for i, f in enumerate(FACTORS) if bool(done if done.dim() == 0 else done[i])}

    def kept_captures(self) -> dict[str, dict[int, torch.Tensor]]:
        """Captured inputs ("A") and output gradients ("B") by micro-batch that no curv_a /
        curv_b has folded in yet. A plan may run a curv op in a later step than its fwd/bwd,
        so a checkpoint taken mid-cycle needs them; state_dict leaves them out."""
        return {f: dict(saved) for f, saved in self._saved.items()}

    def load_kept_captures(self, kept: dict[str, dict[int, torch.Tensor]]) -> None:
        self._saved = {f: dict(kept.get(f, {})) for f in FACTORS}


# --- helpers over groups of layers -------------------------------------------------------------
def make_layers(named_linears, cfg: KfacConfig, loss_divisor: float = 1.0, attach: bool = True) -> list[KfacLayer]:
    """KfacLayer for each (name, nn.Linear) of runtime.models.kfac_linears, hooks attached."""
    layers = [KfacLayer(n, m, cfg, loss_divisor) for n, m in named_linears]
    if attach:
        attach_all(layers)
    return layers


def make_layer(name: str, linear: nn.Linear, cfg: KfacConfig, micro_batches: int) -> KfacLayer:
    """The runtime registry's maker: one layer, its loss divided by the step's micro-batches,
    its capture hooks attached."""
    layer = KfacLayer(name, linear, cfg, loss_divisor=micro_batches)
    layer.attach()
    return layer


def attach_all(layers: list[KfacLayer]) -> None:
    for l in layers:
        l.attach()


@contextlib.contextmanager
def capturing(layers: list[KfacLayer], mb: int, on: bool = True):
    """Forwards run inside save the layers' inputs under `mb` and arrange for their output
    gradients to be saved when the backward runs (inside or later, as in a pipeline)."""
    for l in layers:
        l.capturing, l.mb, l.skip_grad_capture = on, mb, False
    try:
        yield
    finally:
        for l in layers:
            l.capturing, l.skip_grad_capture = False, False


def kl_clip_scale(layers: list[KfacLayer], lr: float, kl_clip: float | None) -> float:
    """kfac-pytorch's KL clip over a group: min(1, sqrt(kl_clip / (lr² Σ <g̃, g>))).
    Layers that were not preconditioned (no inverses in force yet) do not count."""
    if not kl_clip:
        return 1.0
    terms = [l.kl_term for l in layers if l.kl_term is not None]
    if not terms:
        return 1.0
    vg = abs(float(sum(terms))) * lr * lr
    return 1.0 if vg == 0 else min(1.0, math.sqrt(kl_clip / vg))


def scale_grads(layers: list[KfacLayer], scale: float) -> None:
    if scale == 1.0:
        return
    for l in layers:
        if l.kl_term is None:
            continue
        for p in (l.module.weight, l.module.bias):
            if p is not None and p.grad is not None:
                p.grad.mul_(scale)


def apply_kl_clip(layers: list[KfacLayer], lr: float, kl_clip: float | None) -> float:
    """Compute the group's KL-clip scale and apply it to the preconditioned gradients."""
    s = kl_clip_scale(layers, lr, kl_clip)
    scale_grads(layers, s)
    return s
