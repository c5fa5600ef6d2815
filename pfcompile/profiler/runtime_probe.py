"""The runtime probe: a short run of the runtime itself, fitted as `pfcompile calibrate` fits
a trace, for the runtime's overheads around the ops, the p2p link as a run sees it, and each
op kind's mean over median in a run, which raises the parts' medians to their run means."""

from __future__ import annotations

import os
import sys

import torch

from pfcompile.formats.profile import LinkModel, Part, Profile, RuntimeOverheads


def measure_runtime(profile: Profile, device: torch.device,
                    steps: int = 24) -> tuple[RuntimeOverheads, LinkModel | None, dict[str, float], dict]:
    """The runtime's own costs around the ops, measured by running it: a 2-stage GPipe plan of
    the profiled model without K-FAC, `steps` steps on 2 ranks (torchrun, one thread each,
    synthetic tokens), its measured trace fitted as `pfcompile calibrate` fits one
    (pfcompile.calibrate.fit): the dispatch gap per op, the work between steps, a send's
    posting, a receive's completion, and the op times' spread (runtime.op_spread: 24 steps
    give each stage's fwd and bwd ~90 samples), and the p2p link as the run sees it: the
    latency of its receives posted before their send ended, at the benchmark's bandwidth
    (None when none was); and the run's tail per op kind (calibrate.fit.run_tail: fwd, bwd
    and the optimizer step's mean over median in the run; {} when it failed). Kept only where
    the run worked; otherwise the message benchmark's link and send/receive times stand (said
    in the provenance)."""
    import subprocess
    import tempfile

    from pfcompile.calibrate.fit import fit_runtime
    from pfcompile.calibrate.measured import load_measured
    from pfcompile.graph.schedules import PipelineConfig
    from pfcompile.place.build import build_plan
    from pfcompile.place.options import PlanOptions

    with tempfile.TemporaryDirectory(prefix="pfcompile-probe-") as tmp:
        plan, _, _ = build_plan(profile, PipelineConfig("gpipe", stages=2, micro_batches=4, optimizer="adamw"), PlanOptions("none"))
        plan_path, trace_path = os.path.join(tmp, "probe.plan.json"), os.path.join(tmp, "probe.trace.json")
        plan.save(plan_path)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "runtime",
               plan_path, "--steps", str(steps), "--warmup", "2", "--data", "synthetic", "--trace", trace_path,
               "--device", device.type]
        name = profile.model.get("name", "")
        if ":" in name and not name.startswith("hf:"):  # user code (hf:PATH is a config): imported only when told to
            cmd += ["--model-code", name]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if r.returncode or not os.path.exists(trace_path):
            lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
            # the runtime's own one-line error, not torchrun's banner after it
            tail = [ln for ln in lines if "error:" in ln][-1:] or lines[-1:] or ["no output"]
            return RuntimeOverheads(), None, {}, {"runtime_note": f"runtime probe failed ({tail[0][:200]}); overheads "
                                                              f"from the message benchmark only"}
        trace = load_measured(trace_path)
    fit = fit_runtime([trace], profile, "mean")  # sums of op times add means
    link = fit.link if fit.link is not profile.comm.p2p else None
    return fit.overheads, link, fit.tail, {"runtime_note": f"runtime overheads measured by running the runtime: 2-stage GPipe without "
                                       f"K-FAC, 4 micro-batches, {steps} steps (2 warm-up), 2 ranks, 1 thread each, the "
                                       f"runtime's default --recv-ahead; "
                                       f"fitted like pfcompile calibrate (mean occupancy)"}


def raise_to_run_mean(parts: list[Part], tail: dict[str, float]) -> None:
    """Each part's fwd, bwd (and its split halves, B and W, which the probe does not run: the
    backward's) and optimizer-step entries times its kind's run tail (calibrate.fit.run_tail):
    an op's median timed alone becomes its expected time in a run."""
    for p in parts:
        p.fwd_ms *= tail.get("fwd", 1.0)
        b = tail.get("bwd", 1.0)
        p.bwd_ms *= b
        if p.bwd_input_ms is not None and p.bwd_weight_ms is not None:
            p.bwd_input_ms, p.bwd_weight_ms = p.bwd_input_ms * b, p.bwd_weight_ms * b
        p.step_ms = {k: v * tail.get("step", 1.0) for k, v in p.step_ms.items()}
