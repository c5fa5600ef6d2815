"""Schedule families against closed forms: bubble fractions, Chimera's bubble counts, 1F1B memory.

Every number comes from the replay (pfcompile.check.replay) of the family's baseline plan on a
synthetic profile with equal blocks and zero communication.
"""

import pytest
from helpers import uniform_profile

from pfcompile.graph.schedules import PipelineConfig
from pfcompile.place.assemble import baseline_plan

TOL = 1e-3  # the synthetic profile's all-reduce of 100 bytes takes 1e-4 ms


def bubbles(plan, result):
    """Per rank: (idle time before a forward, idle time before a backward or at the end)."""
    out = []
    for steps in plan.ranks:
        t, fb = 0.0, [0.0, 0.0]
        for po in steps[0]:
            if po.op.kind in ("fwd", "bwd"):
                fb[po.op.kind == "bwd"] += max(0.0, po.start - t)
                t = po.end
        fb[1] += result.cycle_time_ms - t
        out.append(tuple(fb))
    return out


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("D,N", [(2, 1), (4, 4), (4, 8), (3, 7)])
def test_bubble_fraction_is_closed_form(schedule, D, N):
    prof = uniform_profile(blocks=D, fwd=1.0, bwd=2.0)
    _, result = baseline_plan(prof, PipelineConfig(schedule, stages=D, micro_batches=N))
    assert 1 - result.utilization == pytest.approx((D - 1) / (N + D - 1), abs=1e-4)
    assert result.step_time_ms == pytest.approx((N + D - 1) * 3.0, abs=TOL)


@pytest.mark.parametrize("D,N,v", [(2, 4, 2), (4, 8, 2), (4, 4, 3)])
def test_interleaved_bubble_shrinks_by_v(D, N, v):
    """Megatron-LM: bubble / ideal time = (D-1) / (v*N) with v chunks per device."""
    prof = uniform_profile(blocks=D * v, fwd=1.0, bwd=2.0)
    _, result = baseline_plan(prof, PipelineConfig("interleaved", stages=D, micro_batches=N, virtual_stages=v))
    ideal = N * v * 3.0
    assert (result.step_time_ms - ideal) / ideal == pytest.approx((D - 1) / (v * N), abs=1e-4)


@pytest.mark.parametrize("D", [4, 6, 8])
def test_chimera_bubble_counts_match_the_paper(D):
    """Chimera (Li & Hoefler 2021) with N = D, in slots (forward = backward = 1): D/2-1
    forward and D/2-1 backward bubbles on every worker, D-2 in all, against 1F1B's 2(D-1)."""
    prof = uniform_profile(blocks=D, fwd=1.0, bwd=1.0)
    plan, result = baseline_plan(prof, PipelineConfig("chimera", stages=D, micro_batches=D))
    for fwd_bubbles, bwd_bubbles in bubbles(plan, result):
        assert fwd_bubbles == pytest.approx(D / 2 - 1, abs=TOL)
        assert bwd_bubbles == pytest.approx(D / 2 - 1, abs=TOL)
    plan, result = baseline_plan(prof, PipelineConfig("1f1b", stages=D, micro_batches=D))
    for f, b in bubbles(plan, result):
        assert f + b == pytest.approx(2 * (D - 1), abs=TOL)
    # more micro-batches: the same D-2 bubble slots, now amortised over twice the work
    plan, result = baseline_plan(prof, PipelineConfig("chimera", stages=D, micro_batches=2 * D))
    assert all(f + b == pytest.approx(D - 2, abs=TOL) for f, b in bubbles(plan, result))


def test_chimera_with_backward_twice_forward():
    """With backward = 2 forward (units of forward time) the slot order leaves 2(D-2) idle
    per worker (D/2-1 before forwards, 3(D/2-1) before backwards) against 1F1B's 3(D-1)."""
    D = 8
    prof = uniform_profile(blocks=D, fwd=1.0, bwd=2.0)
    plan, chim = baseline_plan(prof, PipelineConfig("chimera", stages=D, micro_batches=D))
    assert all(f + b == pytest.approx(2 * (D - 2), abs=TOL) for f, b in bubbles(plan, chim))
    _, one = baseline_plan(prof, PipelineConfig("1f1b", stages=D, micro_batches=D))
    assert one.step_time_ms - 3 * D == pytest.approx(3 * (D - 1), abs=TOL)
    assert chim.utilization > one.utilization


@pytest.mark.parametrize("D,N", [(4, 8), (3, 3)])
def test_1f1b_keeps_at_most_D_minus_s_micro_batches_in_flight(D, N):
    prof = uniform_profile(blocks=D, act_bytes=1000)
    plan, result = baseline_plan(prof, PipelineConfig("1f1b", stages=D, micro_batches=N))
    gplan, gresult = baseline_plan(prof, PipelineConfig("gpipe", stages=D, micro_batches=N))
    for s in range(D):
        in_flight = max(b for _, b in result.memory_trace[s]) - result.resident_bytes[s]
        assert in_flight == min(D - s, N) * 1000
        assert result.peak_memory_bytes[s] == result.resident_bytes[s] + min(D - s, N) * 1000
        # GPipe keeps all N
        assert max(b for _, b in gresult.memory_trace[s]) - gresult.resident_bytes[s] == N * 1000


@pytest.mark.parametrize("kw", [
    dict(schedule="interleaved", stages=3, micro_batches=4, virtual_stages=2),
    dict(schedule="chimera", stages=3, micro_batches=4),
    dict(schedule="chimera", stages=4, micro_batches=3),
    dict(schedule="1f1b", stages=2, micro_batches=3, replicas=2),
    dict(schedule="gpipe", stages=2, micro_batches=2, virtual_stages=2),
    dict(schedule="dualpipev", stages=2, micro_batches=3),
])
def test_impossible_configurations_are_refused(kw):
    from pfcompile.formats.errors import InputError

    with pytest.raises(InputError, match="--"):
        PipelineConfig(**kw)
