"""PipeFisher's greedy baseline: fill the pipeline's bubbles with K-FAC work, first fit.

1. Take the family's step with preconditioning and gradient sync at its end (precond
   after the step's last bwd on each device, as PipeFisher does) and time it (ASAP over
   the task graph's edges and the canonical order; collectives start together). Its
   length is the step time T; step t of the cycle occupies [t·T, (t+1)·T].
2. Visit the floating K-FAC tasks (curv, sync_curv, inv, bcast_inv) in dependency order,
   earliest-ready first, and put each in the first idle gap of its rank (for a collective,
   a window idle on every member) at or after its dependencies' end, in step 0, 1, 2, ...
   The refresh cycle k is the number of steps this needs.
3. Merge the placed tasks into each rank's step lists by start time -> Plan (then the
   replay checks it and gives the predicted times).
No memory model (PipeFisher has none): the replay reports a plan over the memory limit.

As pipe-fisher's auto_schedule.py: the cycle's first step is filled first (earliest gap
wins), and a task goes into a gap only if the gap left holds its duration plus a 5% margin
(`MARGIN_RATIO`, PipeFisher's `margin_ratio`: measured times vary). Where it still differs,
and why: (a) an inversion waits for BOTH factors of its layer (PipeFisher: only its own),
because the runtime splits the damping between A and B by the pi-correction, which needs
both; (b) a collective (factor sync, broadcast) is placed in a window idle on every member
at once (PipeFisher schedules each GPU on its own and lets collectives wait), so the
replayed timeline is exactly the planned one; (c) tasks are visited task by task in
dependency order, earliest-ready first, each into its earliest fitting gap (PipeFisher:
bubble by bubble, trying the workloads in priority order curvature, sync, inversion);
for a dependency-ordered list both fill the earliest bubbles first.
A task no bubble can hold (longer than every gap of its rank, or with no common idle
window on a collective's ranks; with one stage there are no bubbles at all) runs, with
everything that depends on it, after the last step of the cycle.
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import replace

import networkx as nx

from pfcompile.formats.errors import InputError
from pfcompile.formats.limits import MAX_REFRESH_STEPS, MAX_TASKS
from pfcompile.formats.ops import FLOATING_KINDS
from pfcompile.formats.plan import Task
from pfcompile.formats.profile import Profile
from pfcompile.graph.schedules import PipelineConfig
from pfcompile.graph.taskgraph import TaskGraph, TaskGraphs, build_task_graph
from pfcompile.place.upfront import CycleTooLong

EPS = 1e-9
MARGIN_RATIO = 0.05  # pipe-fisher auto_schedule.py: a bubble takes a task only with 5% to spare


def time_fixed_order(tg: TaskGraph, orders: dict[int, list[Task]]) -> dict[Task, tuple[float, float]]:
    """ASAP start/end of the given tasks in the given per-rank order (graph edges with lags,
    rank order, collectives starting together)."""
    unit_of: dict[Task, int] = {}
    members: list[list[Task]] = []
    in_order = {t for ts in orders.values() for t in ts}
    for group in tg.collectives.values():
        group = [t for t in group if t in in_order]
        if group:
            for t in group:
                unit_of[t] = len(members)
            members.append(group)
    for t in in_order:
        if t not in unit_of:
            unit_of[t] = len(members)
            members.append([t])
    dag = nx.DiGraph()
    dag.add_nodes_from(range(len(members)))
    lag: dict[tuple[int, int], float] = {}
    for u, v, data in tg.g.edges(data=True):
        if u in in_order and v in in_order and unit_of[u] != unit_of[v]:
            e = (unit_of[u], unit_of[v])
            dag.add_edge(*e)
            lag[e] = max(lag.get(e, 0.0), data["lag"])
    for ts in orders.values():
        for a, b in zip(ts, ts[1:]):
            if unit_of[a] != unit_of[b]:
                dag.add_edge(unit_of[a], unit_of[b])
                lag.setdefault((unit_of[a], unit_of[b]), 0.0)
    try:
        topo = list(nx.topological_sort(dag))
    except nx.NetworkXUnfeasible:
        raise InputError("schedule", None, "the order deadlocks (cyclic waits between ranks)") from None
    start: dict[int, float] = {}
    for u in topo:
        start[u] = max((start[p] + tg.duration(members[p][0]) + lag[(p, u)] for p in dag.predecessors(u)), default=0.0)
    return {t: (start[unit_of[t]], start[unit_of[t]] + tg.duration(t)) for t in in_order}


class _Gaps:
    """Idle intervals of one rank over the cycle's steps: the step's gaps shifted by t·T.
    Kept sorted and disjoint as two parallel lists (starts, ends), so every query is a
    bisection, not a scan over the cycle's gaps (a 32 x 128 cycle has ~10^5)."""

    def __init__(self, base: list[tuple[float, float]], T: float):
        self.base, self.T = base, T
        self.starts: list[float] = []  # gap i is [starts[i], ends[i]], sorted, disjoint
        self.ends: list[float] = []
        self.steps = 0

    def grow(self, steps: int) -> None:
        while self.steps < steps:
            off = self.steps * self.T
            for a, b in self.base:
                if b - a > EPS:
                    self.starts.append(a + off)
                    self.ends.append(b + off)
            self.steps += 1

    def fits(self, at: float, d: float) -> bool:
        i = bisect.bisect_right(self.starts, at + EPS) - 1
        return i >= 0 and self.starts[i] <= at + EPS and at + d <= self.ends[i] + EPS

    def candidates(self, at: float, d: float):
        """Earliest start >= at in each gap long enough, ascending. A gap that ends before
        at + d - EPS cannot hold it: the search starts at the first that does not (with
        2 EPS of slack, so rounding never skips one the exact test would take)."""
        starts, ends = self.starts, self.ends
        for i in range(bisect.bisect_left(ends, at + d - 2 * EPS), len(starts)):
            a, b = starts[i], ends[i]
            s = a if a > at else at
            if s + d <= b + EPS:
                yield s

    def take(self, at: float, d: float) -> None:
        """Remove [at, at + d] from the first gap (in time) that holds it."""
        starts, ends = self.starts, self.ends
        for i in range(bisect.bisect_left(ends, at + d - 2 * EPS), bisect.bisect_right(starts, at + EPS)):
            a, b = starts[i], ends[i]
            if a <= at + EPS and at + d <= b + EPS:
                pieces = [p for p in ((a, at), (at + d, b)) if p[1] - p[0] > EPS]
                starts[i:i + 1] = [p[0] for p in pieces]
                ends[i:i + 1] = [p[1] for p in pieces]
                return
        raise AssertionError("take() of a window that is not free")


def _check_cycle_size(tg: TaskGraph, floating: list[Task], bubble: dict[int, float], per_step: int) -> None:
    """Refuse up front a cycle too long to plan: the bubbles must absorb each rank's K-FAC
    work, so k >= work / bubble per step, and the plan lists every step's ops k times."""
    work: dict[int, float] = {}
    for t in floating:
        work[t.rank] = work.get(t.rank, 0.0) + tg.duration(t)
    # (a rank without any bubble, one stage alone, gets its K-FAC work after its pipeline work)
    need = {q: math.ceil(w / bubble[q] - 1e-9) for q, w in work.items() if bubble.get(q, 0.0) > 1e-9}
    k = max([*need.values(), 1])
    if k > MAX_REFRESH_STEPS:
        q = max(need, key=need.get)
        raise CycleTooLong(k, q, work[q], bubble[q])
    if k * per_step > MAX_TASKS:
        raise InputError("--micro-batches", None, f"a refresh cycle of at least {k} steps of {per_step} ops is over "
                         f"the limit of {MAX_TASKS} tasks (the greedy's state would not fit in memory; see "
                         "pfcompile/formats/limits.py)")


def greedy_steps(profile: Profile, cfg: PipelineConfig, progress=None, bubbles: bool = True,
                 graphs: TaskGraphs | None = None):
    """-> (graph of one step, steps[rank][step] op lists, info dict). `bubbles` False: no
    first fit, every K-FAC unit after the step's pipeline work (k = 1), the start CP-SAT
    stretches from when the bubbles cannot hold the work (CycleTooLong). `graphs`: the
    planning run's graphs (pfcompile.graph.taskgraph.TaskGraphs)."""
    tg = build_task_graph(profile, replace(cfg, refresh_steps=1), graphs=graphs)
    orders = {q: steps[0] for q, steps in tg.canonical.items()}
    base = time_fixed_order(tg, orders)
    T = max((e for _, e in base.values()), default=0.0) or 1.0  # all-zero costs: any unit will do
    floating = [t for t in tg.g.nodes if t.op.kind in FLOATING_KINDS]
    gaps_of: dict[int, list[tuple[float, float]]] = {}
    for q, ts in orders.items():
        edges = [0.0] + [x for t in ts for x in base[t]] + [T]
        gaps_of[q] = [(edges[i], edges[i + 1]) for i in range(0, len(edges), 2)]
    gaps = {q: _Gaps(g, T) for q, g in gaps_of.items()}
    bubble = {q: sum(b - a for a, b in g) for q, g in gaps_of.items()}
    if bubbles:
        _check_cycle_size(tg, floating, bubble, sum(len(ts) for ts in orders.values()))

    # a collective is placed as one unit: all members start together
    units = tg.unit_graph(floating)
    est = {g: max((base[p][1] for u in g for p in tg.g.predecessors(u) if p in base), default=0.0) for g in units}
    order = list(nx.lexicographical_topological_sort(units, key=lambda g: (est[g], g[0].rank, str(g[0].op))))
    placed: dict[Task, tuple[float, float]] = {}
    tail: list[tuple[Task, ...]] = []  # units no bubble can hold, and what depends on them
    tail_tasks: set[Task] = set()
    last_step = 0
    for n, group in enumerate(order):
        d = tg.duration(group[0])
        preds = [(p, u) for u in group for p in tg.g.predecessors(u)]
        at = None
        if bubbles and not any(p in tail_tasks for p, _ in preds):
            ready = max([0.0] + [(base[p] if p in base else placed[p])[1] + tg.g.edges[p, u]["lag"] for p, u in preds])
            # bubbles repeat every step: a unit that fits in no fresh step never fits
            at = _first_fit(group, ready, d, gaps, max(last_step, int(ready // T)) + 2)
        if at is None:
            tail.append(group)
            tail_tasks.update(group)
        else:
            for u in group:
                gaps[u.rank].take(at, d)
                placed[u] = (at, at + d)
            last_step = max(last_step, int((at + EPS) // T))
        if progress:
            progress(n + 1, len(order))

    k = max([int((s + EPS) // T) + 1 for s, _ in placed.values()] + [1])
    rows: dict[tuple[int, int], list[tuple]] = {(q, t): [] for q in orders for t in range(k)}
    for q, ts in orders.items():
        for step in range(k):
            rows[(q, step)] += [(s + step * T, e + step * T, i, t.op) for i, t in enumerate(ts) for s, e in [base[t]]]
    for j, (t, (s, e)) in enumerate(sorted(placed.items(), key=lambda x: x[1])):
        rows[(t.rank, int((s + EPS) // T))].append((s, e, 10**9 + j, t.op))
    steps = {q: [[op for *_, op in sorted(rows[(q, t)])] for t in range(k)] for q in orders}
    for group in tail:  # after the cycle's last step, in one global order (collectives stay consistent)
        for t in group:
            steps[t.rank][k - 1].append(t.op)
    work = dict.fromkeys(orders, 0)  # one pass each, summed in the same order per rank as before
    for t in floating:
        if t.rank in work:
            work[t.rank] += tg.duration(t)
    in_bubbles = dict.fromkeys(orders, 0)
    for t in placed:
        if t.rank in in_bubbles:
            in_bubbles[t.rank] += tg.duration(t)
    step_work = {q: sum(tg.duration(t) for t in ts) for q, ts in orders.items()}  # every step's own work
    info = {"step_time_model_ms": T, "tail_tasks": sum(len(g) for g in tail), "bubble_ms": bubble,
            "refresh_work_ms": work, "bubble_work_ms": in_bubbles, "step_work_ms": step_work, "refresh_steps": k}
    return tg, steps, info


def _first_fit(group: tuple[Task, ...], ready: float, d: float, gaps: dict[int, _Gaps], max_steps: int) -> float | None:
    """Earliest start >= ready at which every member's rank is idle for d plus the margin,
    within max_steps: the candidates of all members merged in ascending order (lazily:
    one rank's first candidate is already the answer)."""
    ranks = [t.rank for t in group]
    for q in ranks:
        gaps[q].grow(max_steps)
    need = d * (1 + MARGIN_RATIO)
    for s in heapq.merge(*(gaps[q].candidates(ready, need) for q in ranks)):
        if all(gaps[q].fits(s, need) for q in ranks):
            return s
    return None
