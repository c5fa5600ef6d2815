"""What a GPU run depends on, exercised on CPU/gloo: tag-free messages (NCCL's matching
rule), the backend following the requested device, measured peak memory against the
plan's model, and bfloat16 mixed precision. CUDA-only checks skip on a host without one.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from helpers import (
    ROOT,
    assert_same_params,
    distributed_params,
    make_plan,
    plan_in_process,
    reference_params,
    run_single,
    tiered,
    torchrun,
)

from pfcompile.formats.errors import InputError
from runtime.pipeline import comm

PROFILE = ROOT / "profiles" / "bert-tiny-cpu.json"
HAS_CUDA = torch.cuda.is_available()


def plan_from_profile(tmp_path, schedule: str, stages: int, *extra: str, profile=PROFILE):
    out = tmp_path / f"{schedule}.json"
    plan_in_process(profile, "--schedule", schedule, "--stages", stages, "--micro-batches", 4, "--method", "greedy",
                    *extra, "-o", out)
    return out, json.loads(out.read_text())


# --- tag-free messages ----------------------------------------------------------------------
@pytest.mark.e2e
def test_interleaved_plan_runs_tag_free(tmp_path):
    """A planner's interleaved plan (2 devices x 2 chunks), messages matched per pair in issue
    order as on NCCL, ends one cycle plus a step equal to the float64 single process."""
    plan, obj = plan_from_profile(tmp_path, "interleaved", 2, "--virtual-stages", "2")
    steps = obj["config"]["refresh_steps"] + 1
    r = torchrun(plan, obj["config"]["world_size"], "--steps", str(steps), "--checkpoint-dir", str(tmp_path / "ckpt"),
                 "--checkpoint-every", str(steps), "--p2p-tags", "off")
    assert r.returncode == 0, r.stdout[-3000:]
    initial, want = reference_params(plan, steps)
    assert_same_params(distributed_params(tmp_path / "ckpt", steps, plan), want, initial)


# --- backend and device from the command line / plan, not from the host ---------------------
def test_backend_follows_the_device():
    assert comm.backend_for("cpu") == "gloo" and comm.backend_for("cuda") == "nccl"
    assert comm.rank_device("cpu", 3) == torch.device("cpu")  # gloo for CPU tensors even on a GPU host
    assert comm.default_tags("gloo") and not comm.default_tags("nccl")
    with pytest.raises(InputError, match="--device: unsupported device 'tpu'"):
        comm.backend_for("tpu")
    have = torch.cuda.device_count() if HAS_CUDA else 0
    with pytest.raises(InputError, match=f"this host has {have} CUDA device"):
        comm.rank_device("cuda", have)  # one GPU per local rank: one too many is refused


@pytest.mark.e2e
@pytest.mark.skipif(HAS_CUDA, reason="needs a host without CUDA")
def test_cuda_run_without_a_gpu_fails_with_one_line(tmp_path):
    plan = make_plan(tmp_path, "gpipe", 2)
    r = run_single(str(plan), "--device", "cuda", world_size=2)
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "--device: cuda, but torch sees no CUDA device here" in r.stderr


@pytest.mark.e2e
def test_tags_on_need_gloo(tmp_path):
    plan = make_plan(tmp_path, "gpipe", 2)
    r = run_single(str(plan), "--device", "cuda", "--p2p-tags", "on", world_size=2)
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert ("--p2p-tags: on needs gloo" in r.stderr) if HAS_CUDA else ("no CUDA device" in r.stderr)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_one_stage_plan_on_cuda_matches_single_process(tmp_path):
    """NCCL on cuda:0, CUDA-event timing, allocator peak: a 1-rank plan runs and trains."""
    plan = make_plan(tmp_path, "gpipe", 1)
    r = torchrun(plan, 1, "--steps", "3", "--device", "cuda", "--dtype", "float64", "--json",
                 "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "3")
    assert r.returncode == 0, r.stdout[-3000:]
    summary = json.loads(next(l for l in r.stdout.splitlines() if l.startswith("{")))
    assert summary["peak_memory_bytes_measured"][0] > 0
    initial, want = reference_params(plan, 3)
    got = {k: v.cpu() for k, v in distributed_params(tmp_path / "ckpt", 3, plan).items()}
    assert_same_params(got, want, initial, rtol=1e-5)


# --- memory measured against the plan ---------------------------------------------------------
# Every family, and the work divided between replicas or not (each replica holds only its
# layers' inverses, roots or momentum): zb-h1 and zb-v, a W keeps its activations and output
# gradients until it runs (and curv_b shares them); 1F1B with two replicas each doing all the
# work ("all"); Chimera and 1F1B with two replicas dividing it layer by layer ("layers": on
# bert-tiny's one block a stage, PipeFisher's block-wise "split" would divide nothing);
# Shampoo and Muon keep their own state. Chimera's K-FAC plan is CP-SAT's at k = 4: the
# greedy's k = 39 would make the run 117 steps long.
# (interleaved and zb-h1's default plans: tests/test_memory_model.py)
MEMORY_CASES = [("gpipe", 2, ()), ("1f1b", 2, ("--replicas", "2", "--precond", "all")),
                ("chimera", 4, ("--precond", "layers", "--method", "cpsat", "--refresh-steps", "4",
                                "--time-limit", "5")),
                ("zb-v", 2, ("--method", "none")),
                ("1f1b", 2, ("--replicas", "2", "--precond", "layers", "--optimizer", "shampoo")),
                ("chimera", 4, ("--precond", "layers", "--optimizer", "muon"))]


@pytest.mark.e2e  # CI: GPipe over its limit, and split preconditioning over 2 replicas
@pytest.mark.parametrize("schedule,stages,extra", tiered(
    MEMORY_CASES, ["gpipe-over-its-limit", "1f1b-2x2-kfac", "chimera-kfac-split", "zb-v-kfac", "1f1b-2x2-shampoo-split",
                   "chimera-muon-split"], ci={0, 4}))
def test_measured_peak_memory_matches_the_plan(tmp_path, capsys, ops_only_tiny, schedule, stages, extra):
    """On CPU the runtime counts what the planner models; after a full refresh cycle (every
    buffer allocated: optimizer state, factors, spare inverse slots) each rank's measured peak
    is within 10% of the plan's prediction. The run covers a whole cycle after two (3k
    steps): a plan's peak may fall in any step of the cycle (step 0's kept tensors wait for
    curvature ops placed in later steps), and only from the third cycle on does every step
    find that state allocated. The GPipe plan is run with a memory limit below
    what it needs (edited into the plan): the run says so."""
    table = []
    plan, obj = plan_from_profile(tmp_path, schedule, stages, *extra, profile=ops_only_tiny)  # memory: the ops'
    k = obj["config"]["refresh_steps"]
    name = f"{schedule} {' '.join(extra)}".strip()
    if "split" in obj["config"]["precond"]:
        assert any(o is not None for o in obj["config"]["precond_owner"]), name
    predicted = obj["stats"]["peak_memory_bytes"]
    if schedule == "gpipe":
        obj["config"]["memory_limit_bytes"] = int(0.9 * max(predicted))
        plan.write_text(json.dumps(obj))
    r = torchrun(plan, obj["config"]["world_size"], "--steps", str(3 * k), "--dtype", "float32",
                 "--data", "synthetic", "--p2p-tags", "off", "--json")
    assert r.returncode == 0, r.stdout[-3000:]
    summary = json.loads(next(l for l in r.stdout.splitlines() if l.startswith("{")))
    assert summary["peak_memory_bytes_predicted"] == predicted
    for q, (got, want) in enumerate(zip(summary["peak_memory_bytes_measured"], predicted)):
        table.append(f"{name:>60} rank {q}: measured {got:>10} predicted {want:>10} ratio {got / want:.3f}")
        assert abs(got / want - 1) <= 0.10, table[-1]
    if schedule == "gpipe":
        over = [q for q, b in enumerate(summary["peak_memory_bytes_measured"])
                if b > obj["config"]["memory_limit_bytes"]]
        assert over and f"runtime: rank {over[0]} measured peak" in r.stdout
        assert "exceeds the plan's memory limit" in r.stdout
    with capsys.disabled():
        print("\n" + "\n".join(table))


# --- bfloat16 mixed precision -------------------------------------------------------------------
def update_error(got: dict, want: dict, initial: dict) -> float:
    """|got - want| / |want - initial| over all parameters: the error relative to what training moved."""
    num = sum(float((got[n].double() - want[n].double()).norm() ** 2) for n in want)
    den = sum(float((want[n].double() - initial[n].double()).norm() ** 2) for n in want)
    return (num / den) ** 0.5


# bf16 keeps 8 bits of mantissa (relative rounding 2^-9 ~ 0.2%); over a refresh cycle the
# differences in rounding order (pipeline vs one process, bf16 vs float32) measured 1.2-1.4%
# of the parameter update. Stated tolerance: 5% of the update.
BF16_TOL = 0.05


@pytest.mark.e2e
def test_bfloat16_pipeline_matches_single_process(tmp_path):
    plan = make_plan(tmp_path, "1f1b", 2)
    r = torchrun(plan, 2, "--steps", "3", "--dtype", "bfloat16", "--p2p-tags", "off",
                 "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "3")
    assert r.returncode == 0, r.stdout[-3000:]
    got = distributed_params(tmp_path / "ckpt", 3, plan)
    assert all(t.dtype == torch.float32 for t in got.values())  # parameters stay float32
    initial, want = reference_params(plan, 3, dtype="bfloat16")
    _, want32 = reference_params(plan, 3, dtype="float32")
    vs_bf16, vs_fp32 = update_error(got, want, initial), update_error(got, want32, initial)
    assert vs_bf16 <= BF16_TOL, f"pipeline vs single-process bf16: {vs_bf16:.4f} of the update"
    assert vs_fp32 <= BF16_TOL, f"pipeline bf16 vs single-process float32: {vs_fp32:.4f} of the update"
    assert update_error(want, want32, initial) > 1e-4  # autocast really ran in bf16


# --- the prepared GPU check, its CPU half ---------------------------------------------------------
@pytest.mark.e2e
@pytest.mark.full  # a benchmark's smoke: run it (or `make test-all`) before a session spends GPU time on it
def test_gpu_check_script_runs_on_cpu(tmp_path):
    """benchmarks/gpu_check.sh --device cpu: the same steps as on a GPU, with bert-tiny, so the
    script cannot rot while no GPU is at hand."""
    import os
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    r = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--device", "cpu"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    out = r.stdout
    assert json.loads((tmp_path / "profiles" / "bert-tiny-cpu.json").read_text())["schema"] == "pfcompile-profile"
    assert "runtime: 6 steps" in out and "measured/predicted" in out
    ratio = float(out.split("peak measured  peak predicted  measured/predicted\n")[1].splitlines()[0].split()[-1])
    assert abs(ratio - 1) <= 0.10
    # float32 on the CPU vs float64: factors to ~1e-7, the preconditioned gradient to ~1e-5
    worst = next(l for l in out.splitlines() if l.startswith("max over layers")).split()[-3:]
    assert float(worst[0]) < 1e-5 and float(worst[1]) < 1e-5 and float(worst[2]) < 1e-3, out[-2000:]
