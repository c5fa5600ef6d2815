"""Assemble a Plan from a placed schedule (per rank, per step, ops in execution order).

Every plan goes through the replay (pfcompile.check.replay): its times become the plan's
predicted start/end and its statistics the plan's stats, so what a plan file says is
what the independent simulator computed, whichever planner placed it.
"""

from __future__ import annotations

from dataclasses import replace

from pfcompile.check.replay import ReplayResult, plan_costs, replay
from pfcompile.formats.ops import Op
from pfcompile.formats.plan import Plan, PlanConfig, PlannedOp
from pfcompile.formats.profile import Profile
from pfcompile.formats.rules import PlanLayout
from pfcompile.formats.verify import model_hash
from pfcompile.graph.schedules import PipelineConfig
from pfcompile.graph.taskgraph import TaskGraph, TaskGraphs, build_task_graph
from pfcompile.place.message_order import order_messages


def assemble(profile: Profile, tg: TaskGraph, steps: dict[int, list[list[Op]]], method: str,
             *, fixed_order: bool = True) -> Plan:
    """A Plan with zero times from `steps[rank][step]` (op lists in execution order)."""
    cfg = tg.cfg
    steps = order_messages(steps)  # the NCCL rule: each pair's receives in send order
    k = len(next(iter(steps.values())))
    # the plan says who preconditions what ("split" whatever the division: the owners list it)
    config = PlanConfig(
        schedule=cfg.schedule, stages=cfg.stages, micro_batches=cfg.micro_batches, replicas=cfg.replicas,
        world_size=cfg.world_size, method=method, optimizer=cfg.optimizer, refresh_steps=k, virtual_stages=cfg.virtual_stages,
        inverse=cfg.inverse, inversion=cfg.inversion, precond="split" if tg.precond_owner is not None else "all",
        precond_division=cfg.precond,
        precond_owner=tuple(tg.precond_owner) if tg.precond_owner is not None else None,
        memory_limit_bytes=cfg.memory_limit_bytes, fixed_order=fixed_order, cluster=cfg.cluster,
        defer_stats=cfg.defer_stats)
    ranks = [[[PlannedOp(op, 0.0, 0.0) for op in steps[q][t]] for t in range(k)] for q in range(cfg.world_size)]
    return Plan(
        config=config, model=dict(profile.model), partition=[list(g) for g in tg.partition],
        layers=[l.name for l in profile.covered_layers], layer_stage=list(tg.layer_stage),
        placement=cfg.placement(), micro_batch_replica=cfg.micro_batch_replica(), ranks=ranks,
        profile={"name": profile.name, "hash": profile.hash, "source": profile.source,
                 # the runtime's default device (and so its backend) is the profiled one
                 "device_type": profile.provenance.get("device_type", "cpu"),
                 "model_hash": model_hash(profile.model, profile.hash),
                 # a user model's parts, for the verifier (which cannot import its code)
                 "parts": [p.name for p in profile.parts]},
    )


def finish(plan: Plan, profile: Profile, extra_stats: dict | None = None, *, where: str = "<plan>",
           check_memory: bool = True, replayed: ReplayResult | None = None) -> ReplayResult:
    """Replay the plan; write the replayed times and statistics into it. `replayed`: the
    plan's replay, already made (a plan is replayed once)."""
    result = replayed or replay(plan, profile, where=where, check_memory=check_memory)
    costs = plan_costs(plan, profile, PlanLayout(plan))
    for q, steps in enumerate(plan.ranks):
        for t, ops in enumerate(steps):
            for i, po in enumerate(ops):
                po.start, po.end = result.times[q][t][i]
                po.between_ms = costs.between_steps_ms(po.op, t)
    plan.stats = {**result.stats(), "tasks": sum(len(ops) for steps in plan.ranks for ops in steps),
                  "refresh_steps": plan.refresh_steps, "runtime_op_ms": profile.runtime.op_ms, **(extra_stats or {})}
    return result


def canonical_steps(tg: TaskGraph) -> dict[int, list[list[Op]]]:
    return {q: [[t.op for t in step] for step in steps] for q, steps in tg.canonical.items()}


def baseline_plan(profile: Profile, cfg: PipelineConfig, *, check_memory: bool = True,
                  graphs: TaskGraphs | None = None) -> tuple[Plan, ReplayResult]:
    """The family's plan without K-FAC: the bubble baseline."""
    base_cfg = replace(cfg, optimizer="adamw", defer_stats=False, refresh_steps=1)
    tg = build_task_graph(profile, base_cfg, graphs=graphs)
    plan = assemble(profile, tg, canonical_steps(tg), "none")
    result = finish(plan, profile, {"solver_status": "fixed", "gap": None, "solve_seconds": 0.0,
                                    "refresh_steps_lower_bound": 1}, check_memory=check_memory)
    return plan, result


def add_baseline_stats(plan: Plan, baseline: ReplayResult) -> None:
    b = baseline.step_time_ms
    plan.stats["baseline_step_time_ms"] = round(b, 6)
    plan.stats["baseline_utilization"] = round(baseline.utilization, 6)
    plan.stats["step_overhead"] = round(plan.stats["step_time_ms"] / b - 1, 6) if b > 0 else None


def appended_plan(profile: Profile, cfg: PipelineConfig, extra_stats: dict | None = None, *,
                  graphs: TaskGraphs | None = None, where: str = "<plan>") -> tuple[Plan, ReplayResult]:
    """Method "none" with an optimizer: the family's order, and the work of the whole refresh
    cycle (cfg.refresh_steps) after the first step's own ops (appended_steps), replayed."""
    tg = build_task_graph(profile, cfg, graphs=graphs)
    plan = assemble(profile, tg, appended_steps(tg), "none")
    return plan, finish(plan, profile, {"solver_status": "fixed", "gap": None, **(extra_stats or {})}, where=where)


def appended_steps(tg: TaskGraph) -> dict[int, list[list[Op]]]:
    """Method "none" with K-FAC: no bubble filling; the K-FAC work of the cycle runs after
    the step's own ops (k = 1), in one global dependency order (so every member of a
    collective reaches it in the same order)."""
    import networkx as nx

    steps = {q: [list(ops) for ops in s] for q, s in canonical_steps(tg).items()}
    units = tg.unit_graph(tg.floating_tasks())
    for unit in nx.lexicographical_topological_sort(units, key=lambda u: (u[0].op.kind, u[0].op, u[0].rank)):
        for t in unit:
            steps[t.rank][0].append(t.op)
    return steps
