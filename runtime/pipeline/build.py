"""Building this rank's part of the model: its stages (modules on the job's device), the
layers of the plan's optimizer (K-FAC, Shampoo or Muon state per covered Linear, numbered by
the plan's layer index), their optimizers, and the update the plan's `step` op runs (with
global-norm gradient clipping)."""

from __future__ import annotations

from pfcompile.formats.errors import InputError
from runtime.models import Stage, kfac_linears
from runtime.optimizers import kfac, registry
from runtime.optimizers.registry import OpContext
from runtime.optimizers.stage import build_optimizer, clip_coefficient, optim_config, raw_grad_norm_sq, scale_all_grads
from runtime.pipeline.interpreter import StageReplica


def build_stages(job, world) -> dict[int, StageReplica]:
    """This rank's stages with their optimizer layers (plan indices) and optimizers."""
    plan, cfg = job.plan, job.config
    optimizer = plan.config.optimizer
    stages = {}
    for s, r in plan.stages_of(job.rank):
        module = Stage(job.spec, plan.partition[s], seed=cfg.train.seed, dtype=job.dtype).to(world.device)
        layers = _optimizer_layers(job, s, module) if plan.config.optimizer_work else {}
        stages[s] = StageReplica(
            stage=s, replica=r, module=module, layers=layers,
            optimizer=build_optimizer(module, list(layers.values()), optim_config(cfg), optimizer),
            group=world.stage_groups.get(s), is_first=(s == 0), is_last=(s == plan.num_stages - 1))
    return stages


def _optimizer_layers(job, s: int, module) -> dict:
    """The plan's covered layers of stage s as its optimizer's layer state (runtime.optimizers.kfac,
    runtime.optimizers.shampoo, runtime.optimizers.muon; K-FAC's capture hooks attached); a name the stage lacks
    is an InputError."""
    plan = job.plan
    linears = dict(kfac_linears(module))
    make = _layer_maker(job)
    layers = {}
    for i, name in enumerate(plan.layers):
        if plan.layer_stage[i] != s:
            continue
        if name not in linears:
            raise InputError(job.plan_path, f"layers[{i}]", f"{name!r} is not a covered Linear of stage {s} "
                             f"(its layers: {', '.join(linears) or 'none'})")
        layers[i] = make(name, linears[name])
    return layers


def _layer_maker(job):
    """name, nn.Linear -> the plan's optimizer's state of that layer, configured by the job
    (its registry entry's maker: K-FAC's attaches its capture hooks)."""
    entry = registry.entry(job.plan.config.optimizer)
    math_cfg, N = entry.math_config(job.config), job.plan.config.micro_batches
    return lambda name, linear: entry.layer(name, linear, math_cfg, N)


class Update:
    """The `step(stage)` op: the KL-clip over the stage's layers (for an optimizer whose
    registry entry KL-clips: K-FAC), then the stage optimizer.

    It also adds each stage's squared gradient norm (replica 0 only, so a replicated stage
    counts once) to this rank's share of the step's global norm: the gradient as
    back-propagated (a layer whose op replaced it reports its own, raw_grad_sq).
    With clipping (max_grad_norm > 0) the global norm is known only once every stage on
    every rank has its gradient, so the updates wait for the end of the rank's step:
    `finish_step` all-reduces the norm over the world and runs them, every gradient scaled
    by the same factor. Deferring is safe whatever the plan: a step op sends nothing, and
    nothing of a stage runs after its step op within the step.

    An optimizer that clips first (Muon: its per-step op folds the gradient into its
    momentum and normalises it) has its per-step layer ops deferred too (`defers`): the
    interpreter skips them at their place, and the deferred update runs them on every
    layer of the stage after the scaling, in declared order, as the single-process trainer
    does. Every replica of a stage runs them (each holds the summed gradient), so divided
    work stays exact.
    """

    def __init__(self, entry: registry.OptimizerEntry, math_cfg, max_grad_norm: float = 0.0, world=None):
        self.entry, self.max_grad_norm, self.world = entry, max_grad_norm, world
        self.kl_clip = math_cfg.kl_clip if entry.kl_clip else None  # it needs <g~, g> per layer
        self.clip_first = entry.clip_first and max_grad_norm > 0
        # the per-step layer ops run in the deferred update instead of at their place
        self.defers = frozenset(d.kind for d in entry.ops.ops if d.when == "step" and not d.collective) \
            if self.clip_first else frozenset()
        self.norm_sq = 0.0          # this rank's share of the step's squared global norm
        self.deferred: list[tuple[StageReplica, OpContext]] = []

    def __call__(self, sr: StageReplica, at: OpContext | None = None) -> None:
        if sr.replica == 0:
            # clipping first, the layers' ops have not run: every gradient is as back-propagated
            layers = [] if self.clip_first else list(sr.layers.values())
            self.norm_sq += float(raw_grad_norm_sq(sr.module, layers))
        if self.max_grad_norm > 0:
            self.deferred.append((sr, at or OpContext()))
        else:
            self._apply(sr)

    def _apply(self, sr: StageReplica) -> None:
        if sr.layers and self.kl_clip is not None:
            kfac.apply_kl_clip(list(sr.layers.values()), sr.optimizer.lr, self.kl_clip)
        sr.optimizer.step()
        sr.optimizer.zero_grad()

    def finish_step(self) -> float:
        """Run the deferred (clipped) updates; returns this rank's contribution to the step's
        squared global norm, which summed over ranks is the squared norm."""
        share, self.norm_sq = self.norm_sq, 0.0
        if self.max_grad_norm <= 0:
            return share
        import torch

        from runtime.pipeline.comm import all_reduce

        total = torch.tensor([share], dtype=torch.float64, device=self.world.device)
        all_reduce(total, "the all-reduce of the gradient norm", self.world.timeout)
        norm_sq = float(total)
        c = clip_coefficient(norm_sq ** 0.5, self.max_grad_norm)
        for sr, at in self.deferred:
            if self.clip_first:
                scale_all_grads(sr.module, [], c)
                for d in self.entry.ops.ops:
                    if d.kind in self.defers:
                        for i in sorted(sr.layers):
                            getattr(sr.layers[i], d.kind)(**at.keywords())
            else:
                scale_all_grads(sr.module, list(sr.layers.values()), c)
            self._apply(sr)
        self.deferred.clear()
        return norm_sq if self.world.rank == 0 else 0.0  # already global: counted once
