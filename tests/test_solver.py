"""The CP-SAT planner: exact on tiny instances, valid and never worse than the greedy on real ones."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from helpers import uniform_profile
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pfcompile.place.bounds import lower_bounds
from pfcompile.place.cpmodel import solve
from pfcompile.place.problem import Problem, violations

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
        if draw(st.booleans()):  # and one left by task 0 at its end, held until task 1's end if later
            p.late_buffers.append((0, 2, 0, 1))
        p.capacity[0] = draw(st.sampled_from([2, 4]))
    if draw(st.booleans()) and n >= 3 and p.resource[1] != p.resource[2]:
        p.rendezvous.append([1, 2])
    return p


def level_ok(p: Problem, start, end) -> bool:
    for rank, cap in p.capacity.items():
        if cap is None:
            continue
        events = [(start[a], nb) for r, nb, a, f in p.buffers if r == rank] + \
                 [(end[f], -nb) for r, nb, a, f in p.buffers if r == rank]
        # a late buffer: [end of its holder, the later of both ends]
        events += [e for r, nb, h, f in p.late_buffers if r == rank
                   for e in ((end[h], nb), (max(end[h], end[f]), -nb))]
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
        live = [i for i in range(p.n) if i not in absent]
        for starts in itertools.product(range(H + 1), repeat=len(live)):
            start = dict(zip(live, starts))
            end = {i: start[i] + p.dur[i] for i in live}
            if any(a in start and b in start and start[b] < end[a] + lag for a, b, lag in p.edges):
                continue
            if any(start[i] != start[j] for g in p.rendezvous for i in g for j in g if i in start and j in start):
                continue
            if any(p.resource[i] == p.resource[j] and p.dur[i] and p.dur[j]
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


@pytest.mark.parametrize("order,late,want", [
    ("HXU", True, None),   # the late buffer (H's end to U's) overlaps X's: 4 bytes > 2
    ("HXU", False, 4),
    ("UHX", True, 4),      # U ended before H: nothing held
    ("HUX", True, 4)])     # held [2, 3], freed as X allocates at 3
def test_late_buffer_is_held_from_its_holders_end_to_the_later_end(order, late, want):
    """A buffer left by H at its end and freed by U (a split backward's K-FAC kept input):
    CP-SAT's max-equality reservoir against exhaustive search, on one rank of capacity 2
    where H holds 2 bytes while it runs and X 2 bytes while it runs."""
    p = Problem()
    ids = {name: p.add(name, d, (0, "compute")) for name, d in (("H", 2), ("U", 1), ("X", 1))}
    p.edges += [(ids[a], ids[b], 0) for a, b in zip(order, order[1:])]
    p.buffers += [(0, 2, ids["H"], ids["H"]), (0, 2, ids["X"], ids["X"])]
    if late:
        p.late_buffers.append((0, 2, ids["H"], ids["U"]))
    p.capacity[0] = 2
    assert brute_force(p) == want
    res = solve(p, time_limit=10, workers=1)
    if want is None:
        assert res.status == "INFEASIBLE"
    else:
        assert res.status == "OPTIMAL" and res.objective == want and violations(p, res.schedule) == []


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tiny_problems())
def test_list_schedule_is_feasible_and_never_below_the_optimum(p):
    from pfcompile.place.list_schedule import list_schedule

    want = brute_force(replace(p, buffers=[], late_buffers=[], capacity={}, phases=[]))
    assume(want is not None)  # a collective whose members depend on each other: no schedule
    s = list_schedule(p)
    assert violations(p, s, memory=False) == []
    assert s.makespan >= want


# --- real task graphs: plans that the replay accepts --------------------------------------

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from pfcompile.check.replay import replay  # noqa: E402
from pfcompile.formats.errors import InputError  # noqa: E402
from pfcompile.formats.ops import Op  # noqa: E402
from pfcompile.formats.plan import plan_from_json  # noqa: E402
from pfcompile.graph.schedules import PipelineConfig  # noqa: E402
from pfcompile.place.build import build_plan  # noqa: E402
from pfcompile.place.options import Planning, PlanOptions
from pfcompile.place.solver import solve_plan  # noqa: E402

FAMILIES = {
    "gpipe": dict(schedule="gpipe", stages=2, micro_batches=3),
    "1f1b": dict(schedule="1f1b", stages=3, micro_batches=3),
    "1f1b-dp": dict(schedule="1f1b", stages=2, micro_batches=4, replicas=2),
    "interleaved": dict(schedule="interleaved", stages=2, micro_batches=2, virtual_stages=2),
    "chimera": dict(schedule="chimera", stages=4, micro_batches=4),
}


def _profile(kw, **costs):
    return uniform_profile(blocks=kw["stages"] * kw.get("virtual_stages", 1), latency_ms=0.05, out_bytes=100,
                           **costs)


def _ops(plan, kind):
    return [(q, po.op) for q, steps in enumerate(plan.ranks) for ops in steps for po in ops if po.op.kind == kind]


# (family, fixed order) where CP-SAT's own plan is faster than PipeFisher's greedy on these
# synthetic profiles by more than the 0.05 ms the test asks for
GREEDY_BEATEN = {("1f1b", False), ("interleaved", True), ("interleaved", False), ("chimera", True),
                 ("chimera", False)}


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "free"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_cpsat_plans_pass_the_replay_and_beat_or_match_the_greedy(family, fixed):
    kw = FAMILIES[family]
    prof = _profile(kw, curv=0.3, inv=0.7)
    cfg = PipelineConfig(**kw)
    # CP-SAT's own solution: no falling back to the greedy's plan, which would make
    # "beats or matches the greedy" hold by construction
    plan = solve_plan(prof, cfg, PlanOptions(time_limit=3, workers=1, fixed_order=fixed, fall_back_to_greedy=False))
    assert plan.stats["fell_back_to_greedy"] is False
    # an independent replay of the stored plan: dependencies, pairing, collectives, memory
    again = replay(plan_from_json(plan.to_json()), prof)
    assert again.step_time_ms == pytest.approx(plan.stats["step_time_ms"], rel=1e-6)
    assert plan.config.method == "cpsat" and plan.config.fixed_order is fixed
    greedy, _, _ = build_plan(prof, cfg, PlanOptions("greedy"))
    assert plan.stats["step_time_ms"] <= greedy.stats["step_time_ms"] + 1e-3
    if (family, fixed) in GREEDY_BEATEN:
        assert plan.stats["step_time_ms"] < greedy.stats["step_time_ms"] - 0.05
    # every plan states its distance from the best possible
    st = plan.stats
    assert 0 <= st["gap"] < 1 and st["best_bound_step_time_ms"] <= st["objective_step_time_ms"] + 1e-9
    assert st["refresh_steps_lower_bound"] >= 1
    assert (st["refresh_steps"] >= st["refresh_steps_lower_bound"]
            or st["step_time_ms"] > st["refresh_steps_bound_step_time_ms"])
    # the model's step time (integer µs, 1 µs floor for zero-length ops) bounds the replay's
    assert st["step_time_ms"] <= st["objective_step_time_ms"] + 1e-6
    if fixed:  # the family's forward/backward order is kept on every rank
        base = build_plan(prof, cfg, PlanOptions("none"))[0]
        for q in range(cfg.world_size):
            passes = lambda p, q=q: [po.op for po in p.ranks[q][0] if po.op.kind in ("fwd", "bwd")]  # noqa: E731
            assert passes(plan) == passes(base)


def test_the_k_rule_measures_a_k_against_its_timeline_s_bound_not_an_unproven_incumbent():
    """ZB-H1's W passes are free: with little time, the k steps' timeline without refresh
    work stays a list schedule well above its optimum. A k packed as badly as that timeline
    is not "within tolerance of the no-refresh step": the rule compares with the timeline's
    lower bound (bert-tiny's committed profile, real CP-SAT calls of 10 ms)."""
    from pfcompile.formats.profile import load_profile
    from pfcompile.place.solver import search_k, warm_start

    prof = load_profile(str(Path(__file__).resolve().parents[1] / "profiles/bert-tiny-cpu.json"))
    cfg = PipelineConfig("zb-h1", stages=2, micro_batches=4, optimizer="kfac", inversion="balanced", precond="all")
    opts = PlanOptions(time_limit=0.01, workers=1)
    planning = Planning()
    warm = warm_start(prof, cfg, opts, planning)
    search = search_k(prof, cfg, opts, planning, [warm.k, warm.k + 1], warm)
    tol = 1 + opts.tolerance
    assert all(s.reference_bound <= s.reference for s in search.tried)
    # the case: some k's step is within tolerance of its timeline's incumbent, which is not proven
    assert any(s.schedule.makespan <= s.reference * tol and s.reference_bound < s.reference for s in search.tried)
    # accepted exactly when a k's step is within tolerance of its timeline's bound
    assert search.accepted == any(s.schedule.makespan <= s.reference_bound * tol for s in search.tried)
    stats = solve_plan(prof, cfg, opts).stats
    assert all(e["no_refresh_bound_step_time_ms"] <= e["no_refresh_step_time_ms"] for e in stats["k_search"])


def test_a_plan_that_falls_back_to_the_greedy_says_so():
    kw = FAMILIES["1f1b"]
    prof = _profile(kw, curv=0.3, inv=2.0)
    cfg = PipelineConfig(**kw)
    greedy, _, _ = build_plan(prof, cfg, PlanOptions("greedy"))
    # a lax k rule (accept the first k tried, within 100% of the no-refresh step): CP-SAT
    # keeps a short cycle that is slower than the greedy's longer one
    lax = dict(time_limit=2, workers=1, tolerance=1.0, extra_steps=0)
    own = solve_plan(prof, cfg, PlanOptions(**lax, fall_back_to_greedy=False))
    assert own.stats["fell_back_to_greedy"] is False and own.refresh_steps < greedy.refresh_steps
    assert own.stats["step_time_ms"] > greedy.stats["step_time_ms"]
    back = solve_plan(prof, cfg, PlanOptions(**lax))
    assert back.stats["fell_back_to_greedy"] is True and back.stats["solution_from"].startswith("greedy")
    assert back.refresh_steps == greedy.refresh_steps
    assert back.stats["step_time_ms"] == pytest.approx(greedy.stats["step_time_ms"], rel=1e-9)


def test_replicas_invert_each_factor_once_and_share_the_work():
    kw = FAMILIES["chimera"]
    prof = _profile(kw, curv=0.1, inv=2.0)  # inversion dominates: where it runs matters
    plan = solve_plan(prof, PipelineConfig(**kw), PlanOptions(time_limit=5, workers=1))
    invs = _ops(plan, "inv")
    factors = {(op.layer, op.factor) for _, op in invs}
    assert len(invs) == len(factors) == 2 * len(prof.covered_layers)  # once, not once per replica
    for _q, op in _ops(plan, "bcast_inv"):  # every replica gets the inverse from its inverter
        assert (op.peer, Op("inv", layer=op.layer, factor=op.factor)) in invs
    per_rank = [sum(1 for q, _ in invs if q == r) for r in range(4)]
    # chimera pairs rank q with rank 3-q: each pair holds 2 stages x 2 layers x 2 factors
    assert per_rank[0] + per_rank[3] == per_rank[1] + per_rank[2] == 8
    assert max(per_rank) <= 5  # shared: neither rank of a pair inverts (nearly) everything


def test_memory_limit_below_the_possible_names_rank_and_smallest_limit():
    kw = FAMILIES["1f1b"]
    prof = _profile(kw)
    cfg = PipelineConfig(**kw, memory_limit_bytes=500)
    with pytest.raises(InputError) as e:
        solve_plan(prof, cfg, PlanOptions(time_limit=2, workers=1))
    msg = str(e.value)
    assert msg.startswith("--memory-limit: rank ") and "smallest feasible limit" in msg and "\n" not in msg
    smallest = int(msg.split("smallest feasible limit under the family's order is ")[1].split()[0])
    # exactly that limit is feasible, and binding on the rank the message names
    cfg.memory_limit_bytes = smallest
    plan = solve_plan(prof, cfg, PlanOptions(time_limit=3, workers=1))
    peaks = replay(plan, prof).peak_memory_bytes
    assert max(peaks) <= smallest
    assert peaks[int(msg.split("rank ")[1].split()[0])] == smallest


def test_memory_limit_below_the_greedy_peak_is_met():
    kw = FAMILIES["1f1b"]
    prof = _profile(kw, curv=0.3, inv=0.7)
    greedy, _, _ = build_plan(prof, PipelineConfig(**kw), PlanOptions("greedy"))
    peak = max(greedy.stats["peak_memory_bytes"])
    with pytest.raises(InputError) as e:
        solve_plan(prof, PipelineConfig(**kw, memory_limit_bytes=1), PlanOptions(time_limit=2, workers=1))
    smallest = int(str(e.value).split("the smallest feasible limit under the family's order is ")[1].split()[0])
    assert smallest < peak  # the greedy (no memory model) keeps more kept tensors alive than needed
    limit = (smallest + peak) // 2
    plan = solve_plan(prof, PipelineConfig(**kw, memory_limit_bytes=limit), PlanOptions(time_limit=5, workers=1))
    assert max(replay(plan, prof).peak_memory_bytes) <= limit < peak


@pytest.mark.e2e
def test_cli_cpsat_is_the_default_and_reports_solver_stats(tmp_path):
    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "p.json"
    r = subprocess.run([sys.executable, "-m", "pfcompile", "plan", str(repo / "profiles/bert-base-p100-ref.json"),
                        "--schedule", "1f1b", "--stages", "2", "--micro-batches", "2", "--time-limit", "3",
                        "--workers", "1", "--json", "-o", str(out)], capture_output=True, text=True, cwd=repo,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    stats = json.loads(r.stdout)
    assert stats["method"] == "cpsat" and stats["solver_status"] in ("OPTIMAL", "FEASIBLE")
    assert stats["gap"] is not None and stats["step_time_ms"] > 0 and out.exists()
    bad = subprocess.run([sys.executable, "-m", "pfcompile", "plan", str(repo / "profiles/bert-base-p100-ref.json"),
                          "--schedule", "1f1b", "--stages", "2", "--micro-batches", "2", "--workers", "0",
                          "-o", str(tmp_path / "q.json")], capture_output=True, text=True, cwd=repo, timeout=300)
    assert bad.returncode == 2 and "--workers" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "q.json").exists()


def test_an_exhausted_time_limit_skips_cpsat_and_still_returns_a_checked_plan():
    from pfcompile.place.budget import Budget

    kw = FAMILIES["chimera"]
    prof = _profile(kw, curv=0.3, inv=0.7)
    budget = Budget(0.0)  # the command's time is already up: no CP-SAT call may start
    plan = solve_plan(prof, PipelineConfig(**kw), PlanOptions(time_limit=30, workers=1), Planning(budget=budget))
    assert budget.cap(1.0) == 0.0
    st = plan.stats
    assert st["stage_seconds"].get("solve", 0.0) == 0.0  # no search ran
    assert {"graph", "warm start", "replay"} <= set(st["stage_seconds"])
    assert st["solver_status"] in ("FEASIBLE", "OPTIMAL") and len(st["k_search"]) == 1  # no second k tried
    again = replay(plan_from_json(plan.to_json()), prof)  # a valid plan from the warm starts
    assert again.step_time_ms == pytest.approx(st["step_time_ms"], rel=1e-6)


def test_a_search_that_spends_its_share_still_leaves_the_plan_its_expected_step_time():
    """With an op-time spread in the profile, the reserve kept before the search grows by the
    expected step time's least replay (EXPECTED_STEP_MIN_STEPS steps, twice: the plan and its
    baseline) at the run's cost per drawn op, and a search that ran to its deadline (all that
    is left is the reserve) still leaves the plan that figure, from that replay: as many
    steps, not a few refresh cycles (which publish one draw's luck as the plan's step)."""
    import time

    from pfcompile.check.replay import expected_step_time
    from pfcompile.place.budget import EXPECTED_STEP_MIN_STEPS, Budget
    from pfcompile.place.build import _add_expected_step_time
    from pfcompile.place.solver import keep_time_for_the_plan, warm_start

    kw = FAMILIES["1f1b"]
    prof = _profile(kw, curv=0.3, inv=0.7)
    prof.runtime.level_spread = [0.8] * 10 + [1.2] * 10
    cfg, opts = PipelineConfig(**kw), PlanOptions(time_limit=30, workers=1)
    plan = solve_plan(prof, cfg, opts)
    reserve = {}
    for spread in (False, True):
        budget = Budget(600.0)
        budget.replay_s_per_op, budget.spread_s_per_op = 1e-3, 1e-5
        warm = warm_start(prof, cfg, opts, Planning(budget=budget))
        keep_time_for_the_plan(budget, warm, opts, spread=spread)
        reserve[spread] = budget.reserve
    ops_per_step = sum(len(ops) for steps in warm.steps.values() for ops in steps) / warm.k
    assert reserve[True] - reserve[False] >= 2 * EXPECTED_STEP_MIN_STEPS * ops_per_step * 1e-5 * (1 - 1e-9)
    budget.deadline = time.monotonic() + budget.reserve  # the search used every second of its share
    assert budget.left() <= 0.0
    plan.stats.pop("expected_step_time_ms", None)
    _add_expected_step_time(plan, prof, Planning(budget=budget))
    assert plan.stats["expected_step_time_ms"] > plan.stats["step_time_ms"]
    # from the least replay: the same figure as expected_step_time over that many steps
    k = plan.refresh_steps
    steps = k * -(-EXPECTED_STEP_MIN_STEPS // k)
    assert plan.stats["expected_step_time_ms"] == pytest.approx(
        expected_step_time(plan, prof, steps=steps, max_instances=steps // k * plan.stats["tasks"]), abs=1e-6)


def test_a_time_limited_plan_prices_its_drawn_replay_and_publishes_the_long_figure():
    """Under a wall-clock limit with an op-time spread, planning measures what a drawn op
    instance costs (budget.spread_s_per_op, before the search) and the plan's expected
    overhead is the one of EXPECTED_STEP_MIN_STEPS steps or more: its figures equal the
    plan's and its baseline's replays over the steps it names, not a 3-cycle draw."""
    from pfcompile.check.replay import expected_step_time
    from pfcompile.place import assemble
    from pfcompile.place.budget import EXPECTED_STEP_MIN_STEPS, Budget

    kw = FAMILIES["1f1b"]
    prof = _profile(kw, curv=0.3, inv=0.7)
    prof.runtime.level_spread = [0.8] * 10 + [1.2] * 10
    cfg = PipelineConfig(**kw)
    planning = Planning(budget=Budget(20.0))
    plan = build_plan(prof, cfg, PlanOptions("cpsat", time_limit=20, workers=1), planning=planning)[0]
    assert planning.budget.spread_s_per_op is not None and 0 < planning.budget.spread_s_per_op < 1e-2
    st_ = plan.stats
    steps = st_["expected_step_replay_steps"]
    assert steps >= EXPECTED_STEP_MIN_STEPS
    assert st_["expected_step_time_ms"] == pytest.approx(expected_step_time(plan, prof, steps=steps), abs=1e-6)
    base = assemble.baseline_plan(prof, cfg, check_memory=False)[0]
    expected_base = expected_step_time(base, prof, steps=steps, max_instances=steps * base.stats["tasks"])
    assert st_["expected_step_overhead"] == pytest.approx(st_["expected_step_time_ms"] / expected_base - 1, abs=2e-6)


def test_the_expected_overhead_is_over_the_first_order_plan_replayed_as_long():
    """stats.expected_step_overhead: the plan's expected step (the ops' spread drawn) over
    the family's AdamW plan's, built apart here and replayed over as many steps; a plan
    whose work fills the bubbles pays more for the same spread than its baseline does."""
    from pfcompile.check.replay import expected_step_time, spread_replay_cycles
    from pfcompile.place.build import build_plan

    kw = FAMILIES["1f1b"]
    prof = _profile(kw, curv=0.3, inv=0.7)
    plan = build_plan(prof, PipelineConfig(**kw), PlanOptions("greedy"))[0]
    assert "expected_step_overhead" not in plan.stats  # no spread in the profile, no expected step
    prof.runtime.level_spread = [0.8] * 10 + [1.2] * 10
    plan = build_plan(prof, PipelineConfig(**kw), PlanOptions("greedy"))[0]
    first = build_plan(prof, PipelineConfig(**kw, optimizer="adamw"), PlanOptions("greedy"))[0]
    assert "expected_step_overhead" not in first.stats  # its own baseline
    steps = plan.refresh_steps * spread_replay_cycles(plan.refresh_steps, plan.stats["tasks"])
    base = expected_step_time(first, prof, steps=steps, max_instances=steps * first.stats["tasks"])
    assert base > first.stats["step_time_ms"]
    assert plan.stats["expected_baseline_step_time_ms"] == pytest.approx(base, abs=1e-6)
    assert plan.stats["expected_step_overhead"] == pytest.approx(plan.stats["expected_step_time_ms"] / base - 1,
                                                                 abs=2e-6)
    assert plan.stats["expected_step_overhead"] > plan.stats["step_overhead"] + 0.005
    # a cut chosen with the plan: the kept candidate's baseline, not a fresh one's
    auto = build_plan(prof, PipelineConfig(**kw), PlanOptions("greedy", partition="auto"))[0]
    assert "expected_step_overhead" in auto.stats
