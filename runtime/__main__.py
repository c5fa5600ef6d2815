"""`torchrun --nproc-per-node N -m runtime PLAN`: execute a compiled plan.

Each rank validates the plan against the job (world size, its ops, the model) BEFORE any
collective, so a mismatch ends the job with one line instead of a hang; then it builds
only its own stages and runs its op lists step after step (runtime.interpreter).

Exit codes: 0 done, 2 bad input (plan, flags, model), 3 a peer was lost / timed out.
Fault injection for tests: PFC_RUNTIME_CRASH="RANK:STEP" makes that rank exit abruptly at
the start of that step, on the first attempt only (TORCHELASTIC_RESTART_COUNT == 0).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass

from pfcompile.formats.errors import InputError

EXIT_INPUT, EXIT_COMM = 2, 3


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="torchrun --nproc-per-node N -m runtime",
        description="Run a pfcompile plan with torch.distributed (gloo on CPU, NCCL on CUDA).")
    p.add_argument("plan", help="plan JSON written by `pfcompile plan`")
    p.add_argument("--steps", type=int, default=10, help="training steps (default 10)")
    p.add_argument("--data", choices=("pydoc", "synthetic"), default="pydoc",
                   help="pydoc-corpus MLM batches (default) or synthetic tokens")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--seed", type=int, default=0, help="model and data seed (default 0)")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: the optimizer's)")
    p.add_argument("--checkpoint-dir", default=None, help="write per-rank checkpoints here")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="C", help="checkpoint every C steps")
    p.add_argument("--resume", action="store_true", help="continue from the last complete checkpoint")
    p.add_argument("--trace", "-o", default=None, metavar="OUT.json",
                   help="write the measured timeline (Perfetto/Chrome trace) here")
    p.add_argument("--model-code", default=None, metavar="MODULE:FUNCTION",
                   help="allow importing the plan's user model; must equal the plan's model name")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds before a silent peer is an error (default 60)")
    p.add_argument("--warmup", type=int, default=None,
                   help="steps excluded from the measured step time (default: one refresh cycle if steps allow, else 1)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON (rank 0)")
    return p


@dataclass
class Job:
    """What a rank knows after validation, before touching the network."""
    plan: object                 # pfcompile.formats.plan.Plan
    spec: object                 # model spec: cfg, part_names, build_part
    dtype: object                # torch dtype
    rank: int
    world_size: int
    seed: int
    where: str                   # the plan's path, for error messages


def prepare(args, rank: int, world_size: int) -> Job:
    """Validate flags, plan and model against this job; every problem is a one-line InputError."""
    from pfcompile.formats.plan import load_plan

    if args.steps < 1:
        raise InputError("--steps", None, f"must be >= 1, got {args.steps}")
    if (args.checkpoint_every or args.resume) and not args.checkpoint_dir:
        raise InputError("--checkpoint-dir", None, "is needed by --checkpoint-every and --resume")
    if args.checkpoint_every < 0:
        raise InputError("--checkpoint-every", None, f"must be >= 0, got {args.checkpoint_every}")
    plan = load_plan(args.plan)
    where = args.plan
    if plan.world_size != world_size:
        raise InputError(where, "config.world_size",
                         f"the plan is for {plan.world_size} ranks but this job has {world_size} "
                         f"(launch with torchrun --nproc-per-node/--nnodes giving {plan.world_size})")
    _check_rank_ops(plan, rank, where)

    import torch

    from runtime.models import MODEL_CONFIGS, ModelSpecError, resolve_config, resolve_model

    name = plan.model.get("name")
    if ":" in name:  # user code: imported only when the user names the same code on the command line
        if args.model_code != name:
            raise InputError(where, "model.name", f"is user code {name!r}; pass --model-code {name} to allow importing it")
        try:
            spec = resolve_model(name)
        except ModelSpecError as e:
            raise InputError(where, "model.name", str(e)) from None
    else:
        if args.model_code is not None:
            raise InputError("--model-code", None, f"{args.model_code!r} but the plan's model is the built-in {name!r}")
        if name not in MODEL_CONFIGS:
            raise InputError(where, "model.name", f"unknown model {name!r}; built-in: {', '.join(MODEL_CONFIGS)}")
        spec = resolve_model(resolve_config(name, vocab=plan.model.get("vocab"), seq_len=plan.model.get("seq_len")))
    parts = [p for stage in plan.partition for p in stage]
    if parts != list(spec.part_names):
        raise InputError(where, "partition", f"{parts} does not cut the model's parts {list(spec.part_names)} in order")
    for key in ("micro_batch", "seq_len"):
        v = plan.model.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise InputError(where, f"model.{key}", f"must be a positive integer, got {v!r}")
    if len(plan.micro_batch_replica) != plan.config["micro_batches"]:
        raise InputError(where, "micro_batch_replica",
                         f"has {len(plan.micro_batch_replica)} entries for {plan.config['micro_batches']} micro-batches")
    if args.data == "pydoc":
        from runtime.data import VOCAB
        if spec.cfg.vocab < len(VOCAB):
            raise InputError(where, "model.vocab", f"{spec.cfg.vocab} is smaller than the pydoc corpus' {len(VOCAB)} tokens; use --data synthetic")
    dtype = getattr(torch, args.dtype)
    return Job(plan, spec, dtype, rank, world_size, args.seed, where)


def _check_rank_ops(plan, rank: int, where: str) -> None:
    """The ops of this rank refer to stages, layers and peers it actually has."""
    held = {s for s, _ in plan.stages_of(rank)}
    if not held:
        raise InputError(where, "placement", f"rank {rank} holds no stage")
    needs = {"fwd": 0, "bwd": 0, "send_act": 0, "send_grad": 0, "recv_act": 1, "recv_grad": -1,
             "sync_grad": 0, "step": 0}
    for t in range(plan.refresh_steps):
        for i, op in enumerate(plan.ops(rank, t)):
            field = f"ranks[{rank}].steps[{t}][{i}]"
            if op.kind in needs and op.stage + needs[op.kind] not in held:
                raise InputError(where, field, f"{op} needs stage {op.stage + needs[op.kind]}, which rank {rank} does not hold")
            if op.layer is not None and plan.layer_stage[op.layer] not in held:
                raise InputError(where, field, f"{op} is a layer of stage {plan.layer_stage[op.layer]}, not held by rank {rank}")
            if op.is_p2p and op.peer == rank:
                raise InputError(where, field, f"{op} sends to or receives from its own rank")


def build_stages(job: Job, world, kfac_cfg, optim_cfg):
    """This rank's stages with their K-FAC layers (plan indices) and optimizers."""
    from runtime import kfac
    from runtime.interpreter import StageReplica
    from runtime.models import Stage, kfac_linears
    from runtime.optim import build_optimizer

    plan = job.plan
    N = int(plan.config["micro_batches"])
    stages = {}
    for s, r in plan.stages_of(job.rank):
        module = Stage(job.spec, plan.partition[s], seed=job.seed, dtype=job.dtype).to(world.device)
        layers = {}
        if plan.config["kfac"]:
            linears = dict(kfac_linears(module))
            for i, name in enumerate(plan.layers):
                if plan.layer_stage[i] != s:
                    continue
                if name not in linears:
                    raise InputError(job.where, f"layers[{i}]", f"{name!r} is not a K-FAC Linear of stage {s} "
                                     f"(its layers: {', '.join(linears) or 'none'})")
                layers[i] = kfac.KfacLayer(name, linears[name], kfac_cfg, loss_divisor=N)
                layers[i].attach()
        stages[s] = StageReplica(
            stage=s, replica=r, module=module, kfac=layers,
            optimizer=build_optimizer(module, list(layers.values()), optim_cfg),
            group=world.stage_groups.get(s), is_first=(s == 0), is_last=(s == plan.num_stages - 1))
    return stages


def make_update(kfac_cfg):
    """The step(stage) op: KL-clip over the stage's K-FAC layers, then the optimizer."""
    from runtime import kfac

    def update(sr) -> None:
        if sr.kfac:
            kfac.apply_kl_clip(list(sr.kfac.values()), sr.optimizer.lr, kfac_cfg.kl_clip)
        sr.optimizer.step()
        sr.optimizer.zero_grad()
    return update


def stage_state(sr) -> dict:
    # A plan may run a curv op in a later step than its fwd/bwd, so mid-cycle the layers
    # also hold kept inputs / output gradients; KfacLayer.state_dict leaves them out.
    return {"params": sr.module.state_dict(), "optimizer": sr.optimizer.state_dict(),
            "kfac": {layer.name: layer.state_dict() for layer in sr.kfac.values()},
            "kept": {layer.name: {f: dict(saved) for f, saved in layer._saved.items()}
                     for layer in sr.kfac.values()}}


def load_stage_state(sr, state: dict) -> None:
    sr.module.load_state_dict(state["params"])
    sr.optimizer.load_state_dict(state["optimizer"])
    for layer in sr.kfac.values():
        layer.load_state_dict(state["kfac"][layer.name])
        layer._saved = {f: dict(saved) for f, saved in state["kept"][layer.name].items()}


def run(job: Job, args):
    """Join the job, build this rank's stages, run the steps; returns the Summary on rank 0."""
    import torch
    import torch.distributed as dist

    from runtime import checkpoint, comm, measure
    from runtime.data import make_stream, split_micro_batches
    from runtime.interpreter import Interpreter
    from runtime.kfac import KfacConfig
    from runtime.optim import OptimConfig

    plan = job.plan
    N = int(plan.config["micro_batches"])
    k = plan.refresh_steps
    torch.set_num_threads(args.threads)
    world = comm.init_world(args.timeout)
    clean = False
    try:
        comm.make_stage_groups(world, [plan.replica_ranks(s) for s in range(plan.num_stages)])
        kfac_cfg = KfacConfig(refresh_steps=k, inverse=plan.config.get("inverse", "cholesky"))
        optim_cfg = OptimConfig() if args.lr is None else OptimConfig(lr=args.lr)
        stages = build_stages(job, world, kfac_cfg, optim_cfg)
        cfg = job.spec.cfg
        mb_size, seq_len = int(plan.model["micro_batch"]), int(plan.model["seq_len"])
        stream = make_stream(cfg.kind, batch_size=mb_size * N, seq_len=seq_len, seed=args.seed,
                             synthetic=args.data == "synthetic", vocab=cfg.vocab)
        timeline = measure.Timeline(world.rank)
        interp = Interpreter(plan, world, stages, (mb_size, seq_len, cfg.hidden), job.dtype,
                             make_update(kfac_cfg), timeline)

        first = 0
        if args.resume:
            first = _resume(args.checkpoint_dir, world, stages)
        if first >= args.steps:
            raise InputError("--steps", None, f"{args.steps}, but the checkpoint is already at step {first}")
        crash = _crash_step(world.rank)
        losses = torch.zeros(args.steps, dtype=torch.float64)
        dist.barrier()
        timeline.t0 = time.perf_counter()  # all ranks measure from (about) the same instant
        for step in range(first, args.steps):
            if step == crash:
                os._exit(17)  # fault injection: an abrupt death, no cleanup (see module doc)
            batch = stream.batch(step)
            mbs = split_micro_batches(batch, N)
            tokens = [b.tokens.to(world.device) for b in mbs]
            targets = [b.targets.to(world.device) for b in mbs]
            losses[step] = interp.run_step(step, tokens, targets)
            if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
                checkpoint.save(args.checkpoint_dir, step + 1, world.rank, world.world_size, {
                    "step": step + 1, "rng": checkpoint.capture_rng(),
                    "stages": {s: stage_state(sr) for s, sr in stages.items()}})
        # One reduction at the end: a per-step one would add a collective to every step.
        losses_dev = losses.to(world.device)
        dist.all_reduce(losses_dev)
        losses = losses_dev.cpu()
        gathered = comm.gather_json(world, timeline.to_json())
        clean = True
        if world.rank != 0:
            return None
        gathered = [measure.Timeline.from_json(d) for d in gathered]
        last = args.steps - 1
        warmup = args.warmup if args.warmup is not None else (k if args.steps - first > 2 * k else 1)
        summary = measure.summarize(gathered, float(losses[last]) if last >= first else None,
                                    plan.stats.get("step_time_ms"), first + warmup, args.steps, first,
                                    losses[first:].tolist(), predicted_ops=[
                                        [[(str(po.op), po.end - po.start) for po in ops] for ops in steps]
                                        for steps in plan.ranks])
        if args.trace:
            measure.write_measured_trace(args.trace, gathered, {
                "plan": os.path.abspath(args.plan), "steps": args.steps, "summary": summary.line()})
        return summary
    finally:
        comm.shutdown(clean)


def _resume(root: str, world, stages) -> int:
    """Load the last checkpoint complete on ALL ranks (agreed by an all-reduce MIN)."""
    import torch
    import torch.distributed as dist

    from runtime import checkpoint

    done = checkpoint.complete_steps(root, world.world_size)
    latest = torch.tensor([done[-1] if done else 0], dtype=torch.int64, device=world.device)
    dist.all_reduce(latest, op=dist.ReduceOp.MIN)  # ranks may see the folder at different moments
    step = int(latest)
    if step == 0:
        return 0
    try:
        state = checkpoint.load(root, step, world.rank, map_location=world.device)
        for s, sr in stages.items():
            load_stage_state(sr, state["stages"][s])
        checkpoint.restore_rng(state["rng"])
    except (KeyError, RuntimeError, ValueError, OSError) as e:  # another plan's or a damaged checkpoint
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(f"{root}/step-{step:08d}/rank-{world.rank}.pt", None,
                         f"cannot resume this plan from it ({type(e).__name__}: {first})") from None
    if world.rank == 0:
        print(f"runtime: resumed from {root} at step {step}", flush=True)
    return step


def _crash_step(rank: int) -> int | None:
    spec = os.environ.get("PFC_RUNTIME_CRASH")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    r, _, s = spec.partition(":")
    return int(s) if int(r) == rank else None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # From the environment torchrun sets, not from torch: bad input fails before torch loads.
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    try:
        job = prepare(args, rank, world_size)
    except InputError as e:
        print(f"runtime[rank {rank}]: error: {e}", file=sys.stderr, flush=True)
        return EXIT_INPUT
    from runtime.comm import CommTimeout
    try:
        summary = run(job, args)
    except CommTimeout as e:
        print(f"runtime[rank {rank}]: error: {e}", file=sys.stderr, flush=True)
        return EXIT_COMM
    except InputError as e:
        print(f"runtime[rank {rank}]: error: {e}", file=sys.stderr, flush=True)
        return EXIT_INPUT
    if summary is not None:
        if args.json:
            print(json.dumps(summary.__dict__), flush=True)
        else:
            print(summary.loss_curve(), flush=True)
            print(summary.line(), flush=True)
    return 0


def _exit_without_teardown(code: int) -> None:
    """All ranks have met at the final barrier and nothing is left to do: exit without
    running gloo's destructors (see runtime.comm.shutdown)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    code = main()
    if code == 0:
        _exit_without_teardown(0)
    sys.exit(code)
