"""`--pin-cpus`: each rank of a real 2-rank torchrun job on its own share of the cores, as
the kernel reports it for every thread of the rank (gloo's included) at the end of the run;
the default on a cpu where the cores suffice; with `--no-pin-cpus`, every rank may use
every core. Too few cores for the ranks, or for the threads, is a one-line error before
any work when asked for, and no pinning by default."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import plan_in_process

ROOT = Path(__file__).resolve().parents[1]
CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
pytestmark = pytest.mark.skipif(not CORES, reason="needs Linux's sched_getaffinity")


@pytest.fixture(scope="module")
def plan(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pin") / "gpipe.json"
    plan_in_process(ROOT / "profiles" / "bert-tiny-cpu.json", "--schedule", "gpipe", "--stages", 2,
                    "--micro-batches", 2, "--no-kfac", "--method", "none", "-o", out)
    return out


def run(plan: Path, *flags: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "runtime", str(plan), "--steps", "3", "--data", "synthetic", "--json", *flags]
    python_path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    # in the plan's (temporary) folder, where the run folder and torchrun's torchelastic_* go
    return subprocess.run(cmd, cwd=plan.parent, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": python_path,
                                                     "TMPDIR": str(plan.parent), **(env or {})},
                          capture_output=True, text=True, timeout=180)


@pytest.mark.e2e
@pytest.mark.skipif(len(CORES) < 2, reason="two ranks pinned need two cores")
def test_pinned_ranks_get_disjoint_shares_of_the_cores_and_unpinned_ones_all(plan, tmp_path):
    r = run(plan, "--pin-cpus", "--trace", str(tmp_path / "pinned.trace.json"))
    assert r.returncode == 0, r.stderr[-2000:]
    cpus = json.loads(r.stdout.strip().splitlines()[-1])["cpus"]
    each = len(CORES) // 2
    assert cpus == [CORES[:each], CORES[each:2 * each]]  # local rank i: the i-th contiguous share
    trace = json.loads((tmp_path / "pinned.trace.json").read_text())
    assert trace["otherData"]["cpus"] == cpus  # the Perfetto trace records them too

    r = run(plan)  # the default on a cpu with a core per rank: pinned
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1])["cpus"] == cpus

    r = run(plan, "--no-pin-cpus")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1])["cpus"] == [CORES, CORES]


@pytest.mark.e2e
def test_too_few_cores_for_the_ranks_or_their_threads_is_one_line_before_any_work(plan):
    """Checked from the environment torchrun sets, before the process group (rank 0 alone
    would otherwise wait for its absent peer)."""
    base = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    cases = (({"LOCAL_WORLD_SIZE": str(len(CORES) + 1)}, (), "--pin-cpus: "),
             ({"LOCAL_WORLD_SIZE": str(len(CORES))}, ("--threads", "2"), "--threads: 2 threads per rank"))
    for env, flags, want in cases:
        r = subprocess.run([sys.executable, "-m", "runtime", str(plan), "--pin-cpus", "--steps", "1", *flags],
                           cwd=ROOT, env={**os.environ, **base, **env}, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and r.stdout == "", r.stderr
        assert r.stderr.count("\n") == 1 and want in r.stderr, r.stderr


def test_the_default_pins_on_a_cpu_only_where_every_local_rank_gets_its_threads_cores(plan, monkeypatch):
    """The job's resolved setting (what its train.toml records), for the node's ranks and
    threads: pinned where each local rank gets a share of at least its threads, else free
    (no error: it was not asked for); --pin-cpus and --no-pin-cpus decide themselves."""
    from runtime.config.cli import build_parser, prepare

    monkeypatch.setenv("LOCAL_RANK", "0")
    cases = ((2, (), len(CORES) >= 2), (len(CORES) + 1, (), False), (len(CORES), ("--threads", "2"), False),
             (1, ("--no-pin-cpus",), False), (1, ("--pin-cpus",), True))
    for local_ranks, flags, pinned in cases:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_ranks))
        job = prepare(build_parser().parse_args([str(plan), "--steps", "1", *flags]), 0, 2)
        assert job.config.runtime.pin_cpus is pinned, (local_ranks, flags)
    # ranks started without torchrun's LOCAL_WORLD_SIZE may share the node unannounced: free
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert prepare(build_parser().parse_args([str(plan), "--steps", "1"]), 0, 2).config.runtime.pin_cpus is False
