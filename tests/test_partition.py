"""Where the model is cut into stages: the compute and even cuts against closed forms and
brute force, `--partition auto` against the cuts it is compared with (real CP-SAT plans),
under a memory limit, through the CLI, and a chosen cut run by the runtime."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import pytest
from helpers import ROOT, assert_same_params, distributed_params, plan_in_process, torchrun

from pfcompile.formats.errors import InputError
from pfcompile.formats.profile import load_profile
from pfcompile.formats.verify import verify_plan
from pfcompile.graph.partition import (
    bounds_of,
    compute_partition,
    cut_at,
    even_partition,
    format_partition,
    parse_partition,
)
from pfcompile.graph.schedules import PipelineConfig
from pfcompile.place.build import build_plan
from pfcompile.place.options import PlanOptions
from pfcompile.place.partition import _neighbours
from pfcompile.place.upfront import family_step, order_peak_bytes

REF = str(ROOT / "profiles" / "bert-large-p100-ref.json")


def heavy_head_profile(blocks: int = 8, head_blocks: float = 5.0):
    """BERT-Large's reference profile cut to `blocks` blocks, its head given the cost of
    `head_blocks` blocks and a large vocabulary's parameters (as a 32k vocabulary gives)."""
    prof = load_profile(REF)
    block = prof.parts[1]
    prof.parts = [prof.parts[0], *prof.parts[1:1 + blocks], prof.parts[-1]]
    prof.covered_layers = [l for l in prof.covered_layers if int(l.part[5:]) < blocks]
    head = prof.parts[-1]
    head.fwd_ms, head.bwd_ms = head_blocks * block.fwd_ms, head_blocks * block.bwd_ms
    head.param_bytes = head.grad_bytes = 4 * 32000 * 1024
    prof.model = {**prof.model, "name": "tests:heavy_head", "layers": blocks}  # not bert-large's 24 blocks
    return prof


def stage_costs(prof, cut) -> list[float]:
    by_name = {p.name: p for p in prof.parts}
    return [sum(by_name[n].fwd_ms + by_name[n].bwd_ms for n in group) for group in cut]


def test_compute_cut_is_the_brute_force_min_max():
    """The dynamic programme's slowest stage equals the least slowest stage over every cut."""
    prof = heavy_head_profile(blocks=8, head_blocks=2.5)
    n = len(prof.parts)
    for stages in (2, 3, 4, 6):
        cut = compute_partition(prof, stages)
        best = min(max(stage_costs(prof, cut_at(prof, b))) for b in itertools.combinations(range(1, n), stages - 1))
        assert max(stage_costs(prof, cut)) == pytest.approx(best)
        assert [p for g in cut for p in g] == [p.name for p in prof.parts]


def test_even_cut_gives_each_stage_the_same_blocks():
    prof = heavy_head_profile(blocks=10)
    cut = even_partition(prof, 4)
    assert [len(g) for g in cut] == [1 + 3, 3, 2, 2 + 1]  # the first stages take the remainder
    assert cut[0][0] == "embed" and cut[-1][-1] == "head"
    assert even_partition(prof, 1) == [[p.name for p in prof.parts]]
    with pytest.raises(InputError, match="even: 10 blocks cannot give each of 11 stages one"):
        even_partition(prof, 11)


def test_text_form_and_bounds_round_trip():
    prof = heavy_head_profile(blocks=4)
    cut = parse_partition("embed,block0|block1,block2,block3|head", prof, 3)
    assert format_partition(cut) == "embed,block0|block1,block2,block3|head"
    assert cut_at(prof, bounds_of(prof, cut)) == cut


def test_each_neighbour_moves_one_part_between_two_stages():
    prof = heavy_head_profile(blocks=8)
    start = (3, 6, 8)  # 3, 3, 2 and 2 parts
    seen = set()
    for b in _neighbours(start, len(prof.parts)):
        before, after = [len(g) for g in cut_at(prof, start)], [len(g) for g in cut_at(prof, b)]
        diff = [y - x for x, y in zip(before, after)]
        assert sorted(d for d in diff if d) == [-1, 1] and min(after) >= 1
        seen.add(b)
    # 4 stages: every ordered pair of stages, each with a part to give
    assert len(seen) == 4 * 3


def test_order_peak_is_the_replays_peak_without_refresh_work():
    """The screen's memory: what the replay of the family's plan without optimizer work says."""
    prof = load_profile(REF)
    for schedule, D, v in (("1f1b", 8, 1), ("chimera", 8, 1), ("zb-v", 4, 2), ("interleaved", 4, 2)):
        cfg = PipelineConfig(schedule=schedule, stages=D, micro_batches=8, optimizer="adamw", virtual_stages=v)
        plan, _, _ = build_plan(prof, cfg, PlanOptions(method="none"))
        peak = order_peak_bytes(family_step(prof, cfg), cfg)
        assert [peak[q] for q in range(cfg.world_size)] == plan.stats["peak_memory_bytes"], schedule


def plan_of(prof, schedule, D, N, optimizer, partition=None, memory=None, time_limit=10.0, cut=None):
    cfg = PipelineConfig(schedule=schedule, stages=D, micro_batches=N, optimizer=optimizer,
                         memory_limit_bytes=memory, partition=cut)
    return build_plan(prof, cfg, PlanOptions(partition=partition, time_limit=time_limit))[0]


@pytest.mark.parametrize("schedule,optimizer", [("1f1b", "kfac"), ("chimera", "muon")])
def test_auto_against_the_compute_and_even_cuts(schedule, optimizer):
    """A head as heavy as five blocks: the even cut leaves the last stage slow, the compute
    cut balances the stages; auto is never slower than compute (here faster: on Chimera a
    device holds stages s and D-1-s, and auto balances the devices) and its plan is the plan
    of the cut it names, planned alone."""
    prof = heavy_head_profile(blocks=8, head_blocks=5.0)
    # 3 s a solve: the cuts that matter here are proved optimal within a second; the even
    # cut's and a searched cut's Chimera plans stop at their limit, FEASIBLE, either way
    even = plan_of(prof, schedule, 4, 4, optimizer, cut=even_partition(prof, 4), time_limit=3)
    compute = plan_of(prof, schedule, 4, 4, optimizer)
    auto = plan_of(prof, schedule, 4, 4, optimizer, partition="auto", time_limit=3)
    assert auto.stats["step_time_ms"] < compute.stats["step_time_ms"] - 1e-6
    assert auto.stats["step_time_ms"] < 0.95 * even.stats["step_time_ms"]
    search = auto.stats["partition_search"]
    assert search["chosen"] == "auto"
    rules = {f["rule"]: f for f in search["finalists"]}
    assert rules["compute"]["partition"] == format_partition(compute.partition)
    assert rules["compute"]["step_time_ms"] == pytest.approx(compute.stats["step_time_ms"])
    assert rules["even"]["partition"] == format_partition(even.partition)
    assert min(f["step_time_ms"] for f in search["finalists"]) == pytest.approx(auto.stats["step_time_ms"])
    alone = plan_of(prof, schedule, 4, 4, optimizer, cut=auto.partition)
    assert alone.stats["step_time_ms"] == pytest.approx(auto.stats["step_time_ms"])
    verify_plan(auto, "<auto>", profile_model=prof.model)


def test_auto_finds_a_cut_under_a_memory_limit_the_compute_cut_cannot_fit():
    """1F1B's first stage holds D micro-batches' activations: under a limit its compute cut
    exceeds, auto moves a block off it (to the last stage, which holds one) and fits."""
    prof = load_profile(REF)
    limit = int(8.5 * 2**30)
    with pytest.raises(InputError, match="--memory-limit: rank 0 needs"):
        plan_of(prof, "1f1b", 8, 8, "muon", memory=limit)
    auto = plan_of(prof, "1f1b", 8, 8, "muon", partition="auto", memory=limit)
    assert max(auto.stats["peak_memory_bytes"]) <= limit
    assert len(auto.partition[0]) < len(compute_partition(prof, 8)[0])
    refused = auto.stats["partition_search"]["refused"]
    assert [r["rule"] for r in refused] == ["compute"] and "--memory-limit" in refused[0]["why"]


def run_plan_cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pfcompile", "plan", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.e2e
def test_cli_partition_rules(tmp_path):
    out = tmp_path / "even.json"
    r = run_plan_cli(REF, "--schedule", "1f1b", "--stages", "8", "--micro-batches", "8", "--partition", "even",
                     "--method", "none", "--json", "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["partition"] == format_partition(even_partition(load_profile(REF), 8))
    r = run_plan_cli(REF, "--schedule", "1f1b", "--stages", "8", "--micro-batches", "8", "--partition", "auto",
                     "--pareto")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--pareto: plans one cut" in r.stderr
    r = run_plan_cli(REF, "--schedule", "1f1b", "--stages", "8", "--micro-batches", "8", "--partition", "auto",
                     "--optimizer", "muon", "--time-limit", "30")
    assert r.returncode == 0, r.stderr
    assert "partition_search  chose the compute cut" in r.stdout and "parts per stage: 4 3 3 3 3 3 3 4" in r.stdout


@pytest.mark.e2e
def test_the_runtime_runs_the_cut_auto_chose(tmp_path, ops_only_tiny):
    """bert-tiny whose head's update is as slow as a large vocabulary's AdamW makes it: the
    last stage's update follows its last backward, so auto gives that stage the head alone.
    The plan runs on 2 ranks and ends equal to the single-process Muon trainer (float64)."""
    from helpers import optimizer_reference_params as reference_params

    prof = load_profile(str(ops_only_tiny))
    prof.parts[-1].step_ms = dict.fromkeys(prof.parts[-1].step_ms, 40.0)
    profile = tmp_path / "heavy-head-step.json"
    prof.save(str(profile))
    plan = tmp_path / "auto.json"
    plan_in_process(profile, "--schedule", "1f1b", "--stages", 2, "--micro-batches", 4, "--optimizer", "muon",
                    "--partition", "auto", "--time-limit", 30, "-o", plan)
    loaded = json.loads(plan.read_text())
    assert loaded["partition"] == [["embed", "block0", "block1"], ["head"]] != compute_partition(prof, 2)
    assert loaded["stats"]["partition_search"]["chosen"] == "auto"
    run = torchrun(plan, 2, "--steps", "3", "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "3")
    assert run.returncode == 0, run.stdout[-3000:]
    initial, want = reference_params(plan, 3)
    assert_same_params(distributed_params(tmp_path / "ckpt", 3, plan), want, initial, floor=1e-9)
