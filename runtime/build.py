"""Building this rank's part of the model: its stages (modules on the job's device), their
K-FAC layers (numbered by the plan's layer index) and optimizers, and the update the plan's
`step` op runs."""

from __future__ import annotations

from pfcompile.formats.errors import InputError
from runtime import kfac
from runtime.interpreter import StageReplica
from runtime.models import Stage, kfac_linears
from runtime.optim import build_optimizer


def build_stages(job, world, kfac_cfg, optim_cfg) -> dict[int, StageReplica]:
    """This rank's stages with their K-FAC layers (plan indices) and optimizers."""
    plan = job.plan
    N = int(plan.config["micro_batches"])
    stages = {}
    for s, r in plan.stages_of(job.rank):
        module = Stage(job.spec, plan.partition[s], seed=job.seed, dtype=job.dtype).to(world.device)
        layers = _kfac_layers(job, s, module, kfac_cfg, N) if plan.config["kfac"] else {}
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
            raise InputError(job.where, f"layers[{i}]", f"{name!r} is not a K-FAC Linear of stage {s} "
                             f"(its layers: {', '.join(linears) or 'none'})")
        layers[i] = kfac.KfacLayer(name, linears[name], kfac_cfg, loss_divisor=N)
        layers[i].attach()
    return layers


def make_update(kfac_cfg):
    """The step(stage) op: KL-clip over the stage's K-FAC layers, then the optimizer."""

    def update(sr) -> None:
        if sr.kfac:
            kfac.apply_kl_clip(list(sr.kfac.values()), sr.optimizer.lr, kfac_cfg.kl_clip)
        sr.optimizer.step()
        sr.optimizer.zero_grad()
    return update
