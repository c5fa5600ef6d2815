"""The optimizer step as a profiled cost, and closing the loop from measured runs:
`pfcompile calibrate` and `pfcompile inspect MEASURED --against PLAN`.

The measured trace here is written by the runtime's own writer (runtime.observe.measure: Timeline,
plan_identity, write_measured_trace) from op durations we choose, so calibration must give
back exactly those durations; no part of the runtime is mocked, none is run.
"""

from __future__ import annotations

import copy
import json
import random
import re
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from helpers import TINY_OPTIMIZERS_BEFORE_OWN_STEP

from pfcompile.calibrate.compare import against_fitted_run
from pfcompile.calibrate.fit import calibrate, message_spread
from pfcompile.calibrate.measured import load_measured
from pfcompile.check.replay import expected_step_time, replay
from pfcompile.cli import main as pfcompile_main
from pfcompile.formats.errors import InputError
from pfcompile.formats.ops import Op
from pfcompile.formats.plan import load_plan
from pfcompile.formats.profile import BusySpread, LinkModel, Profile, RuntimeOverheads, load_profile, profile_from_json
from pfcompile.graph.costs import Costs
from pfcompile.graph.schedules import PipelineConfig
from pfcompile.place.build import build_plan
from pfcompile.place.options import PlanOptions
from runtime.observe import measure

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "profiles" / "bert-tiny-cpu.json"


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pfcompile", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


# --- the optimizer step, costed -------------------------------------------------------------------
def test_schema_1_profile_loads_with_one_line_warning_and_the_documented_estimate(tmp_path, capsys):
    prof = load_profile(str(PROFILE))
    old = copy.deepcopy(prof)
    old.schema_version = 1
    path = tmp_path / "v1.json"
    old.save(str(path))
    assert "step_ms" not in json.loads(path.read_text())["parts"][0]
    capsys.readouterr()
    loaded = load_profile(str(path))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "schema_version 1 has no optimizer-step costs" in err
    assert loaded.hash == json.loads(path.read_text())["hash"]  # the file's own hash, not a re-versioned one
    # the estimate, from the module doc: K-FAC = 5 passes over the K-FAC layers' parameter
    # bytes + 7 over the rest, AdamW = 7 passes over all, at 2 GB/s on a CPU
    block = loaded.part("block0")
    covered = sum((l.in_features + 1) * l.out_features * 4 for l in loaded.covered_layers if l.part == "block0")
    assert block.step_ms["kfac"] == pytest.approx((5 * covered + 7 * (block.param_bytes - covered)) / 2e6)
    assert block.step_ms["adamw"] == pytest.approx(7 * block.param_bytes / 2e6)


def test_the_step_op_costs_its_parts_steps():
    prof = load_profile(str(PROFILE))
    partition = [["embed", "block0"], ["block1", "head"]]
    for kfac, kind in ((True, "kfac"), (False, "adamw")):
        costs = Costs(prof, partition, replicas=1, optimizer="kfac" if kfac else "adamw")
        want = prof.part("block1").step_ms[kind] + prof.part("head").step_ms[kind]
        assert costs.work_ms(Op("step", stage=1)) == pytest.approx(want + prof.runtime.step_ms) and want > 0
        # one stage per rank: its step op also carries the runtime's work between steps, and the dispatch
        assert costs.duration(Op("step", stage=1)) == pytest.approx(want + prof.runtime.step_ms + prof.runtime.op_ms)


def test_a_plan_records_the_runtimes_work_in_its_spans_and_compares_ops_alone(tmp_path):
    """A plan's `step` op spans its stage's update and the runtime's work between steps (and,
    ending a cycle, SOAP's activation): the plan records that work (`between_ms`, and the
    dispatch of every op, `stats.runtime_op_ms`), so what a run's ops are compared with
    (Plan.own_ms, runtime.observe.measure.predicted_op_table) is each op alone: a step op
    its parts' profiled steps, a forward its parts' forwards. It round-trips; a negative
    between_ms is refused naming the field."""
    from runtime.observe.measure import predicted_op_table

    prof = load_profile(str(ROOT / "profiles" / "bert-tiny-cpu-optimizers.json"))
    rt = prof.runtime
    assert rt.op_ms > 0 and rt.step_ms > 0
    for j, layer in enumerate(prof.covered_layers):  # known activation costs
        layer.optimizer_ms["soap"]["activate"] = 0.05 + 0.001 * j
    partition = [["embed", "block0"], ["block1", "head"]]
    config = PipelineConfig("1f1b", stages=2, micro_batches=4, optimizer="soap", partition=partition)
    plan, _, _ = build_plan(prof, config, PlanOptions("greedy"))
    k = plan.refresh_steps
    assert k >= 2 and plan.stats["runtime_op_ms"] == rt.op_ms
    table = predicted_op_table(plan)
    seen = defaultdict(int)
    for q, steps in enumerate(plan.ranks):
        for t, ops in enumerate(steps):
            for i, po in enumerate(ops):
                names = partition[po.op.stage] if po.op.stage is not None else []
                if po.op.kind == "step":
                    alone = sum(prof.part(n).step_ms.get("soap", prof.part(n).step_ms["kfac"]) for n in names)
                    # the cycle's last step also puts the new eigenbases in force
                    activation = sum(l.optimizer_ms["soap"]["activate"] for l in prof.covered_layers
                                     if l.part in names) if t == k - 1 else 0.0
                    assert po.between_ms == pytest.approx(rt.step_ms + activation, abs=1e-6)
                elif po.op.kind == "fwd" and t == 1:  # not a refresh step: no capture
                    alone = sum(prof.part(n).fwd_ms for n in names)
                else:
                    assert po.between_ms == 0.0
                    continue
                seen[po.op.kind] += 1
                assert plan.own_ms(po) == pytest.approx(alone, abs=2e-6), (q, t, str(po.op))
                assert table[q][t][i] == (str(po.op), plan.own_ms(po))
    assert seen["step"] == 2 * k and seen["fwd"] == 8

    path = tmp_path / "plan.json"
    plan.save(str(path))
    again = load_plan(str(path))
    assert [[[po.between_ms for po in ops] for ops in steps] for steps in again.ranks] == \
        [[[round(po.between_ms, 6) for po in ops] for ops in steps] for steps in plan.ranks]
    raw = json.loads(path.read_text())
    step_op = next(d for d in raw["ranks"][0]["steps"][0] if d["op"] == "step")
    step_op["between_ms"] = -1.0
    path.write_text(json.dumps(raw))
    with pytest.raises(InputError, match=r"ranks\[0\]\.steps\[0\]\[\d+\]\.between_ms"):
        load_plan(str(path))


# --- a measured trace with known durations ------------------------------------------------------------
def true_profile(prof: Profile) -> Profile:
    """The 'machine' the synthetic run ran on: every entry scaled by a known factor, per part
    and per layer different, another message latency, and the runtime's own overheads."""
    t = copy.deepcopy(prof)
    for i, p in enumerate(t.parts):
        p.fwd_ms = (p.fwd_ms or 0.5) * (1.1 + 0.2 * i)
        p.bwd_ms = (p.bwd_ms or 0.7) * (0.7 + 0.1 * i)
        p.step_ms = {k: v * (1.5 + 0.3 * i) for k, v in p.step_ms.items()}
    for j, l in enumerate(t.covered_layers):
        kfac = l.optimizer_ms["kfac"]
        kfac["curv_a"] *= 2.0 + 0.01 * j
        kfac["curv_b"] *= 0.5
        for m in ("cholesky", "eigen"):
            kfac[f"inv_A.{m}"] *= 1.2
            kfac[f"inv_B.{m}"] *= 0.9
        kfac["precond"] *= 3.0
    t.comm.p2p.latency_ms = 0.25
    t.runtime = RuntimeOverheads(op_ms=0.01, step_ms=0.8, send_ms=0.15, recv_ms=0.2)
    return t


def scaled_profile(prof: Profile, factor: float) -> Profile:
    """The same machine `factor` times slower at every op (the runtime's overheads and the
    link as they are)."""
    t = copy.deepcopy(prof)
    for p in t.parts:
        p.fwd_ms, p.bwd_ms = p.fwd_ms * factor, p.bwd_ms * factor
        if p.bwd_input_ms is not None and p.bwd_weight_ms is not None:
            p.bwd_input_ms, p.bwd_weight_ms = p.bwd_input_ms * factor, p.bwd_weight_ms * factor
        p.step_ms = {k: v * factor for k, v in p.step_ms.items()}
        p.capture_ms = p.capture_ms and {k: v * factor for k, v in p.capture_ms.items()}
    for layer in t.covered_layers:
        layer.optimizer_ms = {o: {k: v * factor for k, v in e.items()} for o, e in layer.optimizer_ms.items()}
    return t


def synthetic_trace(tmp_path: Path, plan_path: Path, truth: Profile, steps: int, vary=None, name: str = "",
                    activation: bool = False, extra_gap_ms: float = 0.0, level=None, transfer=None,
                    between=None) -> Path:
    """The run as the cost model says it goes, written from the model's definition (not with
    the replay): each rank runs its ops in order with the TRUE costs; an op's dispatch follows
    it, the runtime's step work follows the step; a send takes its posting time and its data
    reaches a waiting receiver one link time after it ends; a receive lasts at least its
    completion time (recv_ms) and ends no earlier than that. Steps run one after the other on every rank.
    `vary(op, step)`: a multiplier of each compute op's and send's own time, per instance.
    `level(rank, step)`: a multiplier of every compute op of that rank in that step.
    `activation`: each refresh step after the first starts with the activation of the
    rank's layers (Costs.activation_ms), a span of the runtime row, as the runtime does it.
    `extra_gap_ms`: runtime work after every op beyond its dispatch, which no profile has.
    `transfer(op, step)`: a multiplier of a send's link time; `between(rank, step)`: of the
    runtime's work after that rank's step (runtime.step_ms)."""
    plan = load_plan(str(plan_path))
    k = plan.refresh_steps
    costs = Costs(truth, plan.partition, plan.config.replicas, plan.config.inverse,
                  plan.config.optimizer, refresh_steps=k)
    rt = truth.runtime
    timelines = [measure.Timeline(q) for q in range(plan.world_size)]
    clock = [0.0] * plan.world_size
    for step in range(steps):
        ops = [plan.ops(q, step) for q in range(plan.world_size)]
        if activation and step % k == 0 and step > 0:
            for q, tl in enumerate(timelines):
                a = sum(costs.activation_ms(op.stage) for op in ops[q] if op.kind == "step")
                tl.spans.append((step, "activate", clock[q], clock[q] + a))
                clock[q] += a
        pos = [0] * plan.world_size
        starts = list(clock)
        arrival: dict = {}
        while any(pos[q] < len(ops[q]) for q in range(plan.world_size)):
            moved = False
            for q, tl in enumerate(timelines):
                while pos[q] < len(ops[q]):
                    op = ops[q][pos[q]]
                    t = clock[q]
                    if op.kind.startswith("recv"):
                        at = arrival.get(op.message_key())
                        if at is None:
                            break  # its send has not run yet
                        end = max(t + rt.recv_ms, at)
                    elif op.kind.startswith("send"):
                        end = t + rt.send_ms * (vary(op, step) if vary else 1.0)
                        arrival[op.message_key()] = end + costs.link_ms(op) * (transfer(op, step) if transfer else 1.0)
                    else:
                        own = costs.work_ms(op, step % k) - costs.between_steps_ms(op, step % k)
                        end = t + own * (vary(op, step) if vary else 1.0) * (level(q, step) if level else 1.0)
                    tl.record(step, str(op), op.kind, t, end)
                    clock[q] = end + rt.op_ms + extra_gap_ms
                    pos[q] += 1
                    moved = True
            assert moved, "the synthetic run deadlocked"
        for q, tl in enumerate(timelines):
            tl.steps.append((step, starts[q], clock[q] - rt.op_ms))
            clock[q] += rt.step_ms * (between(q, step) if between else 1.0)
    out = tmp_path / f"{plan_path.stem}{name}.measured.json"
    measure.write_measured_trace(str(out), timelines, {
        "plan": str(plan_path), "steps": steps, **measure.plan_identity(str(plan_path), plan), "warmup_steps": 1})
    return out


def make_plan(tmp_path: Path, prof: Profile, name: str, schedule: str = "gpipe", stages: int = 4) -> Path:
    plan, _, _ = build_plan(prof, PipelineConfig(schedule, stages=stages, micro_batches=4), PlanOptions("greedy"))
    path = tmp_path / f"{name}.json"
    plan.save(str(path))
    return path


def test_calibration_recovers_known_costs(tmp_path):
    prof = load_profile(str(PROFILE))
    truth = true_profile(prof)
    plan_path = make_plan(tmp_path, prof, "gpipe4")  # one part per stage: every part's entry is seen alone
    k = load_plan(str(plan_path)).refresh_steps
    trace = synthetic_trace(tmp_path, plan_path, truth, steps=k + 2)
    fitted, counts = calibrate(prof, [load_measured(str(trace))])

    close = lambda a, b: a == pytest.approx(b, rel=0.01)  # noqa: E731
    for got, want in zip(fitted.parts, truth.parts):
        assert close(got.fwd_ms, want.fwd_ms) and close(got.bwd_ms, want.bwd_ms), got.name
        assert close(got.step_ms["kfac"], want.step_ms["kfac"]), got.name
    for got, want, was in zip(fitted.covered_layers, truth.covered_layers, prof.covered_layers):
        g, w = got.optimizer_ms["kfac"], want.optimizer_ms["kfac"]
        for key in ("curv_a", "curv_b", "precond", "inv_A.cholesky", "inv_B.cholesky"):
            assert close(g[key], w[key]), (got.name, key)
        assert g["inv_A.eigen"] == was.optimizer_ms["kfac"]["inv_A.eigen"]  # not run: kept
    assert close(fitted.comm.p2p.latency_ms, truth.comm.p2p.latency_ms)
    for key in ("op_ms", "step_ms", "send_ms", "recv_ms"):  # the runtime around the ops
        assert close(getattr(fitted.runtime, key), getattr(truth.runtime, key)), key
    assert counts["p2p messages"] > 0 and counts["fwd"] == 4

    # the fitted profile predicts the run: its replay equals the synthetic run's step time
    plan = load_plan(str(plan_path))
    assert replay(plan, fitted).step_time_ms == pytest.approx(replay(plan, truth).step_time_ms, rel=0.01)

    # provenance and hash chain: a new hash, naming its parent and its trace; plans record it
    path = tmp_path / "calibrated.json"
    fitted.save(str(path))
    again = load_profile(str(path))
    assert again.hash == fitted.hash != prof.hash
    cal = again.provenance["calibration"]
    assert cal["parent_hash"] == prof.hash and cal["traces"][0]["plan_sha256"].startswith("sha256:")
    replanned = make_plan(tmp_path, again, "replanned")
    assert json.loads(replanned.read_text())["profile"]["hash"] == again.hash


def test_a_muon_runs_step_is_fitted_into_its_own_entry_and_loads_again(tmp_path):
    """Calibrating from a Muon run fits its step op into the parts' step_ms["muon"] (Muon's
    step is not AdamW's: a scaled add on the covered weights); the calibrated profile saves
    and loads again with its hash, and plans from it cost Muon's step from that entry."""
    prof = load_profile(str(ROOT / "profiles" / "bert-tiny-cpu-optimizers.json"))
    truth = true_profile(prof)
    for p in truth.parts:
        p.step_ms["muon"] = 0.6 * p.step_ms["adamw"]
    config = PipelineConfig("gpipe", stages=4, micro_batches=4, optimizer="muon")
    plan, _, _ = build_plan(prof, config, PlanOptions("greedy"))
    plan_path = tmp_path / "muon.json"
    plan.save(str(plan_path))
    trace = synthetic_trace(tmp_path, plan_path, truth, steps=plan.refresh_steps + 2)
    fitted, counts = calibrate(prof, [load_measured(str(trace))])
    assert counts["step"] == 4
    for got, want, was in zip(fitted.parts, truth.parts, prof.parts):
        assert got.step_ms["muon"] == pytest.approx(want.step_ms["muon"], rel=0.01), got.name
        assert got.step_ms["adamw"] == was.step_ms["adamw"]  # AdamW's own did not run: kept
    path = tmp_path / "calibrated.json"
    fitted.save(str(path))
    again = load_profile(str(path))
    assert again.hash == fitted.hash and again.part("block1").step_ms == fitted.part("block1").step_ms
    costs = Costs(again, [[n] for n in ("embed", "block0", "block1", "head")], replicas=1, optimizer="muon")
    assert costs.step_ms(2) == pytest.approx(truth.part("block1").step_ms["muon"], rel=0.01)


@pytest.mark.e2e
def test_replay_with_the_runs_op_times_splits_the_error(tmp_path):
    """`pfcompile inspect TRACE --against PLAN --profile P` replays the plan with the run's
    own op times, messages as P models them. On runs written from the cost model with known
    costs (not the plan's profile's) every step's ops take the same time, so mean and own
    op times replay alike and give the truth's replay: the plan's prediction is off by the
    op times' level. With the profile's messages the replay is the run's step time; with
    another message latency and receive completion the difference is the messages'."""
    prof = load_profile(str(PROFILE))
    # the plan's profile's messages, well above the truth's (0.25 / 0.2 ms) whatever the
    # committed profile's probe measured: the 'other' case needs them apart
    prof.comm.p2p.latency_ms, prof.runtime.recv_ms = 0.5, 0.8
    prof_path = tmp_path / "prof.json"
    prof.save(str(prof_path))
    prof = load_profile(str(prof_path))  # with its hash, which the plan records
    plan_path = make_plan(tmp_path, prof, "gpipe4")
    plan = load_plan(str(plan_path))
    k = plan.refresh_steps
    truth = true_profile(prof)  # another link latency and receive completion than prof's
    same_messages = copy.deepcopy(truth)
    same_messages.comm = copy.deepcopy(prof.comm)
    same_messages.runtime.recv_ms, same_messages.runtime.op_ms = prof.runtime.recv_ms, prof.runtime.op_ms
    same_messages.runtime.step_ms = prof.runtime.step_ms  # all the runtime's own work as the plan counts it
    got = {}
    for name, machine in (("same", same_messages), ("other", truth)):
        trace = synthetic_trace(tmp_path, plan_path, machine, steps=8 * k + 1)
        r = cli("inspect", str(trace), "--against", str(plan_path), "--profile", str(prof_path), "--json")
        assert r.returncode == 0, r.stderr
        got[name] = json.loads(r.stdout)["replayed"]
        assert got[name]["cycles"] == (8 * k + 1) // k - 1  # whole cycles after the 1 warm-up step
        assert got[name]["mean_ops_step_ms"] == pytest.approx(got[name]["own_ops_step_ms"], rel=1e-9)
        assert got[name]["level_ops_step_ms"] == pytest.approx(got[name]["own_ops_step_ms"], rel=1e-9)
    same = got["same"]
    # the runtime's work is what the profile says: the run's op times with the planned work
    # replay as the run's own occupancies
    assert same["planned_work_step_ms"] == pytest.approx(same["mean_ops_step_ms"], rel=1e-9)
    # the run's op times and the profile's messages are the machine's: the truth's replay
    assert same["own_ops_step_ms"] == pytest.approx(replay(plan, same_messages).step_time_ms, rel=1e-6)
    # (the trace writer's steady state runs a little under the replay's on this plan)
    assert same["own_ops_step_ms"] == pytest.approx(same["measured_step_ms"], rel=0.03)
    assert abs(plan.stats["step_time_ms"] / same["mean_ops_step_ms"] - 1) > 0.05  # the level: profile vs truth
    other = got["other"]
    assert other["own_ops_step_ms"] / other["measured_step_ms"] > 1.05  # the profile's messages are slower
    text = cli("inspect", str(trace), "--against", str(plan_path), "--profile", str(prof_path)).stdout
    assert "its slow spells from step to step" in text and "each op's spread beyond its rank's level" in text
    assert "messages and collectives beyond the model" in text
    assert "the runtime's work beyond the plan" in text
    # 0.2 ms more after every op than the dispatch the profile has: the op times' level is
    # unchanged, the runtime's work beyond the plan is the difference
    gappy = synthetic_trace(tmp_path, plan_path, same_messages, steps=8 * k + 1, name="gappy", extra_gap_ms=0.2)
    r = cli("inspect", str(gappy), "--against", str(plan_path), "--profile", str(prof_path), "--json")
    g = json.loads(r.stdout)["replayed"]
    assert g["planned_work_step_ms"] == pytest.approx(same["planned_work_step_ms"], rel=1e-6)
    assert g["mean_ops_step_ms"] - g["planned_work_step_ms"] > 0.2  # the critical path has more than one op
    # each rank 0.5x or 1.5x in each step, its ops alike: the ranks' levels replay the run's
    # own op times exactly, and above their means (a slow rank-step holds its peers)
    rng, drawn = random.Random(5), {}
    spells = synthetic_trace(tmp_path, plan_path, same_messages, steps=8 * k + 1, name="spells",
                             level=lambda q, step: drawn.setdefault((q, step), rng.choice((0.5, 1.5))))
    r = cli("inspect", str(spells), "--against", str(plan_path), "--profile", str(prof_path), "--json")
    s = json.loads(r.stdout)["replayed"]
    assert s["level_ops_step_ms"] == pytest.approx(s["own_ops_step_ms"], rel=1e-9)
    assert s["level_ops_step_ms"] > 1.05 * s["mean_ops_step_ms"]
    truth.save(str(tmp_path / "truth.json"))  # not the profile the plan was made from
    r = cli("inspect", str(trace), "--against", str(plan_path), "--profile", str(tmp_path / "truth.json"))
    assert r.returncode == 2 and "plan_profile.hash" in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.e2e
def test_calibration_records_the_op_times_spread_and_plans_predict_with_it(tmp_path):
    """A run whose every compute op and send takes 0.5x its time in even refresh cycles and
    1.5x in odd ones (after the warm-up step; known durations, written from the cost model's definition, not with the
    replay): calibration gives back the entries (the means) and the spread as 20 quantile
    multipliers: ten 0.5 and ten 1.5 as each rank's level from step to step (every compute op
    of a rank-step moved together), 1s for each compute kind beyond it, and ten 0.5 and ten
    1.5 for the sends, which the level leaves out. With the same two multipliers drawn at
    random per op instance, the plan's expected step time with that spread
    (expected_step_time, the replay with drawn op times) is checked against the independent
    trace writer run with the same spread: each one's step time over its own time without
    spread agree to 3%; a late op delays its peers, so both are well above 1. Drawn per rank
    and step instead (the level spread), the two agree again, and a slow rank-step costs more
    than as many slow ops spread over the ranks."""
    prof = load_profile(str(PROFILE))
    plan_path = make_plan(tmp_path, prof, "gpipe4")
    plan = load_plan(str(plan_path))
    k = plan.refresh_steps
    truth = true_profile(prof)
    rng = random.Random(7)
    vary = lambda op, step: rng.choice((0.5, 1.5))  # noqa: E731
    trace = synthetic_trace(tmp_path, plan_path, truth, steps=20 * k + 1, vary=lambda op, step: 0.5 + (step - 1) // k % 2,
                            name=".spread")
    fitted, _ = calibrate(prof, [load_measured(str(trace))])
    spread = fitted.runtime.op_spread
    # receives: none; the messages' transfers and the work between steps did not vary: 1s
    assert set(spread) == {"fwd", "bwd", "step", "curv_a", "curv_b", "precond", "inv", "send", "message",
                           "between_steps"}
    assert fitted.runtime.level_spread == pytest.approx([0.5] * 10 + [1.5] * 10, abs=1e-6)
    for kind, mult in spread.items():
        assert statistics.fmean(mult) == pytest.approx(1.0, abs=1e-5), kind
        want = [0.5] * 10 + [1.5] * 10 if kind == "send" else [1.0] * 20
        assert mult == pytest.approx(want, abs=1e-6), kind
    for got, want in zip(fitted.parts, truth.parts):  # the entries stay the means
        assert got.fwd_ms == pytest.approx(want.fwd_ms, rel=0.1), got.name
    # the spread goes through the file and into every plan made from the profile
    path = tmp_path / "spread.json"
    fitted.save(str(path))
    again = load_profile(str(path))
    assert again.runtime.op_spread == spread and again.runtime.level_spread == fitted.runtime.level_spread
    shown = cli("inspect", str(path)).stdout
    assert "12.5% / 87.5%" in shown and "level from step to step (runtime.level_spread, 12.5% / 87.5%): 0.50/1.50" in shown

    # the expected step time against the independent writer, both over their no-spread step time
    truth_spread = copy.deepcopy(truth)
    truth_spread.runtime.op_spread = {kind: [0.5] * 10 + [1.5] * 10 for kind in spread
                                      if kind not in ("message", "between_steps")}  # the writer varies neither
    steps = 80 * k + 1
    flat = load_measured(str(synthetic_trace(tmp_path, plan_path, truth, steps=steps, name=".flat")))
    varied = load_measured(str(synthetic_trace(tmp_path, plan_path, truth, steps=steps, vary=vary, name=".varied")))

    def writer_step_ms(tr) -> float:  # the steady spacing of step ends, after the first step
        ends = defaultdict(float)
        for o in tr.ops:
            ends[o.step] = max(ends[o.step], o.end_ms)
        return (ends[steps - 1] - ends[1]) / (steps - 2)
    writer = writer_step_ms(varied) / writer_step_ms(flat)
    model = expected_step_time(plan, truth_spread, steps=4000) / replay(plan, truth).step_time_ms
    assert writer > 1.03 and model > 1.03
    assert model == pytest.approx(writer, rel=0.03)
    # the same multipliers drawn per rank and step: writer and model agree, and cost more
    truth_level = copy.deepcopy(truth)
    truth_level.runtime.level_spread = [0.5] * 10 + [1.5] * 10
    ranks = random.Random(11)
    levels = {}
    slow = load_measured(str(synthetic_trace(
        tmp_path, plan_path, truth, steps=steps, name=".leveled",
        level=lambda q, step: levels.setdefault((q, step), ranks.choice((0.5, 1.5))))))
    writer_level = writer_step_ms(slow) / writer_step_ms(flat)
    model_level = expected_step_time(plan, truth_level, steps=4000) / replay(plan, truth).step_time_ms
    assert model_level == pytest.approx(writer_level, rel=0.03)
    print(f"\nper op: writer {writer:.3f} model {model:.3f}; per rank-step: writer {writer_level:.3f} model {model_level:.3f}")
    assert model_level > model + 0.03 and writer_level > writer + 0.03
    # a spread of 1s is no spread; no spread recorded, no expected step time
    ones = copy.deepcopy(truth)
    ones.runtime.op_spread = {kind: [1.0] * 20 for kind in spread}
    ones.runtime.level_spread = [1.0] * 20
    assert expected_step_time(plan, ones) == pytest.approx(replay(plan, truth).step_time_ms, rel=1e-9)
    assert expected_step_time(plan, truth) is None
    made, _, _ = build_plan(again, PipelineConfig("gpipe", stages=4, micro_batches=4), PlanOptions("greedy"))
    assert made.stats["expected_step_time_ms"] > made.stats["step_time_ms"]


def test_calibration_recovers_a_split_backward(tmp_path):
    """A zero-bubble run (zb-h1, one part per stage): B and W are fitted per part, apart
    from each other and from the whole backward the plan does not run."""
    prof = load_profile(str(PROFILE))
    truth = true_profile(prof)
    for i, p in enumerate(truth.parts):  # B and W off the profile by different known factors
        b, w = prof.part(p.name).split_backward_ms()
        p.bwd_input_ms, p.bwd_weight_ms = (b or 0.4) * (1.3 + 0.1 * i), (w or 0.3) * (0.6 + 0.1 * i)
    plan_path = make_plan(tmp_path, prof, "zbh1", schedule="zb-h1")
    trace = synthetic_trace(tmp_path, plan_path, truth, steps=load_plan(str(plan_path)).refresh_steps + 2)
    fitted, counts = calibrate(prof, [load_measured(str(trace))])
    assert counts["bwd_input"] == counts["bwd_weight"] == 4 and "bwd" not in counts
    for got, want, was in zip(fitted.parts, truth.parts, prof.parts):
        assert got.bwd_input_ms == pytest.approx(want.bwd_input_ms, rel=0.01), got.name
        assert got.bwd_weight_ms == pytest.approx(want.bwd_weight_ms, rel=0.01), got.name
        assert got.bwd_ms == was.bwd_ms  # not run: kept
    plan = load_plan(str(plan_path))
    assert replay(plan, fitted).step_time_ms == pytest.approx(replay(plan, truth).step_time_ms, rel=0.01)


@pytest.mark.e2e
def test_cli_calibrate_inspect_and_refusals(tmp_path, ops_only_tiny):
    # the ops' costs alone: the per-kind ratios are then exactly the known factors
    PROFILE = ops_only_tiny  # noqa: N806
    prof = load_profile(str(PROFILE))
    truth = true_profile(prof)
    plan_path = make_plan(tmp_path, prof, "f1b", schedule="1f1b", stages=2)
    trace = synthetic_trace(tmp_path, plan_path, truth, steps=load_plan(str(plan_path)).refresh_steps + 2)

    r = cli("inspect", str(trace), "--against", str(plan_path), "--json")
    assert r.returncode == 0, r.stderr
    rows = {row["kind"]: row for row in json.loads(r.stdout)["kinds"]}
    assert rows["precond"]["ratio"] == pytest.approx(3.0, rel=1e-3)  # the known factor, per op kind
    assert rows["curv_b"]["ratio"] == pytest.approx(0.5, rel=1e-3)
    beside = json.loads(r.stdout)["beside_work"]  # the ops beside K-FAC's work: as long as the others here
    assert beside["after"]["ratio"] == pytest.approx(1.0, rel=1e-3) and beside["after"]["ops"] > 0
    table = cli("inspect", str(trace), "--against", str(plan_path)).stdout
    assert "op kind" in table and "between ops" in table and "measured/predicted" in table
    assert "beside the optimizer's work" in table

    out = tmp_path / "cal.json"
    r = cli("calibrate", str(PROFILE), str(trace), "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert load_profile(str(out)).provenance["calibration"]["parent_hash"] == prof.hash

    # a trace of another plan, or of a plan made from another profile, is refused with one line
    other_plan = make_plan(tmp_path, prof, "other", schedule="gpipe", stages=2)
    r = cli("inspect", str(trace), "--against", str(other_plan))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "otherData.plan_sha256: the trace ran another plan" in r.stderr
    r = cli("calibrate", str(out), str(trace), "-o", str(tmp_path / "cal2.json"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "otherData.plan_profile.hash: the trace ran a plan made from profile" in r.stderr
    not_measured = tmp_path / "predicted.json"
    assert pfcompile_main(["render", str(plan_path), "--trace", str(not_measured)]) == 0  # the refused input
    r = cli("calibrate", str(PROFILE), str(not_measured), "-o", str(tmp_path / "cal3.json"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "otherData.source" in r.stderr


@pytest.mark.e2e
def test_inspect_with_the_profile_compares_each_op_with_its_own_time(tmp_path):
    """A run written with the plan's own profile's costs (runtime overheads included: the
    committed profile's dispatch and work between steps): with `--profile`, every op kind
    the run times (compute ops, the optimizer step, sends) is predicted exactly, ratio 1; the
    runtime's work is in 'between ops'. Without it, the same from what the plan records of
    that work; a plan made before it recorded it predicts a step op by its span, longer than
    the op by the dispatch and the work between steps."""
    prof = load_profile(str(PROFILE))
    rt = prof.runtime
    assert rt.step_ms > 0 and rt.op_ms > 0
    plan_path = make_plan(tmp_path, prof, "f1b", schedule="1f1b", stages=2)
    trace = synthetic_trace(tmp_path, plan_path, prof, steps=load_plan(str(plan_path)).refresh_steps + 2)

    def rows(*flags, trace=trace, plan_path=plan_path):
        r = cli("inspect", str(trace), "--against", str(plan_path), "--json", *flags)
        assert r.returncode == 0, r.stderr
        return {row["kind"]: row for row in json.loads(r.stdout)["kinds"]}
    own, recorded = rows("--profile", str(PROFILE)), rows()
    for kind in ("fwd", "bwd", "step", "curv_a", "curv_b", "inv", "precond", "send_act", "send_grad"):
        assert own[kind]["ratio"] == pytest.approx(1.0, rel=1e-6), kind
        assert recorded[kind]["predicted_ms"] == pytest.approx(own[kind]["predicted_ms"], abs=2e-6), kind
    raw = json.loads(plan_path.read_text())  # as a plan made before it recorded the runtime's work
    del raw["stats"]["runtime_op_ms"]
    for rank in raw["ranks"]:
        for ops in rank["steps"]:
            for d in ops:
                d.pop("between_ms", None)
    old_path = tmp_path / "before.json"
    old_path.write_text(json.dumps(raw))
    old_trace = synthetic_trace(tmp_path, old_path, prof, steps=load_plan(str(old_path)).refresh_steps + 2)
    span = rows(trace=old_trace, plan_path=old_path)
    assert span["step"]["predicted_ms"] - own["step"]["predicted_ms"] == pytest.approx(rt.op_ms + rt.step_ms)
    assert span["fwd"]["predicted_ms"] - own["fwd"]["predicted_ms"] == pytest.approx(rt.op_ms)
    assert span["step"]["ratio"] < 1.0
    text = cli("inspect", str(trace), "--against", str(plan_path), "--profile", str(PROFILE)).stdout
    assert "predicted: each op's own time in the plan" in text


@pytest.mark.e2e
def test_calibrate_checks_the_profile_against_the_run_it_was_fitted_on(tmp_path):
    """`pfcompile calibrate` prints, per trace, the calibrated profile's prediction of the run
    it was fitted on (the model's own error, apart from the machine's). A run written from
    the TRUE costs (not with the replay) is reproduced to 1%, and its measured step is that
    run's steady step; the parent profile, not fitted to it, is far off the same run; a trace
    whose plan file has moved is named, and calibration still succeeds."""
    prof = load_profile(str(PROFILE))
    truth = true_profile(prof)
    plan_path = make_plan(tmp_path, prof, "f1b", schedule="1f1b", stages=2)
    plan = load_plan(str(plan_path))
    trace = synthetic_trace(tmp_path, plan_path, truth, steps=6 * plan.refresh_steps + 1)
    out = tmp_path / "cal.json"
    r = cli("calibrate", str(PROFILE), str(trace), "-o", str(out))
    assert r.returncode == 0, r.stderr
    m = re.search(r"against the run it was fitted on: measured ([0-9.]+) ms/step, predicted ([0-9.]+), "
                  r"measured/predicted ([0-9.]+)", r.stderr)
    assert m, r.stderr
    assert float(m[3]) == pytest.approx(1.0, abs=0.01)
    assert float(m[1]) == pytest.approx(replay(plan, truth).step_time_ms, rel=0.01)
    parent = against_fitted_run(load_measured(str(trace)), prof)
    assert abs(parent["measured_step_ms"] / parent["predicted_step_ms"] - 1.0) > 0.05

    plan_path.rename(tmp_path / "moved.json")
    r = cli("calibrate", str(PROFILE), str(trace), "-o", str(tmp_path / "cal2.json"))
    assert r.returncode == 0, r.stderr
    assert "no check against the fitted run (the plan file the trace names is not there" in r.stderr


def test_ranks_on_one_host_share_rank_0s_clock():
    """A barrier releases ranks ms apart; on one host perf_counter is one clock, so the
    timelines are moved onto rank 0's origin exactly (a receive never ends before its send)."""
    a = measure.Timeline(0, 10.000, [(0, "F0.0", "fwd", 1.0, 2.0)], [(0, 1.0, 2.0)], host="h")
    b = measure.Timeline(1, 10.002, [(0, "RA0.0<0", "recv_act", 0.5, 1.5)], [(0, 0.5, 1.5)], host="h")
    c = measure.Timeline(2, 10.005, [(0, "F1.0", "fwd", 0.5, 1.5)], [(0, 0.5, 1.5)], host="other")
    got = {tl.rank: tl for tl in measure.align([b, a, c])}
    assert got[1].ops[0][3:] == pytest.approx((2.5, 3.5)) and got[1].steps[0][1:] == pytest.approx((2.5, 3.5))
    assert got[0].ops == a.ops and got[2].ops == c.ops  # rank 0 is the origin; another host keeps its own
    assert measure.Timeline.from_json(got[1].to_json()).host == "h"


def test_step_time_counts_the_ranks_skew_and_the_period_does_not():
    """As a 1F1B run looks: every step lasts P on each rank, and the last stage (rank 1)
    starts each step `skew` before the first. step_ms spans the first start to the last end
    over the timed steps, (n P + skew) / n; period_ms is each rank's start-to-start, P."""
    P, skew, steps, warmup = 100.0, 28.0, 30, 2
    ranks = [measure.Timeline(0, 0.0, [], [(s, skew + s * P, skew + (s + 1) * P) for s in range(steps)]),
             measure.Timeline(1, 0.0, [], [(s, s * P, (s + 1) * P - 5.0) for s in range(steps)])]
    got = measure.summarize(ranks, None, None, warmup, steps)
    n = steps - warmup
    assert got.step_ms == pytest.approx((n * P + skew) / n)
    assert got.period_ms == pytest.approx(P)
    assert measure.summarize(ranks, None, None, steps - 1, steps).period_ms is None  # one timed step: no period


def test_two_message_sizes_fit_latency_and_bandwidth():
    """Receives posted before their send ended measure the link: with two sizes both its
    latency and its bandwidth come back; receives posted after measure recv_ms."""
    from pfcompile.calibrate.fit import fit_receives
    from pfcompile.formats.profile import LinkModel

    true = LinkModel(latency_ms=0.3, bytes_per_ms=2e6)
    recvs = []
    for n in (100_000, 400_000):
        for gap in (-5.0, -3.0, -1.0):  # posted before: lasts until the data is in
            recvs.append((n, gap, true.time_ms(n) - gap))
        for gap in (0.5, 2.0):  # posted after: its own completion, 0.4 ms
            recvs.append((n, gap, 0.4))
    link, recv_ms = fit_receives(recvs, LinkModel(latency_ms=9.0, bytes_per_ms=1.0), statistics.fmean)
    assert link.latency_ms == pytest.approx(0.3, rel=1e-6) and link.bytes_per_ms == pytest.approx(2e6, rel=1e-6)
    assert recv_ms == pytest.approx(0.4)


def test_the_profilers_in_run_levels_are_its_probe_runs_fits(tmp_path):
    """pfcompile.profiler.runtime_probe.in_run_levels: a profile's entries become their times
    in the probe's runs. Runs written from the cost model with known costs (true_profile): a
    GPipe run without optimizer work sets the parts' fwd, bwd and AdamW step to the truth's,
    moves a split backward's B and W with their part's backward (no probe runs them), and a
    run with K-FAC's work appended sets its per-layer entries and its step; what neither
    runs (the eigen inversions) keeps its value, and each factor is new over old. K-FAC's
    run meets a machine 1.3x slower at everything (this VM's speed moves within seconds):
    every entry, the first run's and K-FAC's, is put at the two runs' common speed, their
    passes' levels (1 and 1.3) averaged over their steps."""
    from pfcompile.profiler.runtime_probe import in_run_levels

    prof = load_profile(str(PROFILE))
    truth = true_profile(prof)
    slower = scaled_profile(truth, 1.3)
    traces = {}
    for opt, machine in (("adamw", truth), ("kfac", slower)):
        plan, _, _ = build_plan(prof, PipelineConfig("gpipe", stages=4, micro_batches=4, optimizer=opt),
                                PlanOptions("none"))
        path = tmp_path / f"probe-{opt}.json"
        plan.save(str(path))
        traces[opt] = load_measured(str(synthetic_trace(tmp_path, path, machine, steps=plan.refresh_steps + 2)))
    got = copy.deepcopy(prof)
    factors, levels = in_run_levels(got, traces["adamw"], {"kfac": traces["kfac"]})
    assert levels["kfac"] == pytest.approx(1.3, rel=1e-3)
    n = {opt: len({o.step for o in tr.ops}) for opt, tr in traces.items()}
    common = (n["adamw"] * 1.0 + n["kfac"] * 1.3) / (n["adamw"] + n["kfac"])
    assert levels["common"] == pytest.approx(common, rel=1e-3) and 1.0 < common < 1.3

    close = lambda a, b: a == pytest.approx(b * common, rel=0.01)  # noqa: E731
    for g, want, was in zip(got.parts, truth.parts, prof.parts):
        assert close(g.fwd_ms, want.fwd_ms) and close(g.bwd_ms, want.bwd_ms), g.name
        assert close(g.step_ms["adamw"], want.step_ms["adamw"]), g.name
        assert close(g.step_ms["kfac"], want.step_ms["kfac"]), g.name  # K-FAC's step: from its own probe
        b, w = was.split_backward_ms()
        assert close(g.bwd_input_ms, b * want.bwd_ms / was.bwd_ms) and close(g.bwd_weight_ms, w * want.bwd_ms / was.bwd_ms)
        assert factors[f"parts.{g.name}.fwd_ms"] == pytest.approx(g.fwd_ms / was.fwd_ms)
    for g, want, was in zip(got.covered_layers, truth.covered_layers, prof.covered_layers):
        gk, wk = g.optimizer_ms["kfac"], want.optimizer_ms["kfac"]
        for key in ("curv_a", "curv_b", "precond", "inv_A.cholesky", "inv_B.cholesky"):
            assert close(gk[key], wk[key]), (g.name, key)
            assert factors[f"covered_layers.{g.name}.optimizer_ms.kfac.{key}"] == \
                pytest.approx(gk[key] / was.optimizer_ms["kfac"][key])
        assert gk["inv_A.eigen"] == was.optimizer_ms["kfac"]["inv_A.eigen"]  # not run: kept


def test_kfacs_capture_is_costed_on_refresh_steps_and_fitted_apart_from_the_ops(tmp_path):
    """K-FAC's refresh step captures each layer's input and output gradient, and the step's
    pipeline ops run slower for it (Part.capture_ms). The cost model charges it to the
    pipeline ops of step 0 of each cycle, with K-FAC only; calibration fits it from a run's
    refresh steps against its other steps, and keeps it out of the ops' own times; the
    profiler's K-FAC probe refreshes every other step so that its one run gives both. Runs
    written from the cost model with known capture costs (and scaled entries)."""
    from pfcompile.profiler.runtime_probe import in_run_levels, probe_plan

    prof = load_profile(str(PROFILE))
    assert all(p.capture_ms is None for p in prof.parts)  # made before it was timed: 0
    truth = true_profile(prof)
    for i, p in enumerate(truth.parts):
        p.capture_ms = {"fwd": 0.05 * (i + 1), "bwd": 0.1 * (i + 1)}
    plan, _, _ = build_plan(prof, PipelineConfig("1f1b", stages=2, micro_batches=4),
                            PlanOptions("cpsat", time_limit=2, refresh_steps=3))
    plan_path = tmp_path / "kfac.json"
    plan.save(str(plan_path))
    k = plan.refresh_steps
    costs = Costs(truth, plan.partition, 1, refresh_steps=k)
    stage_sum = {(kind, s): sum(truth.part(n).capture_ms[kind] for n in plan.partition[s])
                 for kind in ("fwd", "bwd") for s in range(2)}
    for (kind, s), want in stage_sum.items():
        op = Op(kind, stage=s, mb=0)
        assert costs.duration(op, 0) - costs.duration(op, 1) == pytest.approx(want) and want > 0
        assert costs.duration(op, 1) == costs.duration(op, k - 1) == costs.duration(op)
        adamw = Costs(truth, plan.partition, 1, optimizer="adamw", refresh_steps=k)  # no capture, no such cost
        assert adamw.duration(op, 0) == adamw.duration(op, 1)
    without = copy.deepcopy(truth)
    for p in without.parts:
        p.capture_ms = None
    assert replay(plan, truth).step_time_ms > replay(plan, without).step_time_ms

    # a plan's run: its refresh steps give the capture, its other steps the ops' own times
    trace = load_measured(str(synthetic_trace(tmp_path, plan_path, truth, steps=6 * k + 1)))
    fitted, counts = calibrate(prof, [trace])
    assert counts["capture"] == 2 * len(prof.parts)
    for (kind, s), want in stage_sum.items():
        names = plan.partition[s]
        assert sum(fitted.part(n).capture_ms[kind] for n in names) == pytest.approx(want, rel=1e-6)
        got_own = sum(getattr(fitted.part(n), f"{kind}_ms") for n in names)
        assert got_own == pytest.approx(sum(getattr(truth.part(n), f"{kind}_ms") for n in names), rel=1e-6)
    assert replay(plan, fitted).step_time_ms == pytest.approx(replay(plan, truth).step_time_ms, rel=1e-6)

    # a run that captures in every step (k = 1) keeps the entries and fits the ops without them
    every, _, _ = build_plan(prof, PipelineConfig("1f1b", stages=2, micro_batches=4), PlanOptions("none"))
    every_path = tmp_path / "kfac-every.json"
    every.save(str(every_path))
    parent = copy.deepcopy(prof)
    for p, t in zip(parent.parts, truth.parts):
        p.capture_ms = dict(t.capture_ms)
    fitted_every, _ = calibrate(parent, [load_measured(str(synthetic_trace(tmp_path, every_path, truth, steps=8)))])
    for names in every.partition:
        got = sum(fitted_every.part(n).fwd_ms for n in names)
        assert got == pytest.approx(sum(truth.part(n).fwd_ms for n in names), rel=1e-6)
        assert [fitted_every.part(n).capture_ms for n in names] == [truth.part(n).capture_ms for n in names]

    # the profiler's probes: K-FAC's refreshes every other step (its work in that step), and
    # its run gives the capture; B and W share the backward's
    probe = probe_plan(prof, "kfac")
    assert probe.refresh_steps == 2 and probe_plan(prof, "adamw").refresh_steps == 1
    assert all(not any(o.layer is not None and o.kind.startswith("curv") for o in probe.ops(q, 1))
               for q in range(probe.world_size))
    traces = {}
    for opt in ("adamw", "kfac"):
        path = tmp_path / f"probe-{opt}.json"
        probe_plan(prof, opt).save(str(path))
        traces[opt] = load_measured(str(synthetic_trace(tmp_path, path, truth, steps=8)))
    got = copy.deepcopy(prof)
    factors, _ = in_run_levels(got, traces["adamw"], {"kfac": traces["kfac"]})
    for names in probe.partition:
        for kind in ("fwd", "bwd"):
            want = sum(truth.part(n).capture_ms[kind] for n in names)
            assert sum(got.part(n).capture_ms[kind] for n in names) == pytest.approx(want, rel=1e-6)
    for p in got.parts:
        b, w = p.split_backward_ms()
        assert p.capture_ms["bwd_input"] + p.capture_ms["bwd_weight"] == pytest.approx(p.capture_ms["bwd"])
        assert p.capture_ms["bwd_input"] * w == pytest.approx(p.capture_ms["bwd_weight"] * b)
    assert not any(".capture_ms." in key for key in factors)  # nothing timed alone to be a factor of


def test_the_probes_run_for_seconds_not_a_fixed_count_of_steps():
    """A probe's run lasts PROBE_SECONDS at its plan's predicted step (an optimizer's,
    OPTIMIZER_PROBE_SECONDS), never fewer steps than its samples need nor more than
    PROBE_MAX_STEPS: a short step runs many, a long one the least."""
    from pfcompile.profiler import runtime_probe as rp

    prof = load_profile(str(PROFILE))
    base = rp.probe_plan(prof, "adamw")
    step_ms, n = base.stats["step_time_ms"], rp.probe_steps(base)
    assert rp.PROBE_STEPS < n <= rp.PROBE_MAX_STEPS  # bert-tiny's ~20 ms steps
    assert n == rp.PROBE_MAX_STEPS or (n - 1) * step_ms < rp.PROBE_SECONDS * 1e3 <= n * step_ms
    slow = copy.deepcopy(prof)
    for p in slow.parts:
        p.fwd_ms, p.bwd_ms = p.fwd_ms * 100, p.bwd_ms * 100
    assert rp.probe_steps(rp.probe_plan(slow, "adamw")) == rp.PROBE_STEPS
    assert rp.probe_steps(rp.probe_plan(slow, "kfac"), "kfac") == rp.CAPTURE_PROBE_STEPS
    kfac = rp.probe_plan(prof, "kfac")
    assert rp.probe_steps(kfac, "kfac") * kfac.stats["step_time_ms"] >= rp.OPTIMIZER_PROBE_SECONDS * 1e3


def test_the_op_times_level_is_split_by_op_kind(tmp_path):
    """`inspect --against --profile` names the op kinds whose level moved the step: the plan
    replayed with one kind at its measured mean occupancy, the others at their profiled
    times. A run written from the cost model (not the replay) in which only the
    preconditioning takes 3x its profiled time: precond's entry is the step that 3x gives
    in the replay, every other kind's is zero."""
    from pfcompile.calibrate.compare import replayed_with_measured

    prof = load_profile(str(PROFILE))
    slow = copy.deepcopy(prof)
    for layer in slow.covered_layers:
        layer.optimizer_ms["kfac"]["precond"] *= 3.0
    plan_path = make_plan(tmp_path, prof, "f1b", schedule="1f1b", stages=2)
    plan = load_plan(str(plan_path))
    k = plan.refresh_steps
    trace = synthetic_trace(tmp_path, plan_path, slow, steps=8 * k + 1)
    r = replayed_with_measured(load_measured(str(trace)), plan, prof)
    level = r["level_by_kind_ms"]
    want = replay(plan, slow, cycles=r["cycles"]).step_time_ms - replay(plan, prof, cycles=r["cycles"]).step_time_ms
    assert want > 0.05  # the plan's updates wait for the preconditioning: it is on the critical path
    assert level["precond"] == pytest.approx(want, rel=1e-6)
    assert {"fwd", "bwd", "step", "curv_a", "inv"} <= set(level)
    assert all(ms == pytest.approx(0.0, abs=1e-9) for kind, ms in level.items() if kind != "precond"), level
    assert next(iter(level)) == "precond"  # the largest first


def test_a_measured_trace_keeps_the_runtimes_spans_apart_from_its_ops(tmp_path):
    """The runtime's own work between ops (Timeline.span) goes to its own row of the
    trace; load_measured keeps it apart from the ops (whose names it parses), and the
    comparison sums each span per step and rank, with its longest instance (a stall)."""
    from pfcompile.calibrate.compare import format_runtime_spans, runtime_spans

    tls = []
    for q in range(2):
        tl = measure.Timeline(q, 0.0)
        for step in range(4):
            t = 10.0 * step
            tl.spans.append((step, "batch", t, t + 0.5 + q))
            tl.record(step, "F0.0" if q == 0 else "F1.0", "fwd", t + 2, t + 5)
            tl.spans.append((step, "verdict", t + 5, t + 5.25 + (3.0 if step == 3 else 0.0)))
            tl.steps.append((step, t + 2, t + 5))
        tls.append(tl)
    path = tmp_path / "measured.json"
    plan_path = make_plan(tmp_path, load_profile(str(PROFILE)), "gpipe2", stages=2)
    measure.write_measured_trace(str(path), tls, {"plan": str(plan_path), "steps": 4, "warmup_steps": 1,
                                                  **measure.plan_identity(str(plan_path), load_plan(str(plan_path)))})
    trace = load_measured(str(path))
    assert [str(o.op) for o in trace.ops].count("F0.0") == 3 and len(trace.ops) == 6  # steps 1-3
    assert len(trace.spans) == 12 and {s.name for s in trace.spans} == {"batch", "verdict"}
    got = runtime_spans(trace, ranks=2, steps=3)
    assert got["batch"]["per_step_ms"] == pytest.approx((0.5 + 1.5) / 2)
    assert got["verdict"]["per_step_ms"] == pytest.approx((0.25 + 0.25 + 3.25) * 2 / 3 / 2)
    assert got["verdict"]["max_ms"] == pytest.approx(3.25) and got["verdict"]["median_ms"] == pytest.approx(0.25)
    text = "\n".join(format_runtime_spans({"runtime_spans": got, "runtime_planned_ms": 1.0}))
    assert "batch" in text and "the plan counts 1.000" in text and "longest 3.250" in text


def test_soaps_activation_is_costed_at_each_cycles_end_and_fitted_from_the_runtime_row(tmp_path):
    """SOAP puts a cycle's new bases into force at the next cycle's start (its moments
    rotated into them: Optimizer.activation). The cost model charges each stage's layers'
    activation to the step op that ends a cycle, and only to it; calibration fits each
    layer's entry from the trace's `activate` spans (a rank's activation shared by its
    layers as their entries were) and keeps it out of the work between steps. A run
    written from the cost model with known activation costs: the fit recovers each stage's
    sum and the runtime's step work, and the refitted profile predicts the true step."""
    prof = load_profile(str(TINY_OPTIMIZERS_BEFORE_OWN_STEP))
    assert all("activate" not in layer.optimizer_ms["soap"] for layer in prof.covered_layers)  # made before it was timed
    plan, _, _ = build_plan(prof, PipelineConfig("1f1b", stages=2, micro_batches=4, optimizer="soap"),
                            PlanOptions("cpsat", time_limit=2, refresh_steps=3))
    plan_path = tmp_path / "soap.json"
    plan.save(str(plan_path))
    k = plan.refresh_steps
    truth = copy.deepcopy(prof)
    for j, layer in enumerate(truth.covered_layers):
        layer.optimizer_ms["soap"]["activate"] = 0.3 + 0.05 * j
    truth.runtime = RuntimeOverheads(op_ms=0.01, step_ms=0.8, send_ms=0.15, recv_ms=0.2)
    costs = Costs(truth, plan.partition, 1, optimizer="soap", refresh_steps=k)
    stage_sum = [sum(truth.covered_layers[l].optimizer_ms["soap"]["activate"] for l in costs.stage_layers[s])
                 for s in range(2)]
    for s in range(2):
        step = Op("step", stage=s)
        assert costs.duration(step, k - 1) - costs.duration(step, 0) == pytest.approx(stage_sum[s]) and stage_sum[s] > 1
        assert costs.duration(step, 1) == costs.duration(step, 0) == costs.duration(step)
        assert costs.activation_ms(s) == pytest.approx(stage_sum[s])
    assert Costs(prof, plan.partition, 1, optimizer="soap", refresh_steps=k).activation_ms(0) == 0.0  # none profiled
    without = copy.deepcopy(truth)
    for layer in without.covered_layers:
        del layer.optimizer_ms["soap"]["activate"]
    # stage 0's activation delays every later op of the cycle: the step grows by its share
    assert replay(plan, truth).step_time_ms - replay(plan, without).step_time_ms == pytest.approx(stage_sum[0] / k)

    trace = load_measured(str(synthetic_trace(tmp_path, plan_path, truth, steps=6 * k + 1, activation=True)))
    assert {sp.name for sp in trace.spans} == {"activate"}
    fitted, counts = calibrate(prof, [trace])
    assert counts["activate"] == 2
    for s in range(2):
        got = sum(fitted.covered_layers[l].optimizer_ms["soap"]["activate"] for l in costs.stage_layers[s])
        assert got == pytest.approx(stage_sum[s], rel=1e-6)
    assert fitted.runtime.step_ms == pytest.approx(0.8, rel=1e-6)  # the activation is not work between steps
    # the refitted profile predicts what the activation adds (the same run without it, refitted, against it)
    plain = load_measured(str(synthetic_trace(tmp_path, plan_path, truth, steps=6 * k + 1, name="-plain")))
    fitted_plain, counts_plain = calibrate(prof, [plain])
    assert "activate" not in counts_plain
    assert replay(plan, fitted).step_time_ms - replay(plan, fitted_plain).step_time_ms == pytest.approx(
        replay(plan, truth).step_time_ms - replay(plan, without).step_time_ms, rel=1e-6)


def test_beside_the_work_compares_ops_with_their_own_kind_within_one_run():
    """A hand-made 2-rank run: rank 0's forwards take 3 ms right after an inversion and 2 ms
    after a backward; rank 1's backwards take 5 ms while rank 0 inverts and 4 ms while it
    runs a forward and a backward; a message sent just before an inversion lands 1.5 ms after its send,
    one sent before a forward 0.5 ms after. Each ratio is the closed form."""
    from pfcompile.calibrate.compare import beside_the_work
    from pfcompile.calibrate.measured import MeasuredOp, MeasuredTrace

    ops = []
    for step in range(4):
        t = 100.0 * step
        inv, fwd_after_inv = Op("inv", layer=0, factor="A"), Op("fwd", 0, 0)
        send_a, send_b = Op("send_act", 0, 0, peer=1), Op("send_act", 0, 1, peer=1)
        ops += [MeasuredOp(0, step, send_a, t, t + 0.1),           # send, then an inversion
                MeasuredOp(0, step, inv, t + 0.1, t + 10.1),
                MeasuredOp(0, step, fwd_after_inv, t + 10.1, t + 13.1),  # 3 ms after the inversion
                MeasuredOp(0, step, Op("bwd", 0, 0), t + 13.1, t + 20.1),
                MeasuredOp(0, step, send_b, t + 20.1, t + 20.2),    # send, then a forward
                MeasuredOp(0, step, Op("fwd", 0, 1), t + 20.2, t + 22.2),  # 2 ms after the backward
                MeasuredOp(0, step, Op("bwd", 0, 1), t + 22.2, t + 29.2),
                MeasuredOp(1, step, Op("recv_act", 0, 0, peer=0), t, t + 1.6),    # lands 1.5 ms after its send
                MeasuredOp(1, step, Op("bwd", 1, 0), t + 1.6, t + 6.6),  # 5 ms beside the inversion
                MeasuredOp(1, step, Op("recv_act", 0, 1, peer=0), t + 19.0, t + 20.7),  # 0.5 ms after its send
                MeasuredOp(1, step, Op("bwd", 1, 1), t + 20.7, t + 24.7)]  # 4 ms beside rank 0's forward
    b = beside_the_work(MeasuredTrace("hand.json", {}, ops))
    assert b["after"]["ratio"] == pytest.approx(1.5) and b["after"]["ops"] == 4
    assert b["during"]["ratio"] == pytest.approx(5 / 4) and b["during"]["ops"] == 4
    assert b["lag"]["optimizer"]["mean_ms"] == pytest.approx(1.5) and b["lag"]["optimizer"]["over_1ms"] == 1.0
    assert b["lag"]["pipeline"]["mean_ms"] == pytest.approx(0.5) and b["lag"]["pipeline"]["messages"] == 4
    without = [o for o in ops if o.op.kind != "inv"]
    assert beside_the_work(MeasuredTrace("adamw.json", {}, without)) is None  # no optimizer work: nothing to compare


def test_message_and_between_step_stalls_are_fitted_and_priced_in_the_expected_step(tmp_path):
    """A run whose messages take 0.25x or 1.75x their link time and whose runtime work between
    steps takes 0.25x or 1.75x its mean, alternately by refresh cycle (after the warm-up
    step; the known run written from the cost model's definition, not with the replay):
    calibration records both as op_spread's `message` and `between_steps`, each half its
    low and half its high multiplier. Drawn at random per message and per rank-step
    instead, the plan's expected step time with those two spreads is checked against the
    independent writer run with them: each one's step over its own step without them agree
    to 3%, and both are above 1 (a late message or a long pause between steps delays the
    rank waiting on it, an early one rarely lets it start sooner)."""
    prof = load_profile(str(PROFILE))
    plan_path = make_plan(tmp_path, prof, "gpipe4")
    plan = load_plan(str(plan_path))
    k = plan.refresh_steps
    truth = true_profile(prof)
    truth.comm.p2p.latency_ms = 2.0  # stalls large enough to move the step
    truth.runtime.step_ms = 6.0
    low_high = lambda step: 0.25 + 1.5 * ((step - 1) // k % 2)  # noqa: E731
    trace = synthetic_trace(tmp_path, plan_path, truth, steps=20 * k + 1, name=".stalls",
                            transfer=lambda op, step: low_high(step), between=lambda q, step: low_high(step))
    fitted, _ = calibrate(prof, [load_measured(str(trace))])
    spread = fitted.runtime.op_spread
    assert spread["between_steps"] == pytest.approx([0.25] * 10 + [1.75] * 10, abs=1e-6)
    message = spread["message"]
    assert statistics.fmean(message) == pytest.approx(1.0, abs=1e-5)
    assert statistics.fmean(message[:10]) < 0.4 and statistics.fmean(message[10:]) > 1.6
    for kind in ("fwd", "bwd", "send"):  # the ops themselves did not vary
        assert spread[kind] == pytest.approx([1.0] * 20, abs=1e-6), kind

    steps = 80 * k + 1
    rng = random.Random(5)
    pick = lambda *_: rng.choice((0.25, 1.75))  # noqa: E731
    flat = load_measured(str(synthetic_trace(tmp_path, plan_path, truth, steps=steps, name=".flat")))
    varied = load_measured(str(synthetic_trace(tmp_path, plan_path, truth, steps=steps, name=".varied",
                                               transfer=pick, between=pick)))

    def writer_step_ms(tr) -> float:  # the steady spacing of step ends, after the first step
        ends = defaultdict(float)
        for o in tr.ops:
            ends[o.step] = max(ends[o.step], o.end_ms)
        return (ends[steps - 1] - ends[1]) / (steps - 2)
    stalls = copy.deepcopy(truth)
    stalls.runtime.op_spread = {"message": [0.25] * 10 + [1.75] * 10, "between_steps": [0.25] * 10 + [1.75] * 10}
    writer = writer_step_ms(varied) / writer_step_ms(flat)
    model = expected_step_time(plan, stalls, steps=4000) / replay(plan, truth).step_time_ms
    print(f"\nwriter {writer:.3f} model {model:.3f}")
    assert writer > 1.02 and model > 1.02
    assert model == pytest.approx(writer, rel=0.03)


def test_a_message_seen_to_arrive_before_its_send_ended_counts_as_no_lag():
    """The ranks' clocks are aligned to within a fraction of a millisecond: a waiting receive
    may end a little before its send's end by the trace. Its transfer counts as 0, and the
    spread stays a valid profile entry (no negative multiplier)."""
    link = LinkModel(latency_ms=0.1, bytes_per_ms=1e6)
    recvs = [(100_000, -0.5, 0.45)] * 4 + [(100_000, -0.5, 0.7)] * 36  # four end 0.05 ms early
    mult = message_spread(recvs, link)
    assert min(mult) == 0.0 and statistics.fmean(mult) == pytest.approx(1.0, abs=1e-5)


def test_a_busy_spread_weighs_in_by_the_plans_utilization(tmp_path):
    """runtime.busy (formats.profile): a plan as busy as the base probe run varies exactly as
    without it; one as busy as the busy run exactly as a profile whose spreads and work
    between steps are the busy run's; one halfway between lies between the two. A busy
    spread with a heavier tail and more work between steps costs the busier plan more.
    It goes through the file, and a bad utilization is refused in one line naming it."""
    prof = load_profile(str(PROFILE))
    assert prof.runtime.op_spread and prof.runtime.step_ms > 0
    prof.runtime.level_spread = [0.8] * 10 + [1.2] * 10
    cfg = PipelineConfig("1f1b", stages=2, micro_batches=4)
    plain = build_plan(prof, cfg, PlanOptions("none"))[0]
    kfac = build_plan(prof, PipelineConfig("1f1b", stages=2, micro_batches=4, optimizer="kfac"),
                      PlanOptions("greedy"))[0]
    u0, u1 = (replay(p, prof, check_memory=False).utilization for p in (plain, kfac))
    assert u0 < u1
    rt = prof.runtime
    heavy = {k: [0.5] * 19 + [10.5] for k in ("between_steps", "message", "send")}
    busy = BusySpread(utilization=[u0, u1], step_ms=2 * rt.step_ms, op_spread={**rt.op_spread, **heavy},
                      level_spread=list(rt.level_spread))
    with_busy = copy.deepcopy(prof)
    with_busy.runtime.busy = busy
    # as busy as the base run: no weight, the same draws
    assert with_busy.runtime.busy_weight(u0) == 0.0
    assert expected_step_time(plain, with_busy) == expected_step_time(plain, prof)
    # as busy as the busy run: all of it, as a profile that is the busy run's
    assert with_busy.runtime.busy_weight(u1) == 1.0
    as_busy = copy.deepcopy(prof)
    as_busy.runtime = RuntimeOverheads(op_ms=rt.op_ms, step_ms=busy.step_ms, send_ms=rt.send_ms, recv_ms=rt.recv_ms,
                                       op_spread=busy.op_spread, level_spread=busy.level_spread)
    full = expected_step_time(kfac, with_busy)
    assert full == pytest.approx(expected_step_time(kfac, as_busy), rel=1e-9)
    base = expected_step_time(kfac, prof)
    assert full > base * 1.02, (full, base)
    # halfway: the weight is the closed form, and the step lies between the two ends
    half = copy.deepcopy(with_busy)
    half.runtime.busy.utilization = [u0, 2 * u1 - u0]
    assert half.runtime.busy_weight(u1) == pytest.approx(0.5)
    assert base < expected_step_time(kfac, half) < full
    # through the file
    path = tmp_path / "busy.json"
    with_busy.save(str(path))
    assert load_profile(str(path)).runtime.busy == busy
    obj = json.loads(path.read_text())
    obj["runtime"]["busy"]["utilization"] = [u1, u0]
    with pytest.raises(InputError) as e:
        profile_from_json(obj, str(path), check_hash=False)
    assert "runtime.busy.utilization" in str(e.value) and "the first the smaller" in str(e.value), str(e.value)
