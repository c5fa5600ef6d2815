"""Our runtime computes what torch.distributed.pipelining computes: the same stages, batches
and AdamW under our plan's schedule and under torch's ScheduleGPipe / Schedule1F1B, both in
one real 2-rank torchrun job (gloo). An independent executor of the same modules: torch's
schedule scales the gradients by 1/N after the backward, ours back-propagates loss_m / N.
It is also what makes benchmarks/runtime.py (a) a like-for-like comparison: the worker
here is that benchmark's own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import plan_in_process, tiered

pytestmark = pytest.mark.e2e  # every test here starts processes

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3


@pytest.mark.parametrize("schedule", tiered([("gpipe",), ("1f1b",)], ["gpipe", "1f1b"], ci={1}))
def test_runtime_matches_torch_pipelining(tmp_path, schedule):
    plan = tmp_path / f"{schedule}.json"
    plan_in_process(ROOT / "profiles" / "bert-tiny-cpu.json", "--schedule", schedule, "--stages", 2,
                    "--micro-batches", 4, "--no-kfac", "--method", "none", "-o", plan)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TMPDIR": str(plan.parent)}  # torchelastic_*
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(ROOT / "benchmarks" / "runtime.py"), "--same-math-worker", str(plan), "--steps", str(STEPS)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    lines = [l for l in r.stdout.splitlines() if l.startswith("{")]
    assert r.returncode == 0 and lines, (r.stdout + r.stderr)[-3000:]
    got = json.loads(lines[-1])
    assert len(got["ours"]) == len(got["torch"]) == STEPS
    for ours, theirs in zip(got["ours"], got["torch"]):
        assert ours == pytest.approx(theirs, rel=1e-6)
    assert got["torch"][0] > 0
    for rank in got["ranks"]:
        # every parameter of the rank's stage got a gradient, under the same names
        assert rank["same_names"] and rank["grads"] > 0, rank
        # gradients before the first update: a loss scaled differently (AdamW would hide it
        # in the losses) shows here as a relative difference of 0.75 with 4 micro-batches
        assert rank["grad_rel_diff"] < 1e-6, rank
        assert rank["param_rel_diff"] < 1e-5, rank
