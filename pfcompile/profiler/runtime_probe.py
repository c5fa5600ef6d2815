"""The runtime probe: short runs of the runtime itself, fitted as `pfcompile calibrate` fits
a trace. A 2-stage 1F1B run without optimizer work gives the runtime's overheads around the
ops, the p2p link as a run sees it and the parts' in-run times; one more run per profiled
optimizer, its work appended to the steps that refresh, gives its per-layer ops' in-run
times (and, for K-FAC, which refreshes every other step there, what its capture adds to the
pipeline's ops). An op timed alone in a loop (`--cold-cache` or not) is not an op in a run:
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
# The busy probe (runtime.busy): the base run's pipeline with this optimizer's work in its
# bubbles, as long as the base run. Where the ranks fill the host's cores, a plan whose
# bubbles hold work stalls more than the base run's.
BUSY_OPTIMIZER = "kfac"


def probe_steps(plan, optimizer: str = "adamw") -> int:
    """The steps of a probe's run of `plan`: enough to fill its seconds (PROBE_SECONDS, or
    OPTIMIZER_PROBE_SECONDS with an optimizer's work) at the plan's predicted step time,
    within [the least for its samples, PROBE_MAX_STEPS]."""
    if optimizer == "adamw":
        least, seconds = PROBE_STEPS, PROBE_SECONDS
    else:
        least = CAPTURE_PROBE_STEPS if captures(optimizer_spec(optimizer)) else OPTIMIZER_PROBE_STEPS
        seconds = OPTIMIZER_PROBE_SECONDS
    step_ms = plan.stats.get("step_time_ms") or 0.0
    return max(least, min(PROBE_MAX_STEPS, math.ceil(seconds * 1e3 / step_ms))) if step_ms > 0 else least


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
        steps = steps or probe_steps(plan, optimizer)
        plan_path, trace_path = os.path.join(tmp, "probe.plan.json"), os.path.join(tmp, "probe.trace.json")
        plan.save(plan_path)
        cmd = launch.torchrun(2, "-m", "runtime", plan_path, "--steps", str(steps), "--warmup", str(warmup),
                              "--data", "synthetic", "--trace", trace_path, "--device", device.type)
        for s in sets:
            cmd += ["--set", s]
        name = profile.model.get("name", "")
        if ":" in name and not name.startswith("hf:"):  # user code (hf:PATH is a config): imported only when told to
            cmd += ["--model-code", name]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        if r.returncode or not os.path.exists(trace_path):
            lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
            # the runtime's own one-line error, not torchrun's banner after it
            tail = [ln for ln in lines if "error:" in ln][-1:] or lines[-1:] or ["no output"]
            return None, tail[0][:200]
        return load_measured(trace_path), None


def measure_runtime(profile: Profile, device: torch.device,
                    steps: int | None = None) -> tuple[RuntimeOverheads, LinkModel | None, dict, object]:
    """The runtime's own costs around the ops, measured by running it: a 2-stage 1F1B plan of
    the profiled model without K-FAC, `steps` steps (None: probe_steps) on 2 ranks
    (torchrun, one thread each, synthetic tokens), its measured trace fitted as `pfcompile
    calibrate` fits one (pfcompile.calibrate.fit): the dispatch gap per op, the work between
    steps, a send's posting, a receive's completion, and the op times' spread
    (runtime.op_spread, and each rank's level from step to step, runtime.level_spread: 24
    steps or more give each stage's fwd and bwd ~90 samples or more, and 48 rank-steps),
    and the p2p link as the run sees it: the latency of its receives posted before their
    send ended, at the benchmark's bandwidth (None when none was). Kept only where the run
    worked; otherwise the message benchmark's link and send/receive times stand (said in
    the provenance). Also returns the trace (None when the run failed), for in_run_levels."""
    from pfcompile.calibrate.fit import fit_runtime

    trace, error = probe_trace(profile, device, steps=steps)
    if trace is None:
        return RuntimeOverheads(), None, {"runtime_note": f"runtime probe failed ({error}); overheads "
                                                          f"from the message benchmark only"}, None
    fit = fit_runtime([trace], profile, "mean")  # sums of op times add means
    link = fit.link if fit.link is not profile.comm.p2p else None
    return fit.overheads, link, {"runtime_note": f"runtime overheads measured by running the runtime: 2-stage {PROBE_SCHEDULE} without "
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


def measure_busy(profile: Profile, device: torch.device, base_trace, runtime: RuntimeOverheads,
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
    base_fit, busy_fit = (calibrate(costed, [t])[0] for t in (base_trace, trace))
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


def in_run_levels(profile: Profile, base_trace, optimizer_traces: dict) -> tuple[dict[str, float], dict[str, float]]:
    """Set `profile`'s entries (in place) to their in-run times: the parts' fwd, bwd and
    AdamW step from `base_trace` (the probe's run without optimizer work), each optimizer's
    per-layer entries and its step from its own probe run (`optimizer_traces`: name ->
    trace), each fitted as `pfcompile calibrate` fits it (mean occupancy; parts in
    proportion within their stage); what a capturing optimizer's refresh step adds to the
    parts' ops (capture_ms) from its run's refresh steps against its others. A split
    backward's B and W, which no probe runs, move with their part's backward, and share its
    capture in proportion.

    This machine's speed moves by more than an optimizer's overhead within seconds, and
    every run has the passes: each run's level is its passes' time over the base run's
    (`levels`; the optimizer's work over the passes of its own run holds within a few percent
    from run to run while both move together). Every entry is put at the runs' common level,
    their levels' mean weighted by their steps: one run's window of the machine is one draw
    of its speed, and the runs together sample more of it than the base run alone.
    -> (entry path -> in-run time / time alone, optimizer -> its run's level against the
    base run; "common" -> the common level)."""
    import copy

    from pfcompile.calibrate.fit import calibrate

    ref = copy.deepcopy(profile)  # what the probes' plans were made from: every fit is against it
    factors: dict[str, float] = {}

    def put(path: str, old: float, new: float) -> float:
        if old > 0:
            factors[path] = new / old
        return new

    def steps(trace) -> int:
        return len({o.step for o in trace.ops})

    fitted, _ = calibrate(ref, [base_trace])
    passes = sum(f.fwd_ms + f.bwd_ms for f in fitted.parts)
    runs = {name: calibrate(ref, [trace]) for name, trace in optimizer_traces.items()}
    levels: dict[str, float] = {}
    for name, (own_fit, _) in runs.items():
        own = sum(f.fwd_ms + f.bwd_ms for f in own_fit.parts)
        levels[name] = own / passes if own > 0 and passes > 0 else 1.0
    weights = {"": steps(base_trace), **{name: steps(optimizer_traces[name]) for name in runs}}
    common = sum(w * levels.get(n, 1.0) for n, w in weights.items()) / sum(weights.values())
    for p, f in zip(profile.parts, fitted.parts):
        b = f.bwd_ms * common / p.bwd_ms if p.bwd_ms > 0 else 1.0
        p.fwd_ms = put(f"parts.{p.name}.fwd_ms", p.fwd_ms, f.fwd_ms * common)
        p.bwd_ms = put(f"parts.{p.name}.bwd_ms", p.bwd_ms, f.bwd_ms * common)
        if p.bwd_input_ms is not None and p.bwd_weight_ms is not None:
            p.bwd_input_ms = put(f"parts.{p.name}.bwd_input_ms", p.bwd_input_ms, p.bwd_input_ms * b)
            p.bwd_weight_ms = put(f"parts.{p.name}.bwd_weight_ms", p.bwd_weight_ms, p.bwd_weight_ms * b)
        if "adamw" in f.step_ms and "adamw" in p.step_ms:
            p.step_ms["adamw"] = put(f"parts.{p.name}.step_ms.adamw", p.step_ms["adamw"], f.step_ms["adamw"] * common)
    for name, (fitted, counts) in runs.items():
        level = levels[name] / common  # its run's entries over the common level's
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
    return factors, {**levels, "common": common}
