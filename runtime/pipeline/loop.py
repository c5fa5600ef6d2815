"""The training loop of one rank, top to bottom: join the job, build this rank's stages,
resume if asked, run the plan's ops step after step (runtime.pipeline.interpreter), report metrics,
evaluate, checkpoint, and at the end gather the trained model and the measured timelines
(rank 0)."""

from __future__ import annotations

import gc
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pfcompile.formats.jsonio import write_atomic
from runtime.config.allocator import keep_freed_memory
from runtime.config.network_threads import network_threads_idle
from runtime.config.precision import flush_denormals
from runtime.io import checkpoint, export
from runtime.io.data import make_stream, split_micro_batches
from runtime.observe import faults, measure
from runtime.observe.metrics import RUNS_DIR, Metrics, make_run_folder
from runtime.optimizers import registry
from runtime.optimizers.stage import optim_config
from runtime.pipeline import affinity, comm
from runtime.pipeline.build import Update, build_stages
from runtime.pipeline.interpreter import Interpreter, NonFiniteError

# Python's cyclic garbage collector runs when a rank has allocated enough container
# objects: at a different moment on each rank, and a full collection walks every object
# torch made, so the other ranks wait for it. Like torchtitan, the loop turns
# automatic collection off and collects the young generations every GC_EVERY steps on all
# ranks at once.
GC_EVERY = 50


@dataclass
class RankParts:
    """What one rank builds once and then steps with (the world, plan and micro-batch count
    are the interpreter's)."""
    stages: dict
    interp: Interpreter
    update: Update
    stream: object                # the training batches
    val_batches: list | None      # the fixed held-out batches (None: no evaluation)
    timeline: measure.Timeline
    optim_cfg: object
    base_lr: float = 0.0          # the peak rate its covered weights follow (the entry's base_lr key)


def build_rank(job, world) -> RankParts:
    """This rank's stages, data, timeline, update and interpreter (after init_world)."""
    plan, cfg = job.plan, job.config
    N = plan.config.micro_batches
    comm.make_stage_groups(world, [plan.replica_ranks(s) for s in range(plan.num_stages)])
    optim_cfg = optim_config(cfg)
    stages = build_stages(job, world)
    mb_size, seq_len = int(plan.model["micro_batch"]), int(plan.model["seq_len"])
    stream, val_batches = _data(job, mb_size * N, seq_len)
    timeline = measure.Timeline(world.rank, device_type=world.device.type)
    entry = registry.entry(plan.config.optimizer)
    update = Update(entry, entry.math_config(cfg), cfg.optimizer.max_grad_norm, world)
    interp = Interpreter(plan, world, stages, (mb_size, seq_len, job.spec.cfg.hidden), job.precision, update,
                         timeline, tags=job.p2p_tags, recv_ahead=cfg.runtime.recv_ahead)
    return RankParts(stages, interp, update, stream, val_batches, timeline, optim_cfg, cfg.get(entry.base_lr))


def train_step(r: RankParts, step: int, then: int | None = None) -> tuple:
    """One training step of this rank: its ops of the plan, then the (clipped) updates.
    `then`: the step run right after it, if no evaluation or other plan comes between
    (Interpreter.run_step posts its receives early).
    Returns the row the metrics flush reduces: (step, loss share, norm² share, ms, lr, refresh)."""
    started = time.perf_counter()
    interp = r.interp
    config = interp.plan.config
    lr = r.base_lr * r.optim_cfg.lr_factor(step)  # every stage follows the same schedule
    device = interp.world.device
    with r.timeline.span(step, "batch"):
        mbs = split_micro_batches(r.stream.batch(step), interp.N)
        tokens, targets = [b.tokens.to(device) for b in mbs], [b.targets.to(device) for b in mbs]
    loss = interp.run_step(step, tokens, targets, then)
    if r.update.max_grad_norm > 0:
        with r.timeline.span(step, "finish"):
            norm_sq = r.update.finish_step()
    else:
        norm_sq = r.update.finish_step()
    refresh = step % interp.k == 0 and config.optimizer_spec.refreshes
    return (step, loss, norm_sq, (time.perf_counter() - started) * 1000.0, lr, refresh)


def join(job) -> tuple[comm.World, tuple[bool, bool]]:
    """Set this rank's process up as the job says (its cores if pinned, its torch threads,
    subnormals flushed, freed memory kept) and join the process group (gloo's network
    threads then yield to the rank's, runtime.config.network_threads).
    -> (world, (denormals flushed, freed memory kept))."""
    rt = job.config.runtime
    if rt.pin_cpus:  # before the process group and torch's thread pool start their threads
        affinity.pin(affinity.share(rt.threads))
    torch.set_num_threads(rt.threads)
    flushed = flush_denormals(job.device_type, rt.flush_denormal)
    kept = keep_freed_memory(job.device_type, rt.keep_freed_memory)  # before the model's tensors exist
    return comm.init_world(rt.timeout, job.device_type, rt.idle_network_threads), (flushed, kept)


def run(job) -> measure.Summary | None:
    """Join the job, build this rank's stages, run the steps; returns the Summary on rank 0."""
    plan, cfg = job.plan, job.config
    steps, ckpt = cfg.train.steps, cfg.checkpoint
    world, (flushed, kept) = join(job)
    clean = False
    try:
        r = build_rank(job, world)
        stages, interp, timeline, N = r.stages, r.interp, r.timeline, r.interp.N
        mb_size, seq_len = int(plan.model["micro_batch"]), int(plan.model["seq_len"])
        if ckpt.dir:
            checkpoint.clean_temporary(ckpt.dir, world.rank)  # a killed write's leftovers
        first = checkpoint.resume(ckpt.dir, world, stages) if ckpt.resume else 0
        if first >= steps:
            raise cfg.error("train.steps", f"{steps}, but the checkpoint is already at step {first}")
        metrics = say = None
        if world.rank == 0:
            # With --json, stdout is for the summary object: what a person reads goes to stderr.
            say = sys.stderr if cfg.log.json else sys.stdout
            log_dir = cfg.log.dir or make_run_folder(RUNS_DIR, Path(job.plan_path).stem)
            print(f"runtime: run folder {log_dir}", file=say, flush=True)
            _announce(cfg, [d for d in dict.fromkeys([log_dir, ckpt.dir]) if d], say)
            metrics = Metrics(log_dir, steps, first, mb_size * N * seq_len)
        before_step = faults.crash_hook(world.rank)
        poison = faults.poison_hook(world.rank, stages)
        losses = torch.zeros(steps, dtype=torch.float64)  # filled on rank 0 by the reductions
        pending: list[tuple] = []  # train_step's rows until the next reduction
        logged = LoggedSteps(world, losses, metrics)
        every, log_every = cfg.eval.every, cfg.log.every
        val_batches = r.val_batches
        comm.barrier("the barrier before the first step", world.timeout)
        timeline.start()  # all ranks measure from (about) the same instant
        gc.disable()  # collections at chosen steps, not whenever a rank allocates (a straggler)
        for step in range(first, steps):
            if (step - first) % GC_EVERY == 0:
                with timeline.span(step, "gc"):
                    gc.collect(1)
            before_step(step)
            poison(step)
            done = step + 1
            evaluate_now = val_batches and ((every and done % every == 0) or done == steps)
            pending.append(train_step(r, step, then=done if done < steps and not evaluate_now else None))
            if len(pending) >= log_every or done == steps or evaluate_now:
                with timeline.span(step, "flush"):
                    logged.post(pending)
            if evaluate_now:
                interp.settle()
                logged.settle()  # the steps' rows before the evaluation's
                _evaluate(interp, stages, world, val_batches, N, done, metrics, say)
            if ckpt.every and done % ckpt.every == 0:
                interp.agree_parameters(step)  # the last good checkpoint stays the last one written
                checkpoint.save_rank(ckpt.dir, done, world, stages, keep=ckpt.keep)
                if ckpt.save_model_every_checkpoint:
                    _save_model(job, world, stages, len(val_batches or []))
        interp.settle()  # the last step's divergence check
        logged.settle()

        if ckpt.save_model:
            interp.agree_parameters(steps - 1)
            _save_model(job, world, stages, len(val_batches or []))
        timeline.cpus = affinity.allowed()  # read back from the kernel, pinned or not
        timeline.denormals_flushed = flushed
        timeline.freed_memory_kept = kept
        timeline.network_threads_idle = network_threads_idle(world.backend)
        timeline.flush_spans()
        gathered = comm.gather_json(world, timeline.to_json())
        if ckpt.every:  # every rank has saved (the gather met them all): prune for real
            checkpoint.prune(ckpt.dir, world.rank, world.world_size, ckpt.keep)
        clean = True
        if world.rank != 0:
            return None
        summary = _summary(job, measure.align([measure.Timeline.from_json(d) for d in gathered]), losses, first)
        metrics.summary(summary.__dict__)
        metrics.close()
        return summary
    except NonFiniteError:
        clean = True  # every rank raised it in the same step (Interpreter.agree): they leave together
        raise
    finally:
        gc.enable()
        comm.shutdown(clean, world.timeout)


def _data(job, batch_size: int, seq_len: int):
    """The training stream and the fixed evaluation batches (None without held-out data)."""
    kind, cfg = job.spec.cfg.kind, job.config
    seed = cfg.train.seed
    if job.data is not None:
        stream = make_stream(kind, batch_size, seq_len, seed=seed, token_file=job.data)
        val = job.val_data and make_stream(kind, batch_size, seq_len, seed=0, token_file=job.val_data)
    else:
        synthetic = cfg.data.path == "synthetic"
        stream = make_stream(kind, batch_size, seq_len, seed=seed, synthetic=synthetic, vocab=job.spec.cfg.vocab)
        val = make_stream(kind, batch_size, seq_len, seed=0, split="val", synthetic=synthetic, vocab=job.spec.cfg.vocab)
    return stream, (val.fixed_batches(cfg.eval.batches) if val else None)


class LoggedSteps:
    """The buffered steps' loss and squared-norm shares, all-reduced in one message and
    logged on rank 0. The reduction is posted (`post`) and read at the next post or at
    `settle`, like the divergence check (Interpreter.agree): waiting for it would stop
    every rank at the slowest one every few steps."""

    def __init__(self, world, losses: torch.Tensor, metrics):
        self.world, self.losses, self.metrics = world, losses, metrics
        self.in_flight: tuple[list[tuple], comm.InFlight] | None = None

    def post(self, pending: list) -> None:
        if not pending:
            return
        self.settle()
        shares = torch.tensor([[p[1], p[2]] for p in pending], dtype=torch.float64, device=self.world.device)
        self.in_flight = (list(pending), comm.post_all_reduce(shares, "the all-reduce of the logged losses",
                                                              self.world.timeout, group=self.world.control))
        pending.clear()

    def settle(self) -> None:
        if self.in_flight is None:
            return
        (rows_of, reduction), self.in_flight = self.in_flight, None
        shares = reduction.wait().cpu()
        if self.world.rank != 0:
            return
        rows = []
        for (step, _, _, ms, lr, refresh), (loss, norm_sq) in zip(rows_of, shares.tolist()):
            self.losses[step] = loss
            rows.append({"step": step + 1, "loss": loss, "lr": lr, "grad_norm": math.sqrt(max(norm_sq, 0.0)),
                         "step_ms": ms, "refresh": refresh})
        self.metrics.steps(rows)


def _evaluate(interp, stages, world, batches, N: int, step: int, metrics, say) -> float:
    """Mean loss over the fixed held-out batches, forward only through the pipeline."""
    for sr in stages.values():
        sr.module.eval()
    total = 0.0
    for batch in batches:
        mbs = split_micro_batches(batch, N)
        total += interp.run_forward([b.tokens.to(world.device) for b in mbs], [b.targets.to(world.device) for b in mbs])
    for sr in stages.values():
        sr.module.train()
    t = torch.tensor([total], dtype=torch.float64, device=world.device)
    comm.all_reduce(t, "the all-reduce of the evaluation loss", world.timeout)
    loss = float(t) / len(batches)
    if world.rank == 0:
        row = metrics.evaluation(step, loss, len(batches))
        print(f"runtime: eval at step {step}: loss {loss:.4f}, perplexity {row['perplexity']:.2f}", file=say, flush=True)
    return loss


def _save_model(job, world, stages, val_batches: int) -> None:
    tensors = export.gather_model(world, job.plan, stages)
    if world.rank == 0:
        export.save_model(job.config.checkpoint.save_model, tensors, export.model_spec(job, val_batches), job.spec)


def _announce(cfg, dirs: list[str], say) -> None:
    """Rank 0: print the effective config and save it (train.toml) where the run writes."""
    text = cfg.to_toml()
    print("runtime: effective config (plan-fixed keys from the plan):\n" + text.rstrip(), file=say, flush=True)
    for d in dirs:
        write_atomic(os.path.join(d, "train.toml"), text)


def _summary(job, timelines: list[measure.Timeline], losses: torch.Tensor, first: int) -> measure.Summary:
    """Rank 0: the run's summary over the steps after warm-up, and the measured trace if asked."""
    plan, rt = job.plan, job.config.runtime
    k = plan.refresh_steps
    steps = job.config.train.steps
    last = steps - 1
    warmup = rt.warmup if rt.warmup is not None else (k if steps - first > 2 * k else 1)
    summary = measure.summarize(timelines, float(losses[last]) if last >= first else None,
                                plan.stats.get("step_time_ms"), first + warmup, steps, first,
                                losses[first:].tolist(), predicted_ops=measure.predicted_op_table(plan),
                                predicted_peaks=plan.stats.get("peak_memory_bytes"),
                                memory_limit=plan.config.memory_limit_bytes,
                                expected_ms=plan.stats.get("expected_step_time_ms"), refresh_steps=k)
    if rt.trace:
        measure.write_measured_trace(rt.trace, timelines, measure.run_metadata(
            job, steps, first + warmup, summary=summary.line(), cpus=summary.cpus))
    return summary
