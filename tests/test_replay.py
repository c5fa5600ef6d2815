"""The replay: every family's plan passes; hand-broken plans are refused naming the op;
timings and memory against closed forms."""

import copy
from dataclasses import replace

import pytest
from helpers import uniform_profile

from pfcompile.check.replay import ReplayError, replay
from pfcompile.formats.ops import Op
from pfcompile.formats.plan import plan_from_json, task_at
from pfcompile.graph.schedules import PipelineConfig
from pfcompile.graph.taskgraph import build_task_graph
from pfcompile.place.assemble import assemble, baseline_plan, canonical_steps
from pfcompile.place.build import build_plan
from pfcompile.place.options import PlanOptions

FAMILIES = [
    dict(schedule="gpipe", stages=3, micro_batches=4),
    dict(schedule="1f1b", stages=4, micro_batches=6),
    dict(schedule="1f1b", stages=2, micro_batches=4, replicas=2),
    dict(schedule="interleaved", stages=2, micro_batches=4, virtual_stages=2),
    dict(schedule="chimera", stages=4, micro_batches=4),
    dict(schedule="chimera", stages=4, micro_batches=8),
]


def _blocks(kw):
    return kw["stages"] * kw.get("virtual_stages", 1)


@pytest.mark.parametrize("kw", FAMILIES, ids=lambda kw: "-".join(str(v) for v in kw.values()))
@pytest.mark.parametrize("method,kfac", [("none", False), ("none", True), ("greedy", True)])
def test_every_family_passes_the_replay(kw, method, kfac):
    prof = uniform_profile(blocks=_blocks(kw), curv=0.3, inv=0.7)
    cfg = PipelineConfig(**kw, optimizer="kfac" if kfac else "adamw")
    plan, result, baseline = build_plan(prof, cfg, PlanOptions(method))
    # the stored plan round-trips through the runtime's loader and replays to the same numbers
    again = plan_from_json(plan.to_json())
    assert replay(again, prof).cycle_time_ms == pytest.approx(result.cycle_time_ms)
    assert 0 < result.utilization <= 1
    if kfac:
        assert plan.stats["step_time_ms"] >= baseline.step_time_ms - 1e-9
        kinds = {po.op.kind for steps in plan.ranks for ops in steps for po in ops}
        assert {"curv_a", "curv_b", "inv", "precond"} <= kinds
    if method == "greedy":
        # the greedy only fills bubbles: its step is the baseline plus the per-step precond
        precond = 2 * 0.05 * (kw.get("virtual_stages", 1) + (1 if kw["schedule"] == "chimera" else 0))
        assert plan.stats["step_time_ms"] <= baseline.step_time_ms + precond + 1e-3
        # below the k bound no plan runs at the best first-order step time
        assert (plan.stats["refresh_steps"] >= plan.stats["refresh_steps_lower_bound"]
                or plan.stats["step_time_ms"] > plan.stats["tight_baseline_step_time_ms"])


def test_greedy_reaches_the_lower_bound_and_raises_utilization():
    prof = uniform_profile(blocks=4, curv=0.5, inv=1.5)
    plan, result, baseline = build_plan(prof, PipelineConfig("1f1b", stages=4, micro_batches=4), PlanOptions("greedy"))
    assert result.utilization > baseline.utilization
    # work on rank s: 2 layers x 4 mbs x 2 factors x 0.5 + 4 inversions x 1.5 = 14 ms; at the
    # first-order step time (N+D-1)(f+b) = 21 ms a rank is idle 21 - 4x3 - 2x0.05 (its
    # per-step preconditioning) = 8.9 ms, so k >= ceil(14/8.9) = 2
    assert plan.stats["refresh_steps_lower_bound"] == 2
    assert plan.stats["refresh_steps"] >= 2


def test_times_against_hand_computation_with_message_lag():
    """GPipe D=2, N=1: F0, message, F1, B1, message, B0 -> 2f + 2b + 2 lag."""
    prof = uniform_profile(blocks=2, fwd=1.0, bwd=2.0, out_bytes=250_000, latency_ms=0.5)
    _, result = baseline_plan(prof, PipelineConfig("gpipe", stages=2, micro_batches=1))
    lag = 0.5 + 250_000 / 1e6
    assert result.cycle_time_ms == pytest.approx(2 * 1 + 2 * 2 + 2 * lag)
    assert result.busy_ms == [pytest.approx(3.0), pytest.approx(3.0)]


# --- hand-broken plans ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small():
    prof = uniform_profile(blocks=2)
    cfg = PipelineConfig("1f1b", stages=2, micro_batches=2, optimizer="adamw")
    tg = build_task_graph(prof, cfg)
    return prof, tg


def _plan(prof, tg, edit):
    steps = canonical_steps(tg)
    edit(steps)
    return assemble(prof, tg, steps, "none")


def test_reversed_dependency_is_named(small):
    prof, tg = small

    def swap(steps):  # rank 0: backward of mb 0 before its forward
        ops = steps[0][0]
        i, j = ops.index(Op("fwd", stage=0, mb=0)), ops.index(Op("bwd", stage=0, mb=0))
        ops[i], ops[j] = ops[j], ops[i]

    with pytest.raises(ReplayError, match=r"B0\.0 \(rank 0, step 0\) runs before its dependency F0\.0"):
        replay(_plan(prof, tg, swap), prof)


def test_removed_receive_is_named(small):
    prof, tg = small

    def drop(steps):
        steps[1][0].remove(Op("recv_act", stage=0, mb=1, peer=0))

    with pytest.raises(ReplayError, match=r"F1\.1 \(rank 1, step 0\) depends on RA0\.1<0"):
        replay(_plan(prof, tg, drop), prof)


def test_removed_send_deadlocks_naming_the_waiting_receive(small):
    prof, tg = small

    def drop(steps):
        steps[0][0].remove(Op("send_act", stage=0, mb=1, peer=1))

    with pytest.raises(ReplayError, match=r"deadlock: .*rank 1 at RA0\.1<0"):
        replay(_plan(prof, tg, drop), prof)


def test_duplicated_op_is_named(small):
    prof, tg = small

    def dup(steps):
        steps[1][0].append(Op("fwd", stage=1, mb=0))

    with pytest.raises(ReplayError, match=r"F1\.0 \(rank 1, step 0\) is listed twice"):
        replay(_plan(prof, tg, dup), prof)


def test_missing_forward_is_named(small):
    prof, tg = small

    def drop(steps):
        steps[0][0].remove(Op("bwd", stage=0, mb=1))

    with pytest.raises(ReplayError, match=r"B0\.1 \(rank 0, step 0\) is missing"):
        replay(_plan(prof, tg, drop), prof)


def test_op_on_the_wrong_rank_is_named(small):
    prof, tg = small

    def move(steps):
        steps[0][0].insert(0, Op("fwd", stage=1, mb=0))

    with pytest.raises(ReplayError, match=r"F1\.0 \(rank 0, step 0\): rank 0 holds no replica of stage 1"):
        replay(_plan(prof, tg, move), prof)


def test_collectives_in_crossed_order_deadlock():
    prof = uniform_profile(blocks=4)
    tg = build_task_graph(prof, PipelineConfig("chimera", stages=4, micro_batches=4, optimizer="adamw"))
    steps = canonical_steps(tg)
    ops = steps[0][0]  # rank 0 holds stages 0 and 3; swap their gradient all-reduces
    i, j = ops.index(Op("sync_grad", stage=0)), ops.index(Op("sync_grad", stage=3))
    ops[i], ops[j] = ops[j], ops[i]
    with pytest.raises(ReplayError, match=r"deadlock: rank 0 at YG3 .*rank 3 at YG0"):
        replay(assemble(prof, tg, steps, "none"), prof)


def test_missing_kfac_work_is_named():
    prof = uniform_profile(blocks=2)
    plan, _, _ = build_plan(prof, PipelineConfig("1f1b", stages=2, micro_batches=2), PlanOptions("greedy"))
    broken = copy.deepcopy(plan)
    for steps in broken.ranks:
        for ops in steps:
            ops[:] = [po for po in ops if po.op != Op("inv", layer=1, factor="B")]
    with pytest.raises(ReplayError, match=r"I1\.B .* is missing"):
        replay(broken, prof)


def test_memory_limit_is_enforced_naming_the_rank():
    prof = uniform_profile(blocks=2, act_bytes=1000)
    plan, result = baseline_plan(prof, PipelineConfig("gpipe", stages=2, micro_batches=4))
    assert result.peak_memory_bytes[0] == result.resident_bytes[0] + 4 * 1000
    plan.config = replace(plan.config, memory_limit_bytes=result.resident_bytes[0] + 3999)
    with pytest.raises(ReplayError, match=r"rank 0 needs \d+ bytes .* over the limit"):
        replay(plan, prof)


# --- any edit of a valid plan is either still valid or refused with a ReplayError ------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@pytest.fixture(scope="module")
def chimera_small():
    prof = uniform_profile(blocks=4)
    plan, _, _ = build_plan(prof, PipelineConfig("chimera", stages=4, micro_batches=4), PlanOptions("greedy"))
    return prof, plan


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_edits_never_crash_or_hang_the_replay(chimera_small, data):
    prof, plan = chimera_small
    broken = copy.deepcopy(plan)
    q = data.draw(st.integers(0, len(broken.ranks) - 1))
    t = data.draw(st.integers(0, broken.refresh_steps - 1))
    ops = broken.ranks[q][t]
    i = data.draw(st.integers(0, len(ops) - 1))
    action = data.draw(st.sampled_from(["drop", "dup", "swap", "swap next", "move"]))
    if action == "drop":
        del ops[i]
    elif action == "dup":
        ops.insert(data.draw(st.integers(0, len(ops))), ops[i])
    elif action == "swap":
        j = data.draw(st.integers(0, len(ops) - 1))
        ops[i], ops[j] = ops[j], ops[i]
    elif action == "swap next":  # often still valid: two independent neighbours
        j = min(i + 1, len(ops) - 1)
        ops[i], ops[j] = ops[j], ops[i]
    else:
        other = broken.ranks[data.draw(st.integers(0, len(broken.ranks) - 1))][t]
        other.insert(data.draw(st.integers(0, len(other))), ops.pop(i))
    try:
        result = replay(broken, prof)
    except ReplayError as e:
        assert "\n" not in str(e) and ("rank" in str(e) or "ranks" in str(e))
        return
    assert_consistent_timeline(broken, prof, result)  # accepted: it must still be a valid plan


def assert_consistent_timeline(plan, prof, result):
    """An accepted plan is valid, checked against the task graph's rules (the planners'
    pfcompile.graph.taskgraph, not the replay's own): it lists every task of the cycle once,
    each op lasts its cost, a rank runs its list in order without overlap, every dependency
    ends (plus its message's transfer time) before its consumer starts, and the members of
    a collective start together."""
    cfg = PipelineConfig(plan.config.schedule, plan.config.stages, plan.config.micro_batches,
                         replicas=plan.config.replicas, virtual_stages=plan.config.virtual_stages,
                         optimizer=plan.config.optimizer, refresh_steps=plan.refresh_steps,
                         partition=[list(g) for g in plan.partition])
    inverters = {}
    for q, steps in enumerate(plan.ranks):
        for ops in steps:
            for po in ops:
                if po.op.kind == "inv":
                    inverters.setdefault((po.op.layer, po.op.factor), []).append(q)
    tg = build_task_graph(prof, cfg, inverters={k: sorted(v) for k, v in inverters.items()})
    at = {}
    for q, steps in enumerate(plan.ranks):
        prev_end = 0.0
        for t, ops in enumerate(steps):
            for i, po in enumerate(ops):
                start, end = result.times[q][t][i]
                task = task_at(t, q, po.op)
                assert task not in at, f"{task} listed twice"
                at[task] = (start, end)
                assert end - start == pytest.approx(tg.costs.duration(po.op), abs=1e-9)
                assert start >= prev_end - 1e-9, f"{task} overlaps the op before it on rank {q}"
                prev_end = end
    assert set(at) == set(tg.g.nodes)
    for u, v, lag in tg.g.edges(data="lag"):
        assert at[u][1] + lag <= at[v][0] + 1e-9, f"{v} starts before {u} ends"
    for members in tg.collectives.values():
        assert len({round(at[t][0], 9) for t in members}) == 1, f"collective {members} does not start together"


@settings(max_examples=25, deadline=None)
@given(schedule=st.sampled_from(["gpipe", "1f1b", "interleaved", "chimera"]), D=st.integers(1, 6),
       N=st.integers(1, 12), v=st.integers(1, 3), R=st.integers(1, 2))
def test_any_valid_configuration_plans_and_replays(schedule, D, N, v, R):
    from pfcompile.formats.errors import InputError

    try:
        cfg = PipelineConfig(schedule, D, N, replicas=R if schedule != "chimera" else 2,
                             virtual_stages=v if schedule == "interleaved" else 1)
    except InputError:
        return
    prof = uniform_profile(blocks=cfg.num_stages)
    plan, result, baseline = build_plan(prof, cfg, PlanOptions("greedy"))
    if plan.stats["tasks_after_last_step"] == 0:  # all work went into bubbles: only adds busy time
        assert result.utilization >= baseline.utilization - 1e-9
    lb = plan.stats["refresh_steps_lower_bound"]  # None: a rank has refresh work and no idle time
    assert (lb is None or plan.stats["refresh_steps"] >= lb
            or plan.stats["step_time_ms"] > plan.stats["tight_baseline_step_time_ms"])


def test_utilization_definitions_against_closed_forms():
    """PipeFisher's per-step utilization (one step window, collectives busy) and the strict
    one (compute only, cycle mean): 1F1B without K-FAC is N/(N+D-1) under both; with two
    replicas the gradient all-reduce counts as busy only under PipeFisher's definition."""
    from pfcompile.graph.costs import Costs

    D, N = 4, 8
    prof = uniform_profile(blocks=D, fwd=1.0, bwd=2.0)
    _, one = baseline_plan(prof, PipelineConfig("1f1b", stages=D, micro_batches=N))
    assert len(one.utilization_pipefisher) == 1
    assert one.utilization_pipefisher[0] == pytest.approx(N / (N + D - 1), abs=1e-4)
    assert one.utilization_strict == pytest.approx(N / (N + D - 1), abs=1e-4)

    prof = uniform_profile(blocks=D, fwd=1.0, bwd=2.0, latency_ms=5.0)
    plan, two = baseline_plan(prof, PipelineConfig("gpipe", stages=D, micro_batches=N, replicas=2))
    sync = Costs(prof, plan.partition, 2, "cholesky", "adamw").duration(Op("sync_grad", stage=0))
    assert sync >= 5.0
    assert two.utilization_pipefisher[0] - two.utilization_strict == pytest.approx(sync / two.step_time_ms, abs=1e-4)
