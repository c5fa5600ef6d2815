"""Bounded inputs and misused flags: each is refused with one line (exit 2) before any work,
in every command that reads the input; a diverging run stops naming the step and stage;
checkpoints: load errors are one line, orphaned temporary files are removed, old ones
pruned to --keep."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pfcompile.cli import main as pfcompile_main

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "profiles" / "bert-tiny-cpu.json"

MALFORMED = {
    "deep": "[" * 1000 + "]" * 1000,                   # RecursionError in Python's reader
    "long-int": '{"schema": ' + "9" * 5000 + "}",      # over Python's 4300-digit limit
    "nan": '{"schema": NaN}',                         # accepted by Python, not JSON
    "overflow": '{"schema": 1e999}',                  # a float that is inf
    "truncated": '{"schema": "pfcompile-plan", "config": {',
}


def _one_line(err: str) -> str:
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def _runtime(argv: list[str], world_size: int = 2) -> tuple[int, str]:
    """The runtime's entry point in-process, as rank 0 (validation runs before torch loads
    and before any collective, so no peer is needed to reach a refusal)."""
    import io
    from contextlib import redirect_stderr

    from runtime.__main__ import main

    os.environ["RANK"], os.environ["WORLD_SIZE"] = "0", str(world_size)
    try:
        buf = io.StringIO()
        with redirect_stderr(buf):
            code = main(argv)
        return code, buf.getvalue()
    finally:
        del os.environ["RANK"], os.environ["WORLD_SIZE"]


@pytest.mark.parametrize("kind", MALFORMED)
def test_malformed_json_is_one_line_in_every_reader(tmp_path, capsys, kind):
    path = tmp_path / f"{kind}.json"
    path.write_text(MALFORMED[kind])
    for argv in (["inspect", str(path)], ["render", str(path), "--trace", str(tmp_path / "t.json")],
                 ["plan", str(path), "--schedule", "1f1b", "--stages", "2", "--micro-batches", "2"]):
        assert pfcompile_main(argv) == 2
        err = _one_line(capsys.readouterr().err)
        assert str(path) in err, err
    code, err = _runtime([str(path)])
    assert code == 2 and str(path) in _one_line(err)


def test_runaway_sizes_are_refused_before_the_profile_is_read(capsys):
    missing = "/nonexistent/profile.json"  # never opened: the sizes are checked first
    for flag, value in (("--micro-batches", "1000000000000"), ("--stages", "100000"),
                        ("--virtual-stages", "1000"), ("--replicas", "100000")):
        argv = ["plan", missing, "--schedule", "1f1b", "--stages", "2", "--micro-batches", "2", flag, value]
        assert pfcompile_main(argv) == 2
        err = _one_line(capsys.readouterr().err)
        assert f"{flag}: {value} is over the limit" in err, err


def _no_planning(monkeypatch) -> None:
    """Building a task graph or a plan fails the test: what is refused is refused before."""
    import pfcompile.graph.taskgraph
    import pfcompile.place.build

    def planned(*_a, **_k):
        raise AssertionError("planning started")
    monkeypatch.setattr(pfcompile.graph.taskgraph, "build_task_graph", planned)
    monkeypatch.setattr(pfcompile.place.build, "build_plan", planned)


def test_task_count_over_the_limit_is_refused_up_front(capsys, ops_only_tiny, monkeypatch):
    _no_planning(monkeypatch)
    # each size within its own bound, the ops of one step over the task limit
    big = str(ROOT / "profiles" / "bert-large-p100-ref.json")
    argv = ["plan", big, "--schedule", "gpipe", "--stages", "8", "--micro-batches", "16384", "--method", "greedy"]
    assert pfcompile_main(argv) == 2
    assert "tasks per step, over the limit" in _one_line(capsys.readouterr().err)
    # a cycle the bubbles would need too many steps for: refused before the task graph, at
    # once (the bound: the family's step timed without its graph, the curvature work)
    for profile in (ops_only_tiny, TINY):
        argv = ["plan", str(profile), "--schedule", "gpipe", "--stages", "2", "--micro-batches", "1024", "--method",
                "greedy"]
        start = time.monotonic()
        assert pfcompile_main(argv) == 2
        took = time.monotonic() - start
        err = _one_line(capsys.readouterr().err)
        assert "refresh cycle of at least" in err and "ms of bubble per step" in err and "--method none" in err
        print(f"\n{profile.name}: gpipe, 2 stages, 1024 micro-batches refused in {took:.2f} s: {err.strip()}")
        assert took < 1.0


def test_a_memory_limit_no_order_fits_is_refused_up_front(capsys, monkeypatch):
    _no_planning(monkeypatch)
    for method in ("greedy", "none"):  # (CP-SAT names the smallest feasible limit, from its task graph)
        argv = ["plan", str(TINY), "--schedule", "1f1b", "--stages", "2", "--micro-batches", "4", "--method", method,
                "--memory-limit", "100KiB"]
        assert pfcompile_main(argv) == 2
        err = _one_line(capsys.readouterr().err)
        assert "--memory-limit: rank 0 needs at least" in err and "over the limit of 102400" in err, err


@pytest.mark.e2e
def test_the_time_limit_counts_from_the_process_start():
    """The command's clock starts when its process does: a second and a half spent before
    pfcompile is even imported counts against --time-limit (and in its stage_seconds)."""
    code = "import sys, time; time.sleep(1.5); from pfcompile.cli import main; sys.exit(main())"
    r = subprocess.run([sys.executable, "-c", code, "plan", str(TINY), "--schedule", "1f1b", "--stages", "2",
                        "--micro-batches", "2", "--method", "greedy", "--time-limit", "600", "--json"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get(
                           "PYTHONPATH")) if p)})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["stage_seconds"]["total"] >= 1.5


def test_plan_output_path_is_checked_before_planning(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    base = ["plan", str(TINY), "--schedule", "1f1b", "--stages", "2", "--micro-batches", "2", "-o"]
    assert pfcompile_main(base + [str(tmp_path)]) == 2
    assert "is a directory" in _one_line(capsys.readouterr().err)
    assert pfcompile_main(base + [str(afile / "plan.json")]) == 2
    assert "is not a directory" in _one_line(capsys.readouterr().err)


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    assert pfcompile_main(["plan", str(TINY), "--schedule", "1f1b", "--stages", "2", "--micro-batches", "2",
                           "--method", "greedy", "-o", str(out)]) == 0
    return out


def test_render_refuses_an_absurd_time_and_a_rank_the_plan_lacks(tmp_path, capsys, plan_path):
    obj = json.loads(plan_path.read_text())
    obj["ranks"][0]["steps"][0][0]["start"] = -1e12
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(obj))
    assert pfcompile_main(["render", str(bad), "--timeline", str(tmp_path / "t.png")]) == 2
    err = _one_line(capsys.readouterr().err)
    assert "ranks[0].steps[0][0].start" in err and "rule: times" in err
    assert not (tmp_path / "t.png").exists()
    assert pfcompile_main(["render", str(plan_path), "--graph", str(tmp_path / "g.svg"), "--ranks", "9"]) == 2
    assert "--ranks: 9 is not in the plan, which has 2 ranks" in _one_line(capsys.readouterr().err)


@pytest.mark.parametrize("flags,needle", [
    (["--threads", "0"], "--threads: must be in 1.."),
    (["--timeout", "0"], "--timeout: must be a number of seconds"),
    (["--timeout", "-1"], "--timeout: must be a number of seconds"),
    (["--lr", "nan"], "--lr: must be a positive finite number"),
    (["--lr", "inf"], "--lr: must be a positive finite number"),
    (["--keep", "0"], "--keep: must be >= 1"),
    (["--recv-ahead", "-1"], "--recv-ahead: must be in 0..64"),
    (["--recv-ahead", "1", "--device", "cuda"], "--recv-ahead: must be 0 on cuda"),
    (["--checkpoint-dir", "{file}"], "--checkpoint-dir: '{file}' is a file, expected a directory"),
    (["--trace", "{dir}"], "--trace: '{dir}' is a directory"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_runtime_flags_are_refused_before_work(tmp_path, plan_path, flags, needle):
    afile = tmp_path / "afile"
    afile.write_text("x")
    sub = {"{file}": str(afile), "{dir}": str(tmp_path)}
    flags = [sub.get(f, f) for f in flags]
    for k, v in sub.items():
        needle = needle.replace(k, v)
    code, err = _runtime([str(plan_path), *flags])
    assert code == 2 and needle in _one_line(err), err


# --- real runs of a one-rank plan (python -m runtime, no torchrun) -----------------------------------

def _run(plan: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """One rank of `plan`, run in the plan's (temporary) folder, where its run folder goes."""
    python_path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": python_path,
           **(env or {})}
    env.pop("MASTER_ADDR", None)
    env.pop("MASTER_PORT", None)
    return subprocess.run([sys.executable, "-m", "runtime", plan, *args, "--data", "synthetic", "--timeout", "30"],
                          cwd=Path(plan).parent, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("one")
    plans = []
    for name, extra in (("kfac.json", []), ("sgd.json", ["--no-kfac"])):
        assert pfcompile_main(["plan", str(TINY), "--schedule", "gpipe", "--stages", "1", "--micro-batches", "2",
                               "--method", "greedy", "-o", str(d / name), *extra]) == 0
        plans.append(d / name)
    return plans[0], plans[1]


@pytest.mark.e2e
@pytest.mark.full  # CI: test_runtime's 4-rank diverging run, the same line on every rank
def test_a_diverging_run_stops_naming_step_and_stage(one_rank):
    plan, _ = one_rank
    r = _run(str(plan), "--steps", "6", env={"PFC_RUNTIME_NAN": "0:2"})  # parameters NaN from step 2
    assert r.returncode == 4, r.stdout[-2000:] + r.stderr[-2000:]
    err = _one_line(r.stderr)
    assert "runtime[rank 0]: error: step 2: stage 0 produced a non-finite loss; the run diverged" in err, err


@pytest.mark.parametrize("optimizer", ["kfac", "shampoo"])
def test_a_failed_factor_has_its_own_code_and_names_optimizer_and_factor(tmp_path, optimizer):
    """Every (layer, factor) of the plan's optimizer gets its own divergence code, and the
    message names the optimizer, that factor and that layer (Shampoo's L and R once shared
    K-FAC's code and message)."""
    from pfcompile.formats.plan import load_plan
    from runtime.pipeline.interpreter import _FACTOR_BASE, _PARAMS_BASE, divergence_code, divergence_message

    path = tmp_path / "plan.json"
    assert pfcompile_main(["plan", str(ROOT / "profiles" / "bert-tiny-cpu-optimizers.json"), "--schedule", "1f1b",
                           "--stages", "2", "--micro-batches", "2", "--optimizer", optimizer, "--method", "greedy",
                           "-o", str(path)]) == 0
    plan = load_plan(str(path))
    title, factors = {"kfac": ("K-FAC", ("A", "B")), "shampoo": ("Shampoo", ("L", "R"))}[optimizer]
    codes = {}
    for i, name in enumerate(plan.layers):
        for f in factors:
            code = divergence_code(layer=i, factor=f, factors=factors)
            assert _FACTOR_BASE <= code < _PARAMS_BASE
            message = divergence_message(code, 3, plan)
            assert message.startswith(f"step 3: {title} factor {f} of layer {name} (stage {plan.layer_stage[i]}) "), \
                message
            codes[(i, f)] = code
    assert len(set(codes.values())) == len(codes) == len(plan.layers) * 2
    # MIN over the ranks reports the earliest layer's first factor
    assert min(codes.values()) == codes[(0, factors[0])]


def test_the_finite_check_agrees_with_isfinite_all():
    """The runtime's per-forward check (a float64 sum) against torch.isfinite(t).all(), on
    NaN, both infinities, opposite infinities (whose sum is NaN) and the largest finite values."""
    import torch

    from runtime.pipeline.interpreter import all_finite

    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        base = torch.randn(4, 8, 16).to(dtype)
        cases = [base, torch.full_like(base, torch.finfo(dtype).max), torch.full_like(base, torch.finfo(dtype).min)]
        for bad in ([float("nan")], [float("inf")], [-float("inf")], [float("inf"), -float("inf")]):
            t = base.clone()
            for i, v in enumerate(bad):
                t[i, 2, 3] = v
            cases.append(t)
        for t in cases:
            assert bool(all_finite(t)) == bool(torch.isfinite(t).all()), (dtype, t.flatten()[:4])


@pytest.mark.e2e
def test_checkpoints_pruned_to_keep_tmp_cleaned_and_load_errors_one_line(tmp_path, one_rank):
    import torch

    plan, _ = one_rank
    ckpt = tmp_path / "ckpt"
    r = _run(str(plan), "--steps", "4", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1", "--keep", "2")
    assert r.returncode == 0, r.stderr[-2000:]
    assert sorted(p.name for p in ckpt.glob("step-*")) == ["step-00000003", "step-00000004"]

    orphan = ckpt / "step-00000004" / ".rank-0.pt.abc123.tmp"  # a write killed half-way
    orphan.write_bytes(b"half")
    r = _run(str(plan), "--steps", "5", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1", "--resume",
             "--keep", "2")
    assert r.returncode == 0 and "resumed from" in r.stdout, r.stderr[-2000:]
    assert not orphan.exists()

    latest = ckpt / "step-00000005" / "rank-0.pt"
    state = torch.load(latest, weights_only=True)
    state["rng"]["torch"] = "not a tensor"  # a malformed RNG state
    torch.save(state, latest)
    r = _run(str(plan), "--steps", "6", "--checkpoint-dir", str(ckpt), "--resume")
    assert r.returncode == 2 and f"{latest}: cannot resume" in _one_line(r.stderr), r.stderr

    torch.save({"step": 5, "rng": Path("/")}, latest)  # a pickled object weights_only refuses
    r = _run(str(plan), "--steps", "6", "--checkpoint-dir", str(ckpt), "--resume")
    assert r.returncode == 2 and "UnpicklingError" in _one_line(r.stderr), r.stderr
