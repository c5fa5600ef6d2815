"""The training loop of one rank, top to bottom: join the job, build this rank's stages,
resume if asked, run the plan's ops step after step (runtime.interpreter), checkpoint, and
at the end gather the measured timelines into the summary (rank 0)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from pfcompile.formats.errors import InputError
from runtime import checkpoint, comm, faults, measure
from runtime.build import build_stages, make_update
from runtime.data import make_stream, split_micro_batches
from runtime.interpreter import Interpreter
from runtime.kfac import KfacConfig
from runtime.optim import OptimConfig


def run(job, args) -> measure.Summary | None:
    """Join the job, build this rank's stages, run the steps; returns the Summary on rank 0."""
    plan = job.plan
    N = int(plan.config["micro_batches"])
    torch.set_num_threads(args.threads)
    world = comm.init_world(args.timeout, job.device_type)
    clean = False
    try:
        comm.make_stage_groups(world, [plan.replica_ranks(s) for s in range(plan.num_stages)])
        kfac_cfg = KfacConfig(refresh_steps=plan.refresh_steps, inverse=plan.config.get("inverse", "cholesky"))
        optim_cfg = OptimConfig() if args.lr is None else OptimConfig(lr=args.lr)
        stages = build_stages(job, world, kfac_cfg, optim_cfg)
        cfg = job.spec.cfg
        mb_size, seq_len = int(plan.model["micro_batch"]), int(plan.model["seq_len"])
        stream = make_stream(cfg.kind, batch_size=mb_size * N, seq_len=seq_len, seed=args.seed,
                             synthetic=args.data == "synthetic", vocab=cfg.vocab)
        timeline = measure.Timeline(world.rank, device_type=world.device.type)
        interp = Interpreter(plan, world, stages, (mb_size, seq_len, cfg.hidden), job.precision,
                             make_update(kfac_cfg), timeline, tags=job.p2p_tags)

        first = checkpoint.resume(args.checkpoint_dir, world, stages) if args.resume else 0
        if first >= args.steps:
            raise InputError("--steps", None, f"{args.steps}, but the checkpoint is already at step {first}")
        before_step = faults.crash_hook(world.rank)
        losses = torch.zeros(args.steps, dtype=torch.float64)
        dist.barrier()
        timeline.start()  # all ranks measure from (about) the same instant
        for step in range(first, args.steps):
            before_step(step)
            mbs = split_micro_batches(stream.batch(step), N)
            tokens = [b.tokens.to(world.device) for b in mbs]
            targets = [b.targets.to(world.device) for b in mbs]
            losses[step] = interp.run_step(step, tokens, targets)
            if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
                checkpoint.save_rank(args.checkpoint_dir, step + 1, world, stages)

        # One reduction at the end: a per-step one would add a collective to every step.
        losses_dev = losses.to(world.device)
        dist.all_reduce(losses_dev)
        losses = losses_dev.cpu()
        gathered = comm.gather_json(world, timeline.to_json())
        clean = True
        if world.rank != 0:
            return None
        return _summary(job, args, [measure.Timeline.from_json(d) for d in gathered], losses, first)
    finally:
        comm.shutdown(clean)


def _summary(job, args, timelines: list[measure.Timeline], losses: torch.Tensor, first: int) -> measure.Summary:
    """Rank 0: the run's summary over the steps after warm-up, and the measured trace if asked."""
    plan = job.plan
    k = plan.refresh_steps
    last = args.steps - 1
    warmup = args.warmup if args.warmup is not None else (k if args.steps - first > 2 * k else 1)
    summary = measure.summarize(timelines, float(losses[last]) if last >= first else None,
                                plan.stats.get("step_time_ms"), first + warmup, args.steps, first,
                                losses[first:].tolist(), predicted_ops=[
                                    [[(str(po.op), po.end - po.start) for po in ops] for ops in steps]
                                    for steps in plan.ranks],
                                predicted_peaks=plan.stats.get("peak_memory_bytes"),
                                memory_limit=plan.config.get("memory_limit_bytes"))
    if args.trace:
        measure.write_measured_trace(args.trace, timelines, {
            "plan": os.path.abspath(args.plan), "steps": args.steps, "summary": summary.line()})
    return summary
