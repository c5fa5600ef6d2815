"""Lower bounds (pfcompile.place.bounds) are below the optimum: checked against exhaustive
search on tiny periodic problems and against CP-SAT's proven optima of small real cycles;
the rank-span bound is strictly above the older bounds where a pipeline's waits matter."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from helpers import uniform_profile
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pfcompile.graph.schedules import PipelineConfig
from pfcompile.place.bounds import jackson_preemptive, lower_bounds, rank_span_bounds
from pfcompile.place.cpmodel import solve
from pfcompile.place.cycle_model import cycle_from_graph, cycle_graph
from pfcompile.place.problem import Problem


@st.composite
def tiny_periodic(draw):
    """3-4 tasks on 2 ranks, random precedences with lags, maybe a phase boundary on rank
    0, a collective, a 2-way choice: small enough to enumerate every start time."""
    p = Problem(periodic=True)
    n = draw(st.integers(3, 4))
    for i in range(n):
        p.add(i, draw(st.integers(1, 3)), (draw(st.integers(0, 1)),))
    for a, b in itertools.combinations(range(n), 2):
        if draw(st.booleans()):
            p.edges.append((a, b, draw(st.integers(0, 2))))
    on0 = [i for i in range(n) if p.resource[i] == (0,)]
    if len(on0) >= 2 and draw(st.booleans()):
        cut = draw(st.integers(1, len(on0) - 1))
        p.phases.append([on0[:cut], on0[cut:]])
    if draw(st.booleans()) and p.resource[0] != p.resource[n - 1]:
        p.rendezvous.append([0, n - 1])
    if n == 3 and draw(st.booleans()):  # which rank runs a task
        d = draw(st.integers(1, 3))
        x, y = p.add("alt0", d, (0,), option=0), p.add("alt1", d, (1,), option=1)
        p.choices.append([0, 1])
        src = draw(st.integers(0, n - 1))
        p.edges += [(src, x, 0), (src, y, 0)]
    return p


def brute_force_period(p: Problem) -> int | None:
    """The least period (largest rank span) over every integer start time and option."""
    H = sum(p.dur) + sum(lag for _, _, lag in p.edges)
    by_opt = p.option_tasks()
    best = None
    for picks in itertools.product(*p.choices) if p.choices else [()]:
        absent = {i for c, o in zip(p.choices, picks) for other in c if other != o for i in by_opt[other]}
        live = [i for i in range(p.n) if i not in absent]
        for starts in itertools.product(range(H + 1), repeat=len(live)):
            s = dict(zip(live, starts))
            e = {i: s[i] + p.dur[i] for i in live}
            if any(a in s and b in s and s[b] < e[a] + lag for a, b, lag in p.edges):
                continue
            if any(s[i] != s[j] for g in p.rendezvous for i in g for j in g if i in s and j in s):
                continue
            if any(p.resource[i] == p.resource[j] and s[i] < e[j] and s[j] < e[i]
                   for i, j in itertools.combinations(live, 2)):
                continue
            if any(e[a] > s[b] for g in p.phases for g0, g1 in zip(g, g[1:]) for a in g0 for b in g1):
                continue
            span = max(max(e[i] for i in live if p.resource[i] == (r,)) - min(s[i] for i in live if p.resource[i] == (r,))
                       for r in {p.resource[i][0] for i in live})
            best = span if best is None else min(best, span)
    return best


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tiny_periodic())
def test_rank_span_bound_is_below_the_least_period_found_by_exhaustive_search(p):
    want = brute_force_period(p)
    if want is None:  # a collective whose members depend on each other
        return
    assert lower_bounds(p).makespan <= want
    assert max(rank_span_bounds(p).values(), default=0) <= want


def test_jackson_preemptive_schedule():
    # one job: release + duration + tail
    assert jackson_preemptive([(2, 3, 4)]) == 9
    # the long-tailed job released later preempts: 0-1 a, 1-3 b (ends 3 + tail 10), 3-5 a
    assert jackson_preemptive([(0, 3, 0), (1, 2, 10)]) == 13
    # a gap before a late release counts
    assert jackson_preemptive([(0, 1, 0), (5, 1, 0)]) == 6


# real refresh cycles (one K-FAC layer per block), small enough for CP-SAT to prove its
# optimum without any of our bounds: pipeline timelines and whole cycles with K-FAC
CYCLES = [("1f1b", dict(stages=3, micro_batches=3), False), ("1f1b", dict(stages=2, micro_batches=2, replicas=2), False),
          ("chimera", dict(stages=2, micro_batches=2), False), ("1f1b", dict(stages=2, micro_batches=2), True),
          ("gpipe", dict(stages=2, micro_batches=2), True), ("1f1b", dict(stages=3, micro_batches=2), True)]


def test_bounds_are_below_cpsat_optima_of_small_cycles_and_rank_span_is_tighter():
    tighter = 0
    for family, kw, refresh in CYCLES:
        prof = uniform_profile(blocks=kw["stages"], latency_ms=0.05, out_bytes=100, curv=0.3, inv=0.7,
                               layers_per_block=1)
        tg = cycle_graph(prof, PipelineConfig(schedule=family, **kw), 1)
        cm = cycle_from_graph(tg, fixed_order=True, refresh=refresh, choose_inverter=True, periodic=True)
        res = solve(cm.problem, time_limit=30, workers=1)
        assert res.status == "OPTIMAL", (family, kw, refresh)
        b = lower_bounds(cm.problem)
        assert b.makespan <= res.objective, (family, kw, refresh, b, res.objective)
        tighter += b.rank_span > max(b.device_work, b.shared_work)
    assert tighter >= 1


def test_balanced_inverters_take_one_option_per_choice_and_share_the_inversions():
    """The balanced warm start (pfcompile.place.solver.balanced_options): exactly one
    inverting replica per factor, the inversion work of a stage's replicas within one
    inversion of each other, and a list schedule with that choice that breaks nothing."""
    from pfcompile.place.list_schedule import list_schedule
    from pfcompile.place.problem import violations
    from pfcompile.place.solver import balanced_options

    prof = uniform_profile(blocks=4, latency_ms=0.05, out_bytes=100, curv=0.3, inv=0.7)
    tg = cycle_graph(prof, PipelineConfig(schedule="chimera", stages=4, micro_batches=4), 2)
    p = cycle_from_graph(tg, fixed_order=True, choose_inverter=True, periodic=True).problem
    taken = balanced_options(p)
    assert p.choices and all(len(taken & set(c)) == 1 for c in p.choices)
    by_opt = p.option_tasks()
    inv = {}
    for o in taken:
        for i in by_opt[o]:
            if p.key[i].op.kind == "inv":
                inv[p.resource[i][0]] = inv.get(p.resource[i][0], 0) + p.dur[i]
    longest = max(p.dur[i] for ts in by_opt.values() for i in ts if p.key[i].op.kind == "inv")
    for s in range(4):  # chimera: stage s on ranks s and 3 - s
        assert abs(inv.get(s, 0) - inv.get(3 - s, 0)) <= longest
    s = list_schedule(p, options=taken)
    assert violations(p, s) == []
    assert s.makespan >= lower_bounds(p).makespan


# --- the bounds checked before planning (pfcompile.place.upfront) -----------------------------

UPFRONT_FAMILIES = [dict(schedule="gpipe", stages=4, micro_batches=6), dict(schedule="1f1b", stages=4, micro_batches=7),
                    dict(schedule="1f1b", stages=2, micro_batches=4, replicas=2),
                    dict(schedule="1f1b", stages=2, micro_batches=4, replicas=2, precond="split"),
                    dict(schedule="interleaved", stages=2, micro_batches=4, virtual_stages=2),
                    dict(schedule="zb-h1", stages=3, micro_batches=5), dict(schedule="zb-v", stages=2, micro_batches=4,
                                                                             virtual_stages=2),
                    dict(schedule="chimera", stages=4, micro_batches=8)]


def test_family_step_is_the_greedys_step_and_its_cycle_bound_is_below_the_greedys():
    """The step, bubbles and curvature work the up-front check uses (no task graph) are the
    greedy's (task graph, networkx), on every family, with messages that take time; so
    its k is a lower bound of the greedy's own, and it refuses only what the greedy would."""
    from pfcompile.formats.ops import FLOATING_KINDS
    from pfcompile.formats.profile import load_profile
    from pfcompile.place.greedy import greedy_steps
    from pfcompile.place.upfront import check_cycle, curvature_ms, family_step

    tiny = load_profile(str(Path(__file__).resolve().parents[1] / "profiles" / "bert-tiny-cpu.json"))
    cases = [(uniform_profile(blocks=kw["stages"] * kw.get("virtual_stages", 1), curv=0.3, inv=0.7, latency_ms=0.2), kw)
             for kw in UPFRONT_FAMILIES]  # and the measured profile, with the runtime's overheads
    cases += [(tiny, dict(schedule="chimera", stages=4, micro_batches=8)), (tiny, dict(schedule="gpipe", stages=2,
                                                                                         micro_batches=16))]
    for prof, kw in cases:
        cfg = PipelineConfig(**kw)
        step = family_step(prof, cfg)
        tg, _, info = greedy_steps(prof, cfg)
        assert step.step_ms == info["step_time_model_ms"], kw
        for q, b in info["bubble_ms"].items():
            assert abs(step.bubble_ms[q] - b) < 1e-9, (kw, q)
        curv = {}
        for t in tg.g.nodes:
            if t.op.kind in ("curv_a", "curv_b"):
                curv[t.rank] = curv.get(t.rank, 0.0) + tg.duration(t)
        assert curvature_ms(step.costs, cfg) == pytest.approx(curv, rel=1e-12), kw
        assert all(t.op.kind in FLOATING_KINDS for t in tg.g.nodes if t.step is None)  # curvature is floating work
        assert check_cycle(step, cfg) <= info["refresh_steps"], kw
