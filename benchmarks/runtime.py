"""Runtime benchmark (not a test): CPU, 2 ranks, one thread each, bert-mini, 4 micro-batches.

  (a) our runtime without K-FAC against torch.distributed.pipelining's ScheduleGPipe and
      Schedule1F1B on the same model, partition, micro-batches and optimizer (AdamW); and
      (a0) our 1f1b run twice per round, against itself: the ratios two identical runs give
      on this machine (how far from 1 a ratio in (a) can lie by chance);
  (a-i) the same five variants in ONE torchrun job on one process group, alternating
      blocks of `--block` steps (default 3) in an order rotated every round: a pair of
      blocks lies seconds apart instead of a minute, and this VM's speed drifts on the scale
      of a minute. Ours is stepped as runtime.pipeline.loop steps it (train_step, the metrics
      reduction every log.every steps); the runtime's GC policy (automatic collection off,
      collect between blocks) applies to every variant alike. Reported beside (a), not
      instead of it: (a) is each variant in its own job, the way a user launches it;
  (b) the compiled plan with K-FAC in the bubbles (CP-SAT) against K-FAC appended after
      each step's pipeline work (`--method none`) and against no K-FAC;
  (c) predicted (plan.stats.step_time_ms) against measured step time;
  (e) `--only-calibration`: predicted against measured for every planned run (GPipe, 1F1B,
      K-FAC appended, K-FAC in bubbles) from the profile as it is, then from the profile
      calibrated on those runs (`pfcompile calibrate`, all four traces), re-planned and
      measured on a second run with another seed (so calibration does not replay the
      numbers it was fitted to);
  (d) zero bubble without K-FAC: our zb-v against torch's ScheduleZBVZeroBubble (same V
      placement: rank r holds stages r and 3-r), our zb-h1 against torch's
      ScheduleInterleavedZeroBubble with one stage per rank (ZB1P = ZB-H1), and our zb-h1
      against our 1f1b (the bubble the split backward saves, measured);
  (f) `--only-pinning`: our 1f1b (no K-FAC, and K-FAC appended) with `--pin-cpus` (each
      rank on its own core, the default on a cpu) and `--no-pin-cpus`, in alternating launches;
  (g) `--only-optimizers`: for K-FAC, Shampoo, SOAP and Muon (`--optimizers` picks), 1F1B with the optimizer's work
      appended to every step (`--method none`) and in the bubbles (CP-SAT), against AdamW
      (no extra work): measured and predicted, and whether the bubbles beat appending by the
      planned difference (the profile must hold every optimizer's costs: `pfcompile profile
      --optimizer shampoo --optimizer soap --optimizer muon`).

Every variant runs in each round and rounds alternate the order, so the ratios compare
runs made side by side on the same machine. The table gives the best round (the one least
disturbed by other processes on a shared CPU) and the median. Every separate launch, ours and
torch's, is timed by the runtime's own measure (runtime.observe.measure.summarize: every step back to
back after one barrier, from the ranks' first start to their last end over the timed steps),
and (a) is given again by the steady step period (Summary.period_ms). Each run times 28 steps after
2 of warm-up by default (a bert-mini step is ~0.3 s on 2 CPU cores: 8 timed steps, the old
default, left the round-to-round spread at ~10%, larger than the differences measured).
Usage:

    .venv/bin/python benchmarks/runtime.py [--steps 30] [--rounds 5] [--out bench-out]
        [--only-torch | --only-interleaved [--interleaved-rounds 30] [--block 3] | --only-pinning | ...]

The same file is the torch.distributed.pipelining worker (`--pipelining-worker`), run by
torchrun like the runtime, and the check that (a) compares the same computation
(`--same-math-worker PLAN`: both from the same weights on the same batches; equal losses,
first-step gradients and parameters; run by tests/test_against_torch.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
# Run as a script, this file's folder comes first on sys.path and its name would shadow
# the `runtime` package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
from runtime import launch  # noqa: E402 (after the path fix above)

AGAIN = "1f1b, no K-FAC (again)"  # (a0): an identical run, for the ratio two equal runs give
# (a) and (a0): ours against torch's, and our 1f1b against itself, launch by launch
A_PAIRS = (("gpipe, no K-FAC", "torch ScheduleGPipe"), ("1f1b, no K-FAC", "torch Schedule1F1B"),
           (AGAIN, "1f1b, no K-FAC"))


class Paired(NamedTuple):
    """Round by round a / b: each round's pair ran side by side, so the ratios are free of the
    drift between rounds, and their mean's standard error says how finely one run resolves a
    against b."""
    per: list[float]

    @classmethod
    def of(cls, a: list[float], b: list[float]) -> Paired:
        return cls([x / y for x, y in zip(a, b)])

    @property
    def median(self) -> float:
        return statistics.median(self.per)

    @property
    def mean_se(self) -> str:
        se = statistics.stdev(self.per) / len(self.per) ** 0.5 if len(self.per) > 1 else float("nan")
        return f"{statistics.fmean(self.per):.3f} ± {se:.3f}"

    def cells(self) -> str:
        """median | min–max | mean ± standard error, as table cells."""
        return f"{self.median:.3f} | {min(self.per):.3f}–{max(self.per):.3f} | {self.mean_se}"


def run_length(a, plans: dict[str, Path]) -> tuple[int, int]:
    """(warm-up, steps) of every separate launch: at least one whole refresh cycle of the
    slowest-refreshing plan warmed up, and one timed."""
    k_max = max(json.loads(p.read_text())["config"]["refresh_steps"] for p in plans.values())
    warmup = max(a.warmup, k_max)
    return warmup, max(a.steps, warmup + k_max)


class Launch(NamedTuple):
    """One separate launch: the runtime's measured ms/step (Summary.step_ms), the compute
    ops' measured / profiled duration (ours only) and the steady step period
    (Summary.period_ms), both sides measured by runtime.observe.measure."""
    step_ms: float
    op_ratio: float | None
    period_ms: float | None


def ended() -> str:
    """The stamp printed beside each launch, "ended HH:MM:SS UTC": a host's slow spells are
    read against the wall clock."""
    return f"ended {time.strftime('%H:%M:%S', time.gmtime())} UTC"


def alternate(runs: dict, rounds: int, steps: int, console) -> dict[str, list[Launch]]:
    """Every run once per round, the order reversed every other round (a drift of the
    machine then falls on each variant alike); returns each run's launches, round by round."""
    launches: dict[str, list[Launch]] = {name: [] for name in runs}
    order = list(runs)
    for r in range(rounds):
        for name in (order if r % 2 == 0 else order[::-1]):
            with console.status(f"round {r + 1}/{rounds}: {name} ({steps} steps)"):
                launches[name].append(runs[name]())
            console.print(f"round {r + 1}: {name}: {launches[name][-1].step_ms:.1f} ms/step ({ended()})")
    return launches


def plan(profile: str, out: Path, name: str, *flags: str) -> Path:
    path = out / f"{name}.json"
    cmd = [PY, "-m", "pfcompile", "plan", profile, "--stages", "2", *flags, "-o", str(path)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"benchmark: planning {name} failed:\n{r.stderr[-2000:]}")
    return path


def torchrun(args: list[str], nproc: int = 2) -> dict:
    """Run an `nproc`-rank job; its rank 0 prints one JSON line last."""
    with launch.launch_env() as env:
        r = subprocess.run(launch.torchrun(nproc, *args), cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=900)
    lines = [l for l in r.stdout.splitlines() if l.startswith("{")]
    if r.returncode or not lines:
        sys.exit(f"benchmark: {' '.join(args[:3])} failed:\n{(r.stdout + r.stderr)[-3000:]}")
    return json.loads(lines[-1])


def run_ours(plan_path: Path, steps: int, warmup: int, *flags: str) -> Launch:
    nproc = json.loads(plan_path.read_text())["config"]["world_size"]
    out = torchrun(["-m", "runtime", str(plan_path), "--steps", str(steps), "--warmup", str(warmup),
                    "--data", "synthetic", "--json", *flags], nproc)
    return Launch(out["step_ms"], out.get("op_ratio"), out.get("period_ms"))


def run_pipelining(schedule: str, plan_path: Path, steps: int, warmup: int) -> Launch:
    out = torchrun([__file__, "--pipelining-worker", schedule, "--plan", str(plan_path),
                    "--steps", str(steps), "--warmup", str(warmup)])
    return Launch(out["step_ms"], None, out.get("period_ms"))


# --- the torch.distributed.pipelining worker ---------------------------------------------------
def torch_pipeline(schedule: str, plan_path: str, rank: int, parts: dict | None = None):
    """The same stages, data and AdamW as our runtime's no-K-FAC plan, under torch's
    schedule; returns one_step(step), which returns the step's mean loss on the rank with
    the last stage (else None). Call after init_process_group. `parts`, if given, receives
    this rank's stage modules and optimizers by stage (for the same-math check)."""
    import torch
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )

    from pfcompile.formats.plan import load_plan
    from runtime.io.data import make_stream
    from runtime.models import Stage, lm_loss, resolve_config
    from runtime.optimizers.stage import build_optimizer

    p = load_plan(plan_path)
    N = p.config.micro_batches
    cfg = resolve_config(p.model["name"], vocab=p.model.get("vocab"), seq_len=p.model["seq_len"])
    S = len(p.partition)
    held = [s for s, r in p.stages_of(rank)]  # zb-v: rank r holds stages r and 2D-1-r
    b, T = p.model["micro_batch"], p.model["seq_len"]
    modules, stages = [], []
    for s in held:
        modules.append(Stage(cfg, p.partition[s], seed=0))
        example = (torch.zeros(b, T, dtype=torch.long) if s == 0 else torch.zeros(b, T, cfg.hidden),)
        stages.append(PipelineStage(modules[-1], s, S, torch.device("cpu"), input_args=example))
    loss = lambda logits, y: lm_loss(logits, y)  # noqa: E731
    if schedule in ("gpipe", "1f1b"):
        sched = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule](stages[0], n_microbatches=N, loss_fn=loss)
    else:
        make = {"zbv": ScheduleZBVZeroBubble, "zb1p": ScheduleInterleavedZeroBubble}[schedule]
        sched = make(stages, n_microbatches=N, loss_fn=loss)
    opts = [build_optimizer(m, []) for m in modules]
    stream = make_stream(cfg.kind, b * N, T, seed=0, synthetic=True, vocab=cfg.vocab)
    first, last = 0 in held, S - 1 in held
    if parts is not None:
        parts.update({s: (m, o) for s, m, o in zip(held, modules, opts)})

    def one_step(step: int) -> float | None:
        batch = stream.batch(step)
        losses: list = []
        if first and last:
            sched.step(batch.tokens, target=batch.targets, losses=losses)
        elif first:
            sched.step(batch.tokens)
        elif last:
            sched.step(target=batch.targets, losses=losses)
        else:
            sched.step()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        return float(sum(l.detach() for l in losses)) / N if losses else None

    return one_step


def pipelining_worker(schedule: str, plan_path: str, steps: int, warmup: int) -> None:
    """One torchrun job of torch's schedule alone, timed as our runtime times itself
    (runtime.pipeline.loop and runtime.observe.measure): a barrier, then every step back to back, each
    rank marking its steps' starts and ends, summarised by the runtime's own `summarize`
    over the steps after warm-up. Timed barrier to barrier instead (as this worker did
    before 2026-12-01), torch's steps start together after the warm-up, while our
    runtime's measure also counts how far its ranks' first starts lie apart: ~0.4% of a
    bert-mini step at 28 steps, in torch's favour."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from runtime.config.network_threads import idle_network_threads
    from runtime.observe import measure
    from runtime.pipeline import affinity, comm

    affinity.pin_by_default(1)  # on its own core, as the runtime's ranks are (runtime.pin_cpus)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    idle_network_threads("gloo")  # as the runtime's ranks run (runtime.idle_network_threads)
    rank, size = dist.get_rank(), dist.get_world_size()
    one_step = torch_pipeline(schedule, plan_path, rank)
    timeline = measure.Timeline(rank)
    dist.barrier()
    timeline.start()
    for step in range(steps):
        start = timeline.mark()
        one_step(step)
        timeline.end_step(step, start, timeline.mark())
    world = comm.World(rank, size, 0, torch.device("cpu"), "gloo", timedelta(seconds=60))
    gathered = comm.gather_json(world, timeline.to_json())
    if rank == 0:
        timelines = measure.align([measure.Timeline.from_json(d) for d in gathered])
        summary = measure.summarize(timelines, None, None, warmup, steps)
        print(json.dumps({"step_ms": summary.step_ms, "period_ms": summary.period_ms}), flush=True)
    dist.barrier()
    os._exit(0)  # like the runtime: no gloo teardown after the final barrier (it can abort a peer)


# --- (a-i): every variant in one job, block after block ----------------------------------------
INTERLEAVED = ("gpipe, no K-FAC", "torch ScheduleGPipe", "1f1b, no K-FAC", "torch Schedule1F1B", AGAIN)


def our_pipeline(plan_path: str, rank: int, world_size: int, world, total_steps: int, parts_out: dict | None = None):
    """Our runtime on a plan, stepped as runtime.pipeline.loop.run steps it (train_step, then the
    metrics reduction every log.every steps); returns one_step(step), which returns this
    rank's share of the step's loss. `parts_out`, if given, receives this rank's stage
    modules and optimizers by stage."""
    import torch

    from runtime.config import job as job_config
    from runtime.config.cli import make_job
    from runtime.observe.metrics import Metrics
    from runtime.pipeline import loop

    job = make_job(job_config.load(overrides=["data.path=synthetic"]), plan_path, rank, world_size)
    parts = loop.build_rank(job, world)
    parts.timeline.start()
    if parts_out is not None:
        parts_out.update({s: (sr.module, sr.optimizer) for s, sr in parts.stages.items()})
    losses = torch.zeros(total_steps, dtype=torch.float64)
    metrics = Metrics(None, total_steps, 0, 1) if rank == 0 else None
    pending: list[tuple] = []
    log_every = job.config.log.every
    logged = loop.LoggedSteps(world, losses, metrics)

    def one_step(step: int) -> float:
        pending.append(loop.train_step(parts, step))
        share = pending[-1][1]
        if len(pending) >= log_every:
            logged.post(pending)
        return share

    return one_step


def same_math_worker(plan_path: str, steps: int) -> None:
    """What (a) compares is the same computation: our runtime and torch's schedule (the
    plan's, gpipe or 1f1b) from the same initial weights on the same batches, `steps` steps
    each. Prints, on rank 0, per step both losses, and per rank the largest relative
    difference of the first step's gradients (read by a hook on each stage's AdamW as it
    steps) and of the final parameters. tests/test_against_torch.py runs it."""
    import torch
    import torch.distributed as dist

    from pfcompile.formats.plan import load_plan
    from runtime.pipeline import comm

    torch.set_num_threads(1)
    world = comm.init_world(60.0, "cpu")  # gloo's network threads idle for both sides, as the runtime's ranks
    rank = world.rank
    schedule = load_plan(plan_path).config.schedule
    ours, theirs = {}, {}
    our_step = our_pipeline(plan_path, rank, world.world_size, world, steps, ours)
    torch_step = torch_pipeline(schedule, plan_path, rank, theirs)
    grads: dict[str, dict] = {"ours": {}, "torch": {}}
    for who, parts in (("ours", ours), ("torch", theirs)):
        for s, (module, opt) in parts.items():
            names = {id(p): f"{s}.{n}" for n, p in module.named_parameters()}

            def first_grads(o, args, kwargs, who=who, names=names):
                if all(k not in grads[who] for k in names.values()):  # this stage's first step
                    grads[who].update({names[id(p)]: p.grad.detach().clone() for g in o.param_groups
                                       for p in g["params"] if p.grad is not None})
            opt.adamw.register_step_pre_hook(first_grads)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))

    our_losses, torch_losses = [], []
    for step in range(steps):
        our_losses.append(our_step(step))
    for step in range(steps):
        torch_losses.append(torch_step(step))
    ours_all = torch.tensor(our_losses, dtype=torch.float64)
    dist.all_reduce(ours_all)  # every rank's share: the global loss of each step
    theirs_all = torch.tensor([x or 0.0 for x in torch_losses], dtype=torch.float64)
    dist.all_reduce(theirs_all)  # only the last stage's rank holds torch's
    grad_diff = max(rel(grads["ours"][k], grads["torch"][k]) for k in grads["torch"])
    param_diff = max(rel(pm, pt) for s in ours for pm, pt in zip(ours[s][0].parameters(), theirs[s][0].parameters()))
    report = {"rank": rank, "grads": len(grads["torch"]), "same_names": sorted(grads["ours"]) == sorted(grads["torch"]),
              "grad_rel_diff": grad_diff, "param_rel_diff": param_diff}
    gathered = comm.gather_json(world, report)
    if rank == 0:
        print(json.dumps({"ours": ours_all.tolist(), "torch": theirs_all.tolist(), "ranks": gathered}), flush=True)
    dist.barrier()
    os._exit(0)


def interleaved_worker(plans: list[str], rounds: int, block: int, warmup: int) -> None:
    """(a-i): ours and torch's in one job on the same process group, alternating blocks of
    `block` steps, so a pair of blocks is seconds apart, not a minute (this VM's speed
    drifts on the scale of a minute). Prints, on rank 0, each variant's ms/step per block."""
    import gc

    import torch
    import torch.distributed as dist

    from runtime.pipeline import affinity, comm

    affinity.pin_by_default(1)  # both pipelines pinned, as the runtime's ranks are
    torch.set_num_threads(1)
    world = comm.init_world(60.0, "cpu")  # gloo's network threads idle for both sides, as the runtime's ranks
    rank, size = world.rank, world.world_size
    gpipe, f1b = plans
    total = warmup + rounds * block * 2  # the most steps one runtime object runs (1f1b runs twice a round)
    ours_gpipe, ours_1f1b = (our_pipeline(gpipe, rank, size, world, total), our_pipeline(f1b, rank, size, world, total))
    step_fns = {"gpipe, no K-FAC": ours_gpipe, "torch ScheduleGPipe": torch_pipeline("gpipe", gpipe, rank),
                "1f1b, no K-FAC": ours_1f1b, "torch Schedule1F1B": torch_pipeline("1f1b", f1b, rank),
                AGAIN: ours_1f1b}  # the same runtime object again: how far two blocks of one thing lie
    next_step = {name: 0 for name in step_fns}
    gc.disable()  # the runtime's policy (runtime.pipeline.loop), for every variant alike: collect between blocks

    def run_block(name: str, n: int) -> float:
        fn, s0 = step_fns[name], next_step[name]
        dist.barrier()
        t0 = time.perf_counter()
        for step in range(s0, s0 + n):
            fn(step)
        dist.barrier()
        next_step[name] = s0 + n
        return (time.perf_counter() - t0) * 1000.0 / n

    for name in INTERLEAVED:
        run_block(name, warmup)
    times: dict[str, list[float]] = {name: [] for name in INTERLEAVED}
    for r in range(rounds):
        order = list(INTERLEAVED[r % len(INTERLEAVED):] + INTERLEAVED[:r % len(INTERLEAVED)])
        if r % 2:
            order.reverse()  # every variant comes before and after every other equally often
        for name in order:
            gc.collect(1)
            times[name].append(run_block(name, block))
        if rank == 0:
            print(f"round {r + 1}/{rounds}", file=sys.stderr, flush=True)
    if rank == 0:
        print(json.dumps({"times": times}), flush=True)
    dist.barrier()
    os._exit(0)


# --- the benchmark -----------------------------------------------------------------------------
CALIBRATION_RUNS = {  # name -> plan flags (part e)
    "gpipe, no K-FAC": ("--schedule", "gpipe", "--no-kfac", "--method", "none"),
    "1f1b, no K-FAC": ("--schedule", "1f1b", "--no-kfac", "--method", "none"),
    "1f1b, K-FAC appended": ("--schedule", "1f1b", "--method", "none"),
    "1f1b, K-FAC in bubbles (cpsat)": ("--schedule", "1f1b", "--method", "cpsat", "--workers", "2"),
}


def run_traced(plan_path: Path, steps: int, warmup: int, seed: int, trace: Path) -> float:
    out = torchrun(["-m", "runtime", str(plan_path), "--steps", str(steps), "--warmup", str(warmup),
                    "--data", "synthetic", "--seed", str(seed), "--trace", str(trace), "--json"])
    return out["step_ms"]


def calibration_tables(a, out: Path, console) -> None:
    """(e): every run planned from the profile, measured (seed 0, traced); the profile
    calibrated on the four traces; every run re-planned from it and measured again (seed 1)."""
    n = ["--micro-batches", str(a.micro_batches), "--time-limit", str(a.time_limit)]
    rows = {}
    profiles = {"profile": a.profile}
    for phase, seed in (("profile", 0), ("calibrated", 1)):
        traces = []
        for name, flags in CALIBRATION_RUNS.items():
            slug = "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-") + "-" + phase
            with console.status(f"({phase}) planning {name}"):
                p = plan(profiles[phase], out, slug, *flags, *n)
            cfg = json.loads(p.read_text())
            k = cfg["config"]["refresh_steps"]
            warmup = max(a.warmup, k)
            steps = max(a.steps, warmup + 2 * k)
            trace = out / f"{slug}.trace.json"
            with console.status(f"({phase}) running {name}, seed {seed}, {steps} steps"):
                ms = run_traced(p, steps, warmup, seed, trace)
            traces.append(str(trace))
            rows.setdefault(name, {})[phase] = (cfg["stats"]["step_time_ms"], ms, k,
                                                cfg["stats"].get("expected_step_time_ms"))
            console.print(f"({phase}) {name}: predicted {cfg['stats']['step_time_ms']:.1f}, measured {ms:.1f} ms/step")
        if phase == "profile":
            calibrated = out / "calibrated.profile.json"
            r = subprocess.run([PY, "-m", "pfcompile", "calibrate", a.profile, *traces, "-o", str(calibrated)],
                               cwd=ROOT, capture_output=True, text=True)
            if r.returncode:
                sys.exit(f"benchmark: calibrate failed:\n{r.stderr[-2000:]}")
            profiles["calibrated"] = str(calibrated)
            fitted_on = [ln for ln in r.stderr.splitlines() if "against the run it was fitted on" in ln]
    print(f"\n(e) predicted against measured, {a.profile} (bert-mini, 2 ranks x 1 thread, gloo, CPU, "
          f"{a.micro_batches} micro-batches); load average at the end {os.getloadavg()[0]:.1f}")
    print("before: planned from the profile, measured with seed 0; after: planned from the profile calibrated on "
          "the four seed-0 runs, measured with seed 1\n")
    print("predicted: the plan's step from the profile's op times; with spread: the plan replayed with each op's "
          "time varying as the profile's runtime.op_spread says (pfcompile.check.replay.expected_step_time)\n")
    print("| run | k | predicted | with spread | measured (seed 0) | measured / predicted | measured / with spread "
          "| k | predicted (calibrated) | with spread | measured (seed 1) | measured / predicted | measured / with spread |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")

    def cells(p, m, k, e):
        return (f"{k} | {p:.1f} | {e:.1f} | {m:.1f} | {m / p:.3f} | {m / e:.3f}" if e else
                f"{k} | {p:.1f} | - | {m:.1f} | {m / p:.3f} | -")
    for name, r in rows.items():
        print(f"| {name} | {cells(*r['profile'])} | {cells(*r['calibrated'])} |")
    # the model's own error, apart from the machine's: the calibrated profile against the
    # four runs it was fitted on (pfcompile calibrate prints it)
    print("\n(e) the calibrated profile against the seed-0 runs it was fitted on:")
    for ln in fitted_on:
        print("  " + ln.split(": the calibrated profile against the run it was fitted on: ", 1)[-1]
              + f"  ({Path(ln.split(':', 1)[0]).name})")


OPTIMIZERS = ("kfac", "shampoo", "soap", "muon")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default=None,
                    help="default profiles/bert-mini-cpu.json; (g): profiles/bert-mini-cpu-optimizers.json, which "
                         "holds Shampoo's and Muon's costs too")
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30, help="steps per run, warm-up included")
    ap.add_argument("--warmup", type=int, default=2, help="steps excluded from timing (raised to one refresh cycle)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--time-limit", type=float, default=20.0, help="CP-SAT seconds per k")
    ap.add_argument("--out", default="bench-out")
    ap.add_argument("--only-zero-bubble", action="store_true", help="only part (d) and its 1f1b reference")
    ap.add_argument("--only-calibration", action="store_true",
                    help="only part (e): predicted vs measured before and after pfcompile calibrate")
    ap.add_argument("--only-torch", action="store_true",
                    help="only parts (a-i) and (a): our gpipe and 1f1b against torch's ScheduleGPipe and Schedule1F1B")
    ap.add_argument("--only-pinning", action="store_true",
                    help="only part (f): our 1f1b (no K-FAC, K-FAC appended) with and without --pin-cpus")
    ap.add_argument("--only-optimizers", action="store_true",
                    help="only part (g): each optimizer's work appended and in the bubbles, against AdamW")
    ap.add_argument("--optimizers", nargs="+", choices=OPTIMIZERS, default=OPTIMIZERS, help="(g): only these")
    ap.add_argument("--only-interleaved", action="store_true",
                    help="only part (a-i): (a) and (a0) in one job, variants alternating block by block")
    ap.add_argument("--interleaved-rounds", type=int, default=30, help="(a-i) rounds (a block of every variant each)")
    ap.add_argument("--block", type=int, default=3, help="(a-i) steps per block")
    ap.add_argument("--pipelining-worker", choices=("gpipe", "1f1b", "zbv", "zb1p"), help=argparse.SUPPRESS)
    ap.add_argument("--interleaved-worker", nargs=2, metavar=("GPIPE_PLAN", "1F1B_PLAN"), help=argparse.SUPPRESS)
    ap.add_argument("--same-math-worker", metavar="PLAN", help=argparse.SUPPRESS)
    ap.add_argument("--plan", help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.profile = a.profile or f"profiles/bert-mini-cpu{'-optimizers' if a.only_optimizers else ''}.json"
    if a.same_math_worker:
        return same_math_worker(a.same_math_worker, a.steps)
    if a.pipelining_worker:
        return pipelining_worker(a.pipelining_worker, a.plan, a.steps, a.warmup)
    if a.interleaved_worker:
        return interleaved_worker(a.interleaved_worker, a.interleaved_rounds, a.block, a.warmup)

    from rich.console import Console
    console = Console(stderr=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.only_calibration:
        return calibration_tables(a, out, console)
    if a.only_optimizers:
        return optimizer_tables(a, out, console)
    n = ["--micro-batches", str(a.micro_batches)]
    with console.status("planning (CP-SAT for the K-FAC plan)..."):
        specs = {  # name -> (file name, plan flags)
            "gpipe, no K-FAC": ("gpipe-nokfac", "--schedule", "gpipe", *n, "--no-kfac", "--method", "none"),
            "1f1b, no K-FAC": ("1f1b-nokfac", "--schedule", "1f1b", *n, "--no-kfac", "--method", "none"),
            "1f1b, K-FAC appended": ("1f1b-kfac-appended", "--schedule", "1f1b", *n, "--method", "none"),
            "1f1b, K-FAC in bubbles (cpsat)": ("1f1b-kfac-cpsat", "--schedule", "1f1b", *n, "--method", "cpsat",
                                               "--time-limit", str(a.time_limit), "--workers", "2"),
            "zb-h1, no K-FAC": ("zbh1-nokfac", "--schedule", "zb-h1", *n, "--no-kfac", "--method", "none"),
            "zb-v, no K-FAC": ("zbv-nokfac", "--schedule", "zb-v", *n, "--no-kfac", "--method", "none"),
        }
        if a.only_zero_bubble:
            specs = {k: v for k, v in specs.items() if k in ("1f1b, no K-FAC", "zb-h1, no K-FAC", "zb-v, no K-FAC")}
        if a.only_torch or a.only_interleaved:
            specs = {k: v for k, v in specs.items() if k in ("gpipe, no K-FAC", "1f1b, no K-FAC")}
        if a.only_pinning:
            specs = {k: v for k, v in specs.items() if k in ("1f1b, no K-FAC", "1f1b, K-FAC appended")}
        plans = {name: plan(a.profile, out, *spec) for name, spec in specs.items()}
    if a.only_pinning:
        return pinning_table(a, plans, console)
    if not a.only_zero_bubble:
        with console.status(f"(a-i): ours and torch's in one job, {a.interleaved_rounds} rounds of "
                            f"{a.block}-step blocks..."):
            interleaved = torchrun([__file__, "--interleaved-worker", str(plans["gpipe, no K-FAC"]),
                                    str(plans["1f1b, no K-FAC"]), "--interleaved-rounds", str(a.interleaved_rounds),
                                    "--block", str(a.block), "--warmup", str(max(a.warmup, 2))])["times"]
        interleaved_table(interleaved, a)
        if a.only_interleaved:
            return
    warmup, steps = run_length(a, plans)
    runs = {name: (lambda p=p: run_ours(p, steps, warmup)) for name, p in plans.items()}
    if not a.only_zero_bubble:
        runs["torch ScheduleGPipe"] = lambda: run_pipelining("gpipe", plans["gpipe, no K-FAC"], steps, warmup)
        runs["torch Schedule1F1B"] = lambda: run_pipelining("1f1b", plans["1f1b, no K-FAC"], steps, warmup)
        # the same run once more: what ratio two identical runs give here (the noise floor of (a))
        runs[AGAIN] = lambda: run_ours(plans["1f1b, no K-FAC"], steps, warmup)
    if not a.only_torch:
        runs["torch ScheduleInterleavedZeroBubble (ZB-H1)"] = lambda: run_pipelining("zb1p", plans["zb-h1, no K-FAC"], steps, warmup)
        runs["torch ScheduleZBVZeroBubble"] = lambda: run_pipelining("zbv", plans["zb-v, no K-FAC"], steps, warmup)

    launches = alternate(runs, a.rounds, steps, console)
    times = {name: [x.step_ms for x in v] for name, v in launches.items()}
    op_ratio = {name: [x.op_ratio for x in v] for name, v in launches.items()}
    periods = {name: [x.period_ms for x in v] for name, v in launches.items()}
    best = {name: min(v) for name, v in times.items()}
    best_ops = {name: op_ratio[name][times[name].index(best[name])] for name in times}
    med = {name: statistics.median(v) for name, v in times.items()}
    predicted = {name: json.loads(p.read_text())["stats"].get("step_time_ms") for name, p in plans.items()}
    expected = {name: json.loads(p.read_text())["stats"].get("expected_step_time_ms") for name, p in plans.items()}

    print(f"\nbert-mini, 2 ranks x 1 thread (gloo, CPU), {a.micro_batches} micro-batches of "
          f"{json.loads(plans['1f1b, no K-FAC'].read_text())['model']['micro_batch']}, {steps} steps "
          f"({warmup} warm-up), {a.rounds} rounds; load average at the end {os.getloadavg()[0]:.1f}")
    print("best = the least disturbed round (other processes share the 2 cores); ratios of best and of median\n")
    print("| run | best ms/step | median ms/step | ratio (best) | ratio (median) | predicted ms/step "
          "| best / predicted | ops measured / profiled | schedule alone | median / predicted with spread |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")

    def row(name: str, ref: str) -> None:
        pred = predicted.get(name)
        rb = f"{best[name] / best[ref]:.3f}" if name != ref else "1"
        rm = f"{med[name] / med[ref]:.3f}" if name != ref else "1"
        pr = f"{pred:.1f}" if pred else "-"
        mp = f"{best[name] / pred:.3f}" if pred else "-"
        ops = best_ops[name]
        opr = f"{ops:.3f}" if ops else "-"
        alone = f"{best[name] / pred / ops:.3f}" if pred and ops else "-"
        ex = f"{med[name] / expected[name]:.3f} ({expected[name]:.1f})" if expected.get(name) else "-"
        print(f"| {name} | {best[name]:.1f} | {med[name]:.1f} | {rb} | {rm} | {pr} | {mp} | {opr} | {alone} | {ex} |")

    if not a.only_zero_bubble:
        print("| **(a) ours vs torch.distributed.pipelining** (ratio vs the torch row above) | | | | | | | | | |")
        row("torch ScheduleGPipe", "torch ScheduleGPipe")
        row("gpipe, no K-FAC", "torch ScheduleGPipe")
        row("torch Schedule1F1B", "torch Schedule1F1B")
        row("1f1b, no K-FAC", "torch Schedule1F1B")
        print("| **(a0) the noise floor: our 1f1b against itself** (ratio vs our 1f1b) | | | | | | | | | |")
        row(AGAIN, "1f1b, no K-FAC")
    if not a.only_zero_bubble and not a.only_torch:
        print("| **(b) K-FAC placement** (ratio vs no K-FAC) | | | | | | | | | |")
        row("1f1b, no K-FAC", "1f1b, no K-FAC")
        row("1f1b, K-FAC appended", "1f1b, no K-FAC")
        row("1f1b, K-FAC in bubbles (cpsat)", "1f1b, no K-FAC")
    if not a.only_torch:
        print("| **(d) zero bubble, no K-FAC** (ratio vs the torch row above; last: vs our 1f1b) | | | | | | | | | |")
        row("torch ScheduleZBVZeroBubble", "torch ScheduleZBVZeroBubble")
        row("zb-v, no K-FAC", "torch ScheduleZBVZeroBubble")
        row("torch ScheduleInterleavedZeroBubble (ZB-H1)", "torch ScheduleInterleavedZeroBubble (ZB-H1)")
        row("zb-h1, no K-FAC", "torch ScheduleInterleavedZeroBubble (ZB-H1)")
        row("1f1b, no K-FAC", "1f1b, no K-FAC")
        row("zb-h1, no K-FAC", "1f1b, no K-FAC")
        f1b, zbh1 = "1f1b, no K-FAC", "zb-h1, no K-FAC"
        if predicted.get(f1b) and predicted.get(zbh1):  # (d) the bubble the split backward saves, per step
            print(f"\n(d) bubble saved by zb-h1 against 1f1b, ms/step (positive: zb-h1 faster): predicted "
                  f"{predicted[f1b] - predicted[zbh1]:.1f} ({1 - predicted[zbh1] / predicted[f1b]:.1%}); measured best "
                  f"{best[f1b] - best[zbh1]:.1f} ({1 - best[zbh1] / best[f1b]:.1%}), median {med[f1b] - med[zbh1]:.1f} "
                  f"({1 - med[zbh1] / med[f1b]:.1%})")
    if not a.only_zero_bubble:  # the same comparison made round by round (both ran back to back in each)
        for ours, ref in A_PAIRS:
            p = Paired.of(times[ours], times[ref])  # a pair of launches lies ~20 s apart
            print(f"(a) {ours} / {ref}, round by round: {', '.join(f'{x:.3f}' for x in p.per)}; "
                  f"median {p.median:.3f}, mean {p.mean_se}")
        period_table(periods)
    ks = {name: json.loads(p.read_text())["config"]["refresh_steps"] for name, p in plans.items()}
    print(f"\n(c) best / predicted. 'ops measured / profiled' = the compute ops' own measured duration over "
          "the profile's (the machine's load and the profile's accuracy); 'schedule alone' = (c) divided by it. "
          f"Refresh cycles k: {json.dumps(ks)}")
    print("Raw ms/step per round:", json.dumps({k: [round(x, 1) for x in v] for k, v in times.items()}))


def period_table(periods: dict[str, list[float | None]]) -> None:
    """(a) in the second definition: the same launches' steady step period (both sides'
    Summary.period_ms), which leaves out how far the ranks' first starts and last ends lie
    apart. ms/step above is the runtime's summary line (Summary.step_ms)."""
    if any(None in periods.get(n, [None]) for pair in A_PAIRS for n in pair):
        return
    print("\n(a) the same launches by their steady step period (each rank's start of its first timed step "
          "to the start of its last; runtime.observe.measure.Summary.period_ms):")
    print("| run | best period ms | median period ms | ratio (best) | ratio (median) | per-round ratio: "
          "mean ± standard error |")
    print("|---|---:|---:|---:|---:|---:|")
    for ours, ref in A_PAIRS:
        a, b = periods[ours], periods[ref]
        p = Paired.of(a, b)
        print(f"| {ours} (vs {ref}) | {min(a):.1f} | {statistics.median(a):.1f} | {min(a) / min(b):.3f} | "
              f"{statistics.median(a) / statistics.median(b):.3f} | {p.mean_se} |")


def pinning_table(a, plans: dict[str, Path], console) -> None:
    """(f): each plan with and without --pin-cpus, in alternating launches (the order reversed
    every round), and the ratio pinned / unpinned of each round's pair."""
    warmup, steps = run_length(a, plans)
    runs = {}
    for name, p in plans.items():
        runs[name] = lambda p=p: run_ours(p, steps, warmup, "--no-pin-cpus")
        runs[f"{name}, pinned"] = lambda p=p: run_ours(p, steps, warmup, "--pin-cpus")  # the default on a cpu
    times = {name: [x.step_ms for x in v] for name, v in alternate(runs, a.rounds, steps, console).items()}
    print(f"\n(f) --pin-cpus, bert-mini, 2 ranks x 1 thread (gloo, CPU), {a.micro_batches} micro-batches, {steps} "
          f"steps ({warmup} warm-up), {a.rounds} rounds of alternating launches; load average at the end "
          f"{os.getloadavg()[0]:.1f}")
    print("| run | best ms/step | median ms/step | pinned / unpinned: best | median | per-round ratio: median "
          "| min–max | mean ± standard error |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in plans:
        for variant in (name, f"{name}, pinned"):
            v = times[variant]
            if variant == name:
                print(f"| {variant} | {min(v):.1f} | {statistics.median(v):.1f} | | | | | |")
                continue
            print(f"| {variant} | {min(v):.1f} | {statistics.median(v):.1f} | {min(v) / min(times[name]):.3f} | "
                  f"{statistics.median(v) / statistics.median(times[name]):.3f} | {Paired.of(v, times[name]).cells()} |")
    print("Raw ms/step per round:", json.dumps({k: [round(x, 1) for x in v] for k, v in times.items()}))


def interleaved_table(times: dict[str, list[float]], a) -> None:
    """(a-i): best and median block, their ratios, and the median of the per-round ratios."""
    print(f"\n(a-i) bert-mini, 2 ranks x 1 thread (gloo, CPU), {a.micro_batches} micro-batches: every variant in "
          f"one torchrun job, {a.interleaved_rounds} rounds of one {a.block}-step block each, the order rotated "
          f"every round; load average at the end {os.getloadavg()[0]:.1f}")
    print("| run | best ms/step | median ms/step | ratio (best) | ratio (median) | per-round ratio: median "
          "| per-round ratio: min–max | per-round ratio: mean ± standard error |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    best = {n: min(v) for n, v in times.items()}
    med = {n: statistics.median(v) for n, v in times.items()}
    for name, ref in (("torch ScheduleGPipe", None), ("gpipe, no K-FAC", "torch ScheduleGPipe"),
                      ("torch Schedule1F1B", None), ("1f1b, no K-FAC", "torch Schedule1F1B"),
                      (AGAIN, "1f1b, no K-FAC")):
        if ref is None:
            print(f"| {name} | {best[name]:.1f} | {med[name]:.1f} | 1 | 1 | | | |")
            continue
        # each round's pair of blocks ran seconds apart: their ratio is free of the VM's drift
        print(f"| {name} (vs {ref}) | {best[name]:.1f} | {med[name]:.1f} | {best[name] / best[ref]:.3f} | "
              f"{med[name] / med[ref]:.3f} | {Paired.of(times[name], times[ref]).cells()} |")
    print("Raw ms/step per block:", json.dumps({k: [round(x, 1) for x in v] for k, v in times.items()}))



def optimizer_tables(a, out: Path, console) -> None:
    """(g): every optimizer's 1F1B plan with its work appended and in the bubbles, and AdamW's,
    run in alternating rounds; measured against predicted, and the saving of the bubbles over
    appending, measured against planned."""
    n = ["--schedule", "1f1b", "--micro-batches", str(a.micro_batches)]
    with console.status("planning (CP-SAT for the plans with the work in the bubbles)..."):
        specs = {"adamw (no extra work)": ("adamw", *n, "--optimizer", "adamw", "--method", "none")}
        for o in a.optimizers:
            specs[f"{o} appended"] = (f"{o}-appended", *n, "--optimizer", o, "--method", "none")
            specs[f"{o} in bubbles"] = (f"{o}-cpsat", *n, "--optimizer", o, "--method", "cpsat",
                                        "--time-limit", str(a.time_limit), "--workers", "2")
        plans = {name: plan(a.profile, out, *spec) for name, spec in specs.items()}
    warmup, steps = run_length(a, plans)
    # Muon's Newton-Schulz iteration in the profile's dtype (torch's bfloat16 is a GPU choice:
    # on a CPU float32 is several times faster; `pfcompile profile --muon-ns-dtype`)
    ns = json.loads(Path(a.profile).read_text())["provenance"].get("muon_ns_dtype", "bfloat16")
    flags = {name: ("--set", f"muon.ns_dtype={ns}") if name.startswith("muon") else () for name in plans}
    launches = alternate({name: (lambda p=p, f=flags[name]: run_ours(p, steps, warmup, *f)) for name, p in plans.items()},
                         a.rounds, steps, console)
    times = {name: [x.step_ms for x in v] for name, v in launches.items()}
    med = {name: statistics.median(v) for name, v in times.items()}
    stats = {name: json.loads(p.read_text())["stats"] for name, p in plans.items()}
    pred = {name: st["step_time_ms"] for name, st in stats.items()}
    base = "adamw (no extra work)"
    print(f"\n(g) bert-mini, 1F1B, 2 ranks x 1 thread (gloo, CPU), {a.micro_batches} micro-batches, {steps} steps "
          f"({warmup} warm-up), {a.rounds} rounds; load average at the end {os.getloadavg()[0]:.1f}\n")
    print("| run | k | measured ms/step (median) | min–max | predicted ms/step | measured / predicted "
          "| overhead vs AdamW, measured | planned |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in plans:
        k = json.loads(plans[name].read_text())["config"]["refresh_steps"]
        print(f"| {name} | {k} | {med[name]:.1f} | {min(times[name]):.1f}–{max(times[name]):.1f} | {pred[name]:.1f} | "
              f"{med[name] / pred[name]:.3f} | {med[name] / med[base] - 1:+.1%} | {pred[name] / pred[base] - 1:+.1%} |")
    print("\n| optimizer | saving of the bubbles over appending, measured | planned | measured ≥ planned − 2%? |")
    print("|---|---:|---:|---|")
    for o in a.optimizers:
        ap_, bu = f"{o} appended", f"{o} in bubbles"
        measured = 1 - med[bu] / med[ap_]
        planned = 1 - pred[bu] / pred[ap_]
        paired = Paired.of(times[bu], times[ap_])
        print(f"| {o} | {measured:.1%} (round by round {1 - paired.median:.1%}) | {planned:.1%} | "
              f"{'yes' if measured >= planned - 0.02 else 'no'} |")
    print("\nRaw ms/step per round:", json.dumps({k: [round(x, 1) for x in v] for k, v in times.items()}))


if __name__ == "__main__":
    main()
