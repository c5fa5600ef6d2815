"""The trainer (issue 12): a TOML config with non-default K-FAC / optimizer settings, a
warm-up + decay schedule and global-norm clipping, on a token file made by prepare_data,
through real torchrun/gloo in float64 — against the single-process trainer with the same
config and data (runtime.train.train_reference), the saved safetensors model against the
pipeline's last evaluation, a resumed run's log against the uninterrupted one's, and every
bad data file or contradicting config key as a one-line error."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import ROOT, make_plan, model_spec, run_single, tiered, torchrun

from pfcompile.formats.errors import InputError
from pfcompile.formats.plan import load_plan
from runtime.config import job as job_config
from runtime.config.cli import SHORTHANDS, build_parser, load_config, prepare
from runtime.io.data import make_stream, open_token_file
from runtime.models import load_trained
from runtime.optimizers.stage import OptimConfig
from runtime.train import train_reference

CONFIG = """\
[train]
steps = 5
seed = 7

[optimizer]
lr = 0.07
momentum = 0.8
weight_decay = 1e-4
adam_lr = 2e-3
adam_betas = [0.85, 0.99]
max_grad_norm = 0.5

[schedule]
warmup_steps = 2
decay = "polynomial"
decay_steps = 3
final_lr_ratio = 0.1
power = 2.0

[kfac]
damping = 1e-3
ema = 0.8
kl_clip = 1e-3

[eval]
every = 2
batches = 2

[log]
every = 2
"""

RUNS: dict = {}  # (schedule, D) -> metrics rows of the uninterrupted run, reused by the resume test


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    """A text file (part of the pydoc corpus, which ships with Python) through prepare_data."""
    from pydoc_data.topics import topics

    d = tmp_path_factory.mktemp("data")
    text = d / "input.txt"
    text.write_text("\n".join(topics[k] for k in sorted(topics))[:60_000])
    r = subprocess.run([sys.executable, "-m", "runtime.prepare_data", str(text), "-o", str(d / "train.bin"),
                        "--val-fraction", "0.1"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    (d / "train.toml").write_text(CONFIG)
    return {"dir": d, "train": d / "train.bin", "val": d / "train.val.bin", "config": d / "train.toml"}


def metrics(log_dir: Path) -> tuple[dict, dict]:
    """(step -> training row, step -> eval row); for a step logged twice the last line counts."""
    train, evals = {}, {}
    for line in (log_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        (evals if row.get("eval") else train)[row["step"]] = row
    return train, evals


def reference(plan_path: Path, data: dict, steps: int | None = None):
    plan = load_plan(str(plan_path))
    cfg = job_config.load(str(data["config"]))
    job_config.apply_plan(cfg, plan, str(plan_path))
    spec = model_spec(plan.model["name"])
    n = plan.config.micro_batches
    batch, seq = plan.model["micro_batch"] * n, plan.model["seq_len"]
    tokens = open_token_file(str(data["train"]), spec.cfg.vocab, batch, seq)
    stream = make_stream(spec.cfg.kind, batch, seq, seed=cfg.train.seed, token_file=tokens)
    stage_of = dict(zip(plan.layers, plan.layer_stage))

    def per_stage(layers):
        return [g for g in ([l for l in layers if stage_of[l.name] == s] for s in range(plan.num_stages)) if g]
    return train_reference(spec, cfg, stream, n, kl_groups_of=per_stage, dtype=torch.float64, steps=steps)


@pytest.mark.e2e
@pytest.mark.parametrize("schedule,D", tiered([("1f1b", 2), ("chimera", 4)], ["1f1b-2", "chimera-4"], ci={0}))
def test_config_run_equals_single_process(tmp_path, data, schedule, D):
    plan = make_plan(tmp_path, schedule, D)
    out = tmp_path / "out"
    r = torchrun(plan, D, "--config", str(data["config"]), "--data", str(data["train"]),
                 "--val-data", str(data["val"]), "--log-dir", str(out), "--save-model", str(out / "model.safetensors"),
                 "--set", "kfac.damping=2e-3")  # an override wins over the file
    assert r.returncode == 0, r.stdout[-3000:]
    assert "damping = 0.002" in r.stdout and (out / "train.toml").is_file()  # the effective config, printed and saved

    # The effective config, saved by the run and read back, holds the file and the override.
    saved = job_config.load(str(out / "train.toml"))
    assert saved.kfac.damping == 2e-3 and saved.schedule.decay == "polynomial"
    assert saved.kfac.refresh_steps == 2  # filled from the plan

    overridden = data["dir"] / f"override-{schedule}.toml"
    overridden.write_text(CONFIG.replace("damping = 1e-3", "damping = 2e-3"))
    model, losses = reference(plan, {**data, "config": overridden})
    want = model.state_dict()
    got, meta = load_trained(str(out / "model.safetensors"))
    initial = load_trained_initial(meta)
    moved = 0
    for name, w in want.items():
        err = float((got.state_dict()[name] - w).norm() / w.norm().clamp_min(1e-30))
        assert err <= 1e-5, f"{name}: relative error {err:.2e}"
        moved += not torch.equal(w, initial[name])
    assert moved > len(want) // 2, "the reference barely trained: the comparison would prove nothing"

    rows, evals = metrics(out)
    assert sorted(rows) == [1, 2, 3, 4, 5] and sorted(evals) == [2, 4, 5]
    for step, loss in enumerate(losses, start=1):
        assert math.isclose(rows[step]["loss"], loss, rel_tol=1e-9)
    lrs = [OptimConfig(lr=0.07, warmup_steps=2, decay="polynomial", decay_steps=3, final_lr_ratio=0.1,
                       power=2.0).lr_factor(s) * 0.07 for s in range(5)]
    assert [rows[s + 1]["lr"] for s in range(5)] == pytest.approx(lrs, rel=1e-12)
    assert all(rows[s]["grad_norm"] > 0.5 for s in rows)  # clipping was active
    assert [rows[s]["refresh"] for s in range(1, 6)] == [True, False, True, False, True]  # k = 2
    RUNS[(schedule, D)] = (plan, rows)

    # The saved model in one process gives the pipeline's last evaluation.
    ev = subprocess.run([sys.executable, "-m", "runtime.evaluate", str(out / "model.safetensors"), "--data",
                         str(data["val"]), "--json"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert ev.returncode == 0, ev.stderr
    assert math.isclose(json.loads(ev.stdout)["loss"], evals[5]["loss"], rel_tol=1e-6)
    assert math.isclose(evals[5]["perplexity"], math.exp(evals[5]["loss"]), rel_tol=1e-12)


@pytest.mark.e2e
@pytest.mark.parametrize("dtype", tiered([("float32",), ("bfloat16",)], ["float32", "bfloat16"], ci={1}))
def test_evaluate_uses_the_runs_precision(tmp_path, dtype):
    """`python -m runtime.evaluate` on a float32 or bf16 run's model file gives the
    pipeline's last evaluation: it computes as the pipeline did (bf16: autocast, each stage's
    output cast at the boundary). Evaluated in float32 instead, the bf16 model gives
    another number: the precision is what makes them equal."""
    from runtime.evaluate import evaluate_model

    plan = make_plan(tmp_path, "1f1b", 2)
    out = tmp_path / "out"
    r = torchrun(plan, 2, "--dtype", dtype, "--steps", "2", "--set", "eval.batches=2", "--log-dir", str(out),
                 "--save-model", str(out / "model.safetensors"))
    assert r.returncode == 0, r.stdout[-3000:]
    _, evals = metrics(out)
    want = evals[2]["loss"]
    ev = subprocess.run([sys.executable, "-m", "runtime.evaluate", str(out / "model.safetensors"), "--data", "pydoc",
                         "--json"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert ev.returncode == 0, ev.stderr
    got = json.loads(ev.stdout)["loss"]
    assert got == want, (got, want)  # the same kernels on the same shapes, one thread each: the same bits
    model, meta = load_trained(str(out / "model.safetensors"))
    assert meta["eval"]["precision"] == dtype
    batches = make_stream("bert", meta["eval"]["batch_size"], meta["eval"]["seq_len"], seed=0,
                          split="val").fixed_batches(2)
    plain = evaluate_model(model, batches, meta["eval"]["micro_batches"])  # float32, one stage
    if dtype == "bfloat16":
        assert not math.isclose(plain, want, rel_tol=1e-6), (plain, want)  # 1e-5 apart after 2 steps
    print(f"\n{dtype}: pipeline {want!r}, runtime.evaluate {got!r}, in float32 without stages {plain!r}")


def load_trained_initial(meta: dict) -> dict:
    from runtime.models import build_model
    return build_model(model_spec(meta["model"]), seed=meta["job"]["train"]["seed"], dtype=torch.float64).state_dict()


@pytest.mark.e2e
def test_resumed_run_logs_the_same_losses(tmp_path, data):
    """Two steps, checkpoint, stop; a second launch resumes to the end. Its log (appended to
    the first's in the same --log-dir) equals the uninterrupted run's."""
    if ("1f1b", 2) in RUNS:
        plan, want = RUNS[("1f1b", 2)]
    else:
        plan = make_plan(tmp_path, "1f1b", 2)
        r = torchrun(plan, 2, "--config", str(data["config"]), "--data", str(data["train"]), "--val-data",
                     str(data["val"]), "--log-dir", str(tmp_path / "whole"), "--set", "kfac.damping=2e-3")
        assert r.returncode == 0, r.stdout[-3000:]
        want, _ = metrics(tmp_path / "whole")
    ckpt = tmp_path / "ckpt"
    common = ["--config", str(data["config"]), "--data", str(data["train"]), "--val-data", str(data["val"]),
              "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2", "--set", "kfac.damping=2e-3",
              "--log-dir", str(tmp_path / "log")]
    first = torchrun(plan, 2, *common, "--set", "train.steps=2", "--set", "schedule.decay_steps=3")
    assert first.returncode == 0, first.stdout[-3000:]
    second = torchrun(plan, 2, *common, "--resume")
    assert second.returncode == 0 and "resumed from" in second.stdout, second.stdout[-3000:]
    got, _ = metrics(tmp_path / "log")
    assert sorted(got) == [1, 2, 3, 4, 5]
    for step in got:
        assert math.isclose(got[step]["loss"], want[step]["loss"], rel_tol=1e-9), step


# --- bad input: one line each, before training ---------------------------------------------------
def _prepare(plan: Path, *args: str):
    """runtime.config.cli.prepare as rank 0 of the plan's world: returns the InputError's text."""
    a = build_parser().parse_args([str(plan), *args])
    with pytest.raises(InputError) as e:
        prepare(a, 0, load_plan(str(plan)).world_size)
    text = str(e.value)
    assert "\n" not in text
    return text


def _token_file(d: Path, name: str, ids, dtype="uint16", vocab=100, raw: bytes | None = None) -> Path:
    p = d / f"{name}.bin"
    p.write_bytes(raw if raw is not None else np.asarray(ids, dtype=dtype).tobytes())
    (d / f"{name}.json").write_text(json.dumps({"dtype": dtype, "vocab_size": vocab}))
    return p


@pytest.mark.e2e
def test_bad_data_and_contradicting_keys_are_one_line_errors(tmp_path, data):
    plan = make_plan(tmp_path, "1f1b", 2)  # micro-batch 2 x 4 micro-batches, 16 tokens: one batch = 129 tokens
    ok = list(range(4, 100)) * 2
    cases = {
        "missing": (str(tmp_path / "nope.bin"), "nope.bin: no such file"),
        "empty": (str(_token_file(tmp_path, "empty", [], raw=b"")), "empty.bin: empty file"),
        "odd": (str(_token_file(tmp_path, "odd", [], raw=b"\x05\x00" * 200 + b"\x05")),
                "odd.bin: size 401 bytes is not a multiple of uint16's 2 bytes"),
        "id": (str(_token_file(tmp_path, "id", ok[:150] + [100] + ok[:10])),
               "id.bin: token id 100 at position 150 is >= the vocabulary size 100"),
        "short": (str(_token_file(tmp_path, "short", ok[:128])),
                  "short.bin: 128 tokens, fewer than one batch needs (8 rows x 16 tokens + 1 = 129)"),
        "vocab": (str(_token_file(tmp_path, "vocab", ok, dtype="uint32", vocab=260)),
                  "vocab.json: vocab_size: 260 exceeds the model's vocabulary of 100"),
    }
    nosidecar = tmp_path / "nosidecar.bin"
    nosidecar.write_bytes(np.asarray(ok, dtype="uint16").tobytes())
    cases["sidecar"] = (str(nosidecar), "nosidecar.json: missing: ")
    for name, (path, want) in cases.items():
        assert want in _prepare(plan, "--data", path), name
    assert "val.bin: empty file" in _prepare(plan, "--data", str(data["train"]), "--val-data",
                                             str(_token_file(tmp_path, "val", [], raw=b"")))

    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text("[kfac]\nrefresh_steps = 3\n")
    assert _prepare(plan, "--config", str(bad_toml)) == (
        f"{bad_toml}: kfac.refresh_steps: is 3 but the plan fixes it at 2 ({plan} config.refresh_steps); "
        "remove the key or plan again")
    for key, want in (("data.micro_batch=4", "--set: data.micro_batch: is 4 but the plan fixes it at 2"),
                      ("data.seq_len=32", "--set: data.seq_len: is 32 but the plan fixes it at 16"),
                      ("data.micro_batches=8", "--set: data.micro_batches: is 8 but the plan fixes it at 4"),
                      ("kfac.inverse=eigen", "--set: kfac.inverse: is 'eigen' but the plan fixes it at 'cholesky'"),
                      ("kfac.fisher=mc", "kfac.fisher: 'mc': the pipeline runtime computes only the empirical Fisher"),
                      ("kfac.dampng=1", "--set: kfac.dampng: unknown key; known: kfac.damping"),
                      ("schedule.decay=exp", "--set: schedule.decay: must be one of constant, linear, cosine, "
                                             "polynomial, got 'exp'")):
        assert want in _prepare(plan, "--set", key), key
    # A key that agrees with the plan is accepted.
    a = build_parser().parse_args([str(plan), "--set", "kfac.refresh_steps=2", "--data", str(data["train"])])
    assert prepare(a, 0, 2).config.kfac.refresh_steps == 2

    # The command line: exit 2, one line on stderr, nothing else.
    r = run_single(str(plan), "--data", cases["odd"][0], world_size=2)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and cases["odd"][1] in r.stderr, r.stderr


# --- the config: run folder, round trip, flags as keys --------------------------------------------
@pytest.mark.e2e
def test_a_run_without_log_dir_leaves_its_run_folder(tmp_path):
    """No --log-dir: rank 0 makes runs/PLAN-UTCTIME/ in the current folder (the torchrun
    helper runs in tmp_path), says so, and leaves there one metrics line per step, the
    summary --json printed, and the effective config, which --config reads back to itself."""
    plan = make_plan(tmp_path, "1f1b", 2)
    r = torchrun(plan, 2, "--steps", "4", "--json", "--set", "kfac.damping=3e-4", "--set", "optimizer.adam_betas=[0.8,0.9]")
    assert r.returncode == 0, r.stdout[-3000:]
    said = re.search(r"^runtime: run folder (runs/1f1b-2x1-\d{8}-\d{6})$", r.stdout, re.M)
    assert said, r.stdout[-3000:]
    folder = tmp_path / said.group(1)
    rows, evals = metrics(folder)
    assert sorted(rows) == [1, 2, 3, 4] and sorted(evals) == [4]
    printed = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("{")))
    assert json.loads((folder / "summary.json").read_text()) == printed
    assert [rows[s]["loss"] for s in sorted(rows)] == printed["losses"]

    saved = (folder / "train.toml").read_text()
    cfg = job_config.load(str(folder / "train.toml"))
    assert cfg.kfac.damping == 3e-4 and cfg.optimizer.adam_betas == (0.8, 0.9) and cfg.train.steps == 4
    assert cfg.log.json and cfg.runtime.dtype == "float64" and cfg.kfac.refresh_steps == 2  # flags and the plan's
    again = prepare(build_parser().parse_args([str(plan), "--config", str(folder / "train.toml")]), 0, 2)
    assert again.config.to_toml() == saved


def test_run_folders_started_in_the_same_second_do_not_clash(tmp_path, monkeypatch):
    import time

    from runtime.observe.metrics import make_run_folder

    frozen = time.gmtime(0)
    monkeypatch.setattr(time, "gmtime", lambda *a: frozen)
    made = [make_run_folder(str(tmp_path / "runs"), "plan") for _ in range(3)]
    base = str(tmp_path / "runs" / "plan-19700101-000000")
    assert made == [base, base + "-2", base + "-3"] and all(Path(m).is_dir() for m in made)


def _value_for(flag: str, kw: dict) -> tuple[list[str], str]:
    """(the flag's arguments, the same as a --set value), each unlike the key's default."""
    if kw.get("action") in ("store_true", "store_false"):
        return [flag], "true" if kw["action"] == "store_true" else "false"
    if flag == "--p2p-tags":
        return [flag, "off"], "false"
    if "choices" in kw:
        return [flag, kw["choices"][-1]], kw["choices"][-1]
    text = {int: "3", float: "2.5"}.get(kw.get("type"), "some/file.bin")
    return [flag, text], text


def test_every_flag_is_a_shorthand_for_its_key(tmp_path):
    base = ["--set", "checkpoint.dir=ck", "--set", "checkpoint.save_model=m.safetensors"]  # what some keys need
    for flag, key, kw in SHORTHANDS:
        args, value = _value_for(flag, kw)
        by_flag = load_config(build_parser().parse_args(["plan.json", *base, *args]))
        by_set = load_config(build_parser().parse_args(["plan.json", *base, "--set", f"{key}={value}"]))
        assert by_flag.to_dict() == by_set.to_dict(), flag
        assert by_flag.get(key) != job_config.JobConfig().get(key), flag
        assert by_flag.origin(key) == (flag, None) and by_set.origin(key) == ("--set", key)
    # the flag wins over --set, which wins over the file
    toml = tmp_path / "t.toml"
    toml.write_text("[train]\nsteps = 7\nseed = 5\n")
    cfg = load_config(build_parser().parse_args(["p.json", "--config", str(toml), "--set", "train.steps=8", "--seed", "9"]))
    assert (cfg.train.steps, cfg.train.seed) == (8, 9)


def test_config_round_trips_and_bad_keys_are_one_line_errors(tmp_path):
    cfg = job_config.JobConfig()
    cfg.data.path = 'a "quoted" \\ path\twith\x7fodd characters'
    cfg.optimizer.adam_betas = (0.8, 0.95)
    cfg.runtime.p2p_tags, cfg.runtime.timeout, cfg.log.json, cfg.kfac.refresh_steps = False, 1e-3, True, 3
    path = tmp_path / "round.toml"
    path.write_text(cfg.to_toml())
    assert job_config.load(str(path)).to_dict() == cfg.to_dict()

    def refused(text: str | None = None, *overrides: str) -> str:
        path.write_text(text or "")
        with pytest.raises(InputError) as e:
            job_config.load(str(path), list(overrides))
        assert "\n" not in str(e.value)
        return str(e.value)

    assert refused("[kfac]\ndamping = 'x'\n") == f"{path}: kfac.damping: must be a number, got 'x'"
    assert refused("[runtime]\nthreads = 0\n") == f"{path}: runtime.threads: must be in 1..1024, got 0"
    assert refused("[nope]\nx = 1\n").startswith(f"{path}: nope.x: unknown key; known: train.steps, train.seed, ")
    assert refused("steps = 3\n") == f"{path}: steps: must be a [section] table, e.g. [kfac] with damping = 1e-4"
    assert refused(None, "train.steps=1.5") == "--set: train.steps: must be an integer, got 1.5"
    assert refused(None, "runtime.p2p_tags=on") == "--set: runtime.p2p_tags: must be true or false, got 'on'"
    assert refused(None, "optimizer.adam_betas=[0.9]") == (
        "--set: optimizer.adam_betas: must be a list of 2 numbers, got [0.9]")
    assert refused("[checkpoint]\nevery = 2\n") == (
        f"{path}: checkpoint.every: needs a checkpoint folder (checkpoint.dir, --checkpoint-dir)")


def test_prepare_data_is_deterministic_and_byte_level_covers_any_text(tmp_path):
    from runtime.prepare_data import main

    src = tmp_path / "in.txt"
    src.write_text("héllo wörld\n" * 50)
    for run in ("a", "b"):
        assert main([str(src), "-o", str(tmp_path / run / "t.bin"), "--level", "byte", "--val-fraction", "0.2"]) == 0
    assert (tmp_path / "a" / "t.bin").read_bytes() == (tmp_path / "b" / "t.bin").read_bytes()
    side = json.loads((tmp_path / "a" / "t.json").read_text())
    assert side["vocab_size"] == 260 and side["dtype"] == "uint16"
    ids = np.fromfile(tmp_path / "a" / "t.bin", dtype=np.uint16)
    held = np.fromfile(tmp_path / "a" / "t.val.bin", dtype=np.uint16)
    raw = src.read_bytes()
    assert len(ids) + len(held) == len(raw) and len(held) == round(0.2 * len(raw))
    assert bytes((np.concatenate([ids, held]) - 4).astype(np.uint8)) == raw  # ids 0-3 are the specials


def test_lr_schedules_closed_form():
    base = dict(warmup_steps=4, decay_steps=10, final_lr_ratio=0.2)
    assert [OptimConfig(**base).lr_factor(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    for s in (4, 9, 14, 30):
        p = min(1.0, (s - 4) / 10)
        assert OptimConfig(**base, decay="constant").lr_factor(s) == 1.0
        assert OptimConfig(**base, decay="linear").lr_factor(s) == pytest.approx(1 - 0.8 * p)
        assert OptimConfig(**base, decay="cosine").lr_factor(s) == pytest.approx(0.2 + 0.4 * (1 + math.cos(math.pi * p)))
        assert OptimConfig(**base, decay="polynomial", power=2.0).lr_factor(s) == pytest.approx(0.2 + 0.8 * (1 - p) ** 2)
