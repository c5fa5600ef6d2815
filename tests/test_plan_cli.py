"""`pfcompile plan` and `pfcompile inspect PLAN` as a user runs them (subprocesses)."""

import json
import os
import subprocess
import sys

import pytest

from pfcompile.check.replay import replay
from pfcompile.formats.plan import load_plan
from pfcompile.formats.profile import load_profile

ROOT = os.path.join(os.path.dirname(__file__), "..")
PROFILE = os.path.join(ROOT, "profiles", "bert-base-p100-ref.json")


def pfc(*args):
    return subprocess.run([sys.executable, "-m", "pfcompile", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)


@pytest.fixture(scope="module")
def chimera_plan(tmp_path_factory):
    out = tmp_path_factory.mktemp("plans") / "chimera.json"
    r = pfc("plan", PROFILE, "--schedule", "chimera", "--stages", "4", "--micro-batches", "4",
            "--method", "greedy", "--json", "-o", str(out))
    assert r.returncode == 0, r.stderr
    return out, json.loads(r.stdout)


@pytest.mark.e2e
def test_plan_json_reports_the_replayed_statistics(chimera_plan):
    out, stats = chimera_plan
    for key in ("utilization", "step_time_ms", "baseline_step_time_ms", "refresh_steps",
                "refresh_steps_lower_bound", "solver_status", "gap", "solve_seconds", "tasks",
                "peak_memory_bytes", "step_overhead"):
        assert key in stats
    assert 0 < stats["baseline_utilization"] < stats["utilization"] <= 1
    assert stats["refresh_steps_lower_bound"] >= 1
    assert (stats["refresh_steps"] >= stats["refresh_steps_lower_bound"]
            or stats["step_time_ms"] > stats["tight_baseline_step_time_ms"])
    assert stats["step_overhead"] == pytest.approx(stats["step_time_ms"] / stats["baseline_step_time_ms"] - 1, abs=1e-5)
    assert len(stats["peak_memory_bytes"]) == 4
    # both utilization definitions; the tight baseline is the CP-SAT first-order plan, never
    # slower than the canonical one, so overhead against it is never smaller
    assert len(stats["utilization_pipefisher"]) == stats["refresh_steps"]
    assert stats["utilization_pipefisher_mean"] == pytest.approx(
        sum(stats["utilization_pipefisher"]) / stats["refresh_steps"], abs=1e-5)
    assert 0 < stats["utilization_strict"] <= 1
    assert stats["tight_baseline_step_time_ms"] <= stats["baseline_step_time_ms"] + 1e-6
    assert stats["step_overhead_tight"] >= stats["step_overhead"] - 1e-6
    # the file: every field filled, loadable by the runtime's loader, and its stats are the replay's
    plan = load_plan(str(out))
    assert plan.config.schedule == "chimera" and plan.config.world_size == 4
    assert plan.profile["hash"] == load_profile(PROFILE).hash
    assert len(plan.ranks) == 4 and all(len(s) == plan.refresh_steps for s in plan.ranks)
    again = replay(plan, load_profile(PROFILE))
    assert again.utilization == pytest.approx(stats["utilization"], abs=1e-6)
    starts = [po.start for po in plan.ranks[0][0]]
    assert starts == sorted(starts)


@pytest.mark.e2e
def test_inspect_prints_stats_and_compact_ops(chimera_plan):
    out, stats = chimera_plan
    r = pfc("inspect", str(out), "--ops", "6")
    assert r.returncode == 0, r.stderr
    assert "utilization" in r.stdout
    assert "rank 0 [s0/r0, s3/r1] step 0" in r.stdout
    assert "F0.0 SA0.0>1" in r.stdout and "more)" in r.stdout


@pytest.mark.e2e
def test_baseline_without_kfac_and_explicit_partition(tmp_path):
    parts = "embed,block0,block1,block2|block3,block4,block5|block6,block7,block8|block9,block10,block11,head"
    r = pfc("plan", PROFILE, "--schedule", "1f1b", "--stages", "4", "--micro-batches", "8", "--no-kfac",
            "--partition", parts, "--json", "-o", str(tmp_path / "b.json"))
    assert r.returncode == 0, r.stderr
    stats = json.loads(r.stdout)
    # equal blocks, zero-cost embed/head: 1 - (D-1)/(N+D-1), less the messages' transfer time
    assert 1 - 3 / 11 - 0.03 < stats["utilization"] < 1 - 3 / 11
    assert stats["step_overhead"] == 0.0
    assert load_plan(str(tmp_path / "b.json")).partition[0] == ["embed", "block0", "block1", "block2"]


@pytest.mark.e2e
@pytest.mark.parametrize("args,needle", [
    (["--memory-limit", "lots"], "--memory-limit: not a size: 'lots'"),
    (["--memory-limit", "1MiB"], "over the limit of 1048576"),
    (["--partition", "embed,block0|head"], "--partition: must list every part"),
    (["--stages", "3"], "--stages: chimera needs an even number of stages"),
    (["--micro-batches", "3"], "--micro-batches"),
    (["--replicas", "1"], "--replicas: chimera is two pipelines"),
])
def test_bad_input_is_one_line_exit_2_and_no_file(tmp_path, args, needle):
    out = tmp_path / "x.json"
    base = {"--schedule": "chimera", "--stages": "4", "--micro-batches": "4", "--method": "greedy"}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    r = pfc("plan", PROFILE, *[x for kv in base.items() for x in kv], "-o", str(out))
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert not out.exists() and not list(tmp_path.iterdir())


@pytest.mark.e2e
def test_missing_profile_is_named(tmp_path):
    r = pfc("plan", str(tmp_path / "nope.json"), "--schedule", "gpipe", "--stages", "2", "--micro-batches", "2")
    assert r.returncode == 2 and "nope.json: no such file" in r.stderr


@pytest.mark.e2e
@pytest.mark.parametrize("edit,needle", [
    (lambda d: d["ranks"][1]["steps"][0][0].update(op="fwdd"), "ranks[1].steps[0][0]: unknown op 'fwdd'"),
    (lambda d: d["config"].update(refresh_steps=0), "config.refresh_steps"),
    (lambda d: d["ranks"][0]["steps"][0][2].pop("end"), "ranks[0].steps[0][2].end: missing"),
])
def test_malformed_plan_is_refused_by_inspect(chimera_plan, tmp_path, edit, needle):
    out, _ = chimera_plan
    d = json.loads(out.read_text())
    edit(d)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(d))
    r = pfc("inspect", str(bad))
    assert r.returncode == 2
    assert needle in r.stderr and str(bad) in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


@pytest.mark.e2e
def test_refresh_steps_below_the_bound_is_a_valid_slower_plan(tmp_path):
    out = tmp_path / "k2.json"
    r = pfc("plan", PROFILE, "--schedule", "chimera", "--stages", "4", "--micro-batches", "4", "--time-limit", "2",
            "--workers", "1", "--refresh-steps", "2", "--json", "-o", str(out))
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    assert st["refresh_steps"] == 2 < st["refresh_steps_lower_bound"]
    # below the bound no plan reaches the best first-order step: it says by how much it misses
    assert st["step_time_ms"] > st["tight_baseline_step_time_ms"]
    assert "below the lower bound" in r.stderr and f"{100 * st['step_overhead_tight']:.2f}%" in r.stderr
    plan = load_plan(str(out))
    assert plan.refresh_steps == 2
    assert replay(plan, load_profile(PROFILE)).step_time_ms == pytest.approx(st["step_time_ms"], rel=1e-6)


@pytest.mark.e2e
def test_fixed_k_over_the_memory_limit_names_the_smallest_limit():
    r = pfc("plan", PROFILE, "--schedule", "chimera", "--stages", "4", "--micro-batches", "4", "--time-limit", "2",
            "--refresh-steps", "3", "--memory-limit", "1GiB")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--memory-limit" in lines[0] and "smallest feasible limit" in lines[0]
    smallest = int(lines[0].split("smallest feasible limit under the family's order is ")[1].split()[0])
    r = pfc("plan", PROFILE, "--schedule", "chimera", "--stages", "4", "--micro-batches", "4", "--time-limit", "2",
            "--workers", "1", "--refresh-steps", "3", "--memory-limit", str(smallest), "--json")
    assert r.returncode == 0, r.stderr
    assert max(json.loads(r.stdout)["peak_memory_bytes"]) <= smallest


@pytest.mark.e2e
def test_cpsat_stretches_the_step_when_the_bubbles_cannot_hold_kfac(tmp_path):
    """A 4-stage Chimera of bert-tiny with the runtime's measured overheads leaves little
    bubble per step next to its K-FAC work, here x10 so that no refresh cycle up to the limit
    holds it whatever the profile measured: the greedy (bubbles only) refuses, naming the
    ways out; CP-SAT starts from the work appended to the step and stretches the step, a plan
    faster than the appended one that the replay accepts, at the k it is given too."""
    prof = load_profile(os.path.join(ROOT, "profiles", "bert-tiny-cpu.json"))
    for l in prof.covered_layers:
        l.optimizer_ms["kfac"] = {k: 10 * v for k, v in l.optimizer_ms["kfac"].items()}
    tiny = str(tmp_path / "bert-tiny-kfac-x10.json")
    prof.save(tiny)
    base = ("plan", tiny, "--schedule", "chimera", "--stages", "4", "--micro-batches", "4")
    r = pfc(*base, "--method", "greedy", "-o", str(tmp_path / "g.json"))
    assert r.returncode == 2 and "refresh cycle of at least" in r.stderr and "--method cpsat" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "g.json").exists()
    r = pfc(*base, "--method", "none", "--json", "-o", str(tmp_path / "appended.json"))
    assert r.returncode == 0, r.stderr
    appended = json.loads(r.stdout)["step_time_ms"]
    for extra in ([], ["--refresh-steps", "4"]):
        out = tmp_path / f"cpsat{len(extra)}.json"
        r = pfc(*base, "--method", "cpsat", "--time-limit", "5", "--workers", "2", *extra, "--json", "-o", str(out))
        assert r.returncode == 0, r.stderr
        stats = json.loads(r.stdout)
        assert "ms of bubble per step" in stats["bubbles_too_small"]
        assert stats["step_time_ms"] < appended
        plan = load_plan(str(out))
        if extra:
            assert plan.refresh_steps == 4
        assert replay(plan, load_profile(tiny)).step_time_ms == pytest.approx(stats["step_time_ms"], rel=1e-6)
