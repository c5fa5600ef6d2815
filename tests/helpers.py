"""Shared test helpers: hand-written plans, the runtime launched as users launch it
(torchrun), single-process references, profiles and the CLI. Test modules import these
from here, never from one another."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pfcompile.formats.profile import (
    Comm,
    CoveredLayer,
    LinkModel,
    Part,
    Profile,
)
from pfcompile.formats.verify import model_hash
from runtime.config import job as job_config
from runtime.config.job import JobConfig
from runtime.io.data import make_stream
from runtime.models import (
    build_model,
    build_stage,
    kfac_linears,
    resolve_config,
    resolve_model,
    split_parts,
)
from runtime.optimizers import registry
from runtime.optimizers.kfac import (
    kfac_config,
    make_layers,
)
from runtime.optimizers.stage import (
    build_optimizer,
    optim_config,
)
from runtime.train import make_optimizer_layers, train_step

ROOT = Path(__file__).resolve().parents[1]
MODEL, MICRO, SEQ, N, K = "bert-tiny", 2, 16, 4, 2
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
USER_MODEL = "my_model:build"  # examples/my_model.py: a user's GPT-style model with SwiGLU blocks
EXAMPLES = str(ROOT / "examples")
# profiles/bert-tiny-cpu-optimizers.json as committed on 2026-12-03, kept as it was: made
# before each optimizer's own step and SOAP's activation were timed (what loading an older
# profile must still give), and a fixed case for properties that need its costs
TINY_OPTIMIZERS_BEFORE_OWN_STEP = ROOT / "tests" / "data" / "profiles-before-own-step" / "bert-tiny-cpu-optimizers.json"
D64 = torch.float64


def tiered(cases, ids, ci) -> list:
    """Parametrize cases (tuples) with their ids; those whose index is not in `ci` are marked
    `full`: another family, optimizer or variant of a property the CI tier checks with the
    cases in `ci`. `make test` leaves them out, `make test-all` runs them."""
    return [pytest.param(*c, id=i, marks=() if n in ci else pytest.mark.full)
            for n, (c, i) in enumerate(zip(cases, ids))]


def optimizer_reference_params(plan_path, steps: int, max_grad_norm: float = 0.0, settings: tuple[str, ...] = ()):
    """The single-process trainer (runtime.train.train_step) with the plan's model, data,
    optimizer (its registry entry's config from the runtime's defaults) and refresh cycle
    (clipping the gradient's global norm to `max_grad_norm` > 0)."""
    plan = json.loads(plan_path.read_text())
    optimizer, n, k = plan["config"]["optimizer"], plan["config"]["micro_batches"], plan["config"]["refresh_steps"]
    spec = resolve_model(plan["model"]["name"])
    model = build_model(spec, seed=0, dtype=torch.float64)
    initial = {name: v.clone() for name, v in model.state_dict().items()}
    defaults = job_config.load(overrides=list(settings)) if settings else JobConfig()  # the run's --set
    defaults.kfac.refresh_steps = k  # the plan fixes it (runtime.config.job.apply_plan)
    entry = registry.entry(optimizer)
    cfg = entry.math_config(defaults)
    layers = make_optimizer_layers(model, optimizer, cfg, n)
    opt = build_optimizer(model, layers, optim_config(defaults), optimizer)
    stream = make_stream(spec.cfg.kind, plan["model"]["micro_batch"] * n, plan["model"]["seq_len"], seed=0)
    for step in range(steps):
        train_step(model, layers, opt, stream.batch(step), step, n, cfg, max_grad_norm=max_grad_norm)
    return initial, model.state_dict()


def torch_runtime(num_stages: int, group_size: int, n_microbatches: int):
    """A schedule object as torch's own tests build it for CSV loading: stages without a model."""
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime
    from torch.distributed.pipelining.stage import _PipelineStageBase

    class StageShape(_PipelineStageBase):  # only what the schedule reads: sizes and rank
        def __init__(self):
            self.num_stages, self.group_size, self.group_rank, self.group = num_stages, group_size, 0, None
            self.submod = None

        # stage set-up for real tensors; never called while loading and checking a schedule
        def _create_grad_recv_info(self, *a, **k):
            raise NotImplementedError

        _prepare_forward_infra = _prepare_backward_infra = _create_grad_recv_info

    return _PipelineScheduleRuntime([StageShape()], n_microbatches)


def cli(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pfcompile", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**os.environ, **(env or {})})


def plan_in_process(*args: object) -> None:
    """`pfcompile plan ARGS` in this process (pfcompile.cli.main, the command's own entry point),
    for a test whose subject is what runs or draws the plan: a subprocess would add ~1.6 s of
    start-up. Tests of the command itself (exit codes, stderr, --json) run it through `cli`."""
    import io
    from contextlib import redirect_stderr

    from pfcompile.cli import main

    err = io.StringIO()
    with redirect_stderr(err):
        code = main(["plan", *map(str, args)])
    assert code == 0, err.getvalue()[-2000:]


def one_line_error(r: subprocess.CompletedProcess, *needles: str) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


D64 = torch.float64


def chained(spec, stages, batch, seed=0, dtype=D64):
    cuts = split_parts(list(spec.part_names), stages)
    mods = [build_stage(spec, names, seed, dtype) for names in cuts]
    inputs, outputs, x = [], [], batch.tokens
    for s, mod in enumerate(mods):
        if s > 0:
            x = x.detach().requires_grad_(True)
        inputs.append(x)
        x = mod(x, batch.targets) if s == len(mods) - 1 else mod(x)
        outputs.append(x)
    outputs[-1].backward()
    for s in range(len(mods) - 2, -1, -1):  # send each input-gradient back one stage
        outputs[s].backward(inputs[s + 1].grad)
    grads = {f"{n}": p.grad for mod in mods for n, p in mod.named_parameters()}
    return float(outputs[-1].detach()), grads


def uniform_profile(blocks: int = 4, fwd: float = 1.0, bwd: float = 2.0, layers_per_block: int = 2,
                    act_bytes: int = 1000, out_bytes: int = 0, latency_ms: float = 0.0,
                    curv: float = 0.1, inv: float = 0.3, precond: float = 0.05) -> Profile:
    """A synthetic profile: equal blocks, zero-cost embed/head, zero comm unless asked."""
    parts = [Part("embed", 0.0, 0.0, 0, 0, 0, out_bytes)]
    layers = []
    for b in range(blocks):
        parts.append(Part(f"block{b}", fwd, bwd, act_bytes, 100, 100, out_bytes))
        for j in range(layers_per_block):
            layers.append(CoveredLayer(
                name=f"block{b}.fc{j}", part=f"block{b}", in_features=8, out_features=8, bias=False,
                optimizer_ms={"kfac": {"curv_a": curv, "curv_b": curv, "inv_A.cholesky": inv, "inv_A.eigen": 2 * inv,
                                       "inv_B.cholesky": inv, "inv_B.eigen": 2 * inv, "precond": precond}},
                kept_a_bytes=10, kept_b_bytes=20, factor_a_bytes=4, factor_b_bytes=4,
                inverse_a_bytes=4, inverse_b_bytes=4))
    parts.append(Part("head", 0.0, 0.0, 0, 0, 0, 0))
    link = LinkModel(latency_ms=latency_ms, bytes_per_ms=1e6)
    prof = Profile(source="reference", provenance={"note": "synthetic, tests"},
                   model={"name": "tests:synthetic", "micro_batch": 1, "seq_len": 1},  # user code: its own parts
                   parts=parts, covered_layers=layers, comm=Comm("model", out_bytes, link, link))
    prof.to_json()  # sets the hash
    return prof


def _placement(schedule: str, D: int, R: int) -> dict[tuple[int, int], int]:
    if schedule == "chimera":
        return {**{(s, 0): s for s in range(D)}, **{(s, 1): D - 1 - s for s in range(D)}}
    return {(s, r): r * D + s for s in range(D) for r in range(R)}


def _compute_order(schedule: str, D: int, s: int, mbs: list[int]) -> list[tuple[str, int]]:
    """Canonical fwd/bwd order of one stage replica over its micro-batches."""
    if schedule == "gpipe":
        return [("fwd", m) for m in mbs] + [("bwd", m) for m in mbs]
    warmup = min(D - s - 1, len(mbs))  # 1F1B (and each direction of Chimera)
    order = [("fwd", m) for m in mbs[:warmup]]
    for i, m in enumerate(mbs[warmup:]):
        order += [("fwd", m), ("bwd", mbs[i])]
    order += [("bwd", m) for m in mbs[len(mbs) - warmup:]]
    return order


def hand_plan(schedule: str, D: int, N: int, R: int, k: int, model: dict, partition: list[list[str]],
              layers: list[str], layer_stage: list[int], kfac: bool = True) -> dict:
    """A valid plan dict: per-rank op lists from a round-based simulation of the schedule.

    Every rank's list is its projection of one global order, so sends/receives pair up and
    collectives (emitted after the pipeline ops, by stage and layer index) come in the same
    order on every rank: the plan cannot deadlock. On the refresh step each layer's
    curvature follows its fwd/bwd, except the first layer of each stage whose curv_b is
    deferred to step 1 (kept gradients held across steps); factors are reduced and
    inverted in step min(1, k-1), one replica inverting per layer and broadcasting.
    """
    if schedule == "chimera":
        R = 2
    W = D if schedule == "chimera" else D * R
    place = _placement(schedule, D, R)
    per = N // R
    mbr = [m // per for m in range(N)]
    seqs: dict[int, list[list[tuple[str, int, int, int]]]] = {q: [] for q in range(W)}
    for (s, r), q in sorted(place.items()):
        mbs = [m for m in range(N) if mbr[m] == r]
        seqs[q].append([(kind, s, r, m) for kind, m in _compute_order(schedule, D, s, mbs)])

    done: set[tuple[str, int, int]] = set()

    def ready(kind, s, r, m):
        if kind == "fwd":
            return s == 0 or ("fwd", s - 1, m) in done
        return ("fwd", s, m) in done and (s == D - 1 or ("bwd", s + 1, m) in done)

    global_order: list[tuple[int, tuple]] = []
    while any(any(q) for q in seqs.values()):
        progressed = []
        for q, queues in seqs.items():
            heads = [qq[0] for qq in queues if qq and ready(*qq[0])]
            if heads:  # prefer backward (frees memory), then the earlier micro-batch
                op = min(heads, key=lambda o: (o[0] != "bwd", o[3]))
                next(qq for qq in queues if qq and qq[0] == op).pop(0)
                progressed.append((q, op))
        assert progressed, "hand_plan: schedule deadlocked"
        for q, op in progressed:
            done.add((op[0], op[1], op[3]))
            global_order.append((q, op))

    stage_layers = {s: [i for i, ls in enumerate(layer_stage) if ls == s] for s in range(D)}
    steps = {q: [[] for _ in range(k)] for q in range(W)}
    t = {q: 0.0 for q in range(W)}

    def emit(q, step, **op):
        steps[q][step].append({**op, "start": t[q], "end": t[q] + 1.0})
        t[q] += 1.0

    sync_step = min(1, k - 1)
    for step in range(k):
        refresh = kfac and step == 0
        for q, (kind, s, r, m) in global_order:
            if kind == "fwd":
                if s > 0 and place[(s - 1, r)] != q:
                    emit(q, step, op="recv_act", stage=s - 1, mb=m, peer=place[(s - 1, r)])
                emit(q, step, op="fwd", stage=s, mb=m)
                if refresh:
                    for li in stage_layers[s]:
                        emit(q, step, op="curv_a", layer=li, mb=m)
                if s < D - 1 and place[(s + 1, r)] != q:
                    emit(q, step, op="send_act", stage=s, mb=m, peer=place[(s + 1, r)])
            else:
                if s < D - 1 and place[(s + 1, r)] != q:
                    emit(q, step, op="recv_grad", stage=s + 1, mb=m, peer=place[(s + 1, r)])
                emit(q, step, op="bwd", stage=s, mb=m)
                if refresh:
                    for li in stage_layers[s]:
                        if not (k > 1 and li == stage_layers[s][0]):
                            emit(q, step, op="curv_b", layer=li, mb=m)
                if s > 0 and place[(s - 1, r)] != q:
                    emit(q, step, op="send_grad", stage=s, mb=m, peer=place[(s - 1, r)])
        for q in range(W):
            held = sorted(s for (s, r), qq in place.items() if qq == q)
            if kfac and k > 1 and step == 1:
                for s in (s for s in held if stage_layers[s]):
                    r = next(r for (ss, r), qq in place.items() if qq == q and ss == s)
                    for m in (m for m in range(N) if mbr[m] == r):
                        emit(q, step, op="curv_b", layer=stage_layers[s][0], mb=m)
            if kfac and step == sync_step:
                for s in held:
                    for li in stage_layers[s]:
                        inverter = place[(s, li % R)]
                        if R > 1:
                            for f in "AB":
                                emit(q, step, op="sync_curv", layer=li, factor=f)
                        for f in "AB":
                            if q == inverter:
                                emit(q, step, op="inv", layer=li, factor=f)
                        if R > 1:
                            for f in "AB":
                                emit(q, step, op="bcast_inv", layer=li, factor=f, peer=inverter)
            for s in held:
                if R > 1:
                    emit(q, step, op="sync_grad", stage=s)
            for s in held:
                if kfac:
                    for li in stage_layers[s]:
                        emit(q, step, op="precond", layer=li)
                emit(q, step, op="step", stage=s)

    return {
        "schema": "pfcompile-plan", "schema_version": 1,
        "config": {"schedule": schedule, "stages": D, "virtual_stages": 1, "micro_batches": N,
                   "replicas": R, "world_size": W, "method": "none", "kfac": kfac,
                   "refresh_steps": k, "inverse": "cholesky", "fixed_order": True,
                   "memory_limit_bytes": None},
        "model": model, "partition": partition, "layers": layers, "layer_stage": layer_stage,
        "placement": [{"stage": s, "replica": r, "rank": q} for (s, r), q in sorted(place.items())],
        "micro_batch_replica": mbr,
        "ranks": [{"rank": q, "steps": steps[q]} for q in range(W)],
        "stats": {"step_time_ms": max(t.values()) / k},
        "profile": {"name": "hand-made", "hash": "", "source": "test",
                    "model_hash": model_hash(model, "")},  # the spec the plan was made for
    }




def model_spec(name: str):
    if ":" in name:
        if EXAMPLES not in sys.path:
            sys.path.insert(0, EXAMPLES)
        return resolve_model(name)
    return resolve_model(resolve_config(name, seq_len=SEQ))


def make_plan(tmp: Path, schedule: str, D: int, R: int = 1, kfac: bool = True, name: str = MODEL) -> Path:
    spec = model_spec(name)
    partition = split_parts(list(spec.part_names), D)
    layers, layer_stage = [], []
    for s, parts in enumerate(partition):
        for layer, _ in kfac_linears(build_stage(spec, parts)):
            layers.append(layer)
            layer_stage.append(s)
    plan = hand_plan(schedule, D, N, R, K, {"name": name, "micro_batch": MICRO, "seq_len": SEQ},
                     partition, layers, layer_stage, kfac)
    path = tmp / f"{schedule}-{D}x{R}.json"
    path.write_text(json.dumps(plan))
    return path


def torchrun(plan: Path, nproc: int, *args: str, launcher: list[str] = (), env: dict | None = None,
             wait: bool = True, timeout: float = 180):
    """The runtime on `plan`, run in the plan's folder (a temporary one): a run without
    --log-dir makes its run folder there, runs/PLAN-UTCTIME/, not in the repository, and
    torchrun's own temporary folder (torchelastic_*, which it leaves behind) goes there too."""
    cmd = [*TORCHRUN, *(launcher or ["--standalone"]), "--nproc-per-node", str(nproc),
           "-m", "runtime", str(plan), "--dtype", "float64", "--data", "pydoc", *args]
    python_path = os.pathsep.join(p for p in (str(ROOT), EXAMPLES, os.environ.get("PYTHONPATH")) if p)
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": python_path, "TMPDIR": str(plan.parent),
                **(env or {})}
    p = subprocess.Popen(cmd, cwd=plan.parent, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    if not wait:
        return p
    out, _ = p.communicate(timeout=timeout)
    return subprocess.CompletedProcess(cmd, p.returncode, out, "")


def distributed_params(ckpt: Path, step: int, plan_path: Path) -> dict[str, torch.Tensor]:
    """The whole model's parameters from every rank's checkpoint; replicas must agree."""
    plan = json.loads(plan_path.read_text())
    params: dict[str, torch.Tensor] = {}
    for q in range(plan["config"]["world_size"]):
        state = torch.load(ckpt / f"step-{step:08d}" / f"rank-{q}.pt", weights_only=True)
        for stage in state["stages"].values():
            for name, t in stage["params"].items():
                if name in params:  # another replica of the same stage
                    torch.testing.assert_close(t, params[name], rtol=1e-9, atol=1e-12, msg=f"replicas differ on {name}")
                params[name] = t
    return params


def reference_params(plan_path: Path, steps: int, kfac: bool = True, dtype: str = "float64") -> tuple[dict, dict]:
    """The single-process run (runtime.train.train_step) of the plan's model, data (global
    batch of N micro-batches), optimizer and refresh cycle, KL-clipped per stage like the
    runtime; returns (initial, final) parameters. dtype "bfloat16": autocast, float32 state."""
    from runtime.config.precision import precision

    prec = precision(dtype)
    plan = json.loads(plan_path.read_text())
    spec = model_spec(plan["model"]["name"])
    cfg = spec.cfg
    n, k = plan["config"]["micro_batches"], plan["config"]["refresh_steps"]
    model = build_model(spec, seed=0, dtype=prec.param_dtype)
    initial = {name: v.clone() for name, v in model.state_dict().items()}
    # The runtime's defaults (runtime.config.job) with the plan's refresh interval and inversion.
    defaults = JobConfig()
    kcfg = replace(kfac_config(defaults), refresh_steps=k, inverse=plan["config"].get("inverse", "cholesky"))
    layers = make_layers(kfac_linears(model), kcfg, n) if kfac else []
    stage_of = dict(zip(plan["layers"], plan["layer_stage"]))
    groups = [[l for l in layers if stage_of[l.name] == s] for s in range(len(plan["partition"]))]
    opt = build_optimizer(model, layers, optim_config(defaults))
    stream = make_stream(cfg.kind, plan["model"]["micro_batch"] * n, plan["model"]["seq_len"], seed=0)
    for step in range(steps):
        train_step(model, layers, opt, stream.batch(step), step, n, kcfg if kfac else None,
                   kl_groups=[g for g in groups if g], precision=prec if prec.mixed else None)
    return initial, model.state_dict()


def assert_same_params(got: dict, want: dict, initial: dict, rtol: float = 1e-5, floor: float = 1e-30) -> None:
    """Each parameter within `rtol` of the reference, relative to its norm or `floor`, the
    smaller norm a parameter may have and still be compared relatively."""
    assert set(got) == set(want)
    moved = 0
    for name, w in want.items():
        err = float((got[name] - w).norm() / w.norm().clamp_min(floor))
        assert err <= rtol, f"{name}: relative error {err:.2e} > {rtol}"
        moved += not torch.equal(w, initial[name])
    assert moved > len(want) // 2, "the reference barely trained: the comparison would prove nothing"


def run_single(*args: str, world_size: int = 1) -> subprocess.CompletedProcess:
    """`python -m runtime` without torchrun: rank 0 of `world_size`, enough to reach validation
    (which must fail before any collective, else this would wait for absent peers)."""
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": str(world_size)}
    return subprocess.run([sys.executable, "-m", "runtime", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
