"""Zero-bubble families (zb-h1, zb-v, dualpipev): split backward B/W, their canonical orders
against torch's own generators, the published bubble closed forms, torch's CSV validation and
simulator on the export, the W pass's memory, and K-FAC placed next to the W passes.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from helpers import ROOT, torch_runtime, uniform_profile

from pfcompile.check.replay import ReplayError, replay
from pfcompile.formats.ops import Op, parse_op
from pfcompile.graph.schedules import V_SCHEDULES, PipelineConfig, compute_orders
from pfcompile.graph.taskgraph import Task, build_task_graph
from pfcompile.place.assemble import baseline_plan
from pfcompile.place.build import build_plan
from pfcompile.place.options import PlanOptions
from pfcompile.render import torch_csv

TOL = 1e-3


def test_split_backward_ops_have_compact_text_forms():
    for text, kind in (("IB3.5", "bwd_input"), ("W0.2", "bwd_weight")):
        op = parse_op(text)
        assert op.kind == kind and str(op) == text
    assert parse_op("I3.A").kind == "inv" and parse_op("BI1.B<2").kind == "bcast_inv"


def _torch_order(cls, D: int, N: int, chunks: int) -> dict[int, list[tuple[str, int, int]]]:
    """torch's own per-rank compute order of a schedule class (its generator, no process group)."""
    from torch.distributed.pipelining.schedules import _ComputationType as C

    kind = {C.FORWARD: "fwd", C.BACKWARD_INPUT: "bwd_input", C.BACKWARD_WEIGHT: "bwd_weight"}
    s = cls.__new__(cls)  # the generator reads these fields only
    s.pp_group_size, s._n_microbatches, s.n_local_stages, s.num_stages = D, N, chunks, D * chunks
    s.number_of_rounds = max(1, N // D)
    s.microbatches_per_round = N // s.number_of_rounds
    out = {}
    for r in range(D):
        s.rank = r
        out[r] = [(kind[a.computation_type], a.stage_index, a.microbatch_index)
                  for a in s._calculate_single_rank_operations(r) if a is not None]
    return out


@pytest.mark.parametrize("D,N", [(2, 4), (4, 4), (4, 8), (3, 7), (4, 3)])
def test_canonical_orders_are_torchs(D, N):
    from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble

    if N % max(1, N // D) == 0:  # torch's ZB1P needs N a multiple of its rounds
        assert compute_orders(PipelineConfig("zb-h1", D, N, optimizer="adamw")) == _torch_order(ScheduleInterleavedZeroBubble, D, N, 1)
    assert compute_orders(PipelineConfig("zb-v", D, N, optimizer="adamw")) == _torch_order(ScheduleZBVZeroBubble, D, N, 2)


def _torch_dualpipev_order(D: int, N: int) -> dict[int, list[tuple[str, int, int]]]:
    """torch's ScheduleDualPipeV generator per rank, its actions mapped to our passes as
    pfcompile.graph.schedules._dualpipev states: an overlapped pair is its forward then its
    backward; a full backward B is bwd_input then bwd_weight of the same (stage, mb)."""
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV
    from torch.distributed.pipelining.schedules import _ComputationType as C

    kind = {C.FORWARD: ("fwd",), C.BACKWARD_INPUT: ("bwd_input",), C.BACKWARD_WEIGHT: ("bwd_weight",),
            C.FULL_BACKWARD: ("bwd_input", "bwd_weight")}
    s = ScheduleDualPipeV.__new__(ScheduleDualPipeV)  # the generator reads these fields only
    s.pp_group_size, s._n_microbatches = D, N
    out = {}
    for r in range(D):
        actions = s._calculate_single_rank_operations(r)
        assert any(a.computation_type == C.OVERLAP_F_B for a in actions)  # the mapping is exercised
        out[r] = [(k, a.stage_index, a.microbatch_index)
                  for top in actions for a in (top.sub_actions if top.computation_type == C.OVERLAP_F_B else (top,))
                  for k in kind[a.computation_type]]
    return out


@pytest.mark.parametrize("D,N", [(1, 2), (2, 4), (2, 7), (3, 6), (4, 8), (4, 11), (8, 16), (8, 21)])
def test_dualpipev_orders_are_torchs(D, N):
    ours = compute_orders(PipelineConfig("dualpipev", D, N, optimizer="adamw"))
    assert ours == _torch_dualpipev_order(D, N)
    for d, passes in ours.items():  # every pass of both chunks once
        assert sorted(passes) == sorted((k, s, m) for k in ("fwd", "bwd_input", "bwd_weight")
                                        for s in (d, 2 * D - 1 - d) for m in range(N))


def test_dualpipev_needs_twice_the_stages_in_micro_batches():
    from pfcompile.formats.errors import InputError

    with pytest.raises(InputError, match="at least 2 x --stages = 8 micro-batches per replica, got 7"):
        PipelineConfig("dualpipev", 4, 7)
    with pytest.raises(InputError, match="exactly 2 chunks per device"):
        PipelineConfig("dualpipev", 2, 4, virtual_stages=3)
    cfg = PipelineConfig("dualpipev", 2, 8, replicas=2)
    assert cfg.virtual_stages == 2 and cfg.stages_of(3) == [(1, 1), (2, 1)]  # the V of replica 1


@pytest.mark.parametrize("D,N", [(2, 4), (4, 4), (4, 8), (3, 7), (6, 12)])
def test_bubble_matches_the_closed_forms(D, N):
    """Uniform stages, T_F = T_B = T_W = 1 per device, no communication.
    ZB-H1 (Qi et al. 2024, sec. 3): bubble (D-1)(T_F + T_B - T_W) against 1F1B's
    (D-1)(T_F + T_B + T_W). ZB-V (N >= 2D-1): zero bubble once steps repeat (the next
    step's forwards fill the tail); from an idle start only the warm-up's ramp, one
    chunk forward (T_F/2) per hop: (D-1)·T_F/2."""
    prof = uniform_profile(blocks=D, fwd=1.0, bwd=2.0)
    _, h1 = baseline_plan(prof, PipelineConfig("zb-h1", stages=D, micro_batches=N, optimizer="adamw"))
    _, f1b = baseline_plan(prof, PipelineConfig("1f1b", stages=D, micro_batches=N, optimizer="adamw"))
    assert h1.step_time_ms == pytest.approx(3 * N + (D - 1) * 1.0, abs=TOL)
    assert f1b.step_time_ms - 3 * N == pytest.approx(3 * (h1.step_time_ms - 3 * N), abs=TOL)
    assert 1 - h1.utilization == pytest.approx((D - 1) / (3 * N + D - 1), abs=1e-4)
    if N >= 2 * D - 1:
        prof_v = uniform_profile(blocks=2 * D, fwd=0.5, bwd=1.0)  # two chunks per device
        _, v = baseline_plan(prof_v, PipelineConfig("zb-v", stages=D, micro_batches=N, optimizer="adamw"))
        assert v.step_time_from_idle_ms == pytest.approx(3 * N + (D - 1) * 0.5, abs=TOL)
        assert v.step_time_ms == pytest.approx(3 * N, abs=TOL)


@pytest.mark.parametrize("schedule,D,N", [("zb-h1", 4, 6), ("zb-v", 2, 4), ("zb-v", 4, 8), ("dualpipev", 2, 4),
                                          ("dualpipev", 4, 9)])
def test_torch_validates_and_simulates_the_exported_csv(tmp_path, schedule, D, N):
    from torch.distributed.pipelining.schedules import _simulate_comms_compute

    v_shaped = schedule in V_SCHEDULES
    blocks = D * (2 if v_shaped else 1)
    plan, _ = baseline_plan(uniform_profile(blocks=blocks), PipelineConfig(schedule, D, N, optimizer="adamw"))
    paths, _ = torch_csv.export(plan, tmp_path / "o.csv")
    rows = [line.split(",") for line in paths[0].read_text().strip().splitlines()]
    assert any(a.endswith(f"I{0}") for a in rows[0]) and any("W" in a for a in rows[0])
    sched = torch_runtime(blocks, D, N)
    sched._load_csv(str(paths[0]), format="compute_comms")  # torch's _validate_schedule
    if v_shaped:  # torch infers the V: device d holds stages d and 2D-1-d
        assert sched.stage_index_to_group_rank == {s: (s if s < D else 2 * D - 1 - s) for s in range(blocks)}
    assert [[str(a) for a in sched.pipeline_order_with_comms[q]] for q in range(D)] == rows
    simulated = _simulate_comms_compute(sched.pipeline_order_with_comms,
                                        lambda s: sched.stage_index_to_group_rank[s], blocks)
    assert sum(a is not None for row in simulated.values() for a in row) == sum(map(len, rows))
    # compute-only: torch lowers the send/recvs itself
    paths, _ = torch_csv.export(plan, tmp_path / "c.csv", fmt="compute_only")
    sched = torch_runtime(blocks, D, N)
    sched._load_csv(str(paths[0]))


def test_weight_pass_keeps_activations_and_output_gradients():
    prof = uniform_profile(blocks=2, act_bytes=1000)
    tg = build_task_graph(prof, PipelineConfig("zb-h1", 2, 4))
    ib, w = Task(0, 1, Op("bwd_input", stage=1, mb=2)), Task(0, 1, Op("bwd_weight", stage=1, mb=2))
    assert tg.g.has_edge(ib, w)
    act = next(b for b in tg.buffers if b.key == ("act", 1, 2) and b.alloc.step == 0)
    assert act.free == w
    # curv_b shares W's output gradients: it waits for W, its buffer starts at B
    cb = Task(None, 1, Op("curv_b", layer=2, mb=2))
    assert tg.g.has_edge(w, cb)
    kept = next(b for b in tg.buffers if b.key == ("kept_b", 2, 2))
    assert kept.alloc == ib and kept.free == cb
    # the send of the input gradient follows B, not W
    send = Task(0, 1, Op("send_grad", stage=1, mb=2, peer=0))
    assert tg.g.has_edge(ib, send) and not tg.g.has_edge(w, send)


def test_weight_pass_over_the_memory_limit_is_refused_naming_the_rank():
    D, N = 4, 8
    prof = uniform_profile(blocks=D, act_bytes=10**6)
    _, free = baseline_plan(prof, PipelineConfig("zb-h1", D, N, optimizer="adamw"))
    _, f1b = baseline_plan(prof, PipelineConfig("1f1b", D, N, optimizer="adamw"))
    # ZB-H1's delayed W passes hold D micro-batches on every rank (1F1B: D - s)
    assert free.peak_memory_bytes[-1] > f1b.peak_memory_bytes[-1]
    limit = max(free.peak_memory_bytes) - 1
    q = max(range(D), key=lambda r: free.peak_memory_bytes[r])
    with pytest.raises(ReplayError, match=f"rank {q} needs"):
        baseline_plan(prof, PipelineConfig("zb-h1", D, N, optimizer="adamw", memory_limit_bytes=limit))


@pytest.mark.parametrize("method", ["greedy", "cpsat"])
@pytest.mark.parametrize("schedule,D,N", [("zb-h1", 2, 4), ("zb-v", 2, 4), ("dualpipev", 2, 4)])
def test_kfac_plans_of_zero_bubble_families_replay(schedule, D, N, method):
    blocks = D * (2 if schedule in V_SCHEDULES else 1)
    prof = uniform_profile(blocks=blocks, curv=0.2, inv=0.5)
    cfg = PipelineConfig(schedule, D, N)
    plan, result, base = build_plan(prof, cfg, PlanOptions(method, time_limit=5))
    again = replay(plan, prof)
    assert again.step_time_ms == pytest.approx(result.step_time_ms)
    for steps in plan.ranks:  # curv_b never before the W of its micro-batch
        seen = set()
        for t, ops in enumerate(steps):
            for p in ops:
                if p.op.kind == "bwd_weight" and t == 0:
                    seen.add((p.op.stage, p.op.mb))
                if p.op.kind == "curv_b":
                    assert (plan.layer_stage[p.op.layer], p.op.mb) in seen
    assert result.step_time_ms >= base.step_time_ms - TOL


def test_cpsat_moves_weight_passes_to_fit_the_memory_limit():
    """Under a limit the canonical ZB-H1 order exceeds (its deferred W's keep output
    gradients), CP-SAT moves W passes earlier and fits; below the least any order needs,
    the refusal names the rank."""
    from pfcompile.formats.errors import InputError

    D, N = 4, 8
    prof = uniform_profile(blocks=D, act_bytes=10**6)
    cfg = PipelineConfig("zb-h1", D, N)
    _, canonical = baseline_plan(prof, cfg, check_memory=False)
    limit = max(canonical.peak_memory_bytes) - 30
    plan, result, _ = build_plan(prof, PipelineConfig("zb-h1", D, N, memory_limit_bytes=limit), PlanOptions("cpsat", time_limit=5))
    assert max(result.peak_memory_bytes) <= limit
    moved = [q for q in range(D) if [p.op for p in plan.ranks[q][0] if p.op.kind in ("bwd_input", "bwd_weight")]
             != [p.op for p in canonical_ops(prof, cfg, q) if p.op.kind in ("bwd_input", "bwd_weight")]]
    assert moved
    with pytest.raises(InputError, match="rank 0 needs"):
        build_plan(prof, PipelineConfig("zb-h1", D, N, memory_limit_bytes=4 * 10**6), PlanOptions("cpsat", time_limit=5))


# --- K-FAC's kept input shares what W keeps ----------------------------------------------------
def kept_input_profile(kept_a: int):
    """2 blocks of 2 K-FAC layers; act 1000 per block, kept_b 10 per layer (so W keeps
    nothing beyond the K-FAC output gradients: wgrad falls back to the kept_b sum)."""
    prof = uniform_profile(blocks=2, act_bytes=1000)
    for l in prof.covered_layers:
        l.kept_a_bytes, l.kept_b_bytes = kept_a, 10
    prof.to_json()  # the hash
    return prof


def brute_force_peaks(plan, prof) -> list[int]:
    """Each rank's peak from the plan's (replayed) op times and the memory model's intervals
    alone, buffer by buffer, half-open [alloc, free) (a free at an instant before an
    allocation): act [F start, W end), W's output gradients [B start, W end) beyond the
    K-FAC ones, kept_b [B start, curv_b end), kept_a [W end, max(W end, curv_a end)).
    Cycle 0 (k = 1; the plans here start the next cycle after the last op)."""
    from pfcompile.graph.costs import Costs

    costs = Costs(prof, plan.partition, 1)
    at = {(q, p.op): (p.start, p.end) for q, steps in enumerate(plan.ranks) for ops in steps for p in ops}
    out = []
    for q, steps in enumerate(plan.ranks):
        iv = []  # (from, to, bytes)
        for p in (p for ops in steps for p in ops):
            s, m = p.op.stage, p.op.mb
            if p.op.kind == "fwd":
                iv.append((p.start, at[(q, Op("bwd_weight", stage=s, mb=m))][1], costs.act_bytes(s)))
            elif p.op.kind == "bwd_input":
                w_end = at[(q, Op("bwd_weight", stage=s, mb=m))][1]
                kept_b = 0
                for l in costs.stage_layers[s]:
                    kept_b += prof.covered_layers[l].kept_b_bytes
                    iv.append((p.start, at[(q, Op("curv_b", layer=l, mb=m))][1], prof.covered_layers[l].kept_b_bytes))
                    ca_end = at[(q, Op("curv_a", layer=l, mb=m))][1]
                    iv.append((w_end, max(w_end, ca_end), prof.covered_layers[l].kept_a_bytes))
                iv.append((p.start, w_end, max(0, costs.wgrad_bytes(s) - kept_b)))
        level = max(sum(n for a, f, n in iv if a <= t < f) for t in {a for a, _, _ in iv})
        held = sorted({p.op.stage for ops in steps for p in ops if p.op.kind == "fwd"})
        out.append(costs.resident_bytes([(s, 0) for s in held]) + level)
    return out


def test_kfac_kept_input_is_counted_from_the_weight_pass_on():
    """zb-h1, D = 2, N = 2, k = 1, the K-FAC work after the step (every curv_a after its W):
    the kept inputs (100 bytes a layer, 2 layers a stage) are inside the activations until W
    ends, then held alone until their curv_a. Each rank's peak is resident + 2 activations
    (1000 each) + the output gradients (10 a layer) of what has passed B by then; the old
    model held every kept input from its forward on: 2 x 200 more on both ranks."""
    from pfcompile.place.assemble import appended_steps, assemble, finish

    prof = kept_input_profile(kept_a=100)
    tg = build_task_graph(prof, PipelineConfig("zb-h1", 2, 2))
    kept_a = next(b for b in tg.buffers if b.key == ("kept_a", 2, 1))
    assert kept_a.at_end and kept_a.alloc == Task(0, 1, Op("bwd_weight", stage=1, mb=1))
    assert kept_a.free == Task(None, 1, Op("curv_a", layer=2, mb=1))
    # curv_a still follows only the forward: the planner may run it before or after W
    assert tg.g.has_edge(Task(0, 1, Op("fwd", stage=1, mb=1)), kept_a.free)
    assert not tg.g.has_edge(kept_a.alloc, kept_a.free)
    plan = assemble(prof, tg, appended_steps(tg), "none")
    result = finish(plan, prof)
    resident = result.resident_bytes
    # rank 0: F0 F1 B0 ...: at B0 both activations and B0's output gradients (2 x 10);
    # rank 1: F0 B0 F1 B1 W0 W1: at B1 both activations and both micro-batches' (4 x 10)
    assert result.peak_memory_bytes == [resident[0] + 2000 + 20, resident[1] + 2000 + 40]
    old = [p + 2 * 200 for p in result.peak_memory_bytes]  # every kept input held from its forward
    assert all(new < o for new, o in zip(result.peak_memory_bytes, old))
    # after rank 1's W0 (ends at 6 ms): activation 1 + 40 of output gradients + W0's kept inputs
    assert (6.0, resident[1] + 1000 + 40 + 200) in result.memory_trace[1]
    assert brute_force_peaks(plan, prof) == result.peak_memory_bytes


def test_cpsat_fits_a_limit_only_the_shared_kept_input_allows():
    """Kept inputs of 500 a layer (1000 a stage): counted from the forward, the family's order
    needs resident + 2 activations + the second forward's kept inputs on rank 0 (3464 bytes);
    shared with W, 2484. A limit of 3000 between them is now planned by CP-SAT and accepted by
    the replay; below 2484 it is refused naming the rank."""
    from pfcompile.formats.errors import InputError

    prof = kept_input_profile(kept_a=500)
    resident = build_task_graph(prof, PipelineConfig("zb-h1", 2, 4)).resident_bytes[0]
    assert resident + 2 * 1000 + 1000 == 3464 and resident + 2 * 1000 + 20 == 2484
    cfg = PipelineConfig("zb-h1", 2, 4, memory_limit_bytes=3000)
    plan, result, _ = build_plan(prof, cfg, PlanOptions("cpsat", time_limit=5))
    assert max(result.peak_memory_bytes) <= 3000
    assert replay(plan, prof).peak_memory_bytes == result.peak_memory_bytes  # the limit is in the plan
    with pytest.raises(InputError, match="rank 0 needs 2484 bytes, over the limit of 2400"):
        build_plan(prof, PipelineConfig("zb-h1", 2, 4, memory_limit_bytes=2400), PlanOptions("cpsat", time_limit=5))
    # and a plan whose curv_a run after W with the limit below its peak: the replay names the rank
    plan.config = replace(plan.config, memory_limit_bytes=max(result.peak_memory_bytes) - 1)
    q = result.peak_memory_bytes.index(max(result.peak_memory_bytes))
    with pytest.raises(ReplayError, match=f"rank {q} needs {max(result.peak_memory_bytes)} bytes"):
        replay(plan, prof)


def canonical_ops(prof, cfg, q):
    plan, _ = baseline_plan(prof, cfg, check_memory=False)
    return plan.ranks[q][0]


# --- B and W as profiled -------------------------------------------------------------------------
def test_costs_take_b_and_w_from_the_profile_and_older_profiles_estimate_half(tmp_path, capsys):
    """Schema 3 stores each part's measured B and W (they need not add up to the whole
    backward); the planner's durations are their sums over a stage. A schema-2 profile
    loads with one warning line and the documented estimate: half the backward each."""
    import copy
    import json
    from pathlib import Path

    from pfcompile.formats.profile import load_profile
    from pfcompile.graph.costs import Costs

    prof = load_profile(str(Path(__file__).resolve().parents[1] / "profiles" / "bert-tiny-cpu.json"))
    assert all(p.split_measured for p in prof.parts)
    partition = [["embed", "block0"], ["block1", "head"]]
    costs = Costs(prof, partition, replicas=1)
    for s, group in enumerate(partition):
        b = sum(prof.part(n).bwd_input_ms for n in group)
        w = sum(prof.part(n).bwd_weight_ms for n in group)
        assert costs.work_ms(Op("bwd_input", stage=s, mb=0)) == pytest.approx(b)
        assert costs.work_ms(Op("bwd_weight", stage=s, mb=0)) == pytest.approx(w)
        assert costs.work_ms(Op("bwd", stage=s, mb=0)) == pytest.approx(sum(prof.part(n).bwd_ms for n in group))
        # an op occupies its rank for its work and the runtime's dispatch of it
        assert costs.duration(Op("bwd_input", stage=s, mb=0)) == pytest.approx(b + prof.runtime.op_ms)
        assert b + w != pytest.approx(costs.bwd_ms(s))  # measured, not the whole backward cut in two
        # what W keeps: every Linear's output gradient, as measured (the head's vocabulary
        # projection is no K-FAC layer, so it is more than the K-FAC layers' kept_b)
        assert costs.wgrad_bytes(s) == sum(prof.part(n).wgrad_bytes for n in group)
    kept_b = sum(prof.covered_layers[l].kept_b_bytes for l in costs.stage_layers[1])
    assert costs.wgrad_bytes(1) > kept_b

    old = copy.deepcopy(prof)
    old.schema_version = 2
    path = tmp_path / "v2.json"
    old.save(str(path))
    assert "bwd_input_ms" not in json.loads(path.read_text())["parts"][1]
    capsys.readouterr()
    loaded = load_profile(str(path))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "schema_version 2 has no split-backward costs" in err
    assert loaded.hash == json.loads(path.read_text())["hash"]
    est = Costs(loaded, partition, replicas=1)
    for s in range(2):
        assert est.bwd_input_ms(s) == pytest.approx(est.bwd_ms(s) / 2)
        assert est.bwd_weight_ms(s) == pytest.approx(est.bwd_ms(s) / 2)
        assert est.wgrad_bytes(s) == sum(loaded.covered_layers[l].kept_b_bytes for l in est.stage_layers[s])


def test_split_fields_are_both_numbers_or_both_null(tmp_path):
    import json
    from pathlib import Path

    from pfcompile.formats.errors import InputError
    from pfcompile.formats.profile import load_profile

    obj = json.loads((Path(__file__).resolve().parents[1] / "profiles" / "bert-tiny-cpu.json").read_text())
    obj["parts"][1]["bwd_weight_ms"] = None
    obj.pop("hash")
    path = tmp_path / "half.json"
    path.write_text(json.dumps(obj))
    with pytest.raises(InputError, match=r"parts\[1\]\.bwd_weight_ms: .*both numbers or both null"):
        load_profile(str(path))


def test_adamw_by_cpsat_places_the_weight_passes_and_beats_the_family_order():
    """A first-order plan by CP-SAT keeps each rank's forwards and input gradients in the
    family's order and places the weight passes (ZB-H1 leaves them free): on the committed
    bert-tiny profile it replays faster than the family's order, which its stats say as a
    negative overhead. Where nothing is free (1F1B, one replica) it is the family's order."""
    from pfcompile.formats.profile import load_profile

    prof = load_profile(str(ROOT / "profiles" / "bert-tiny-cpu.json"))
    cfg = PipelineConfig("zb-h1", 2, 4, optimizer="adamw")
    plan, result, base = build_plan(prof, cfg, PlanOptions("cpsat", time_limit=5))
    assert replay(plan, prof).step_time_ms == pytest.approx(result.step_time_ms)
    assert result.step_time_ms < base.step_time_ms - TOL
    assert plan.stats["step_overhead"] == pytest.approx(result.step_time_ms / base.step_time_ms - 1, abs=1e-5)
    family = baseline_plan(prof, cfg)[0]
    ordered = ("fwd", "bwd_input")
    for q in range(2):
        got, want = plan.ops(q, 0), family.ops(q, 0)
        assert [str(o) for o in got if o.kind in ordered] == [str(o) for o in want if o.kind in ordered]
        assert sorted(map(str, got)) == sorted(map(str, want))  # the same ops, the W passes moved
    assert [str(o) for q in range(2) for o in plan.ops(q, 0)] != [str(o) for q in range(2) for o in family.ops(q, 0)]
    one_f = PipelineConfig("1f1b", 2, 4, optimizer="adamw")
    plan, result, base = build_plan(prof, one_f, PlanOptions("cpsat", time_limit=5))
    assert [str(o) for o in plan.ops(0, 0)] == [str(o) for o in baseline_plan(prof, one_f)[0].ops(0, 0)]
    assert result.step_time_ms == pytest.approx(base.step_time_ms)
