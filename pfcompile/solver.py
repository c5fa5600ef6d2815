"""`pfcompile plan --method cpsat`: place the K-FAC work of a refresh cycle with CP-SAT.

For a refresh cycle of k steps the task graph (pfcompile.graph) becomes a `Problem`
(pfcompile.problem) in integer microseconds; pfcompile.cpmodel minimises its makespan, i.e.
the step time makespan/k. What this module adds to the graph:

- the inversion choice: with replicas, each factor is inverted on ONE replica of its stage,
  chosen by the solver (an option per candidate rank: its inv and the bcast_inv from it);
- steps run one after another on every rank (the plan lists each step's ops in order and
  the runtime runs step t with list t): a boundary per rank and step;
- `fixed_order`: the family's forward/backward order per rank as a chain; the K-FAC work,
  sync_grad, precond and step are placed freely either way;
- memory: capacity = memory limit - resident bytes per rank (a reservoir in the model);
- sends and receives glued to the op they follow / precede (their message an edge with
  the transfer time as lag): moving them gains nothing, and it halves the tasks;
- above GROUP_ABOVE curvature ops, the curvature ops one forward/backward enables are one
  task (its layers back to back; kept tensors held until the group ends): recorded in the
  plan's stats as `curvature_grouped`.

Each k is solved in three stages (`solve_cycle`), each warm-starting the next and each
stopping at a proven optimum: (1) the pipeline timeline, the k steps without refresh work
(its bound bounds the whole cycle too); (2) the refresh work packed into that timeline,
per-step tasks pinned (what it gives up: moving the pipeline to make room); (3) the whole
cycle, which may move everything. Warm starts: PipeFisher's greedy (its k only), list
schedules (pfcompile.list_schedule), the packing. The plan's stats say which stages ran.

k, lexicographically after the step time: try k = k_lb, k_lb+1, ... (k_lb: the K-FAC work
of one refresh over the bubble time per step on the most loaded rank, pfcompile.bounds)
and keep the FIRST k whose step time is within `tolerance` (0.5%) of the step time the
same k steps reach without any refresh work (the best any k can hope for: the refresh
then costs nothing); if no k up to max(k_lb + `extra_steps`, the greedy's k) gets there,
the k with the least step time (ties: the smaller k).

The solution becomes per-rank op lists (sorted by model start), is assembled with
pfcompile.planner and replayed by pfcompile.replay like every plan.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from pfcompile import planner
from pfcompile.bounds import heads_and_tails, lower_bounds, refresh_steps_lower_bound
from pfcompile.cpmodel import Result, solve
from pfcompile.errors import InputError
from pfcompile.graph import FLOATING_KINDS, Task, TaskGraph, build_task_graph
from pfcompile.list_schedule import list_schedule
from pfcompile.ops import P2P_KINDS, Op
from pfcompile.plan import Plan
from pfcompile.problem import Problem, Schedule, to_us, violations
from pfcompile.profile import Profile
from pfcompile.schedules import PipelineConfig

PASS_KINDS = ("fwd", "bwd")
GROUP_ABOVE = 3000  # curvature ops per cycle above which a producer's curvature ops are one task


@dataclass
class SolverOptions:
    time_limit: float = 60.0  # seconds per solve (each k tried is one solve)
    workers: int = 2
    fixed_order: bool = True
    tolerance: float = 0.005  # accept k when within 0.5% of the no-refresh step time
    extra_steps: int = 2  # try at most k_lb + extra_steps
    refresh_steps: int | None = None  # force k
    group_curvature: bool | None = None  # None: when the curvature ops alone exceed GROUP_ABOVE
    total_time_limit: float | None = None  # if set: shared evenly by the k tried (overrides time_limit)


@dataclass
class CycleModel:
    """The Problem of one k, and how its task indices map back to the graph."""

    tg: TaskGraph
    problem: Problem
    tasks: list[Task]
    index: dict[Task, int]
    per_step: set[int] = field(default_factory=set)  # indices of the per-step tasks
    emit: dict[Task, list[Op]] = field(default_factory=dict)  # ops a task stands for, in order
    host: dict[Task, Task] = field(default_factory=dict)  # graph task -> the model task it is in


# --- graph -> problem ---------------------------------------------------------------------


def build_cycle(profile: Profile, cfg: PipelineConfig, k: int, *, fixed_order: bool,
                refresh: bool = True, group_curvature: bool = False) -> CycleModel:
    """The Problem of a k-step cycle. `refresh=False` drops the floating K-FAC work (the
    reference the refresh is measured against). Point-to-point ops are glued to the op they
    follow or precede (see `_contract`); `group_curvature` makes the curvature ops of one
    producer one task (fewer tasks, coarser packing, kept tensors held to the group's end)."""
    return cycle_from_graph(cycle_graph(profile, cfg, k), fixed_order=fixed_order, refresh=refresh,
                            group_curvature=group_curvature)


def cycle_graph(profile: Profile, cfg: PipelineConfig, k: int) -> TaskGraph:
    """The task graph the model is built from: with replicas, every candidate inverts (the
    model's options choose one)."""
    choose = cfg.kfac and cfg.replicas > 1
    return build_task_graph(profile, replace(cfg, refresh_steps=k, inversion="all" if choose else cfg.inversion))


def cycle_from_graph(tg: TaskGraph, *, fixed_order: bool, refresh: bool = True,
                     group_curvature: bool = False) -> CycleModel:
    cfg = tg.cfg
    choose = cfg.kfac and cfg.replicas > 1
    host, emit, edges = _contract(tg, refresh, group_curvature)
    # deterministic task order (every model duration is >= 1 µs, so a task never starts
    # with its successor: sorting a rank's tasks by start alone respects the dependencies)
    tasks = sorted(emit, key=lambda t: (_step(t), t.rank, t.op))
    p = Problem()
    index: dict[Task, int] = {}
    option_of = _inversion_options(tg, p) if choose and refresh else {}
    duration = tg.costs.duration
    for t in tasks:
        us = sum(_model_us(duration(op)) for op in emit[t] if op.kind not in P2P_KINDS)
        index[t] = p.add(t, us, (t.rank,), option_of.get(t))
    if choose and refresh:  # the broadcasts from each candidate inverter
        for (layer, f), cands in tg.inv_candidates.items():
            for c in cands:
                inv = Task(None, c, Op("inv", layer=layer, factor=f))
                group = []
                for q in cands:
                    b = Task(None, q, Op("bcast_inv", layer=layer, factor=f, peer=c))
                    index[b] = p.add(b, _model_us(duration(b.op)), (q,), option_of[inv])
                    tasks.append(b)
                    emit[b] = [b.op]
                    p.edges.append((index[inv], index[b], 0))
                    group.append(index[b])
                p.rendezvous.append(group)
    p.edges += [(index[u], index[v], to_us(lag)) for (u, v), lag in edges.items()]
    for group in tg.collectives.values():
        members = [index[t] for t in group if t in index]
        if len(members) > 1:
            p.rendezvous.append(members)
    for b in tg.buffers:
        if b.alloc in host and b.free in host:
            p.buffers.append((b.rank, b.nbytes, index[host[b.alloc]], index[host[b.free]]))
    limit = cfg.memory_limit_bytes
    p.capacity = {q: (None if limit is None else limit - tg.resident_bytes[q]) for q in tg.ranks}
    for q, steps in tg.canonical.items():
        p.phases.append([[index[t] for t in step if t in index] for step in steps])
        if fixed_order:
            p.chains.append([index[t] for step in steps for t in step if t.op.kind in PASS_KINDS])
    per_step = {i for i, t in enumerate(tasks) if t.step is not None}
    return CycleModel(tg, p, tasks, index, per_step, emit, host)


def _contract(tg: TaskGraph, refresh: bool, group_curvature: bool):
    """-> (host of every graph task, ops each host emits in order, edges between hosts with
    their lag).

    A send is posted right after the op that made its message and a receive waits right
    before the op that needs it: nothing is gained by moving them, so they are glued to
    those ops and their message becomes an edge with the transfer time as lag. This halves
    the tasks of a pipeline without changing what the replay computes. With
    `group_curvature`, the curvature ops a forward/backward enables form one task."""
    g = tg.g
    nodes = [t for t in g.nodes if refresh or t.step is not None]
    host = {t: t for t in nodes}
    for t in nodes:
        kind = t.op.kind
        if kind in ("send_act", "send_grad"):
            (host[t],) = g.predecessors(t)
        elif kind in ("recv_act", "recv_grad"):
            (host[t],) = g.successors(t)
    if group_curvature:
        for u in nodes:
            if u.step == 0 and u.op.kind in PASS_KINDS:
                curv = sorted((v for v in g.successors(u) if v.op.kind in ("curv_a", "curv_b")), key=lambda v: v.op)
                for v in curv[1:]:
                    host[v] = curv[0]
    emit: dict[Task, list[Op]] = {t: [] for t in nodes if host[t] == t}
    for t in nodes:  # receives first, then the op (or the group in layer order), then sends
        if host[t] != t and t.op.kind.startswith("recv"):
            emit[host[t]].append(t.op)
    for t in nodes:
        if host[t] == t or t.op.kind in ("curv_a", "curv_b"):
            emit[host[t]].append(t.op)
    for t in nodes:
        if host[t] != t and t.op.kind.startswith("send"):
            emit[host[t]].append(t.op)
    edges: dict[tuple[Task, Task], float] = {}
    for u, v, lag in g.edges(data="lag"):
        if u in host and v in host:
            hu, hv = host[u], host[v]
            if hu != hv:
                edges[hu, hv] = max(lag, edges.get((hu, hv), lag))
    return host, emit, edges


def curvature_ops(profile: Profile, cfg: PipelineConfig) -> int:
    return 2 * len(profile.kfac_layers) * cfg.micro_batches if cfg.kfac else 0


def _group(profile: Profile, cfg: PipelineConfig, opts: SolverOptions) -> bool:
    if opts.group_curvature is not None:
        return opts.group_curvature
    return curvature_ops(profile, cfg) > GROUP_ABOVE


def _model_us(ms: float) -> int:
    """Duration in the model: at least 1 µs, so that a zero-length op (a posted send, a
    receive, the update) is ordered on its rank by the no-overlap like every other op: a
    send placed inside a curvature op would be posted only after it, later than the model
    assumed. Costs at most 1 µs per such op on the critical path."""
    return max(1, to_us(ms))


def _step(t: Task) -> int:
    return -1 if t.step is None else t.step


def _inversion_options(tg: TaskGraph, p: Problem) -> dict[Task, int]:
    """One option per (factor, candidate rank): that rank's inv (the graph, built with
    inversion="all", has one on every candidate) and its broadcasts."""
    option_of = {}
    for key, cands in tg.inv_candidates.items():
        ids = []
        for c in cands:
            o = len(option_of)
            option_of[Task(None, c, Op("inv", layer=key[0], factor=key[1]))] = o
            ids.append(o)
        p.choices.append(ids)
    return option_of


# --- solution -> op lists -------------------------------------------------------------------


def steps_from_schedule(cm: CycleModel, s: Schedule) -> dict[int, list[list[Op]]]:
    """Per rank, its tasks by start (ties: the problem's task order, which respects the
    dependencies); a floating task joins the step of the per-step task before it."""
    k = cm.tg.refresh_steps
    out: dict[int, list[list[Op]]] = {q: [[] for _ in range(k)] for q in cm.tg.ranks}
    by_rank: dict[int, list[tuple]] = {q: [] for q in cm.tg.ranks}
    for i, t in enumerate(cm.tasks):
        if s.start[i] is not None:
            by_rank[t.rank].append((s.start[i], s.start[i] + cm.problem.tasks[i].dur, i))
    for q, rows in by_rank.items():
        step = 0
        for _, _, i in sorted(rows):
            t = cm.tasks[i]
            if t.step is not None:
                step = t.step
            out[q][step] += cm.emit[t]
    return out


def schedule_from_steps(cm: CycleModel, steps: dict[int, list[list[Op]]]) -> Schedule | None:
    """Another planner's op lists (the greedy's) as a Schedule of this problem: each rank's
    order becomes a chain, its inverting replicas the options, and the list scheduler
    times it (as soon as possible in that order)."""
    k = cm.tg.refresh_steps
    if any(len(s) != k for s in steps.values()):
        return None
    chains, taken = [], set()
    for q, per_step in steps.items():
        chain = []
        for t, ops in enumerate(per_step):
            for op in ops:
                task = Task(None if op.kind in FLOATING_KINDS else t, q, op)
                host = cm.host.get(task, task)
                i = cm.index.get(host)
                if i is None:
                    continue
                if not chain or chain[-1] != i:
                    chain.append(i)
                if cm.problem.tasks[i].option is not None:
                    taken.add(cm.problem.tasks[i].option)
        chains.append(chain)
    if len({i for c in chains for i in c}) != sum(len(c) for c in chains):
        return None  # grouped curvature split apart by the other plan: no single order
    p = replace(cm.problem, chains=chains)
    try:
        return list_schedule(p, options=taken)
    except ValueError:  # the other plan's order contradicts a dependency
        return None


# --- memory: the smallest limit that can work -----------------------------------------------


def smallest_feasible_limit(cm: CycleModel) -> dict[int, int]:
    """Per rank: resident + the least dynamic peak under the family's order, reached by
    running each curvature op right after the op that made its kept tensor (activations
    are fixed by the fwd/bwd order; kept tensors then live only while their producer runs)."""
    tg = cm.tg
    out = {}
    for q, steps in tg.canonical.items():
        live = peak = 0  # activations live between ops
        for t_step, step in enumerate(steps):
            for t in step:
                made = tg.costs.allocates(t.op, refresh=(t_step == 0))
                peak = max(peak, live + sum(n for _, n in made))
                live += sum(n for key, n in made if key[0] == "act")
                if t.op.kind == "bwd":
                    live -= tg.costs.act_bytes(t.op.stage)
        out[q] = tg.resident_bytes[q] + peak
    return out


def memory_error(cm: CycleModel, fixed_order: bool, *, proven: bool = False) -> InputError | None:
    """The one-line error for a limit below the smallest feasible one (None if it may fit).
    Under the family's order the smallest limit is exact; with a free order it is one that
    surely works, and only a solver's proof of infeasibility (`proven`) rejects a limit."""
    limit = cm.tg.cfg.memory_limit_bytes
    if limit is None:
        return None
    need = smallest_feasible_limit(cm)
    q = max(need, key=lambda r: need[r] - limit)
    if need[q] <= limit or not (fixed_order or proven):
        return None
    how = "under the family's order" if fixed_order else "known (under the family's order)"
    return InputError("--memory-limit", None,
                      f"rank {q} needs {need[q]} bytes, over the limit of {limit}: the smallest feasible limit "
                      f"{how} is {need[q]} bytes ({_gib(need[q])} = resident {_gib(cm.tg.resident_bytes[q])} + "
                      f"activations and kept tensors)")


def _gib(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3f} {unit}"
    return f"{n} B"


# --- one cycle length -----------------------------------------------------------------------


@dataclass
class CycleSolution:
    k: int
    cm: CycleModel
    result: Result
    schedule: Schedule
    bound: int  # best lower bound on the makespan (µs): the solver's or pfcompile.bounds'
    reference: int  # makespan of the same k steps without refresh work (µs)
    hint_source: str  # where the returned schedule came from
    stages: list[str] = field(default_factory=list)

    @property
    def step_time_ms(self) -> float:
        return self.schedule.makespan / self.k / 1000

    @property
    def gap(self) -> float:
        mk = self.schedule.makespan
        return max(0.0, (mk - self.bound) / mk) if mk else 0.0


def solve_cycle(profile: Profile, cfg: PipelineConfig, k: int, opts: SolverOptions, *,
                greedy_steps: dict | None = None, describe=None) -> CycleSolution:
    """Three stages, each warm-starting the next, each stopping early at a proven optimum:
    (1) the pipeline timeline: the k steps without refresh work, on their own model (its
    bound is a lower bound of the whole cycle); (2) the refresh work packed into that
    timeline (per-step tasks pinned); (3) the whole model, which may move the pipeline to
    make room. `time_limit` is shared 20/30/50 between them."""
    tg = cycle_graph(profile, cfg, k)
    cm = cycle_from_graph(tg, fixed_order=opts.fixed_order, group_curvature=_group(profile, cfg, opts))
    err = memory_error(cm, opts.fixed_order)
    if err:
        raise err
    p = cm.problem
    head, _ = heads_and_tails(p)
    by_head = lambda i: (head[i], i)  # noqa: E731
    canon = _canonical_position(cm)
    report = _reporter(describe, k)

    # (1) the pipeline timeline
    ref_cm = cycle_from_graph(tg, fixed_order=opts.fixed_order, refresh=False)
    ref_head, _ = heads_and_tails(ref_cm.problem)
    ref_canon = _canonical_position(ref_cm)
    ref_hint = min((list_schedule(ref_cm.problem, order_key=lambda i: (ref_head[i], i)),
                    list_schedule(ref_cm.problem, order_key=lambda i: ref_canon.get(i, (ref_head[i], i)))),
                   key=lambda s: s.makespan)
    ref = solve(ref_cm.problem, time_limit=0.2 * opts.time_limit, workers=opts.workers, hint=ref_hint,
                extra_bound=lower_bounds(ref_cm.problem).makespan, on_solution=report("pipeline"))
    if ref.status == "INFEASIBLE":  # activations alone do not fit (free order)
        raise memory_error(cm, opts.fixed_order, proven=True) or InputError(
            "--memory-limit", None, "the activations alone do not fit the limit")
    ref_sched = ref.schedule or ref_hint
    bound = max(lower_bounds(p).makespan, ref.bound)

    # candidates: the greedy, a list schedule, and (2) the packing into the timeline
    cands: list[tuple[str, Schedule]] = [
        ("list", list_schedule(p, first=cm.per_step, order_key=by_head)),
        ("canonical list", list_schedule(p, first=cm.per_step, order_key=lambda i: canon.get(i, (head[i], i)))),
        ("memory-lean list", list_schedule(p, order_key=_memory_lean_key(cm, canon, head)))]
    if greedy_steps is not None:
        h = schedule_from_steps(cm, greedy_steps)
        if h is not None:
            cands.append(("greedy", h))
    pinned = {cm.index[t]: ref_sched.start[j] for j, t in enumerate(ref_cm.tasks)}
    packed = list_schedule(p, pinned=pinned, order_key=by_head)
    cands.append(("timeline+first-fit", packed))
    pack = solve(p, time_limit=0.3 * opts.time_limit, workers=opts.workers, hint=packed, pinned=pinned,
                 extra_bound=bound, on_solution=report("packing"))
    if pack.schedule is not None:
        cands.append(("timeline+cpsat packing", pack.schedule))
    ok = [c for c in cands if not violations(p, c[1])]
    source, best = min(ok or cands, key=lambda c: c[1].makespan)
    status, stages = "FEASIBLE", ["pipeline timeline", "refresh packed into it"]

    # (3) the whole model, unless the packing is already within 0.01% of the bound
    if best.makespan - bound > 1e-4 * best.makespan:
        full = solve(p, time_limit=0.5 * opts.time_limit, workers=opts.workers, hint=best, extra_bound=bound,
                     on_solution=report("whole cycle"))
        stages.append("whole cycle")
        if full.status == "INFEASIBLE":
            raise memory_error(cm, opts.fixed_order, proven=True) or InputError(
                "--memory-limit", None, f"no schedule with k={k} fits the limit")
        bound = max(bound, full.bound)
        if full.schedule is not None and full.schedule.makespan < best.makespan:
            source, best = "whole-cycle cpsat", full.schedule
    if not ok and violations(p, best):
        raise InputError("--memory-limit", None, f"no schedule found with k={k} within the time limit")
    if best.makespan <= bound:
        status = "OPTIMAL"
    result = Result(status, best, best.makespan, bound, 0.0)
    return CycleSolution(k, cm, result, best, bound, ref_sched.makespan, source, stages)


def _canonical_position(cm: CycleModel) -> dict[int, tuple]:
    """(step, position in the family's op list of its rank) of every per-step task: the
    list scheduler's priority that reproduces the family's order (precond at the end)."""
    out = {}
    for q, steps in cm.tg.canonical.items():
        for t, step in enumerate(steps):
            for pos, task in enumerate(step):
                if task in cm.index:
                    out[cm.index[task]] = (t, pos, 0)
    return out


def _memory_lean_key(cm: CycleModel, canon: dict[int, tuple], head: list[int]):
    """The family's order with each curvature op straight after the op that made its kept
    tensor (the least memory, as in smallest_feasible_limit); the rest of the refresh after
    the cycle's per-step work."""
    k = cm.tg.refresh_steps
    pred = {}
    for a, b, _ in cm.problem.edges:
        if cm.tasks[b].op.kind in ("curv_a", "curv_b") and a in canon:
            pred[b] = a

    def key(i: int) -> tuple:
        if i in canon:
            return canon[i]
        if i in pred:
            t, pos, _ = canon[pred[i]]
            return (t, pos, 1, i)
        return (k, head[i], 0, i)
    return key


def _reporter(describe, k: int):
    def stage(name: str):
        def on_solution(sec, obj, bound):
            if describe:
                describe(f"cpsat k={k} {name}: {obj / k / 1000:.2f} ms/step, bound {bound / k / 1000:.2f} ({sec:.0f} s)")
        return on_solution
    return stage


# --- the plan -------------------------------------------------------------------------------


def solve_plan(profile: Profile, cfg: PipelineConfig, *, time_limit: float = 60.0, workers: int = 2,
               fixed_order: bool = True, refresh_steps: int | None = None, progress=None, describe=None,
               options: SolverOptions | None = None) -> Plan:
    """The CP-SAT plan: k searched upwards from its lower bound (module docstring), the
    solution replayed; stats carry status, bound, gap and the k search."""
    opts = options or SolverOptions(time_limit=time_limit, workers=workers, fixed_order=fixed_order,
                                    refresh_steps=refresh_steps)
    if not opts.time_limit > 0:
        raise InputError("--time-limit", None, f"must be positive, got {opts.time_limit}")
    if opts.workers < 1:
        raise InputError("--workers", None, f"must be at least 1, got {opts.workers}")
    t0 = time.perf_counter()
    greedy, greedy_info = _greedy(profile, cfg)
    k_greedy = len(next(iter(greedy.values())))
    k_lb = refresh_steps_lower_bound(greedy_info["kfac_work_ms"], greedy_info["bubble_ms"]) if cfg.kfac else 1
    if opts.refresh_steps:
        ks = [opts.refresh_steps]
    else:
        ks = list(range(k_lb, max(k_lb + opts.extra_steps, k_greedy) + 1))
    if opts.total_time_limit:
        opts = replace(opts, time_limit=opts.total_time_limit / len(ks))
    tried: list[CycleSolution] = []
    for n, k in enumerate(ks):
        if progress:
            progress(n, len(ks))
        sol = solve_cycle(profile, cfg, k, opts, greedy_steps=greedy if k == k_greedy else None, describe=describe)
        tried.append(sol)
        if sol.schedule.makespan <= sol.reference * (1 + opts.tolerance):
            break
    best = min(tried, key=lambda s: (round(s.step_time_ms, 3), s.k))
    steps = steps_from_schedule(best.cm, best.schedule)
    tg = replace(best.cm.tg, cfg=replace(cfg, refresh_steps=best.k))
    plan = planner.assemble(profile, tg, steps, "cpsat", fixed_order=opts.fixed_order)
    stats = {
        "solver_status": best.result.status,
        "objective_step_time_ms": round(best.step_time_ms, 6),
        "best_bound_step_time_ms": round(best.bound / best.k / 1000, 6),
        "gap": round(best.gap, 6),
        "solve_seconds": round(time.perf_counter() - t0, 3),
        "refresh_steps_lower_bound": k_lb,
        "lower_bounds_ms": lower_bounds(best.cm.problem).as_dict(1 / 1000 / best.k),
        "solution_from": best.hint_source,
        "k_search": [{"k": s.k, "step_time_ms": round(s.step_time_ms, 3), "status": s.result.status,
                      "gap": round(s.gap, 6), "no_refresh_step_time_ms": round(s.reference / s.k / 1000, 3)}
                     for s in tried],
        "k_rule": (f"first k from the lower bound whose step time is within {opts.tolerance:.1%} of the same "
                   f"k steps without refresh work; else the least step time"),
        "curvature_grouped": _group(profile, cfg, opts),
        "decomposition": " -> ".join(best.stages) + (
            "" if "whole cycle" in best.stages else
            " (stopped early: the packing reached the bound, nothing given up)" if best.gap == 0 else
            " (the pipeline was not moved to make room for K-FAC work)"),
        "time_unit": "integer microseconds (rounding: optimal within 0.5 us per task on the critical path)",
        "workers": opts.workers, "time_limit_s": opts.time_limit,
        "tasks_model": len(best.cm.problem.tasks),
    }
    planner.finish(plan, profile, stats)
    if progress:
        progress(len(ks), len(ks))
    return plan


def _greedy(profile: Profile, cfg: PipelineConfig):
    """PipeFisher's greedy op lists and its info (k, bubbles, K-FAC work): the warm start
    and the bar to beat."""
    from pfcompile.greedy import greedy_steps

    _, steps, info = greedy_steps(profile, cfg)
    return steps, info
