"""build_plan: profile + pipeline configuration + options -> a replayed plan, by any method.

The one entry point of planning that the CLI, the tests, the benchmarks and the examples
all call. The methods: "none" (the family's order, K-FAC appended to each step), "greedy"
(PipeFisher's first-fit into the bubbles) and "cpsat" (pfcompile.place.solver).
"""

from __future__ import annotations

import time
from dataclasses import replace

from pfcompile.check.replay import (
    EXPECTED_STEP_MAX_OPS,
    ReplayError,
    ReplayResult,
    expected_step_time,
    spread_replay_cycles,
)
from pfcompile.formats.errors import InputError
from pfcompile.formats.plan import Plan
from pfcompile.formats.profile import Profile
from pfcompile.graph.schedules import PipelineConfig
from pfcompile.place import assemble
from pfcompile.place.bounds import refresh_steps_lower_bound_at
from pfcompile.place.budget import SPREAD_S_PER_OP_GUESS, Budget, least_expected_replay_ops
from pfcompile.place.greedy import greedy_steps
from pfcompile.place.options import Planning, PlanOptions

# the share of the time left beyond the reserve that the expected step time (with the ops'
# spread) may take under a wall-clock limit, and the steps of the short drawn replay that
# measures what one drawn op instance costs on this machine before the search
EXPECTED_STEP_SHARE_OF_TIME_LEFT = 0.5
SPREAD_COST_PROBE_STEPS = 50


def build_plan(profile: Profile, cfg: PipelineConfig, options: PlanOptions | None = None, *,
               where: str = "<plan>", planning: Planning | None = None) -> tuple[Plan, ReplayResult, ReplayResult]:
    """The plan of `cfg` as `options` ask (pfcompile.place.options.PlanOptions), replayed.

    -> (plan, replay result of the plan, replay result of the first-order baseline).
    `planning`: the run's budget, progress reports and task graphs (a fresh one without a
    limit when None). With `cfg.cluster`, the ranks are first put on the nodes
    (`options.placement`; the plan's stats["placement"] says what and why). The plan also
    has the step time with the profile's op-time spread (stats.expected_step_time_ms), and
    the overhead over its baseline with it (stats.expected_step_overhead), where the profile
    has one. `options.partition` "auto" chooses the stages' cut with the
    plan (pfcompile.place.partition); otherwise `cfg.partition` (None: the compute cut)."""
    options = options or PlanOptions()
    planning = planning or Planning()
    planning.graphs_of(profile)
    if options.partition == "auto":
        from pfcompile.place.partition import choose_partition

        def plan_cut(c: PipelineConfig, p: Planning):
            return _plan_cut(profile, c, options, where, p)

        plan, result, baseline = choose_partition(profile, cfg, options, where, planning, plan_cut)
    else:
        plan, result, baseline = _plan_cut(profile, cfg, options, where, planning)
    _add_expected_step_time(plan, profile, planning)
    planning.baselines.clear()  # the candidates' baselines: only the kept plan's was wanted
    return plan, result, baseline


def _plan_cut(profile: Profile, cfg: PipelineConfig, options: PlanOptions, where: str,
              planning: Planning) -> tuple[Plan, ReplayResult, ReplayResult]:
    """The plan of `cfg`'s partition, in the division of the preconditioning `options` asks."""
    if options.precond == "auto":
        return _best_division(profile, cfg, options, where, planning)
    if options.precond is not None:
        cfg = replace(cfg, precond=options.precond)
    return _build_division(profile, cfg, options, where, planning)


def _best_division(profile: Profile, cfg: PipelineConfig, options: PlanOptions, where: str,
                   planning: Planning) -> tuple[Plan, ReplayResult, ReplayResult]:
    """precond "auto": plan with every replica preconditioning every layer, with PipeFisher's
    split and with the layers divided one by one, and keep the fastest (then the smaller k)."""
    if not (cfg.optimizer_spec.divisible and cfg.replicas > 1) or options.method == "none":
        return _build_division(profile, replace(cfg, precond="all"), options, where, planning)
    budget = planning.budget
    tried, skipped, longest = [], [], 0.0
    divisions = ("all", "split", "layers")
    for n, division in enumerate(divisions):
        # under a wall-clock limit a division gets an equal share of what is left, and is
        # tried only if that holds the Python (graph, warm starts, replay) of the longest so
        # far: the limit is hard, and only the search stops at its share
        if tried and budget.left() < longest:
            skipped.append(division)
            continue
        t0, searched = time.monotonic(), budget.seconds["solve"]
        with budget.share(1 / (len(divisions) - n)):
            tried.append(_build_division(profile, replace(cfg, precond=division), options, where, planning))
        longest = max(longest, time.monotonic() - t0 - (budget.seconds["solve"] - searched))
    best = min(tried, key=lambda t: (round(t[0].stats["step_time_ms"], 3), t[0].refresh_steps))
    best[0].stats["precond_auto"] = {t[0].config.precond_division: round(t[0].stats["step_time_ms"], 3)
                                     for t in tried}
    if skipped:
        best[0].stats["precond_auto_skipped"] = skipped  # not tried: the time limit would not hold them
    return best


def _add_expected_step_time(plan: Plan, profile: Profile, planning: Planning) -> None:
    """The step a run sees with the ops' measured spread (check.replay.expected_step_time),
    and for a plan with an optimizer's work, its first-order baseline's over as many steps
    with the same draws' seed: the overhead a run sees (stats.expected_step_overhead). A
    plan with less slack pays more for the same spread, so this is mostly above
    step_overhead where the work fills the bubbles. Both are Monte Carlo figures, replayed
    over at least EXPECTED_STEP_MIN_STEPS steps (at most EXPECTED_STEP_MAX_OPS op
    instances): a few refresh cycles would publish one slow or fast draw as the plan's step.
    Under a wall-clock limit, that least replay is what the search's reserve kept for the
    plan and its baseline (solver.keep_time_for_the_plan), and more steps only as a share of
    the time the search left beyond the reserve, at this run's measured cost per drawn op."""
    tasks = plan.stats.get("tasks", 0)
    least = least_expected_replay_ops(plan.refresh_steps, tasks)
    cap = EXPECTED_STEP_MAX_OPS
    budget = planning.budget
    if budget.deadline is not None:
        spare = EXPECTED_STEP_SHARE_OF_TIME_LEFT * max(0.0, budget.left())
        per_op = budget.spread_s_per_op or SPREAD_S_PER_OP_GUESS
        cap = min(cap, least + int(spare / (2 * per_op)))  # the plan's replay and its baseline's
    if cap < least:  # a plan too large for even its shortest replay under the cap
        return
    steps = plan.refresh_steps * spread_replay_cycles(plan.refresh_steps, tasks, max_instances=cap)
    expected = expected_step_time(plan, profile, steps=steps, max_instances=cap)
    if expected is None:
        return
    plan.stats["expected_step_time_ms"] = round(expected, 6)
    plan.stats["expected_step_replay_steps"] = steps  # the Monte Carlo's length: its figures' precision
    base = planning.baselines.get(id(plan))
    if base is None:  # AdamW: the plan is its own baseline
        return
    # the baseline's cycle is one step of fewer ops: the plan's steps cost it less than the plan
    expected_base = expected_step_time(base, profile, steps=steps, max_instances=steps * base.stats.get("tasks", 0))
    plan.stats["expected_baseline_step_time_ms"] = round(expected_base, 6)
    plan.stats["expected_step_overhead"] = round(expected / expected_base - 1, 6)


def _measure_spread_cost(base_plan: Plan, profile: Profile, budget: Budget) -> None:
    """What one drawn op instance of the expected step's replay costs on this machine now
    (budget.spread_s_per_op), from a short drawn replay of the baseline: the search's
    reserve keeps the expected step's least replay at this cost (its fixed work counted in,
    so the figure errs long)."""
    tasks = max(1, base_plan.stats.get("tasks", 1))
    t = time.perf_counter()
    expected_step_time(base_plan, profile, steps=SPREAD_COST_PROBE_STEPS)
    cycles = spread_replay_cycles(base_plan.refresh_steps, tasks, SPREAD_COST_PROBE_STEPS)
    budget.spread_s_per_op = (time.perf_counter() - t) / (cycles * tasks)


def _build_division(profile: Profile, cfg: PipelineConfig, options: PlanOptions, where: str,
                    planning: Planning) -> tuple[Plan, ReplayResult, ReplayResult]:
    """One division of the preconditioning: place the ranks on the nodes, then plan."""
    placed = None
    if cfg.cluster is not None and cfg.rank_map is None:  # where the family's ranks go on the nodes
        from pfcompile.place.topology import choose_rank_map

        rank_map, placed = choose_rank_map(profile, cfg, search=options.placement == "auto")
        cfg = replace(cfg, rank_map=rank_map)
    plan, result, baseline = _build_plan(profile, cfg, options, where, planning)
    if placed is not None:
        plan.stats["placement"] = placed
    return plan, result, baseline


def _build_plan(profile: Profile, cfg: PipelineConfig, options: PlanOptions, where: str,
                planning: Planning) -> tuple[Plan, ReplayResult, ReplayResult]:
    method, refresh_steps, budget = options.method, options.refresh_steps, planning.budget
    graphs = planning.graphs_of(profile)
    if refresh_steps is not None and (method != "cpsat" or not cfg.optimizer_work):
        raise InputError("--refresh-steps", None, "a fixed k needs --method cpsat with K-FAC "
                         "(the greedy's k is what its first fit needs)")
    t0 = time.perf_counter()
    # the baseline is only a reference here: the memory limit applies to the plan made
    t_base = time.perf_counter()
    base_plan, baseline = assemble.baseline_plan(profile, cfg, check_memory=not cfg.optimizer_work, graphs=graphs)
    # what a replay costs on this machine now: the budget's reserve scales with it
    budget.replay_s_per_op = (time.perf_counter() - t_base) / max(1, base_plan.stats.get("tasks", 1))
    if budget.deadline is not None and budget.spread_s_per_op is None and profile.runtime.has_spread():
        _measure_spread_cost(base_plan, profile, budget)
    # the best first-order plan of the family: the tight baseline, and the step time the k
    # lower bound aims at
    tight = tight_baseline(profile, cfg, options, planning) if cfg.optimizer_work else None
    first_order_ms = min(tight.stats["step_time_ms"], baseline.step_time_ms) if tight else baseline.step_time_ms
    if not cfg.optimizer_work and method != "cpsat":  # the family's order: nothing else to place
        plan, result = base_plan, baseline
    elif method == "none":
        plan, result = assemble.appended_plan(profile, replace(cfg, refresh_steps=1),
                                              {"solve_seconds": round(time.perf_counter() - t0, 3)},
                                              graphs=graphs, where=where)
    elif method == "greedy":
        plan, result = _greedy_plan(profile, cfg, first_order_ms, where, planning, t0)
    else:
        try:
            from pfcompile.place.solver import solve_plan_replayed
        except ImportError as e:
            raise InputError("--method cpsat", None, f"the CP-SAT planner is not available ({e})") from None
        plan, result = solve_plan_replayed(profile, cfg, options, planning, first_order_step_ms=first_order_ms)
        # a first-order plan: the family's F and B order with its free ops (a zero-bubble
        # family's W passes, syncs, sends) placed, kept where it is faster than the family's
        # order; an optimizer's plan gets this freedom too, so a comparison against AdamW in
        # the family's order would credit the optimizer with it
        if not cfg.optimizer_work and not result.step_time_ms < baseline.step_time_ms * (1 - 1e-6):
            plan, result = base_plan, baseline
    plan.stats.setdefault("refresh_steps_lower_bound", 1)
    assemble.add_baseline_stats(plan, baseline)
    if plan is not base_plan:  # its expected step, if this plan is the one kept
        planning.baselines[id(plan)] = base_plan
    if tight is not None:
        add_tight_baseline_stats(plan, tight)
    lb = plan.stats.get("refresh_steps_lower_bound")
    if refresh_steps is not None and lb is not None and refresh_steps < lb:
        slower = plan.stats["step_time_ms"] / first_order_ms - 1
        plan.stats["refresh_steps_note"] = (
            f"k={refresh_steps} is below the lower bound {lb}: no k={refresh_steps} plan runs at the best first-order "
            f"step time ({first_order_ms:.1f} ms); this one is {slower:.2%} slower than it")
    return plan, result, baseline


def _greedy_plan(profile: Profile, cfg: PipelineConfig, first_order_ms: float, where: str, planning: Planning,
                 t0: float) -> tuple[Plan, ReplayResult]:
    """PipeFisher's first fit, replayed; its gap is on k, against the k lower bound."""
    tg, steps, info = greedy_steps(profile, cfg, progress=planning.progress, graphs=planning.graphs_of(profile))
    plan = assemble.assemble(profile, tg, steps, "greedy")
    # below this k no plan runs at the best first-order step time (bounds.py)
    lb = refresh_steps_lower_bound_at(info["refresh_work_ms"], info["step_work_ms"], first_order_ms)
    k = len(next(iter(steps.values())))
    try:
        result = assemble.finish(plan, profile, {
            "solver_status": "greedy", "refresh_steps_lower_bound": lb,
            "tasks_after_last_step": info["tail_tasks"],  # K-FAC work no bubble could hold
            # greedy has no bound on its own objective; the gap is on k against the bound
            "gap": round(max(0, k - lb) / k, 6) if lb else None,
            "solve_seconds": round(time.perf_counter() - t0, 3)}, where=where)
    except ReplayError as e:
        if e.field == "config.memory_limit_bytes":  # PipeFisher's greedy has no memory model
            raise ReplayError(e.where, e.field, e.message + "; the greedy plans without memory, "
                              "try --method cpsat") from None
        raise
    return plan, result


def pareto(profile: Profile, cfg: PipelineConfig, options: PlanOptions | None = None, *,
           max_extra: int = 8, planning: Planning | None = None) -> list[Plan]:
    """CP-SAT plans for k = the k lower bound, +1, ... up to the first k whose step time does
    not fall below the previous one's (at most `max_extra` past the bound): what a
    shorter refresh cycle costs in step time."""
    # each k's plan keeps the configuration's division of the preconditioning
    options = replace(options or PlanOptions(), method="cpsat", precond=None)
    planning = planning or Planning()
    tight = tight_baseline(profile, cfg, options, Planning())
    first = min(tight.stats["step_time_ms"], assemble.baseline_plan(profile, cfg, check_memory=False)[1].step_time_ms)
    _, _, info = greedy_steps(profile, cfg)
    lb = refresh_steps_lower_bound_at(info["refresh_work_ms"], info["step_work_ms"], first) or 1
    plans: list[Plan] = []
    for k in range(lb, lb + max_extra + 1):
        planning.say(f"pareto: k={k}")
        plan, _, _ = build_plan(profile, cfg, replace(options, refresh_steps=k))
        plans.append(plan)
        if len(plans) > 1 and plan.stats["step_time_ms"] >= plans[-2].stats["step_time_ms"] * (1 - 1e-4):
            break
    return plans


def tight_baseline(profile: Profile, cfg: PipelineConfig, options: PlanOptions | None = None,
                   planning: Planning | None = None) -> Plan | None:
    """The best first-order plan of the family (pfcompile.place.solver.tight_baseline);
    None without OR-Tools."""
    try:
        from pfcompile.place.solver import tight_baseline as solve_tight_baseline
    except ImportError:
        return None
    return solve_tight_baseline(profile, cfg, options, planning)


def add_tight_baseline_stats(plan: Plan, tight: Plan) -> None:
    b = min(tight.stats["step_time_ms"], plan.stats["baseline_step_time_ms"])  # never looser than the canonical
    plan.stats["tight_baseline_step_time_ms"] = round(b, 6)
    plan.stats["tight_baseline_status"] = tight.stats.get("solver_status")
    plan.stats["step_overhead_tight"] = round(plan.stats["step_time_ms"] / b - 1, 6) if b > 0 else None
