"""The job's configuration: the command-line flags of `torchrun -m runtime PLAN`, and their
validation together with the plan and the model against this job.

Each rank validates BEFORE any collective (and before torch is even imported where it can
be), so a mismatch ends the job with one line instead of a hang. Everything here raises
InputError; runtime.__main__ turns it into exit status 2.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from pfcompile.formats.errors import InputError
from pfcompile.formats.jsonio import check_output_dir, check_output_path
from pfcompile.formats.ops import stage_served

MAX_STEPS = 10**9          # a step index fits every counter; more is a typo
MAX_THREADS = 1024
MAX_TIMEOUT_S = 7 * 86400  # a week: longer is never meant (and overflows gloo's millisecond timeout)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="torchrun --nproc-per-node N -m runtime",
        description="Run a pfcompile plan with torch.distributed (gloo on CPU, NCCL on CUDA).",
        epilog="Training settings: --config FILE.toml and --set SECTION.KEY=VALUE (see runtime/train_config.py "
               "for every key); --steps, --seed and --lr are shorthands for --set train.steps=, train.seed=, "
               "optimizer.lr=.")
    p.add_argument("plan", help="plan JSON written by `pfcompile plan`")
    p.add_argument("--config", default=None, metavar="TRAIN.toml", help="training config (TOML)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", dest="overrides",
                   help="override one config key, e.g. --set kfac.damping=1e-4 (repeatable; later wins)")
    p.add_argument("--steps", type=int, default=None, help="training steps (= --set train.steps=S; default 10)")
    p.add_argument("--seed", type=int, default=None, help="model and data seed (= --set train.seed=S; default 0)")
    p.add_argument("--lr", type=float, default=None, help="K-FAC layers' learning rate (= --set optimizer.lr=LR)")
    p.add_argument("--data", default="pydoc", metavar="pydoc|synthetic|TRAIN.bin",
                   help="pydoc corpus (default), synthetic tokens, or a token file with its JSON sidecar")
    p.add_argument("--val-data", default=None, metavar="VAL.bin",
                   help="held-out token file for evaluation (pydoc and synthetic bring their own)")
    p.add_argument("--dtype", choices=("float32", "float64", "bfloat16"), default=None,
                   help="float32 / float64 throughout, or bfloat16 mixed precision (autocast; parameters, "
                        "K-FAC and optimizer state float32); default: the plan's model dtype, else float32")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="cpu (gloo, even on a GPU host) or cuda (NCCL, one GPU per local rank); "
                        "default: the device of the plan's profile, else cpu")
    p.add_argument("--p2p-tags", choices=("on", "off"), default=None,
                   help="match messages by tag (gloo only) or by per-pair issue order as NCCL does; "
                        "default: on for cpu, off for cuda")
    p.add_argument("--recv-ahead", type=int, default=None, metavar="R",
                   help="receives posted ahead of the op that needs them (gloo; NCCL runs them in issue order "
                        "per peer, where posting ahead can deadlock: 0); default: 1 on cpu, 0 on cuda")
    p.add_argument("--checkpoint-dir", default=None, help="write per-rank checkpoints (and the effective config) here")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="C", help="checkpoint every C steps")
    p.add_argument("--resume", action="store_true", help="continue from the last complete checkpoint")
    p.add_argument("--log-dir", default=None, metavar="DIR",
                   help="metrics.jsonl, TensorBoard events (if installed) and the effective config (default: --checkpoint-dir)")
    p.add_argument("--save-model", default=None, metavar="OUT.safetensors",
                   help="at the end, gather the trained model into this file (spec beside it, OUT.json)")
    p.add_argument("--save-model-every-checkpoint", action="store_true",
                   help="also write --save-model at every checkpoint")
    p.add_argument("--keep", type=int, default=1, metavar="K",
                   help="complete checkpoints kept in --checkpoint-dir, the newest (default 1)")
    p.add_argument("--trace", "-o", default=None, metavar="OUT.json",
                   help="write the measured timeline (Perfetto/Chrome trace) here")
    p.add_argument("--model-code", default=None, metavar="MODULE:FUNCTION",
                   help="allow importing the plan's user model; must equal the plan's model name")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds before a silent peer is an error (default 60)")
    p.add_argument("--warmup", type=int, default=None,
                   help="steps excluded from the measured step time (default: one refresh cycle if steps allow, else 1)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--pin-cpus", action="store_true",
                   help="bind each rank to its own share of the node's cores (local rank i of n: the i-th "
                        "contiguous len(cores)//n of the cores this job may use); the summary says which")
    p.add_argument("--json", action="store_true", help="print the summary as JSON (rank 0)")
    return p


@dataclass
class Job:
    """What a rank knows after validation, before touching the network."""
    plan: object                 # pfcompile.formats.plan.Plan
    spec: object                 # model spec: cfg, part_names, build_part
    dtype: object                # torch dtype of the parameters (float32 under bfloat16)
    rank: int
    world_size: int
    seed: int
    where: str                   # the plan's path, for error messages
    precision: object = None     # runtime.precision.Precision
    device_type: str = "cpu"     # "cpu" | "cuda": the backend follows it (runtime.comm)
    p2p_tags: bool = True        # False: messages matched per pair in issue order (NCCL's rule)
    train: object = None         # runtime.train_config.TrainConfig, plan-fixed keys filled in
    data: object = None          # runtime.data.TokenFile, or None (pydoc / synthetic)
    val_data: object = None      # runtime.data.TokenFile, or None
    steps: int = 0


def prepare(args, rank: int, world_size: int) -> Job:
    """Validate flags, config, plan, model and data against this job; every problem is a
    one-line InputError."""
    from pfcompile.formats.plan import load_plan
    from runtime import train_config

    _check_flags(args)
    train = train_config.load(args.config, args.overrides, {
        "train.steps": (args.steps, "--steps"), "train.seed": (args.seed, "--seed"), "optimizer.lr": (args.lr, "--lr")})
    plan = load_plan(args.plan)
    where = args.plan
    if plan.world_size != world_size:
        raise InputError(where, "config.world_size",
                         f"the plan is for {plan.world_size} ranks but this job has {world_size} "
                         f"(launch with torchrun --nproc-per-node/--nnodes giving {plan.world_size})")
    _check_rank_ops(plan, rank, where)
    # The whole plan, every rank's lists: the same verdict on every rank, before any
    # collective (a plan that would deadlock or train different mathematics ends here).
    from pfcompile.formats.verify import verify_plan
    verify_plan(plan, where)
    spec = _resolve_model(plan, args, where)
    _check_plan_fits_model(plan, spec, where)
    train_config.apply_plan(train, plan, where)
    data, val_data = _check_data(args, plan, spec, where)
    prec, device_type, tags = _device_and_precision(args, plan, where)
    return Job(plan, spec, prec.param_dtype, rank, world_size, train["train.seed"], where, prec, device_type, tags,
               train, data, val_data, train["train.steps"])


def _check_data(args, plan, spec, where: str):
    """The token files (None for the built-in pydoc / synthetic data), checked before training."""
    from runtime.data import VOCAB, open_token_file

    batch = int(plan.model["micro_batch"]) * plan.config.micro_batches
    seq_len = int(plan.model["seq_len"])
    if args.data == "pydoc":
        if spec.cfg.vocab < len(VOCAB):
            raise InputError(where, "model.vocab", f"{spec.cfg.vocab} is smaller than the pydoc corpus' {len(VOCAB)} tokens; use --data synthetic")
    if args.data in ("pydoc", "synthetic"):
        if args.val_data:
            raise InputError("--val-data", None, f"is for a token file given with --data, not the built-in {args.data!r} data")
        return None, None
    data = open_token_file(args.data, spec.cfg.vocab, batch, seq_len)
    val = open_token_file(args.val_data, spec.cfg.vocab, batch, seq_len) if args.val_data else None
    return data, val


def _device_and_precision(args, plan, where: str):
    """(precision, device type, p2p tags) of the job, from the flags or the plan's profile."""
    import torch

    from runtime.precision import NAMES, precision

    dtype_name = args.dtype or plan.model.get("dtype") or "float32"
    if dtype_name not in NAMES:
        raise InputError(where, "model.dtype", f"{dtype_name!r} is not one the runtime runs ({', '.join(NAMES)}); pass --dtype")
    prec = precision(dtype_name)
    device_type = args.device or plan.profile.get("device_type") or "cpu"
    if device_type not in ("cpu", "cuda"):
        raise InputError(where, "profile.device_type", f"{device_type!r}: pass --device cpu or --device cuda")
    if args.recv_ahead and device_type == "cuda":
        raise InputError("--recv-ahead", None, "must be 0 on cuda (NCCL runs a peer's messages in issue order: "
                                               "a receive posted ahead of a send can deadlock the pair)")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise InputError("--device" if args.device else where, None if args.device else "profile.device_type",
                         f"cuda, but torch sees no CUDA device here (torch {torch.__version__}); pass --device cpu")
    tags = (device_type == "cpu") if args.p2p_tags is None else args.p2p_tags == "on"
    if tags and device_type == "cuda":
        raise InputError("--p2p-tags", None, "on needs gloo (--device cpu): NCCL ignores point-to-point tags")
    return prec, device_type, tags


def _check_flags(args) -> None:
    if args.save_model_every_checkpoint and not args.save_model:
        raise InputError("--save-model-every-checkpoint", None, "needs --save-model")
    if (args.checkpoint_every or args.resume) and not args.checkpoint_dir:
        raise InputError("--checkpoint-dir", None, "is needed by --checkpoint-every and --resume")
    if args.checkpoint_every < 0:
        raise InputError("--checkpoint-every", None, f"must be >= 0, got {args.checkpoint_every}")
    # every number and path before any work: a bad one found after training started would
    # waste the run (or, for --trace, all of it)
    if args.steps is not None and args.steps > MAX_STEPS:
        raise InputError("--steps", None, f"{args.steps} is over the limit of {MAX_STEPS}")
    if not 1 <= args.threads <= MAX_THREADS:
        raise InputError("--threads", None, f"must be in 1..{MAX_THREADS}, got {args.threads}")
    if args.pin_cpus:  # enough cores for every local rank's threads, before any work
        from runtime import affinity
        affinity.share(args.threads)
    if not (math.isfinite(args.timeout) and 0 < args.timeout <= MAX_TIMEOUT_S):
        raise InputError("--timeout", None, f"must be a number of seconds in (0, {MAX_TIMEOUT_S}], got {args.timeout}")
    if args.lr is not None and not (math.isfinite(args.lr) and args.lr > 0):
        raise InputError("--lr", None, f"must be a positive finite number, got {args.lr}")
    if args.warmup is not None and args.warmup < 0:
        raise InputError("--warmup", None, f"must be >= 0, got {args.warmup}")
    if args.recv_ahead is not None and not 0 <= args.recv_ahead <= 64:
        raise InputError("--recv-ahead", None, f"must be in 0..64, got {args.recv_ahead}")
    if args.seed is not None and not 0 <= args.seed < 2**63:
        raise InputError("--seed", None, f"must be in 0..2**63-1, got {args.seed}")
    if args.keep < 1:
        raise InputError("--keep", None, f"must be >= 1 (the checkpoint to resume from), got {args.keep}")
    if args.checkpoint_dir is not None:
        check_output_dir(args.checkpoint_dir, "--checkpoint-dir")
    if args.trace is not None:
        check_output_path(args.trace, "--trace")


def _resolve_model(plan, args, where: str):
    """The plan's model spec. User code is imported only when the command line names the
    same code (--model-code), so a plan file alone never runs code."""
    from runtime.models import MODEL_CONFIGS, ModelSpecError, resolve_config, resolve_model

    name = plan.model.get("name")
    if ":" in name:
        if args.model_code != name:
            raise InputError(where, "model.name", f"is user code {name!r}; pass --model-code {name} to allow importing it")
        try:
            return resolve_model(name)
        except ModelSpecError as e:
            raise InputError(where, "model.name", str(e)) from None
    if args.model_code is not None:
        raise InputError("--model-code", None, f"{args.model_code!r} but the plan's model is the built-in {name!r}")
    if name not in MODEL_CONFIGS:
        raise InputError(where, "model.name", f"unknown model {name!r}; built-in: {', '.join(MODEL_CONFIGS)}")
    return resolve_model(resolve_config(name, vocab=plan.model.get("vocab"), seq_len=plan.model.get("seq_len")))


def _check_plan_fits_model(plan, spec, where: str) -> None:
    parts = [p for stage in plan.partition for p in stage]
    if parts != list(spec.part_names):
        raise InputError(where, "partition", f"{parts} does not cut the model's parts {list(spec.part_names)} in order")
    for key in ("micro_batch", "seq_len"):
        v = plan.model.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise InputError(where, f"model.{key}", f"must be a positive integer, got {v!r}")
    # the spec the plan was made for must be the model built here (the runtime builds by name)
    for key in ("kind", "layers", "hidden", "heads", "ffn", "vocab"):
        if key in plan.model and plan.model[key] != getattr(spec.cfg, key):
            raise InputError(where, f"model.{key}", f"{plan.model[key]!r:.40} but the model {plan.model['name']!r} "
                             f"built here has {getattr(spec.cfg, key)!r} (rule: model)")
    if len(plan.micro_batch_replica) != plan.config.micro_batches:
        raise InputError(where, "micro_batch_replica",
                         f"has {len(plan.micro_batch_replica)} entries for {plan.config.micro_batches} micro-batches")


def _check_rank_ops(plan, rank: int, where: str) -> None:
    """The ops of this rank refer to stages, layers and peers it actually has."""
    held = {s for s, _ in plan.stages_of(rank)}
    if not held:
        raise InputError(where, "placement", f"rank {rank} holds no stage")
    for t in range(plan.refresh_steps):
        for i, op in enumerate(plan.ops(rank, t)):
            field = f"ranks[{rank}].steps[{t}][{i}]"
            if op.stage is not None and stage_served(op) not in held:  # a receive serves its neighbour
                raise InputError(where, field, f"{op} needs stage {stage_served(op)}, which rank {rank} does not hold")
            if op.layer is not None and plan.layer_stage[op.layer] not in held:
                raise InputError(where, field, f"{op} is a layer of stage {plan.layer_stage[op.layer]}, not held by rank {rank}")
            if op.is_p2p and op.peer == rank:
                raise InputError(where, field, f"{op} sends to or receives from its own rank")
