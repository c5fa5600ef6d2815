"""The CP-SAT model of a `Problem`: minimise the makespan of the refresh cycle.

One function per constraint family, objective last; `build_model` reads like the math:

    start_i + dur_i = end_i                       for every task (optional if in an option)
    no_overlap(tasks of resource r)               for every (rank, stream)
    start_v >= end_u + lag_uv                     for every dependency (if both present)
    start_i = start_j                             members of one collective
    sum(option literals of a choice) = 1          which replica inverts a factor
    0 <= sum of live buffers(t) <= capacity_q     memory reservoir per rank
    end_i <= start_j                              consecutive tasks of a fixed order
    minimise C >= end_i                           the makespan

Memory is a reservoir (+bytes at the allocating task's start, -bytes at the freeing task's
end) solved with `expand_reservoir_constraints=False`: expanded into Booleans per pair of
events it does not finish on real instances. A late buffer (Problem.late_buffers) adds
+bytes at its holder's end and -bytes at max(holder's end, free task's end), a variable
tied by a max equality: an empty interval when the free task ends first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ortools.sat.python import cp_model

from pfcompile.place.problem import Problem, Schedule


@dataclass
class Vars:
    start: list
    end: list
    interval: list
    option: dict[int, object]  # option id -> Boolean literal (taken)
    makespan: object = None  # the objective: the makespan, or the period (Problem.periodic)
    boundary: list = field(default_factory=list)  # (var, tasks before it)
    window: dict = field(default_factory=dict)  # periodic: rank -> (lo, hi), its first start and last end
    later_end: list = field(default_factory=list)  # (var, a, b): var = max(end_a, end_b), late buffers

    def present(self, p: Problem, i: int) -> list:
        """Literals under which task i exists (empty: always)."""
        o = p.option[i]
        return [] if o is None else [self.option[o]]


def build_model(p: Problem, horizon: int | None = None) -> tuple[cp_model.CpModel, Vars]:
    m = cp_model.CpModel()
    v = add_intervals(m, p, horizon or p.horizon())
    add_no_overlap(m, p, v)
    add_dependencies(m, p, v)
    add_rendezvous(m, p, v)
    add_choices(m, p, v)
    add_memory(m, p, v, horizon or p.horizon())
    add_fixed_order(m, p, v)
    add_phases(m, p, v, horizon or p.horizon())
    add_makespan_objective(m, p, v, horizon or p.horizon())
    return m, v


def add_intervals(m, p: Problem, horizon: int) -> Vars:
    option = {o: m.new_bool_var(f"opt{o}") for c in p.choices for o in c}
    start, end, interval = [], [], []
    for i, (d, o) in enumerate(zip(p.dur, p.option)):
        s = m.new_int_var(0, horizon - d, f"s{i}")
        e = s + d  # affine end: no extra variable
        if o is None:
            iv = m.new_fixed_size_interval_var(s, d, f"i{i}")
        else:
            iv = m.new_optional_fixed_size_interval_var(s, d, option[o], f"i{i}")
        start.append(s), end.append(e), interval.append(iv)
    return Vars(start, end, interval, option)


def add_no_overlap(m, p: Problem, v: Vars) -> None:
    for tasks in p.resources().values():
        # zero-length tasks (a posted send) never block a stream
        busy = [v.interval[i] for i in tasks if p.dur[i] > 0]
        if len(busy) > 1:
            m.add_no_overlap(busy)


def add_dependencies(m, p: Problem, v: Vars) -> None:
    for a, b, lag in p.edges:
        lits = {id(x): x for x in v.present(p, a) + v.present(p, b)}
        m.add(v.start[b] >= v.end[a] + lag).only_enforce_if(list(lits.values()))


def add_rendezvous(m, p: Problem, v: Vars) -> None:
    for group in p.rendezvous:
        for j in group[1:]:
            lits = {id(x): x for x in v.present(p, group[0]) + v.present(p, j)}
            m.add(v.start[j] == v.start[group[0]]).only_enforce_if(list(lits.values()))


def add_choices(m, p: Problem, v: Vars) -> None:
    for options in p.choices:
        m.add_exactly_one(v.option[o] for o in options)


def add_memory(m, p: Problem, v: Vars, horizon: int) -> None:
    by_rank: dict[int, list] = {}
    for rank, nbytes, alloc, free in p.buffers:
        by_rank.setdefault(rank, []).append((nbytes, alloc, free, False))
    for rank, nbytes, holder, free in p.late_buffers:
        by_rank.setdefault(rank, []).append((nbytes, holder, free, True))
    for rank, bufs in by_rank.items():
        cap = p.capacity.get(rank)
        if cap is None:
            continue
        times, changes = [], []
        for nbytes, alloc, free, late in bufs:
            if late:
                # held from the holder's end to the later end: a max equality, so that a free
                # task that ends first leaves an empty interval (+bytes and -bytes at once)
                assert p.option[alloc] is None and p.option[free] is None, "a late buffer's tasks always run"
                freed = m.new_int_var(0, horizon, "")
                m.add_max_equality(freed, [v.end[alloc], v.end[free]])
                v.later_end.append((freed, alloc, free))
                times += [v.end[alloc], freed]
            else:
                times += [v.start[alloc], v.end[free]]
            changes += [nbytes, -nbytes]
        m.add_reservoir_constraint(times, changes, 0, cap)


def add_fixed_order(m, p: Problem, v: Vars) -> None:
    for chain in p.chains:
        for a, b in zip(chain, chain[1:]):
            m.add(v.start[b] >= v.end[a])


def add_phases(m, p: Problem, v: Vars, horizon: int) -> None:
    for groups in p.phases:
        for g0, g1 in zip(groups, groups[1:]):
            b = m.new_int_var(0, horizon, "")
            v.boundary.append((b, g0))
            for i in g0:
                m.add(v.end[i] <= b)
            for j in g1:
                m.add(v.start[j] >= b)


def add_makespan_objective(m, p: Problem, v: Vars, horizon: int) -> None:
    if p.periodic:
        return add_period_objective(m, p, v, horizon)
    # a task with a mandatory successor ends before it: only the others bound C
    has_succ = {a for a, b, _ in p.edges if p.option[b] is None}
    v.makespan = m.new_int_var(0, horizon, "makespan")
    for i in range(p.n):
        if i not in has_succ:
            m.add(v.makespan >= v.end[i]).only_enforce_if(v.present(p, i))
    m.minimize(v.makespan)


def add_period_objective(m, p: Problem, v: Vars, horizon: int) -> None:
    """minimise P >= hi_q - lo_q, lo_q <= start_i, hi_q >= end_i for every task i of rank q:
    the steady-state cycle (Problem.periodic). A task with a successor on its own rank in
    a fixed chain ends before it, but chains are few; every task bounds its rank's span."""
    v.makespan = m.new_int_var(0, horizon, "period")
    by_rank: dict = {}
    for i, r in enumerate(p.resource):
        by_rank.setdefault(r[0], []).append(i)
    for r, tasks in by_rank.items():
        lo, hi = m.new_int_var(0, horizon, f"lo{r}"), m.new_int_var(0, horizon, f"hi{r}")
        v.window[r] = (lo, hi)
        for i in tasks:
            lits = v.present(p, i)
            m.add(lo <= v.start[i]).only_enforce_if(lits)
            m.add(hi >= v.end[i]).only_enforce_if(lits)
        m.add(v.makespan >= hi - lo)
    m.minimize(v.makespan)


# --- solving ----------------------------------------------------------------------------


def add_hint(m, p: Problem, v: Vars, hint: Schedule) -> None:
    taken = {p.option[i] for i, s in enumerate(hint.start) if s is not None and p.option[i] is not None}
    for o, lit in v.option.items():
        m.add_hint(lit, o in taken)
    for i, s in enumerate(hint.start):  # an absent task: any start (its constraints are off)
        m.add_hint(v.start[i], 0 if s is None else s)
    m.add_hint(v.makespan, hint.makespan)
    for b, before in v.boundary:
        m.add_hint(b, max((hint.start[i] + p.dur[i] for i in before), default=0))
    for e, a, b in v.later_end:
        m.add_hint(e, max(hint.start[a] + p.dur[a], hint.start[b] + p.dur[b]))
    # every variable hinted: an incomplete hint is only a search preference, and CP-SAT
    # may not complete it into a solution for minutes on a large periodic model
    lo: dict = {}
    hi: dict = {}
    for i, s in enumerate(hint.start):
        if s is not None:
            r = p.resource[i][0]
            lo[r] = min(lo.get(r, s), s)
            hi[r] = max(hi.get(r, s), s + p.dur[i])
    for r, (lo_var, hi_var) in v.window.items():
        m.add_hint(lo_var, lo.get(r, 0))
        m.add_hint(hi_var, hi.get(r, 0))


@dataclass
class Result:
    status: str  # OPTIMAL, FEASIBLE, INFEASIBLE, UNKNOWN, MODEL_INVALID
    schedule: Schedule | None
    objective: int | None
    bound: int
    seconds: float
    trace: list[tuple[float, int, int]] = field(default_factory=list)  # (s, incumbent, bound)


class _Progress(cp_model.CpSolverSolutionCallback):
    def __init__(self, on_solution=None):
        super().__init__()
        self.t0 = time.perf_counter()
        self.trace: list[tuple[float, int, int]] = []
        self.on_solution = on_solution

    def on_solution_callback(self):
        row = (time.perf_counter() - self.t0, int(self.objective_value), int(self.best_objective_bound))
        self.trace.append(row)
        if self.on_solution:
            self.on_solution(*row)


def solve(p: Problem, *, time_limit: float = 60.0, workers: int = 2, hint: Schedule | None = None,
          horizon: int | None = None, on_solution=None, extra_bound: int = 0,
          pinned: dict[int, int] | None = None, deadline: float | None = None) -> Result:
    """Solve to optimality or the time limit. `extra_bound` is a known lower bound on the
    makespan (pfcompile.place.bounds); it tightens the model and the reported gap. `pinned`
    fixes the start of some tasks (a decomposition's earlier stage). `deadline` (a
    time.monotonic()): the search ends by then, whatever building the model took."""
    horizon = horizon or (max(p.horizon(), hint.makespan + 1) if hint else p.horizon())
    m, v = build_model(p, horizon)
    if extra_bound:
        m.add(v.makespan >= extra_bound)
    for i, t0 in (pinned or {}).items():
        m.add(v.start[i] == t0)
    if hint is not None:
        add_hint(m, p, v, hint)
    solver = cp_model.CpSolver()
    if deadline is not None:  # building the model took time too: the search gets what is left
        time_limit = max(0.01, min(time_limit, deadline - time.monotonic()))
    solver.parameters.max_time_in_seconds = float(time_limit)
    solver.parameters.num_workers = int(workers)
    solver.parameters.expand_reservoir_constraints = False
    cb = _Progress(on_solution)
    t0 = time.perf_counter()
    status = solver.solve(m, cb)
    seconds = time.perf_counter() - t0
    name = solver.status_name(status)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return Result(name, None, None, int(solver.best_objective_bound), seconds, cb.trace)
    start: list[int | None] = []
    for i, o in enumerate(p.option):
        ok = o is None or solver.boolean_value(v.option[o])
        start.append(int(solver.value(v.start[i])) if ok else None)
    mk = int(solver.objective_value)
    return Result(name, Schedule(start, mk), mk, int(solver.best_objective_bound), seconds, cb.trace)
