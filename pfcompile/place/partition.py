"""`--partition auto`: the stage boundaries chosen with the plan.

A cut that balances forward and backward time (graph.partition.compute_partition) is
blind to the optimizer's work: which stage's per-step work lies on the step's critical
path, which ranks' bubbles can hold its refresh work, and what each rank must hold in
memory. Planning every cut is out of reach (24 blocks in 8 stages are 480,700 cuts), so
the cut is chosen in three rounds, each dearer per cut than the one before:

1. screen: from the compute cut and the even cut, a local search moves one part at a
   time from a stage to another (the stages between shifting by one) while the family's
   step gets faster. A cut's step is
   timed by place.upfront.family_step (the family's order with the optimizer's per-step
   work, in plain Python); a cut whose ranks cannot fit the memory limit in that order
   (place.upfront.order_peak_bytes) is dropped.
2. shortlist: the best screened cuts are planned by the greedy, which fills the bubbles
   with the refresh work the screen leaves out.
3. final: the method asked for (CP-SAT by default) plans the compute cut, the even cut
   and the best of the shortlist; the fastest plan is kept (then the smaller k, then the
   compute cut, the even cut, the searched ones), so auto is never slower than compute
   by the planner's own measure.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

from pfcompile.check.replay import ReplayResult
from pfcompile.formats.errors import InputError
from pfcompile.formats.plan import Plan
from pfcompile.formats.profile import Profile
from pfcompile.graph.partition import bounds_of, compute_partition, cut_at, even_partition, format_partition
from pfcompile.graph.schedules import PipelineConfig
from pfcompile.place import assemble
from pfcompile.place.budget import Budget
from pfcompile.place.greedy import greedy_steps
from pfcompile.place.options import Planning, PlanOptions
from pfcompile.place.upfront import check_memory, family_step, order_peak_bytes

# cuts the local search may time; a step costs milliseconds to time, so this bounds the
# screen to seconds on the largest configurations the limits admit
MAX_SCREENED = 4000
# the screen and the shortlist together take at most this share of the time left: the
# final plans, one CP-SAT run per finalist, are what the limit is for
SEARCH_SHARE_OF_TIME = 0.3
SHORTLIST = 4  # screened cuts the greedy plans
ALL_PAIRS_UP_TO = 16  # stages up to which the search moves a part between any two stages
FINALISTS = 4  # cuts the method asked for plans: compute, even and the best of the shortlist
# the compute cut, planned first, gets half the time left (the others share the rest and
# what it leaves): the cut that `--partition compute` plans alone must not lose for want of time
COMPUTE_SHARE_OF_TIME = 0.5
RULE_ORDER = ("compute", "even", "auto")  # the tie-break between equally fast plans


@dataclass
class Candidate:
    rule: str  # "compute", "even" or "auto" (found by the search)
    bounds: tuple[int, ...]
    screen_ms: float = math.inf  # the family's step with the per-step work (round 1)
    greedy_ms: float = math.inf  # the greedy's plan (round 2)


def choose_partition(profile: Profile, cfg: PipelineConfig, options: PlanOptions, where: str,
                     planning: Planning, plan_cut) -> tuple[Plan, ReplayResult, ReplayResult]:
    """The plan of the best cut (module doc); `plan_cut(cfg, planning)` plans one cut as
    the method asks. The plan's stats["partition_search"] says what was compared."""
    t0 = time.monotonic()
    budget = planning.budget
    search_deadline = None if budget.deadline is None else time.monotonic() + SEARCH_SHARE_OF_TIME * budget.left()
    starts = _starts(profile, cfg)
    planning.say("partition: screening cuts")
    screened = _screen(profile, cfg, starts, search_deadline, options.fixed_order)
    planning.say("partition: the greedy on the best cuts")
    shortlist = _shortlist(profile, cfg, starts, screened, search_deadline, planning)
    finalists = _finalists(starts, shortlist)
    search_s = time.monotonic() - t0
    planned: list[tuple[Candidate, tuple[Plan, ReplayResult, ReplayResult]]] = []
    refused: list[tuple[Candidate, str]] = []
    for i, cand in enumerate(finalists):
        planning.say(f"partition: planning cut {i + 1} of {len(finalists)} ({cand.rule})")
        share = COMPUTE_SHARE_OF_TIME if i == 0 and len(finalists) > 1 else 1 / (len(finalists) - i)
        child = Planning(budget=_share(budget, share), progress=planning.progress,
                         describe=planning.describe, graphs=planning.graphs, baselines=planning.baselines)
        try:
            planned.append((cand, plan_cut(replace(cfg, partition=cut_at(profile, cand.bounds)), child)))
        except InputError as e:  # over the memory limit, a cycle too long: this cut has no plan
            if len(finalists) - i == 1 and not planned:
                raise
            refused.append((cand, str(e)))
    cand, best = min(planned, key=lambda cp: (round(cp[1][0].stats["step_time_ms"], 3), cp[1][0].refresh_steps,
                                              RULE_ORDER.index(cp[0].rule)))
    best[0].stats["partition_search"] = {
        "chosen": cand.rule,
        "screened": len(screened),
        "seconds": round(time.monotonic() - t0, 3),
        "search_seconds": round(search_s, 3),
        "finalists": [{"rule": c.rule, "partition": format_partition(cut_at(profile, c.bounds)),
                       "screen_ms": _ms(c.screen_ms), "greedy_ms": _ms(c.greedy_ms),
                       "step_time_ms": round(p[0].stats["step_time_ms"], 6), "refresh_steps": p[0].refresh_steps,
                       "solver_status": p[0].stats.get("solver_status")} for c, p in planned],
        "refused": [{"rule": c.rule, "partition": format_partition(cut_at(profile, c.bounds)), "why": why}
                    for c, why in refused],
    }
    return best


def _ms(x: float) -> float | None:
    return None if math.isinf(x) else round(x, 6)


def _starts(profile: Profile, cfg: PipelineConfig) -> list[Candidate]:
    """The compute cut and, where every stage can hold a block, the even cut."""
    starts = [Candidate("compute", bounds_of(profile, compute_partition(profile, cfg.num_stages)))]
    try:
        even = bounds_of(profile, even_partition(profile, cfg.num_stages))
    except InputError:  # fewer blocks than stages: no even cut
        return starts
    if even != starts[0].bounds:
        starts.append(Candidate("even", even))
    return starts


def _screen_ms(profile: Profile, cfg: PipelineConfig, bounds: tuple[int, ...], fixed_order: bool) -> float:
    """The family's step of a cut with its per-step work; infinite where a rank cannot fit
    the memory limit: in the family's order (`fixed_order`), or in any order."""
    c = replace(cfg, partition=cut_at(profile, bounds))
    step = family_step(profile, c)
    if c.memory_limit_bytes is not None:
        if fixed_order and max(order_peak_bytes(step, c).values()) > c.memory_limit_bytes:
            return math.inf
        try:
            check_memory(step.costs, c)
        except InputError:
            return math.inf
    return step.step_ms


def _neighbours(bounds: tuple[int, ...], n_parts: int):
    """Every cut that moves one part from a stage to another, the stages between them
    shifting by one: next to each other, or (what a single boundary move cannot do without
    overloading a neighbour) from one end of the pipeline to anywhere. With at most
    ALL_PAIRS_UP_TO stages, from every stage to every other."""
    edges = (0, *bounds, n_parts)
    stages = len(edges) - 1
    pairs = [(a, b) for a in range(stages) for b in range(stages)
             if a != b and (stages <= ALL_PAIRS_UP_TO or abs(a - b) == 1 or {a, b} & {0, stages - 1})]
    for a, b in pairs:
        if edges[a + 1] - edges[a] < 2:  # stage a keeps at least one part
            continue
        if a < b:  # stage a's last part goes right: boundaries a .. b-1 move left
            yield tuple(x - 1 if a <= i < b else x for i, x in enumerate(bounds))
        else:  # stage a's first part goes left: boundaries b .. a-1 move right
            yield tuple(x + 1 if b <= i < a else x for i, x in enumerate(bounds))


def _screen(profile: Profile, cfg: PipelineConfig, starts: list[Candidate], deadline: float | None,
            fixed_order: bool) -> dict[tuple[int, ...], float]:
    """Local search from each start (steepest descent on the screened step): every cut timed."""
    timed: dict[tuple[int, ...], float] = {}

    def timed_ms(b: tuple[int, ...]) -> float:
        if b not in timed:
            timed[b] = _screen_ms(profile, cfg, b, fixed_order)
        return timed[b]

    def out_of_time() -> bool:
        return len(timed) >= MAX_SCREENED or (deadline is not None and time.monotonic() > deadline)

    for start in starts:
        start.screen_ms = current = timed_ms(start.bounds)
        at = start.bounds
        while not out_of_time():
            best = min(_neighbours(at, len(profile.parts)), key=timed_ms, default=None)
            if best is None or not timed[best] < current * (1 - 1e-9):
                break
            at, current = best, timed[best]
    return timed


def _greedy_ms(profile: Profile, cfg: PipelineConfig, planning: Planning) -> float:
    """The greedy's step time for `cfg`'s cut; infinite where it has no plan."""
    try:
        tg, steps, _ = greedy_steps(profile, cfg, graphs=planning.graphs_of(profile))
        plan = assemble.assemble(profile, tg, steps, "greedy")
        assemble.finish(plan, profile, {"solver_status": "greedy"})
    except InputError:  # a cycle over the limit, or over the memory limit
        return math.inf
    return plan.stats["step_time_ms"]


def _shortlist(profile: Profile, cfg: PipelineConfig, starts: list[Candidate], timed: dict, deadline: float | None,
               planning: Planning) -> list[Candidate]:
    """The starts and the best screened cuts, each with its greedy plan's step time."""
    known = {c.bounds for c in starts}
    searched = [Candidate("auto", b, ms) for b, ms in sorted(timed.items(), key=lambda x: (x[1], x[0]))
                if b not in known and not math.isinf(ms)][:SHORTLIST]
    out = [*starts, *searched]
    if not cfg.optimizer_work:  # nothing for the greedy to place: the screen is the step
        for c in out:
            c.greedy_ms = c.screen_ms
        return out
    for c in out:
        if c.rule == "auto" and deadline is not None and time.monotonic() > deadline:
            break
        c.greedy_ms = _greedy_ms(profile, replace(cfg, partition=cut_at(profile, c.bounds)), planning)
    return out


def _finalists(starts: list[Candidate], shortlist: list[Candidate]) -> list[Candidate]:
    """The starts, then the searched cuts the greedy (then the screen) ranks best. A cut
    timed exactly as one already in is left out: moving a block between two stages that
    share a device, as Chimera's mirrored stages do, changes nothing the planner sees."""
    searched = sorted((c for c in shortlist if c.rule == "auto" and not math.isinf(min(c.greedy_ms, c.screen_ms))),
                      key=lambda c: (c.greedy_ms, c.screen_ms, c.bounds))
    out = list(starts)
    for c in searched:
        if len(out) >= FINALISTS:
            break
        if all((c.screen_ms, c.greedy_ms) != (o.screen_ms, o.greedy_ms) for o in out):
            out.append(c)
    return out


def _share(budget: Budget, share: float) -> Budget:
    """A budget of `share` of the time left, for one of the final plans."""
    if budget.deadline is None:
        child = Budget()
    else:
        child = Budget(max(0.0, budget.left()) * share)
    child.seconds = budget.seconds  # one account of where the command's time went
    child.replay_s_per_op = budget.replay_s_per_op
    child.spread_s_per_op = budget.spread_s_per_op
    return child
