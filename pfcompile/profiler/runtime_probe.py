"""The runtime probe: short runs of the runtime itself, fitted as `pfcompile calibrate` fits
a trace. A 2-stage 1F1B plan without optimizer work gives the runtime's overheads around the
ops, the p2p link as a run sees it and the parts' in-run times; a plan per profiled
optimizer, its work appended to the steps that refresh, gives its per-layer ops' in-run
times (and, for K-FAC, which refreshes every other step there, what its capture adds to the
pipeline's ops). Each optimizer's plan runs in one launch with the base plan, in
alternating blocks (probe_launch), so that both see the same spells of the machine. An op timed alone in a loop (`--cold-cache` or not) is not an op in a run:
its caches hold what the ops before it left, the neighbouring rank shares the core's memory
bandwidth, and now and then it is stalled. The profile's entries are the run's
(`in_run_levels`); what each was timed at alone stays in the provenance as the factor
between the two."""

from __future__ import annotations

import math
import os

import torch

from pfcompile.formats.dataflow import captures
from pfcompile.formats.optimizers import optimizer as optimizer_spec
from pfcompile.formats.profile import BusySpread, LinkModel, Profile, RuntimeOverheads
from runtime import launch

# The overheads' and parts' run: at least PROBE_STEPS (each stage's fwd and bwd ~90
# samples), raised to PROBE_SECONDS of predicted run: a shared host's slow spells last a
# second or more and come in runs of them, so the profile's level (the runs' mean) is only
# as steady as the seconds it spans. Each optimizer's run likewise, to
# OPTIMIZER_PROBE_SECONDS; PROBE_MAX_STEPS bounds a model with millisecond steps.
PROBE_STEPS = 24
PROBE_WARMUP = 2  # untraced steps at the start of every probe run
PROBE_SECONDS = 8.0
OPTIMIZER_PROBE_SECONDS = 4.0
PROBE_MAX_STEPS = 400
# The probe's schedule: 1F1B, the family most plans run. Its steady state keeps both ranks
# computing while messages cross, as a plan with work in its bubbles does; GPipe's
# all-forwards-then-all-backwards leaves one rank idle at each turn, and its runs posted
# sends and completed receives at half the cost that runs of the plans later met.
PROBE_SCHEDULE = "1f1b"
OPTIMIZER_PROBE_STEPS = 12  # one per optimizer: every covered layer's ops ~10 samples
# An optimizer that captures (its micro-batch ops keep a pass: K-FAC) refreshes every other
# step of its probe, so one run has the pipeline's ops with and without capture, side by
# side (what capture adds, free of the machine's drift between runs); its refresh ops get
# half the samples, so its run is longer.
CAPTURE_PROBE_CYCLE = 2
CAPTURE_PROBE_STEPS = 20
# Each optimizer's probe plan runs in one launch with the base plan, their steps in
# alternating blocks of about PROBE_BLOCK_SECONDS (runtime.interleave): shorter than the
# machine's spells, so both plans see the same ones. Each plan of a launch runs
# OPTIMIZER_PROBE_SECONDS, or more where there are few launches, so that the base plan's
# blocks of all launches together run PROBE_SECONDS at least.
PROBE_BLOCK_SECONDS = 1.0
# The busy probe (runtime.busy): the base run's pipeline with this optimizer's work in its
# bubbles, as long as the base run. Where the ranks fill the host's cores, a plan whose
# bubbles hold work stalls more than the base run's.
BUSY_OPTIMIZER = "kfac"


def probe_steps(plan) -> int:
    """The steps of a probe run of `plan` in a launch of its own (the busy probe, the
    fallback base run): enough to fill PROBE_SECONDS at the plan's predicted step time,
    within [PROBE_STEPS, PROBE_MAX_STEPS]."""
    step_ms = plan.stats.get("step_time_ms") or 0.0
    return max(PROBE_STEPS, min(PROBE_MAX_STEPS, math.ceil(PROBE_SECONDS * 1e3 / step_ms))) if step_ms > 0 else PROBE_STEPS


def probe_plan(profile: Profile, optimizer: str = "adamw"):
    """The probe's plan: 2 stages of PROBE_SCHEDULE, 4 micro-batches, `optimizer`'s work
    appended to the step that refreshes (`--method none`): every step, or every
    CAPTURE_PROBE_CYCLE-th for an optimizer that captures."""
    from dataclasses import replace

    from pfcompile.graph.schedules import PipelineConfig
    from pfcompile.place import assemble
    from pfcompile.place.build import build_plan
    from pfcompile.place.options import PlanOptions

    cfg = PipelineConfig(PROBE_SCHEDULE, stages=2, micro_batches=4, optimizer=optimizer)
    if not captures(cfg.optimizer_spec):
        return build_plan(profile, cfg, PlanOptions("none"))[0]
    return assemble.appended_plan(profile, replace(cfg, refresh_steps=CAPTURE_PROBE_CYCLE))[0]


def probe_trace(profile: Profile, device: torch.device, optimizer: str = "adamw", steps: int | None = None,
                sets: tuple[str, ...] = (), plan=None, warmup: int = PROBE_WARMUP):
    """A traced run of the runtime: `plan` (None: the probe's plan, probe_plan) of the
    profiled model, `steps` steps (None: probe_steps), `warmup` of them untraced, on 2 ranks,
    one thread each, synthetic tokens. -> (MeasuredTrace, None) or (None, the run's one-line
    error)."""
    import subprocess

    from pfcompile.calibrate.measured import load_measured

    with launch.launch_env() as env:
        tmp = env["TMPDIR"]  # the launch's own folder holds the probe's plan and trace too
        plan = plan or probe_plan(profile, optimizer)
        steps = steps or probe_steps(plan)
        plan_path, trace_path = os.path.join(tmp, "probe.plan.json"), os.path.join(tmp, "probe.trace.json")
        plan.save(plan_path)
        cmd = launch.torchrun(2, "-m", "runtime", plan_path, "--steps", str(steps), "--warmup", str(warmup),
                              "--data", "synthetic", "--trace", trace_path, *run_args(profile, device, sets))
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        if r.returncode or not os.path.exists(trace_path):
            return None, launch_error(r)
        return load_measured(trace_path), None


def run_args(profile: Profile, device: torch.device, sets: tuple[str, ...] = ()) -> list[str]:
    """A probe run's flags beyond its plan and steps: the device, `sets` (--set), and a user's
    model code (hf:PATH is a config; user code is imported only when told to)."""
    name = profile.model.get("name", "")
    code = ["--model-code", name] if ":" in name and not name.startswith("hf:") else []
    return ["--device", device.type, *[x for s in sets for x in ("--set", s)], *code]


def launch_error(r) -> str:
    """A failed probe launch's one line: the runtime's own error, not torchrun's banner after it."""
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    tail = [ln for ln in lines if "error:" in ln][-1:] or lines[-1:] or ["no output"]
    return tail[0][:200]


def launch_shape(plans: list, least: int, seconds: float) -> tuple[int, int]:
    """(blocks, timed steps per block) of a launch of `plans` (runtime.interleave): blocks of
    whole refresh cycles of every plan, about PROBE_BLOCK_SECONDS of the slowest plan's
    predicted step, enough of them for `seconds` of it and at least `least` timed steps,
    at most PROBE_MAX_STEPS; one more block, the warm-up."""
    k = math.lcm(*(p.config.refresh_steps for p in plans))
    step_ms = max(p.stats.get("step_time_ms") or 0.0 for p in plans)
    per_block = max(1, round(PROBE_BLOCK_SECONDS * 1e3 / step_ms / k)) if step_ms > 0 else 1
    timed = k * per_block
    want = max(least, min(PROBE_MAX_STEPS, math.ceil(seconds * 1e3 / step_ms))) if step_ms > 0 else least
    return 1 + math.ceil(want / timed), timed


def probe_launch(profile: Profile, device: torch.device, optimizer: str, launches: int = 1,
                 sets: tuple[str, ...] = ()):
    """One launch of the base probe plan and `optimizer`'s (probe_plan), their steps in
    alternating blocks (runtime.interleave; launch_shape), on 2 ranks, one thread each,
    synthetic tokens; `sets` are the optimizer's run settings. `launches`: how many such
    launches the profile makes (the base plan's blocks of all of them make its run).
    -> (the base plan's block traces, the optimizer's, None) or ([], [], the launch's one-line error)."""
    import glob
    import subprocess

    from pfcompile.calibrate.measured import load_measured

    plans = [probe_plan(profile), probe_plan(profile, optimizer)]
    least = max(math.ceil(PROBE_STEPS / launches),
                CAPTURE_PROBE_STEPS if captures(optimizer_spec(optimizer)) else OPTIMIZER_PROBE_STEPS)
    blocks, timed = launch_shape(plans, least, max(OPTIMIZER_PROBE_SECONDS, PROBE_SECONDS / launches))
    with launch.launch_env() as env:
        tmp = env["TMPDIR"]  # the launch's own folder holds the plans and traces too
        paths = [os.path.join(tmp, f"probe-{name}.plan.json") for name in ("adamw", optimizer)]
        for plan, path in zip(plans, paths):
            plan.save(path)
        cmd = launch.torchrun(2, "-m", "runtime.interleave", *paths, "--blocks", str(blocks), "--timed", str(timed),
                              "--labels", "base,own", "--set-for", "1", "--trace-prefix", os.path.join(tmp, "block"),
                              "--log-dir", tmp, *run_args(profile, device, sets))
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        found = {label: sorted(glob.glob(os.path.join(tmp, f"block-block*-{label}-*.trace.json")))
                 for label in ("base", "own")}
        if r.returncode or not all(found.values()):
            return [], [], launch_error(r)
        return [load_measured(t) for t in found["base"]], [load_measured(t) for t in found["own"]], None


def probe_in_runs(profile: Profile, device: torch.device, optimizers, muon_ns_dtype: str, notes: dict,
                  progress=lambda description: None) -> tuple[RuntimeOverheads, LinkModel | None, list, dict]:
    """The runtime probe's runs: one launch per optimizer (K-FAC first; probe_launch), each
    alternating the base probe plan with the optimizer's. The base plan's blocks of all the
    launches give the runtime's overheads and link (fit_base) and the parts' in-run times;
    each optimizer's blocks, with its launch's base blocks, its own (in_run_levels). Where
    no launch works, the base plan runs alone (measure_runtime). Writes the provenance's
    notes into `notes`. -> (overheads, link or None, the base plan's traces ([] where every
    run failed), {optimizer: (its launch's base traces, its traces)})."""
    names = list(dict.fromkeys(("kfac", *optimizers)))
    base_traces: list = []
    runs: dict = {}
    for name in names:
        progress(f"the runtime itself: the base plan and {name}'s, in alternating blocks (2 ranks)")
        sets = (f"muon.ns_dtype={muon_ns_dtype}",) if name == "muon" else ()
        base, own, error = probe_launch(profile, device, name, len(names), sets)
        if error:
            notes[f"in_run_note.{name}"] = f"probe run failed ({error}): its entries are timed alone"
            continue
        base_traces += base
        runs[name] = (base, own)
    if not base_traces:
        progress("the runtime itself (2 ranks, a short 1F1B run)")
        overheads, link, note, trace = measure_runtime(profile, device)
        notes.update(note)
        return overheads, link, [trace] if trace is not None else [], {}
    overheads, link = fit_base(profile, base_traces)
    steps = lambda traces: sum(len({o.step for o in t.ops}) for t in traces)  # noqa: E731
    ran = ", ".join(f"{name} {steps(own)} steps in {len(own)} blocks" for name, (_, own) in runs.items())
    notes["runtime_note"] = (
        f"runtime overheads measured by running the runtime: 2-stage {PROBE_SCHEDULE} without optimizer work "
        f"(the base plan), 4 micro-batches, 2 ranks, 1 thread each, the runtime's default --recv-ahead, in "
        f"{len(runs)} launch(es) that each alternate it with one optimizer's plan in blocks of whole refresh "
        f"cycles (runtime.interleave; the first block of each plan and each block's first step untraced): "
        f"the base plan {steps(base_traces)} steps in {len(base_traces)} blocks, {ran}; each optimizer's work "
        f"appended to its refresh steps (K-FAC refreshes every other step, its capture_ms is its refresh steps' "
        f"ops over its others'); fitted like pfcompile calibrate (mean occupancy); the parts' entries are the "
        f"base plan's (in proportion within a stage), each optimizer's its own blocks' put at the base plan's "
        f"level by its launch's base blocks (in_run_level.launch); in_run_level.beside holds each optimizer's "
        f"passes over its launch's base passes; in_run holds each entry's in-run time over its time alone")
    return overheads, link, base_traces, runs


def fit_base(profile: Profile, traces: list) -> tuple[RuntimeOverheads, LinkModel | None]:
    """The runtime's overheads and the p2p link as the base probe plan's traces show them,
    fitted as `pfcompile calibrate` fits (mean occupancy): see measure_runtime."""
    from pfcompile.calibrate.fit import fit_runtime

    fit = fit_runtime(traces, profile, "mean")  # sums of op times add means
    return fit.overheads, (fit.link if fit.link is not profile.comm.p2p else None)


def measure_runtime(profile: Profile, device: torch.device,
                    steps: int | None = None) -> tuple[RuntimeOverheads, LinkModel | None, dict, object]:
    """The runtime's own costs around the ops, measured by running it: a 2-stage 1F1B plan of
    the profiled model without K-FAC, `steps` steps (None: probe_steps) on 2 ranks
    (torchrun, one thread each, synthetic tokens), in a launch of its own (the profiler's
    fallback where no launch of probe_launch worked), fitted by fit_base: the dispatch gap
    per op, the work between steps, a send's posting, a receive's completion, and the op
    times' spread (runtime.op_spread, and each rank's level from step to step,
    runtime.level_spread: 24 steps or more give each stage's fwd and bwd ~90 samples or
    more, and 48 rank-steps), and the p2p link as the run sees it: the latency of its
    receives posted before their send ended, at the benchmark's bandwidth (None when none
    was). Kept only where the run worked; otherwise the message benchmark's link and
    send/receive times stand (said in the provenance). Also returns the trace (None when the
    run failed)."""
    trace, error = probe_trace(profile, device, steps=steps)
    if trace is None:
        return RuntimeOverheads(), None, {"runtime_note": f"runtime probe failed ({error}); overheads "
                                                          f"from the message benchmark only"}, None
    overheads, link = fit_base(profile, [trace])
    return overheads, link, {"runtime_note": f"runtime overheads measured by running the runtime: 2-stage {PROBE_SCHEDULE} without "
                                             f"K-FAC, 4 micro-batches, {trace.meta.get('steps', steps)} steps (2 warm-up), 2 ranks, 1 thread each, the "
                                             f"runtime's default --recv-ahead; "
                                             f"fitted like pfcompile calibrate (mean occupancy)"}, trace


def busy_plan(profile: Profile):
    """The busy probe's plan: the probe's pipeline (2 stages of PROBE_SCHEDULE, 4
    micro-batches) with K-FAC's work placed in its bubbles by PipeFisher's first fit."""
    from pfcompile.graph.schedules import PipelineConfig
    from pfcompile.place.build import build_plan
    from pfcompile.place.options import PlanOptions

    return build_plan(profile, PipelineConfig(PROBE_SCHEDULE, stages=2, micro_batches=4, optimizer=BUSY_OPTIMIZER),
                      PlanOptions("greedy"))[0]


def measure_busy(profile: Profile, device: torch.device, base_traces: list, runtime: RuntimeOverheads,
                 link: LinkModel | None = None, steps: int | None = None) -> tuple[BusySpread | None, str]:
    """runtime.busy (formats.profile): a run of busy_plan as long as the base probe's,
    fitted as the base run is (fit_runtime, through calibrate). Its work between steps is taken as measured: it
    is mostly the runtime's Python and its waits, not compute that moves with the passes'
    level (recorded in the note). The plan is built, and both plans' utilizations replayed,
    with `profile`, its `runtime` and the p2p `link` it will have, as a plan of it is.
    -> (the busy spread, or None where the run failed or its plan is no busier; a note for
    the provenance)."""
    import copy
    import dataclasses

    from pfcompile.calibrate.fit import calibrate
    from pfcompile.check.replay import replay

    costed = copy.copy(profile)  # as the profile will be: what a plan of it is built and costed with
    costed.runtime = runtime
    if link is not None:
        costed.comm = dataclasses.replace(profile.comm, p2p=link)
    plan = busy_plan(costed)
    # its first refresh cycle untraced: until step k no inverse is in force, and a precond
    # without one only copies the gradient (a short run's spread would be two-humped)
    warmup = max(PROBE_WARMUP, plan.config.refresh_steps)
    trace, error = probe_trace(costed, device, BUSY_OPTIMIZER,
                               steps=(steps or probe_steps(plan)) + warmup - PROBE_WARMUP,
                               plan=plan, warmup=warmup)
    if trace is None:
        return None, f"busy probe failed ({error}): every plan varies as the base run did"
    # one fit per run (fit_runtime's, inside calibrate): the busy run's overheads and both passes
    base_fit, busy_fit = (calibrate(costed, t)[0] for t in (base_traces, [trace]))
    passes = [sum(f.fwd_ms + f.bwd_ms for f in fit.parts) for fit in (base_fit, busy_fit)]
    level = passes[1] / passes[0] if all(x > 0 for x in passes) else 1.0
    u = [replay(x, costed, check_memory=False).utilization for x in (probe_plan(costed), plan)]
    if u[1] <= u[0]:
        return None, f"busy probe's plan no busier than the base run's ({u[1]:.3f} against {u[0]:.3f}): not used"
    rt = busy_fit.runtime
    busy = BusySpread(utilization=[round(x, 6) for x in u], step_ms=rt.step_ms, op_spread=rt.op_spread,
                      level_spread=rt.level_spread)
    return busy, (f"runtime.busy from a {PROBE_SCHEDULE} run with {BUSY_OPTIMIZER} in its bubbles (greedy, "
                  f"k = {plan.config.refresh_steps}, {trace.meta.get('steps')} steps, the first {warmup} untraced, "
                  f"utilization {u[1]:.3f} against the base run's {u[0]:.3f}); its passes at {level:.3f} of the base "
                  f"run's")


def in_run_levels(profile: Profile, base_traces: list, runs: dict) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """Set `profile`'s entries (in place) to their in-run times: the parts' fwd, bwd and
    AdamW step from `base_traces` (the probe's plan without optimizer work, every block of
    every launch), each optimizer's per-layer entries and its step from its own probe plan's
    blocks (`runs`: name -> (the base plan's traces of its launch, its own traces)), each
    fitted as `pfcompile calibrate` fits it (mean occupancy; parts in proportion within
    their stage); what a capturing optimizer's refresh step adds to the parts' ops
    (capture_ms) from its refresh steps against its others. A split backward's B and W,
    which no probe runs, move with their part's backward, and share its capture in
    proportion.

    This machine's speed moves by more than an optimizer's overhead within seconds. Each
    optimizer's blocks alternate with the base plan's in one launch (probe_launch), so its
    launch's base blocks saw the same spells: its entries are put at the level of all the
    base blocks by that launch's base passes over all of them (`launch`). Its own passes over
    its launch's base passes (`beside`) are the work's effect on the passes, free of that
    drift: recorded, not applied (capture_ms is the part of it the plan counts).
    -> (entry path -> in-run time / time alone, {"launch": optimizer -> its launch's level,
    "beside": optimizer -> its passes over its launch's base passes})."""
    import copy

    from pfcompile.calibrate.fit import calibrate

    ref = copy.deepcopy(profile)  # what the probes' plans were made from: every fit is against it
    factors: dict[str, float] = {}

    def put(path: str, old: float, new: float) -> float:
        if old > 0:
            factors[path] = new / old
        return new

    def passes(traces) -> float:
        return sum(f.fwd_ms + f.bwd_ms for f in calibrate(ref, traces)[0].parts)

    fitted, _ = calibrate(ref, base_traces)
    overall = sum(f.fwd_ms + f.bwd_ms for f in fitted.parts)
    levels: dict[str, dict[str, float]] = {"launch": {}, "beside": {}}
    fits = {}
    for name, (its_base, its_own) in runs.items():
        fits[name] = calibrate(ref, its_own)
        base_passes = passes(its_base)
        own = sum(f.fwd_ms + f.bwd_ms for f in fits[name][0].parts)
        levels["launch"][name] = base_passes / overall if base_passes > 0 and overall > 0 else 1.0
        levels["beside"][name] = own / base_passes if own > 0 and base_passes > 0 else 1.0
    for p, f in zip(profile.parts, fitted.parts):
        b = f.bwd_ms / p.bwd_ms if p.bwd_ms > 0 else 1.0
        p.fwd_ms = put(f"parts.{p.name}.fwd_ms", p.fwd_ms, f.fwd_ms)
        p.bwd_ms = put(f"parts.{p.name}.bwd_ms", p.bwd_ms, f.bwd_ms)
        if p.bwd_input_ms is not None and p.bwd_weight_ms is not None:
            p.bwd_input_ms = put(f"parts.{p.name}.bwd_input_ms", p.bwd_input_ms, p.bwd_input_ms * b)
            p.bwd_weight_ms = put(f"parts.{p.name}.bwd_weight_ms", p.bwd_weight_ms, p.bwd_weight_ms * b)
        if "adamw" in f.step_ms and "adamw" in p.step_ms:
            p.step_ms["adamw"] = put(f"parts.{p.name}.step_ms.adamw", p.step_ms["adamw"], f.step_ms["adamw"])
    for name, (fitted, counts) in fits.items():
        level = levels["launch"][name]  # its launch's speed over all the base blocks
        for layer, f in zip(profile.covered_layers, fitted.covered_layers):
            mine, theirs = layer.optimizer_ms.get(name, {}), f.optimizer_ms.get(name, {})
            for key in mine:
                if key in theirs and theirs[key] != mine[key]:  # fitted (an entry the run has no op of keeps its value)
                    mine[key] = put(f"covered_layers.{layer.name}.optimizer_ms.{name}.{key}", mine[key],
                                    theirs[key] / level)
        if "step" in counts:
            for p, f in zip(profile.parts, fitted.parts):
                if name in f.step_ms and name in p.step_ms:
                    p.step_ms[name] = put(f"parts.{p.name}.step_ms.{name}", p.step_ms[name], f.step_ms[name] / level)
        if "capture" in counts:  # its refresh steps against its others, in the one run
            for p, f in zip(profile.parts, fitted.parts):
                mine, theirs = dict(p.capture_ms or {}), f.capture_ms or {}
                for kind in ("fwd", "bwd"):  # the probe's 1F1B has no B or W: they share bwd's
                    if kind in theirs and theirs[kind] != mine.get(kind):
                        mine[kind] = put(f"parts.{p.name}.capture_ms.{kind}", mine.get(kind, 0.0), theirs[kind] / level)
                b, w = p.split_backward_ms()
                if "bwd" in mine and b + w > 0:
                    for kind, share in (("bwd_input", b), ("bwd_weight", w)):
                        mine[kind] = put(f"parts.{p.name}.capture_ms.{kind}", mine.get(kind, 0.0),
                                         mine["bwd"] * share / (b + w))
                p.capture_ms = mine
    return factors, levels
