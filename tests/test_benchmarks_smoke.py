"""Every script of benchmarks/ runs at its smallest size and prints its table with rows.

A benchmark no test runs rots unseen: benchmarks/planner.py's scaling crashed on every size
for a round before anyone ran it. Nothing about the figures is asserted (they are
measurements, not properties), only that each script runs to its end and prints the table
it exists for, with rows. Each runs as a user runs it, a subprocess of this Python, at the
smallest setting a flag of its own gives (`--smoke` where none existed). A script not run
here is in EXCUSED with the reason (test_every_benchmark_is_smoked_or_excused: every
script is in one list or the other).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"

# script -> why this module does not run it
EXCUSED = {
    "gpu_check.sh": "run by tests/test_gpu_ready.py::test_gpu_check_script_runs_on_cpu (--device cpu), which checks "
                    "its tables",
    "gpu_check.py": "the numerical half of gpu_check.sh, run and checked by the same test",
}


def markdown_rows(out: str) -> list[str]:
    """The data rows of every markdown table printed: the lines after a |---| separator."""
    rows, in_table = [], False
    for line in out.splitlines():
        if re.match(r"^\|[-:|]+\|$", line.strip()):
            in_table = True
        elif in_table and line.startswith("|"):
            rows.append(line)
        else:
            in_table = False
    return rows


def lines_matching(out: str, pattern: str) -> list[str]:
    """The rows of an aligned-column table: the lines that match its row's pattern."""
    return [line for line in out.splitlines() if re.match(pattern, line)]


def check_planner(out: str) -> None:
    rows = markdown_rows(out)
    assert [r.split("|")[1].strip() for r in rows] == ["1f1b", "chimera"], out


def check_partition(out: str) -> None:
    families = [r.split("|")[2].strip() for r in markdown_rows(out)]
    assert families == ["1f1b", "chimera"], out


def check_convergence(out: str) -> None:
    assert len(lines_matching(out, r"\s+0\s+\d+\.\d{4}\s")) == 1, out  # seed 0's comparison
    tuned = lines_matching(out, r"(adamw|kfac)\s+\S+\s+\S+\s+\S+\s+\d+\.\d{3} \d+\.\d{3}\s+\d+\.\d{4} \*$")
    assert [t.split()[0] for t in tuned] == ["adamw", "kfac"], out  # one point of each grid, chosen


def check_convergence_pipeline(out: str) -> None:
    assert len(lines_matching(out, r"\s+pydoc\s+0\s+\d+\.\d{4}\s")) == 1, out


def check_compare_commits(out: str) -> None:
    same = [line for line in out.splitlines() if line.startswith("- HEAD against HEAD: ")]
    assert len(same) == 2 and all("ops identical: True; statistics that differ: none" in s for s in same), out


def check_race(out: str) -> None:
    cells = [[c.strip() for c in r.split("|")] for r in markdown_rows(out)]
    for optimizer in ("adamw", "kfac"):  # a row in the plans' table, the race's and its medians'
        assert sum(optimizer in row for row in cells) == 3, out


def check_fair_race(out: str) -> None:
    cells = [[c.strip() for c in r.split("|")] for r in markdown_rows(out)]
    assert any(row[1] == "adamw" and row[4] == "**yes**" for row in cells if len(row) > 4), out  # a tuned AdamW


def check_exactness_snapshot(out: str) -> None:
    assert re.search(r"^kfac\s+\d+\s+\d+\.\d{16}\s+\d+\.\d{16}$", out, re.M), out
    assert re.search(r"^kfac\s+0\.000e\+00\s+0\.000e\+00$", out, re.M) and "equal" in out, out


def check_runtime(out: str) -> None:
    rows = markdown_rows(out)
    assert len(rows) == 5 and rows[0].startswith("| torch ScheduleGPipe |"), out


def check_split_backward(out: str) -> None:
    rows = markdown_rows(out)
    assert [r.split("|")[1].strip().split(":")[0] for r in rows] == ["whole backward", "ours", "torch"], out


def check_promise(out: str) -> None:
    cells = [[c.strip() for c in r.split("|")] for r in markdown_rows(out)]
    # adamw, muon and the control (AdamW's plan again) in the promise table, muon and the control
    # in the one-launch overhead's, adamw and muon in the traced runs'
    assert [row[3] for row in cells] == ["adamw", "muon", "control", "muon", "control", "adamw", "muon"], out
    # the control's plan is AdamW's: the same prediction, a planned overhead of 0
    assert cells[2][5] == cells[0][5] and cells[2][16] == "+0.0%", out
    assert re.search(r"^- bert-tiny 1f1b: two launches [+-]\d+\.\d% \(.*within ±2 points \d+%\); one launch "
                     r"[+-]\d+\.\d% \(.*within ±2 points \d+%\)$", out, re.M), out
    assert cells[1][-4].startswith(("yes", "**no**")) and "inspect failed" not in out, out
    # the two launches' overhead against the plan's own expected_step_overhead too
    assert re.match(r"^[+-]\d+\.\d%$", cells[1][-3]) and re.match(r"^[+-]\d+\.\d$", cells[1][-2]), out
    assert re.search(r"overhead, two launches: against the plans' step times \d+ of 1; against their "
                     r"expected_step_overhead \d+ of 1", out), out
    assert "measured/expected" in out and "median/predicted" in out, out  # both definitions of measured
    assert re.match(r"^\d+\.\d{3} \(\d+\.\d{3}–\d+\.\d{3}\)$", cells[0][13]), out  # the schedule alone, per round
    # against the expected step, and against it without runtime.busy (this profile has none: the
    # same but for the plan's replay, shortened under its time limit)
    assert float(cells[0][11]) == pytest.approx(float(cells[0][10]), rel=0.02), out
    # beside the optimizer's work: nothing to compare in AdamW's run, the ratios in Muon's
    assert cells[5][-3:-1] == ["-", "-"] and re.match(r"^(\d+\.\d{3}|-) / (\d+\.\d{3}|-)$", cells[6][-3]), out
    assert re.search(r"before profiling \d+\.\d / \d+\.\d, before the rounds \d+\.\d / \d+\.\d, after them "
                     r"\d+\.\d / \d+\.\d", out), out  # the drift, compute- and memory-bound
    assert cells[3][6].endswith("%") and cells[3][9] in ("yes", "**no**"), out  # in one launch
    # the planned overhead of the plans' expected step times, and the measured one less it
    assert re.match(r"^([+-]\d+\.\d%|-)$", cells[3][10]) and re.match(r"^([+-]\d+\.\d|-)$", cells[3][11]), out
    assert re.match(r"^[+-]\d+\.\d%$", cells[3][12]) and re.match(r"^[+-]\d+\.\d$", cells[3][13]), out
    assert float(cells[3][12][:-1]) == pytest.approx(float(cells[3][10][:-1]), abs=1.0), out  # as above
    assert re.match(r"^\d+\.\d{3}, \d+\.\d{3}$", cells[3][14]), out  # the passes' level in each plan


def check_denormals(out: str) -> None:
    rows = [[c.strip() for c in r.split("|")] for r in markdown_rows(out)]
    assert [r[1] for r in rows] == ["adamw", "kfac"] and all(float(r[6]) > 0 for r in rows), out  # the paired ratio


def check_freed_memory(out: str) -> None:
    rows = [[c.strip() for c in r.split("|")] for r in markdown_rows(out)]
    assert [r[2] for r in rows] == ["kept", "given back"] and all(r[4].endswith("%") for r in rows), out
    assert all(re.match(r"^\d+\.\d{3}, \d+\.\d{3}$", r[6]) and re.match(r"^\d+, \d+$", r[7]) for r in rows), out


def check_drift(out: str) -> None:
    rows = [[c.strip() for c in r.split("|")] for r in markdown_rows(out)]
    assert [r[1].split(":")[0].split(",")[0] for r in rows[:5]] == [
        "kernel", "beside it", "the two", "one plan", "the same runs paired"], out
    assert all(float(rows[i][4]) > 0 for i in range(4)) and rows[4][3] == "2", out  # 3 runs: two pairs
    # each run beside the kernels timed just before it: a correlation with each
    assert re.search(r"\(3 runs\): Pearson's r of its ms/step with the matmuls' ms [-+]\d\.\d\d, "
                     r"with the updates' ms [-+]\d\.\d\d", out), out
    side = [r for r in rows[5:] if r[2] in ("matmuls", "updates")]
    windows = [r for r in rows[5:] if r not in side]  # the long run's: at least its 0.5-s windows, about its mean
    assert windows and windows[0][1] == "0.5 s" and int(windows[0][2]) >= 2, out
    assert all(0.5 < float(r[6]) <= float(r[7]) < 2.0 for r in windows), out
    # both kernels on both cores at once: 1-s windows of each, every core's levels about its median
    assert [r[2] for r in side[:2]] == ["matmuls", "updates"] and side[0][1] == "1 s", out
    for r in side:
        for core in (r[4], r[5]):
            low, high = (float(x) for x in core.split("–"))
            assert 0.3 < low <= 1.0 <= high < 3.0, out
        assert re.match(r"^[+-]\d\.\d\d$", r[6]) and r[7].endswith("%"), out


def check_interleaved(out: str) -> None:
    rows = [[c.strip() for c in r.split("|")] for r in markdown_rows(out)]
    rounds = [r for r in rows if r[1].isdigit()]
    assert [r[1] for r in rounds] == ["1"] and rounds[0][5].endswith("%"), out  # one launch: both plans' blocks
    assert re.match(r"^\d+\.\d{3}, \d+\.\d{3}$", rounds[0][6]), out  # the passes' level in each plan
    assert re.match(r"^\d+, \d+$", rounds[0][8]), out  # each plan's page faults per step
    assert re.search(r"measured - planned [-+]\d+\.\d points", out), out
    assert "BASE equal, PLAN equal" in out, out  # two plans in one process train as each does alone
    # the traced blocks' split, cause by cause: six rows from the profile's prediction to the measured step
    split = [r for r in rows if not r[1].isdigit()]
    assert [r[1].split()[0] for r in split] == ["the", "each", "with", "each", "each", "measured"], out
    assert split[3][6] == "a rank's slow spells", out
    assert all(r[4].endswith("%") for r in split) and split[1][6] == "the op times' level", out


def check_runtime_ab(out: str) -> None:
    rows = [[c.strip() for c in r.split("|")] for r in markdown_rows(out)]
    assert [r[1] for r in rows] == ["bert-tiny-1f1b-adamw"] and float(rows[0][6]) > 0, out  # the paired ratio


# script -> (its smallest run's arguments; {tmp}: a fresh folder), the check of its output
SMOKE = {
    "planner.py": (["--only", "scaling", "--sizes", "4x4", "--instance-limit", "5"], check_planner),
    "partition.py": (["--profiles", "profiles/bert-tiny-cpu.json", "--stages", "2", "--micro-batches", "2",
                      "--time-limit", "1", "--out", "{tmp}"], check_partition),
    "compare_commits.py": (["--smoke"], check_compare_commits),
    "convergence.py": (["--smoke"], check_convergence),
    "drift.py": (["--seconds", "1", "--runs", "3", "--steps", "4", "--warmup", "1", "--long-steps", "80",
                  "--beside", "0.2", "--side-by-side", "5"], check_drift),
    "denormals.py": (["--optimizers", "adamw", "kfac", "--rounds", "1", "--steps", "6", "--time-limit", "1",
                      "--out", "{tmp}"], check_denormals),
    "convergence_pipeline.py": (["--smoke"], check_convergence_pipeline),
    "exactness_snapshot.py": (["--smoke"], check_exactness_snapshot),
    "race.py": (["--only", "race", "--corpus", "pydoc", "--seeds", "0", "--optimizers", "adamw", "kfac",
                 "--steps", "2", "--cap", "2", "--eval-every", "1", "--eval-batches", "1", "--time-limit", "1",
                 "--work", "{tmp}"], check_race),
    "race.py --part": (["--part", "tune", "--optimizers", "adamw", "--steps", "2", "--eval-every", "0",
                        "--eval-batches", "1", "--time-limit", "1", "--jobs", "2", "--work", "{tmp}"], check_fair_race),
    "promise.py": (["--models", "bert-tiny", "--profile", "bert-tiny=profiles/bert-tiny-cpu-optimizers.json",
                    "--optimizers", "adamw", "muon", "--schedules", "1f1b", "--rounds", "1", "--steps", "4",
                    "--warmup", "1", "--time-limit", "1", "--kernel-seconds", "1", "--interleaved", "--control", "--out", "{tmp}"],
                   check_promise),
    "runtime.py": (["--only-interleaved", "--profile", "profiles/bert-tiny-cpu.json", "--interleaved-rounds", "1",
                    "--block", "1", "--warmup", "1", "--out", "{tmp}"], check_runtime),
    "runtime_ab.py": (["--smoke"], check_runtime_ab),
    "interleaved.py": (["--smoke"], check_interleaved),
    "freed_memory.py": (["--smoke"], check_freed_memory),
    "split_backward.py": (["--model", "bert-tiny", "--parts", "block0", "--micro-batch", "2", "--seq-len", "16",
                           "--repeats", "2", "--warmup", "1"], check_split_backward),
}


# Smoked by `make test-all` only (pytest mark `full`): the measurements that run the trainer
# or the runtime for many runs (convergence, race, promise, drift, denormals, freed_memory, runtime_ab,
# exactness_snapshot). Their parts are CI's: the trainer and the runtime in test_trainer and
# test_runtime*, `inspect --against --json` in test_calibrate, the launch helpers in
# runtime.py's smoke. A smoke is what keeps each script from rotting; `make test-all` runs them.
# CI keeps runtime.py's and split_backward.py's smokes (the runtime launched from Python, runtime.launch)
FULL = {"convergence.py", "convergence_pipeline.py", "race.py", "race.py --part", "promise.py", "drift.py",
        "denormals.py", "freed_memory.py", "runtime_ab.py", "interleaved.py", "exactness_snapshot.py", "planner.py", "partition.py", "compare_commits.py"}


def test_every_benchmark_is_smoked_or_excused():
    scripts = {p.name for p in BENCHMARKS.iterdir() if p.suffix in (".py", ".sh")}
    smoked = {name.split()[0] for name in SMOKE}  # "race.py --part": a second smoke of race.py
    assert scripts == smoked | set(EXCUSED), "a benchmark neither smoked nor excused (or one gone)"
    assert FULL <= set(SMOKE), "a smoke left to `make test-all` that is not a smoke"
    assert not smoked & set(EXCUSED)


@pytest.mark.parametrize("script", [pytest.param(s, marks=pytest.mark.full) if s in FULL else s for s in sorted(SMOKE)])
def test_benchmark_runs_to_its_table(script, tmp_path):
    args, check = SMOKE[script]
    cmd = [sys.executable, str(BENCHMARKS / script.split()[0]), *(a.replace("{tmp}", str(tmp_path)) for a in args)]
    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp)}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    check(r.stdout)
    # its torchrun launches made their torchelastic_* folders in TMPDIRs of their own (runtime.launch)
    assert not list(tmp.glob("torchelastic_*")), list(tmp.iterdir())
