"""Building this rank's part of the model: its stages (modules on the job's device), their
K-FAC layers (numbered by the plan's layer index) and optimizers, and the update the plan's
`step` op runs (with global-norm gradient clipping)."""

from __future__ import annotations

from pfcompile.formats.errors import InputError
from runtime import kfac
from runtime.interpreter import StageReplica
from runtime.models import Stage, kfac_linears
from runtime.optim import build_optimizer, clip_coefficient, raw_grad_norm_sq, scale_all_grads


def build_stages(job, world, kfac_cfg, optim_cfg) -> dict[int, StageReplica]:
    """This rank's stages with their K-FAC layers (plan indices) and optimizers."""
    plan = job.plan
    N = plan.config.micro_batches
    stages = {}
    for s, r in plan.stages_of(job.rank):
        module = Stage(job.spec, plan.partition[s], seed=job.config.train.seed, dtype=job.dtype).to(world.device)
        layers = _kfac_layers(job, s, module, kfac_cfg, N) if plan.config.kfac else {}
        stages[s] = StageReplica(
            stage=s, replica=r, module=module, kfac=layers,
            optimizer=build_optimizer(module, list(layers.values()), optim_cfg),
            group=world.stage_groups.get(s), is_first=(s == 0), is_last=(s == plan.num_stages - 1))
    return stages


def _kfac_layers(job, s: int, module, kfac_cfg, N: int) -> dict[int, kfac.KfacLayer]:
    """The plan's K-FAC layers of stage s, hooks attached; a name the stage lacks is an InputError."""
    plan = job.plan
    linears = dict(kfac_linears(module))
    layers = {}
    for i, name in enumerate(plan.layers):
        if plan.layer_stage[i] != s:
            continue
        if name not in linears:
            raise InputError(job.plan_path, f"layers[{i}]", f"{name!r} is not a K-FAC Linear of stage {s} "
                             f"(its layers: {', '.join(linears) or 'none'})")
        layers[i] = kfac.KfacLayer(name, linears[name], kfac_cfg, loss_divisor=N)
        layers[i].attach()
    return layers


class Update:
    """The `step(stage)` op: KL-clip over the stage's K-FAC layers, then the optimizer.

    It also adds each stage's squared gradient norm (before preconditioning; replica 0 only,
    so a replicated stage counts once) to this rank's share of the step's global norm.
    With clipping (max_grad_norm > 0) the global norm is known only once every stage on
    every rank has its gradient, so the updates wait for the end of the rank's step:
    `finish_step` all-reduces the norm over the world and runs them, every gradient scaled
    by the same factor. Deferring is safe whatever the plan: a step op sends nothing, and
    nothing of a stage runs after its step op within the step.
    """

    def __init__(self, kfac_cfg, max_grad_norm: float = 0.0, world=None):
        self.kfac_cfg, self.max_grad_norm, self.world = kfac_cfg, max_grad_norm, world
        self.norm_sq = 0.0          # this rank's share of the step's squared global norm
        self.deferred: list[StageReplica] = []

    def __call__(self, sr: StageReplica) -> None:
        if sr.replica == 0:
            self.norm_sq += float(raw_grad_norm_sq(sr.module, list(sr.kfac.values())))
        if self.max_grad_norm > 0:
            self.deferred.append(sr)
        else:
            self._apply(sr)

    def _apply(self, sr: StageReplica) -> None:
        if sr.kfac:
            kfac.apply_kl_clip(list(sr.kfac.values()), sr.optimizer.lr, self.kfac_cfg.kl_clip)
        sr.optimizer.step()
        sr.optimizer.zero_grad()

    def finish_step(self) -> float:
        """Run the deferred (clipped) updates; returns this rank's contribution to the step's
        squared global norm, which summed over ranks is the squared norm."""
        share, self.norm_sq = self.norm_sq, 0.0
        if self.max_grad_norm <= 0:
            return share
        import torch

        from runtime.comm import all_reduce

        total = torch.tensor([share], dtype=torch.float64, device=self.world.device)
        all_reduce(total, "the all-reduce of the gradient norm", self.world.timeout)
        norm_sq = float(total)
        c = clip_coefficient(norm_sq ** 0.5, self.max_grad_norm)
        for sr in self.deferred:
            scale_all_grads(sr.module, list(sr.kfac.values()), c)
            self._apply(sr)
        self.deferred.clear()
        return norm_sq if self.world.rank == 0 else 0.0  # already global: counted once
