"""`pfcompile plan --method cpsat`: place the K-FAC work of a refresh cycle with CP-SAT.

A refresh cycle of k steps becomes a `Problem` (pfcompile.place.cycle_model: the task graph plus
the inversion choice, step boundaries, fixed order, memory capacity, glued sends/receives)
in integer microseconds; pfcompile.place.cpmodel minimises its makespan, i.e. the step time
makespan/k. Above GROUP_ABOVE curvature ops, the curvature ops one forward/backward
enables are one task (recorded in the plan's stats as `curvature_grouped`).

Each k is solved in three stages (`solve_cycle`), each warm-starting the next and each
stopping at a proven optimum: (1) the pipeline timeline, the k steps without refresh work
(its bound bounds the whole cycle too); (2) the refresh work packed into that timeline,
per-step tasks pinned (what it gives up: moving the pipeline to make room); (3) the whole
cycle, which may move everything. Warm starts: PipeFisher's greedy (its k only), list
schedules (pfcompile.place.list_schedule), the packing. The plan's stats say which stages ran.

k, lexicographically after the step time: try k = k_lb, k_lb+1, ... (k_lb: the K-FAC work
of one refresh over the bubble time per step on the most loaded rank, pfcompile.place.bounds)
and keep the FIRST k whose step time is within `tolerance` (0.5%) of the step time the
same k steps reach without any refresh work (the best any k can hope for: the refresh
then costs nothing), taken at its lower bound: a timeline searched only briefly is no
reference (a short search can leave it several percent above its optimum, and a k packed
as badly would pass); if no k up to max(k_lb + `extra_steps`, the greedy's k) gets
there, the k with the least step time (ties: the smaller k). A k whose lower bound is already
beyond that tolerance cannot be accepted: it gets its warm starts only and its search time
goes to the ks after it; if none is accepted, the best of them is searched with the time
left. With `total_time_limit`, each k gets what is left of it over the ks left. Under a
wall-clock limit (a Budget with a deadline) every k but the last gets its warm starts only
(the first k whose warm start is within the tolerance is accepted), then the best k is
searched with the time left.

The solution becomes per-rank op lists (sorted by model start), is assembled with
pfcompile.place.assemble and replayed by pfcompile.check.replay like every plan.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from pfcompile.check.replay import ReplayError, ReplayResult, replay
from pfcompile.formats.errors import InputError
from pfcompile.formats.plan import Plan
from pfcompile.formats.profile import Profile
from pfcompile.graph.schedules import PipelineConfig
from pfcompile.graph.taskgraph import TaskGraph
from pfcompile.place import assemble
from pfcompile.place.bounds import Bounds, heads_and_tails, lower_bounds, refresh_steps_lower_bound_at
from pfcompile.place.budget import (
    REPLAY_S_PER_OP_GUESS,
    RESERVE_FIXED_S,
    RESERVE_REPLAYS,
    SPREAD_S_PER_OP_GUESS,
    Budget,
    least_expected_replay_ops,
)
from pfcompile.place.cpmodel import Result, solve
from pfcompile.place.cycle_model import (
    CycleModel,
    curvature_ops,
    cycle_from_graph,
    cycle_graph,
    memory_error,
    schedule_from_steps,
    steps_from_schedule,
)
from pfcompile.place.list_schedule import list_schedule
from pfcompile.place.options import Planning, PlanOptions
from pfcompile.place.problem import Schedule, violations


class NoScheduleFound(InputError):
    """No schedule within the limits found in the time given (none proven impossible)."""


# curvature ops per cycle above which a producer's curvature ops are one task. Grouping
# makes the model smaller but the packing coarse (ungrouped list schedules reach the
# rank-span bound where grouped ones stay several percent off), so only the largest cycles
# (32 x 128: 49152 curvature ops) are grouped; benchmarks/results/2026-11-30-planner-scaling.md
# has the ungrouped rows' gaps
GROUP_ABOVE = 30000
# the tight first-order baseline is small (proven optimal well within this) and only a reference
TIGHT_BASELINE_TIME_LIMIT_S = 10.0


# how one k's time limit is shared by its three stages (solve_cycle): the pipeline
# timeline is usually proven optimal at once, the whole cycle is where the search pays
STAGE_SHARES = {"pipeline timeline": 0.2, "packing": 0.3, "whole cycle": 0.5}
# the next k is tried only when the time left holds its graph and warm starts with this
# margin (the largest k so far is the estimate; a larger k takes longer)
NEXT_K_MARGIN = 1.2
# time kept for the greedy's gap when the plan falls back to it: its graph and bounds, with
# this margin over the largest graph built so far, and a replay's with NEXT_K_MARGIN
GREEDY_GAP_MARGIN = 1.3


def _group(profile: Profile, cfg: PipelineConfig, opts: PlanOptions) -> bool:
    if opts.group_curvature is not None:
        return opts.group_curvature
    return curvature_ops(profile, cfg) > GROUP_ABOVE


# --- one cycle length -----------------------------------------------------------------------


@dataclass
class CycleSolution:
    k: int
    cm: CycleModel
    result: Result
    schedule: Schedule
    bound: int  # best lower bound on the makespan (µs): the solver's or pfcompile.place.bounds'
    reference: int  # makespan of the same k steps without refresh work (µs)
    reference_bound: int  # its lower bound (µs): the k rule's reference (= reference when proven)
    hint_source: str  # where the returned schedule came from
    stages: list[str] = field(default_factory=list)
    lower: Bounds | None = None  # pfcompile.place.bounds' bounds of this k's problem
    searched: bool = True  # False: warm starts only (the k was out of the k rule's reach)

    @property
    def step_time_ms(self) -> float:
        return self.schedule.makespan / self.k / 1000

    @property
    def gap(self) -> float:
        mk = self.schedule.makespan
        return max(0.0, (mk - self.bound) / mk) if mk else 0.0


def solve_cycle(profile: Profile, cfg: PipelineConfig, k: int, opts: PlanOptions, planning: Planning, *,
                time_limit: float | None = None, greedy_steps: dict | None = None,
                unless_out_of_reach: bool = False, warm_only: bool = False) -> CycleSolution:
    """Three stages, each warm-starting the next, each stopping early at a proven optimum:
    (1) the pipeline timeline: the k steps without refresh work, on their own model (its
    bound is a lower bound of the whole cycle); (2) the refresh work packed into that
    timeline (per-step tasks pinned); (3) the whole model, which may move the pipeline to
    make room. `time_limit` (default `opts.time_limit`) is shared between them as
    STAGE_SHARES says. `unless_out_of_reach`: no
    search past the warm starts when the bound already puts this k's step time beyond the
    k rule's tolerance of its timeline (the k cannot be the one accepted; `searched` False).
    `warm_only`: no search past the warm starts whatever the bound says."""
    budget = planning.budget
    time_limit = opts.time_limit if time_limit is None else time_limit
    with budget.stage("graph"):
        tg = cycle_graph(profile, cfg, k, planning.graphs_of(profile))
        cm = cycle_from_graph(tg, fixed_order=opts.fixed_order, group_curvature=_group(profile, cfg, opts),
                              choose_inverter=cfg.inversion == "balanced", periodic=opts.steady_state)
        ref_cm = cycle_from_graph(tg, fixed_order=opts.fixed_order, refresh=False, periodic=opts.steady_state)
    err = memory_error(cm, opts.fixed_order)
    if err:
        raise err
    p = cm.problem
    head, tail = heads_and_tails(p)
    by_head = lambda i: (head[i], i)  # noqa: E731
    canon = _canonical_position(cm)
    report = _reporter(planning.describe, k, budget)

    def cpsat(problem, stage: str, **kw) -> Result:
        """One CP-SAT call within the command's budget (skipped when nothing is left)."""
        limit = budget.cap(STAGE_SHARES[stage] * time_limit)
        if limit <= 0:
            return Result("UNKNOWN", None, None, 0, 0.0)
        with budget.stage("solve"):
            return solve(problem, time_limit=limit, workers=opts.workers, deadline=budget.deadline_for_search(), **kw)

    # (1) the pipeline timeline (no search when a list schedule meets the bound: the rank
    # span bound is usually exact for the timeline alone)
    with budget.stage("warm start"):
        ref_head, _ = heads_and_tails(ref_cm.problem)
        ref_canon = _canonical_position(ref_cm)
        ref_hint = min((list_schedule(ref_cm.problem, order_key=lambda i: (ref_head[i], i)),
                        list_schedule(ref_cm.problem, order_key=lambda i: ref_canon.get(i, (ref_head[i], i)))),
                       key=lambda s: s.makespan)
        ref_lower = lower_bounds(ref_cm.problem).makespan
    if ref_hint.makespan <= ref_lower and not violations(ref_cm.problem, ref_hint):
        ref = Result("OPTIMAL", ref_hint, ref_hint.makespan, ref_hint.makespan, 0.0)
    else:
        ref = cpsat(ref_cm.problem, "pipeline timeline", hint=ref_hint, extra_bound=ref_lower, on_solution=report("pipeline"))
    if ref.status == "INFEASIBLE":  # activations alone do not fit (free order)
        raise memory_error(cm, opts.fixed_order, proven=True) or InputError(
            "--memory-limit", None, "the activations alone do not fit the limit")
    ref_sched = ref.schedule or ref_hint
    ref_bound = min(ref_sched.makespan, max(ref_lower, ref.bound))
    with budget.stage("warm start"):
        lower = lower_bounds(p)
    bound = max(lower.makespan, ref.bound)

    # candidates: the greedy, a list schedule, and (2) the packing into the timeline
    with budget.stage("warm start"):
        cands: list[tuple[str, Schedule]] = [
            ("list", list_schedule(p, first=cm.per_step, order_key=by_head)),
            ("canonical list", list_schedule(p, first=cm.per_step, order_key=lambda i: canon.get(i, (head[i], i)))),
            ("memory-lean list", list_schedule(p, order_key=_memory_lean_key(cm, canon, head)))]
        if p.choices:  # the inverting replicas chosen to balance the work, not by earliest finish
            balanced = balanced_options(p)
            cands.append(("balanced list", list_schedule(p, first=cm.per_step, order_key=by_head,
                                                         options=balanced)))
            # the work with the most after it first: on Chimera it packs closer to the bound
            # than earliest start does
            cands.append(("balanced list, longest tail first",
                          list_schedule(p, first=cm.per_step, order_key=lambda i: (-tail[i], i), options=balanced)))
        if greedy_steps is not None:
            h = schedule_from_steps(cm, greedy_steps)
            if h is not None:
                cands.append(("greedy", h))
        if cfg.defer_stats:
            h = _undeferred_warm_start(profile, cfg, k, opts, planning, cm)
            if h is not None:
                cands.append(("undeferred warm start", h))
        pinned = {cm.index[t]: ref_sched.start[j] for j, t in enumerate(ref_cm.tasks)}
        packed = list_schedule(p, pinned=pinned, order_key=by_head)
        cands.append(("timeline+first-fit", packed))
    ok = [c for c in cands if not violations(p, c[1])]
    stages = ["pipeline timeline", "refresh packed into it"]
    if ok and (warm_only or unless_out_of_reach and bound > ref_bound * (1 + opts.tolerance)):
        source, best = min(ok, key=lambda c: c[1].makespan)
        status = "OPTIMAL" if best.makespan <= bound else "FEASIBLE"
        return CycleSolution(k, cm, Result(status, best, best.makespan, bound, 0.0), best, bound,
                             ref_sched.makespan, ref_bound, source, stages, lower, searched=False)
    if not ok or min(c[1].makespan for c in ok) > bound:
        pack = cpsat(p, "packing", hint=packed, pinned=pinned, extra_bound=bound, on_solution=report("packing"))
        if pack.schedule is not None:
            cands.append(("timeline+cpsat packing", pack.schedule))
            if not violations(p, pack.schedule):
                ok.append(cands[-1])
    source, best = min(ok or cands, key=lambda c: c[1].makespan)
    status = "FEASIBLE"

    # (3) the whole model, unless the packing is already within 0.01% of the bound
    if best.makespan - bound > 1e-4 * best.makespan:
        full = cpsat(p, "whole cycle", hint=best, extra_bound=bound, on_solution=report("whole cycle"))
        stages.append("whole cycle")
        if full.status == "INFEASIBLE":
            raise memory_error(cm, opts.fixed_order, proven=True) or InputError(
                "--memory-limit", None, f"no schedule with k={k} fits the limit")
        bound = max(bound, full.bound)
        if full.schedule is not None and full.schedule.makespan < best.makespan:
            source, best = "whole-cycle cpsat", full.schedule
    if not ok and violations(p, best):
        raise NoScheduleFound("--memory-limit", None, f"no schedule found within the time limit (k tried up to {k})")
    if best.makespan <= bound:
        status = "OPTIMAL"
    result = Result(status, best, best.makespan, bound, 0.0)
    return CycleSolution(k, cm, result, best, bound, ref_sched.makespan, ref_bound, source, stages, lower)


def _undeferred_warm_start(profile: Profile, cfg: PipelineConfig, k: int, opts: PlanOptions, planning: Planning,
                           cm: CycleModel) -> Schedule | None:
    """The best warm start of the same k without deferred statistics, as a schedule of the
    deferred model (an undeferred order is a deferred one too). The list schedules start a
    deferred `stats` as soon as it is ready, at its step's start, where on the first stage
    it delays every pass; the undeferred order keeps it after the gradient."""
    plain = solve_cycle(profile, replace(cfg, defer_stats=False), k, opts, planning, time_limit=0.0, warm_only=True)
    return schedule_from_steps(cm, steps_from_schedule(plain.cm, plain.schedule))


def balanced_options(p) -> set[int]:
    """One option per choice, longest first, each to the option that leaves its busiest
    rank least loaded (LPT over every rank's mandatory work): the list scheduler's own
    pick (the earliest finish) piles the inversions on the replica that is free first,
    and a periodic cycle is as long as its most loaded rank."""
    load: dict = {}
    for i, o in enumerate(p.option):
        if o is None:
            load[p.resource[i][0]] = load.get(p.resource[i][0], 0) + p.dur[i]
    by_opt = p.option_tasks()
    work = {o: sum(p.dur[i] for i in ts) for o, ts in by_opt.items()}
    taken = set()
    for c in sorted(p.choices, key=lambda c: (-max(work[o] for o in c), c)):
        def busiest_after(o: int) -> int:
            add: dict = {}
            for i in by_opt[o]:
                add[p.resource[i][0]] = add.get(p.resource[i][0], 0) + p.dur[i]
            return max((load.get(r, 0) + d for r, d in add.items()), default=0)
        o = min(c, key=busiest_after)
        taken.add(o)
        for i in by_opt[o]:
            load[p.resource[i][0]] = load.get(p.resource[i][0], 0) + p.dur[i]
    return taken


def _canonical_position(cm: CycleModel) -> dict[int, tuple]:
    """(step, position in the family's op list of its rank) of every per-step task: the
    list scheduler's priority that reproduces the family's order (precond at the end)."""
    out = {}
    for steps in cm.tg.canonical.values():
        for t, step in enumerate(steps):
            for pos, task in enumerate(step):
                if task in cm.index:
                    out[cm.index[task]] = (t, pos, 0)
    return out


def _memory_lean_key(cm: CycleModel, canon: dict[int, tuple], head: list[int]):
    """The family's order with each curvature op straight after the op that made its kept
    tensor and each W pass straight after its B (the least memory, as in
    smallest_feasible_limit); the rest of the refresh after the cycle's per-step work."""
    k = cm.tg.refresh_steps
    lean = dict(canon)
    for a, b, _ in cm.problem.edges:  # a split backward's W right after its B
        if cm.tasks[b].op.kind == "bwd_weight" and cm.tasks[a].op.kind == "bwd_input" and a in canon:
            t, pos, _ = canon[a]
            lean[b] = (t, pos, 0, 1)
    pred = {}
    micro_batch_kinds = {d.kind for d in cm.tg.cfg.optimizer_spec.micro_batch_ops}
    for a, b, _ in cm.problem.edges:
        # the producer latest in the order (split backward: curv_b follows both B and W)
        if cm.tasks[b].op.kind in micro_batch_kinds and a in lean and (b not in pred or lean[a] > lean[pred[b]]):
            pred[b] = a

    def key(i: int) -> tuple:
        if i in lean:
            return lean[i]
        if i in pred:
            return lean[pred[i]][:2] + (2, i)
        return (k, head[i], 0, i)
    return key


def _reporter(describe, k: int, budget: Budget):
    """Progress a user can read on long solves: the best step time so far, the bound, the
    gap, and the seconds left of the command's limit."""
    def stage(name: str):
        def on_solution(sec, obj, bound):
            if describe:
                gap = (obj - bound) / obj if obj else 0.0
                left = budget.left() + budget.reserve
                describe(f"cpsat k={k} {name}: best {obj / k / 1000:.2f} ms/step, bound {bound / k / 1000:.2f}, "
                         f"gap {gap:.2%}" + (f", {left:.0f} s left" if left != float("inf") else ""))
        return on_solution
    return stage


# --- the plan: the k search, the fall-back, the stats -------------------------------------


def solve_plan(profile: Profile, cfg: PipelineConfig, options: PlanOptions | None = None,
               planning: Planning | None = None) -> Plan:
    """The CP-SAT plan: k searched upwards from its lower bound (module docstring), the
    solution replayed; stats carry status, bound, gap and the k search."""
    return solve_plan_replayed(profile, cfg, options, planning)[0]


@dataclass
class WarmStart:
    """PipeFisher's greedy plan of this configuration: the first warm start and the bar the
    solver must beat. `replayed`: its op lists as a plan in the solver's form, replayed (None
    when it is not a candidate: no K-FAC, another k asked for, or over the memory limit)."""

    tg: TaskGraph
    steps: dict
    info: dict
    replayed: tuple[Plan, ReplayResult] | None = None

    @property
    def k(self) -> int:
        return len(next(iter(self.steps.values())))


@dataclass
class KSearch:
    """What the k search tried, and what it learnt of this machine's speed on the way."""

    tried: list[CycleSolution] = field(default_factory=list)
    accepted: bool = False
    python_per_k: float = 0.0  # the most seconds of graph and warm starts one k took
    graph_per_k: float = 0.0  # of which the graph and the model
    failure: NoScheduleFound | None = None

    def best(self) -> CycleSolution:
        return min(self.tried, key=lambda s: (round(s.step_time_ms, 3), s.k))


def solve_plan_replayed(profile: Profile, cfg: PipelineConfig, options: PlanOptions | None = None,
                        planning: Planning | None = None, *,
                        first_order_step_ms: float | None = None) -> tuple[Plan, ReplayResult]:
    """`solve_plan` and the plan's replay (-> (plan, replay result)). `first_order_step_ms`:
    the best first-order step time, the k lower bound's aim (None: solved here)."""
    opts = options or PlanOptions()
    planning = planning or Planning()
    budget = planning.budget
    t0 = time.perf_counter()
    warm = warm_start(profile, cfg, opts, planning)
    keep_time_for_the_plan(budget, warm, opts, spread=profile.runtime.has_spread())
    k_lb, target = k_lower_bound(profile, cfg, opts, planning, warm, first_order_step_ms)
    ks = ks_to_try(opts, k_lb, warm.k)
    search = search_k(profile, cfg, opts, planning, ks, warm)
    best = search.best()
    steps = steps_from_schedule(best.cm, best.schedule)
    tg = replace(best.cm.tg, cfg=replace(cfg, refresh_steps=best.k))
    plan = assemble.assemble(profile, tg, steps, "cpsat", fixed_order=opts.fixed_order)
    stats = solver_stats(profile, cfg, opts, best, search, k_lb, target,
                         solve_seconds=time.perf_counter() - t0, greedy_info=warm.info)
    with budget.stage("replay"):
        t_replay = time.monotonic()
        result = assemble.finish(plan, profile, stats)
        t_replay = time.monotonic() - t_replay
        if warm.replayed is not None:
            plan, result = no_worse_than_greedy(profile, plan, result, warm.replayed, search.tried, opts)
    # (the check on writing that follows takes about a replay)
    if plan.stats.get("fell_back_to_greedy") and plan.stats.get("gap") is None and \
            budget.left() + budget.reserve > GREEDY_GAP_MARGIN * search.graph_per_k + NEXT_K_MARGIN * t_replay:
        # the greedy's k was not searched: its gap against the bounds of its own cycle (a
        # graph and bounds, no search), when the time left holds them
        with budget.stage("graph"):
            greedy_gap(profile, cfg, plan, opts, planning)
    plan.stats["stage_seconds"] = budget.report()
    planning.report(len(ks), len(ks))
    return plan, result


def warm_start(profile: Profile, cfg: PipelineConfig, opts: PlanOptions, planning: Planning) -> WarmStart:
    """The greedy's plan, and its replay when it is a candidate: replayed now rather than
    after the search, so that the search's deadline already counts it (the limit is hard)."""
    from pfcompile.place.greedy import CycleTooLong, greedy_steps

    budget, graphs = planning.budget, planning.graphs_of(profile)
    with budget.stage("warm start"):
        try:
            warm = WarmStart(*greedy_steps(profile, cfg, graphs=graphs))
        except CycleTooLong as e:
            # bubbles too small for the K-FAC work (a zero-bubble pipeline, a short one): start
            # from it appended to the step; CP-SAT then stretches the step, k from the k rule
            tg, steps, info = greedy_steps(profile, cfg, bubbles=False, graphs=graphs)
            warm = WarmStart(tg, steps, {**info, "bubbles_too_small": e.short})
    if cfg.optimizer_work and opts.fall_back_to_greedy and opts.refresh_steps in (None, warm.k):
        with budget.stage("replay"):
            warm.replayed = _replay_greedy(profile, cfg, warm, opts)
    return warm


def keep_time_for_the_plan(budget: Budget, warm: WarmStart, opts: PlanOptions, *, spread: bool = False) -> None:
    """Reserve the seconds that assembling and replaying the plan and the check on writing it
    (about one and a half replays) take after the search, plus a margin, at the seconds per
    op this run's first replay took (the machine's load counts); with `spread` (the profile
    has an op-time spread) also the expected step time's least replay (EXPECTED_STEP_MIN_STEPS
    steps, at most EXPECTED_STEP_MAX_OPS drawn op instances) at this run's measured cost per
    drawn op, so a search that uses its whole share still leaves the plan that figure, and
    its baseline's over as many steps (fewer ops: at most as long)."""
    ops = sum(len(ops) for steps in warm.steps.values() for ops in steps) / warm.k
    per_op = budget.replay_s_per_op or REPLAY_S_PER_OP_GUESS
    cycle = max(warm.k, opts.refresh_steps or 1, 2)
    reserve = RESERVE_FIXED_S + RESERVE_REPLAYS * per_op * ops * cycle
    if spread:
        drawn = least_expected_replay_ops(cycle, max(1, round(ops * cycle)))
        reserve += 2 * drawn * (budget.spread_s_per_op or SPREAD_S_PER_OP_GUESS)
    budget.reserve = max(budget.reserve, reserve)


def k_lower_bound(profile: Profile, cfg: PipelineConfig, opts: PlanOptions, planning: Planning, warm: WarmStart,
                  first_order_step_ms: float | None) -> tuple[int, float | None]:
    """-> (k_lb, the first-order step time it aims at): below k_lb no plan runs at the best
    first-order step time (pfcompile.place.bounds). Without K-FAC, (1, None)."""
    if not cfg.optimizer_work:
        return 1, None
    target = first_order_step_ms
    if target is None:  # the tight first-order plan (small: proven optimal in well under a second)
        target = tight_baseline(profile, cfg, opts, planning).stats["step_time_ms"]
    return refresh_steps_lower_bound_at(warm.info["refresh_work_ms"], warm.info["step_work_ms"], target), target


def tight_baseline(profile: Profile, cfg: PipelineConfig, options: PlanOptions | None = None,
                   planning: Planning | None = None) -> Plan:
    """The best first-order plan of the family: the family's forward/backward order with its
    gradient syncs, sends and receives placed by the same CP-SAT machinery. The canonical
    baseline posts every sync at the end of the step; moving a stage's sync into a bubble
    is free speed that K-FAC plans get too, so an overhead measured against the canonical
    plan partly credits K-FAC with it. In the family's order whatever `options` say (the
    baseline is of the family), within TIGHT_BASELINE_TIME_LIMIT_S."""
    options = options or PlanOptions()
    first_order = PlanOptions(method="cpsat", time_limit=min(options.time_limit, TIGHT_BASELINE_TIME_LIMIT_S),
                              workers=options.workers, fixed_order=True)
    planning = planning or Planning()  # its budget and graphs, not its progress reports
    return solve_plan(profile, replace(cfg, optimizer="adamw", defer_stats=False, memory_limit_bytes=None), first_order,
                      Planning(budget=planning.budget, graphs=planning.graphs))


def ks_to_try(opts: PlanOptions, k_lb: int | None, k_greedy: int) -> list[int]:
    """The ks in the order the k rule tries them: the asked-for k alone, else from the bound
    (or the greedy's k when it is below: a slower step holds more refresh work) up to
    max(that + `extra_steps`, the greedy's k)."""
    if opts.refresh_steps:
        return [opts.refresh_steps]
    k_first = min(k_lb or k_greedy, k_greedy)
    return list(range(k_first, max(k_first + opts.extra_steps, k_greedy) + 1))


def search_k(profile: Profile, cfg: PipelineConfig, opts: PlanOptions, planning: Planning, ks: list[int],
             warm: WarmStart) -> KSearch:
    """Try each k in turn (module docstring: the k rule) and, if none is accepted, search the
    best of those that got their warm starts only with the time left."""
    budget = planning.budget
    search = KSearch()
    t_loop = time.perf_counter()

    def time_limit(n_left: int) -> float:
        """One k's time limit: what is left of the total over the ks left, and under the
        command's wall-clock limit, no more than its share of what is left."""
        limit = opts.time_limit
        if opts.total_time_limit:
            limit = max(0.0, opts.total_time_limit - (time.perf_counter() - t_loop)) / n_left
        if budget.deadline is not None and n_left > 1:
            limit = min(limit, max(0.0, budget.left()) / n_left)  # the first k must not take it all
        return limit

    # under a wall-clock limit the ks cannot all be searched (at the largest sizes the graph
    # and warm starts of one k take tens of seconds): every k but the last gets its warm
    # starts only (which often meet the bound: the k is then accepted at once)
    warm_first = budget.deadline is not None
    kept_for_greedy_gap = False
    for n, k in enumerate(ks):
        planning.report(n, len(ks))
        python_s = budget.seconds["graph"] + budget.seconds["warm start"]
        graph_s = budget.seconds["graph"]
        if search.tried and budget.deadline is not None and budget.left() < NEXT_K_MARGIN * search.python_per_k:
            break  # the next k's graph and warm start alone would not fit in what is left
        try:
            sol = solve_cycle(profile, cfg, k, opts, planning, time_limit=time_limit(len(ks) - n),
                              greedy_steps=warm.steps if k == warm.k else None,
                              unless_out_of_reach=n + 1 < len(ks), warm_only=warm_first and n + 1 < len(ks))
        except NoScheduleFound as e:  # not proven impossible: a longer cycle may still be found
            search.failure = e
            continue
        search.tried.append(sol)
        search.python_per_k = max(search.python_per_k,
                                  budget.seconds["graph"] + budget.seconds["warm start"] - python_s)
        search.graph_per_k = max(search.graph_per_k, budget.seconds["graph"] - graph_s)
        if warm.replayed is not None and not kept_for_greedy_gap and budget.deadline is not None:
            # should the plan fall back to the greedy's k without it being searched, its gap
            # needs that k's graph and bounds after the search: keep the time for them
            budget.reserve += GREEDY_GAP_MARGIN * search.graph_per_k
            kept_for_greedy_gap = True
        if sol.schedule.makespan <= sol.reference_bound * (1 + opts.tolerance):
            search.accepted = True
            break
        if budget.left() <= 0:  # the command's time is up: keep the best k found so far
            break
    if not search.tried:
        raise search.failure
    if not search.accepted and budget.left() > NEXT_K_MARGIN * search.python_per_k:
        lead = search.best()
        if not lead.searched:  # its graph and warm starts again, then a search with the time left
            again = solve_cycle(profile, cfg, lead.k, opts, planning, time_limit=time_limit(1),
                                greedy_steps=warm.steps if lead.k == warm.k else None)
            search.tried[search.tried.index(lead)] = again
    return search


def solver_stats(profile: Profile, cfg: PipelineConfig, opts: PlanOptions, best: CycleSolution, search: KSearch,
                 k_lb: int, target: float | None, *, solve_seconds: float, greedy_info: dict) -> dict:
    """The plan's stats from the solver: status, bounds, gap, the k search and how it ran."""
    return {
        "solver_status": best.result.status,
        "objective_step_time_ms": round(best.step_time_ms, 6),
        "best_bound_step_time_ms": round(best.bound / best.k / 1000, 6),
        "gap": round(best.gap, 6),
        "solve_seconds": round(solve_seconds, 3),
        "refresh_steps_lower_bound": k_lb,
        "refresh_steps_bound_step_time_ms": None if target is None else round(target, 6),
        "lower_bounds_ms": best.lower.as_dict(1 / 1000 / best.k),
        "solution_from": best.hint_source,
        "k_search": [{"k": s.k, "step_time_ms": round(s.step_time_ms, 3), "status": s.result.status,
                      "gap": round(s.gap, 6), "no_refresh_step_time_ms": round(s.reference / s.k / 1000, 3),
                      "no_refresh_bound_step_time_ms": round(s.reference_bound / s.k / 1000, 3)}
                     for s in search.tried],
        "k_rule": (f"first k from the lower bound whose step time is within {opts.tolerance:.1%} of the same "
                   f"k steps without refresh work (at their lower bound); else the least step time"),
        "curvature_grouped": _group(profile, cfg, opts),
        "decomposition": " -> ".join(best.stages) + (
            "" if "whole cycle" in best.stages else
            " (stopped early: the packing reached the bound, nothing given up)" if best.gap == 0 else
            " (the pipeline was not moved to make room for K-FAC work)"),
        "time_unit": "integer microseconds (rounding: optimal within 0.5 us per task on the critical path)",
        "workers": opts.workers, "time_limit_s": opts.time_limit, "total_time_limit_s": opts.total_time_limit,
        "tasks_model": best.cm.problem.n,
        "fell_back_to_greedy": False,
        # why the search started from the K-FAC work appended to the step, not in bubbles
        **({"bubbles_too_small": greedy_info["bubbles_too_small"]} if "bubbles_too_small" in greedy_info else {}),
    }


def _replay_greedy(profile: Profile, cfg: PipelineConfig, warm: WarmStart,
                   opts: PlanOptions) -> tuple[Plan, ReplayResult] | None:
    """The greedy's op lists as a plan (the solver's method and order), replayed; None if
    over the memory limit (the greedy has no memory model)."""
    other = assemble.assemble(profile, replace(warm.tg, cfg=replace(cfg, refresh_steps=warm.k)), warm.steps, "cpsat",
                              fixed_order=opts.fixed_order)
    try:
        return other, replay(other, profile)
    except ReplayError:
        return None


def no_worse_than_greedy(profile: Profile, plan: Plan, replayed: ReplayResult, greedy_replayed: tuple[Plan, ReplayResult],
                         tried: list[CycleSolution], opts: PlanOptions) -> tuple[Plan, ReplayResult]:
    """The greedy's plan if it is faster than what the solver found in its time (grouped
    curvature cannot take the greedy's split placement as a warm start): the planner then
    never returns worse than the baseline it is compared with."""
    other, result = greedy_replayed
    k = other.refresh_steps
    ours = plan.stats["step_time_ms"]
    faster = result.step_time_ms < ours - 1e-9
    as_fast_fewer_steps = result.step_time_ms <= ours * (1 + 1e-6) and k < plan.refresh_steps
    if not (faster or as_fast_fewer_steps):
        return plan, replayed
    same_k = [s for s in tried if s.k == k]
    mk = (result.steady_cycle_time_ms if opts.steady_state else result.cycle_time_ms) * 1000
    gap = max(0.0, (mk - same_k[0].bound) / mk) if same_k else None
    # within rounding of a proven optimum (µs durations, 1 µs floors) the optimum stands
    status = same_k[0].result.status if same_k and gap is not None and gap <= 1e-4 else "FEASIBLE"
    stats = {**plan.stats, "solver_status": status, "gap": None if gap is None else round(gap, 6),
             "solution_from": "greedy (the solver found no faster plan within its time limit)",
             "fell_back_to_greedy": True,
             "objective_step_time_ms": round(result.step_time_ms, 6),
             "best_bound_step_time_ms": round(same_k[0].bound / k / 1000, 6) if same_k else None}
    for key in ("utilization", "utilization_pipefisher", "utilization_pipefisher_mean", "utilization_strict",
                "step_time_ms", "step_time_from_idle_ms", "cycle_time_ms", "steady_cycle_time_ms", "busy_ms",
                "idle_ms", "peak_memory_bytes", "tasks", "refresh_steps"):
        stats.pop(key, None)
    return other, assemble.finish(other, profile, stats, replayed=result)


def greedy_gap(profile: Profile, cfg: PipelineConfig, plan: Plan, opts: PlanOptions, planning: Planning) -> None:
    """The greedy's plan's gap against pfcompile.place.bounds' lower bounds of its k's cycle
    (set in its stats: gap, best_bound_step_time_ms, lower_bounds_ms)."""
    k = plan.refresh_steps
    cm = cycle_from_graph(cycle_graph(profile, cfg, k, planning.graphs_of(profile)), fixed_order=opts.fixed_order,
                          group_curvature=_group(profile, cfg, opts), choose_inverter=cfg.inversion == "balanced",
                          periodic=opts.steady_state)
    lower = lower_bounds(cm.problem)
    mk = plan.stats["step_time_ms"] * k * 1000
    plan.stats["gap"] = round(max(0.0, (mk - lower.makespan) / mk), 6) if mk else 0.0
    plan.stats["best_bound_step_time_ms"] = round(lower.makespan / k / 1000, 6)
    plan.stats["lower_bounds_ms"] = lower.as_dict(1 / 1000 / k)
