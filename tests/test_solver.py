"""The CP-SAT planner: exact on tiny instances, valid and never worse than the greedy on real ones."""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pfcompile.bounds import lower_bounds
from pfcompile.cpmodel import solve
from pfcompile.problem import Problem, violations

# --- tiny random problems against exhaustive search -------------------------------------


@st.composite
def tiny_problems(draw):
    """3-4 tasks on 2 resources, random precedences with lags, maybe a 2-way choice and a
    memory limit: small enough to enumerate every start time."""
    p = Problem()
    n = draw(st.integers(2, 3))
    for i in range(n):
        p.add(i, draw(st.integers(0, 3)), (draw(st.integers(0, 1)), "compute"))
    for a, b in itertools.combinations(range(n), 2):
        if draw(st.booleans()):
            p.edges.append((a, b, draw(st.integers(0, 1))))
    if draw(st.booleans()):  # one choice: the same work on either resource
        d = draw(st.integers(1, 3))
        x = p.add("alt0", d, (0, "compute"), option=0)
        y = p.add("alt1", d, (1, "compute"), option=1)
        p.choices.append([0, 1])
        src = draw(st.integers(0, n - 1))
        p.edges += [(src, x, 0), (src, y, 0)]
    if draw(st.booleans()) and n >= 2:  # two buffers on rank 0 competing for memory
        p.buffers.append((0, 2, 0, 0))
        p.buffers.append((0, 2, 1, 1))
        p.capacity[0] = draw(st.sampled_from([2, 4]))
    if draw(st.booleans()) and n >= 3 and p.tasks[1].resource != p.tasks[2].resource:
        p.rendezvous.append([1, 2])
    return p


def level_ok(p: Problem, start, end) -> bool:
    for rank, cap in p.capacity.items():
        if cap is None:
            continue
        events = [(start[a], nb) for r, nb, a, f in p.buffers if r == rank] + \
                 [(end[f], -nb) for r, nb, a, f in p.buffers if r == rank]
        for t, _ in events:
            if not 0 <= sum(c for u, c in events if u <= t) <= cap:
                return False
    return True


def brute_force(p: Problem) -> int | None:
    """Minimal makespan over every integer start time in [0, horizon] and every option."""
    H = p.horizon()
    by_opt = p.option_tasks()
    best = None
    for picks in itertools.product(*p.choices) if p.choices else [()]:
        absent = {i for c, o in zip(p.choices, picks) for other in c if other != o for i in by_opt[other]}
        live = [i for i in range(len(p.tasks)) if i not in absent]
        for starts in itertools.product(range(H + 1), repeat=len(live)):
            start = dict(zip(live, starts))
            end = {i: start[i] + p.tasks[i].dur for i in live}
            if any(a in start and b in start and start[b] < end[a] + lag for a, b, lag in p.edges):
                continue
            if any(start[i] != start[j] for g in p.rendezvous for i in g for j in g if i in start and j in start):
                continue
            if any(p.tasks[i].resource == p.tasks[j].resource and p.tasks[i].dur and p.tasks[j].dur
                   and start[i] < end[j] and start[j] < end[i] for i, j in itertools.combinations(live, 2)):
                continue
            if not level_ok(p, start, end):
                continue
            mk = max(end.values(), default=0)
            best = mk if best is None else min(best, mk)
    return best


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tiny_problems())
def test_optimal_on_tiny_instances_matches_exhaustive_search(p):
    want = brute_force(p)
    res = solve(p, time_limit=10, workers=1)
    if want is None:
        assert res.status == "INFEASIBLE"
        return
    assert res.status == "OPTIMAL"
    assert res.objective == want
    assert violations(p, res.schedule) == []
    assert lower_bounds(p).makespan <= want


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tiny_problems())
def test_list_schedule_is_feasible_and_never_below_the_optimum(p):
    from pfcompile.list_schedule import list_schedule

    s = list_schedule(p)
    assert violations(p, s, memory=False) == []
    want = brute_force(p.__class__(p.tasks, p.edges, p.rendezvous, p.choices, [], {}, p.chains))
    assert want is not None and s.makespan >= want
