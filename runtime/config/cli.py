"""The command line of `torchrun -m runtime PLAN` and the job it describes: the flags (each
a shorthand for one key of runtime.config.job), and the validation of the config, the plan
and the model against this job.

Each rank validates BEFORE any collective (and before torch is even imported where it can
be), so a mismatch ends the job with one line instead of a hang. Everything here raises
InputError; runtime.__main__ turns it into exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass

from pfcompile.formats.errors import InputError, echo
from pfcompile.formats.jsonio import check_output_dir, check_output_path
from pfcompile.formats.ops import stage_served
from runtime.config import job as job_config
from runtime.config.job import JobConfig
from runtime.observe.metrics import RUNS_DIR

# The flags: each sets one key, after the file and the --set overrides (`--steps 20` is
# `--set train.steps=20`); what a key means is its help in runtime.config.job.
# (flag, key, argparse keywords; a flag's default is always None: "not given")
SHORTHANDS = [
    ("--steps", "train.steps", dict(type=int, metavar="S")),
    ("--seed", "train.seed", dict(type=int, metavar="S")),
    ("--lr", "optimizer.lr", dict(type=float, metavar="LR")),
    ("--data", "data.path", dict(metavar="pydoc|synthetic|TRAIN.bin")),
    ("--val-data", "data.val_path", dict(metavar="VAL.bin")),
    ("--log-dir", "log.dir", dict(metavar="DIR")),
    ("--json", "log.json", dict(action="store_true")),
    ("--checkpoint-dir", "checkpoint.dir", dict(metavar="DIR")),
    ("--checkpoint-every", "checkpoint.every", dict(type=int, metavar="C")),
    ("--keep", "checkpoint.keep", dict(type=int, metavar="K")),
    ("--resume", "checkpoint.resume", dict(action="store_true")),
    ("--save-model", "checkpoint.save_model", dict(metavar="OUT.safetensors")),
    ("--save-model-every-checkpoint", "checkpoint.save_model_every_checkpoint", dict(action="store_true")),
    ("--device", "runtime.device", dict(choices=("cpu", "cuda"))),
    ("--dtype", "runtime.dtype", dict(choices=job_config.DTYPES)),
    ("--p2p-tags", "runtime.p2p_tags", dict(choices=("on", "off"))),  # on: true, off: false
    ("--recv-ahead", "runtime.recv_ahead", dict(type=int, metavar="R")),
    ("--timeout", "runtime.timeout", dict(type=float, metavar="SECONDS")),
    ("--threads", "runtime.threads", dict(type=int, metavar="T")),
    ("--pin-cpus", "runtime.pin_cpus", dict(action="store_true")),
    ("--no-pin-cpus", "runtime.pin_cpus", dict(action="store_false")),
    ("--warmup", "runtime.warmup", dict(type=int, metavar="W")),
    ("--trace", "runtime.trace", dict(metavar="OUT.json")),
    ("--model-code", "runtime.model_code", dict(metavar="MODULE:FUNCTION")),
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="torchrun --nproc-per-node N -m runtime",
        description="Run a pfcompile plan with torch.distributed (gloo on CPU, NCCL on CUDA).\n"
                    "Without --log-dir, the metrics, the effective config and the summary go to a new\n"
                    f"run folder, {RUNS_DIR}/PLAN-UTCTIME/ (printed at the start).",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_keys_help())
    p.add_argument("plan", help="plan JSON written by `pfcompile plan`")
    p.add_argument("--config", default=None, metavar="TRAIN.toml", help="the run's config (TOML, the sections below)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", dest="overrides",
                   help="override one config key, e.g. --set kfac.damping=1e-4 (repeatable; later wins)")
    for flag, key, kw in SHORTHANDS:
        f = _field(key)
        if kw.get("action") in ("store_true", "store_false"):
            value = "true" if kw["action"] == "store_true" else "false"
        elif flag == "--p2p-tags":
            value = "true|false"
        else:
            value = kw.get("metavar") or "|".join(kw["choices"])
        shown = f.default is not None and f.default is not False
        default = f"; default {job_config.toml_value(f.default)}" if shown else ""
        names = (flag, "-o") if flag == "--trace" else (flag,)
        what = "the opposite of --pin-cpus" if flag == "--no-pin-cpus" else f.metadata['help']
        p.add_argument(*names, dest=key, default=None, help=f"{what} (= --set {key}={value}{default})", **kw)
    return p


def _field(key: str) -> dataclasses.Field:
    section, _, name = key.partition(".")
    return next(f for f in dataclasses.fields(getattr(JobConfig(), section)) if f.name == name)


def _keys_help() -> str:
    """Every config key with its default and help, by section (the epilog of --help)."""
    lines = ["config keys (--config FILE.toml, --set SECTION.KEY=VALUE; defaults < file < --set < flags):"]
    for section in job_config.SECTIONS:
        lines.append(f"  [{section}]")
        for f in dataclasses.fields(getattr(JobConfig(), section)):
            setting = f.name if f.default is None else f"{f.name} = {job_config.toml_value(f.default)}"
            lines.append(f"    {setting:<36} {f.metadata['help']}")
    return "\n".join(lines)


def load_config(args) -> JobConfig:
    """The run's config from the parsed command line: the file, the --set overrides, the flags."""
    flags = []
    for flag, key, kw in SHORTHANDS:
        value = getattr(args, key)
        if value is None or kw.get("action") in ("store_true", "store_false") and value != (kw["action"] == "store_true"):
            continue  # not given, or given by the other flag of an on/off pair (it names itself)
        flags.append((key, value == "on" if flag == "--p2p-tags" else value, flag))
    return job_config.load(args.config, args.overrides, flags)


@dataclass
class Job:
    """What a rank knows after validation, before touching the network."""
    config: JobConfig            # the run's settings, the plan-fixed keys filled in
    plan_path: str               # for error messages and the trace
    plan: object                 # pfcompile.formats.plan.Plan
    spec: object                 # model spec: cfg, part_names, build_part
    rank: int
    world_size: int
    precision: object            # runtime.config.precision.Precision
    device_type: str = "cpu"     # "cpu" | "cuda": the backend follows it (runtime.pipeline.comm)
    p2p_tags: bool = True        # False: messages matched per pair in issue order (NCCL's rule)
    data: object = None          # runtime.io.data.TokenFile, or None (pydoc / synthetic)
    val_data: object = None      # runtime.io.data.TokenFile, or None

    @property
    def dtype(self):
        """The parameters' torch dtype (float32 under bfloat16)."""
        return self.precision.param_dtype


def prepare(args, rank: int, world_size: int) -> Job:
    """The job of a parsed command line (see make_job)."""
    _import_plugin_optimizer(args.plan)
    return make_job(load_config(args), args.plan, rank, world_size)


def _import_plugin_optimizer(plan_path: str) -> None:
    """A plan whose optimizer is "package.module:entry" names a plugin: it is imported before
    the config is read, so the keys of a section it registers are known. A plan that cannot
    be read is left to make_job, which says why."""
    try:
        with open(plan_path, encoding="utf-8") as f:
            name = json.load(f)["config"]["optimizer"]
    except Exception:  # unreadable, not JSON, too deep, another shape: load_plan's one line says which
        return
    if isinstance(name, str) and ":" in name:
        from runtime.optimizers import registry

        try:
            registry.entry(name)
        except ValueError as e:
            raise InputError(plan_path, "config.optimizer", str(e)) from None


def make_job(cfg: JobConfig, plan_path: str, rank: int, world_size: int) -> Job:
    """Validate the config, plan, model and data against this job; every problem is a
    one-line InputError."""
    from pfcompile.formats.plan import load_plan

    _check_outputs(cfg, rank)
    plan = load_plan(plan_path)
    where = plan_path
    if plan.world_size != world_size:
        raise InputError(where, "config.world_size",
                         f"the plan is for {plan.world_size} ranks but this job has {world_size} "
                         f"(launch with torchrun --nproc-per-node/--nnodes giving {plan.world_size})")
    # The whole plan, every rank's lists: the same verdict on every rank, before any
    # collective (a plan that would deadlock or train different mathematics ends here),
    # and the same line `pfcompile inspect` prints for it.
    from pfcompile.formats.verify import verify_plan
    verify_plan(plan, where)
    _check_rank_ops(plan, rank, where)
    spec = _resolve_model(plan, cfg, where)
    _check_plan_fits_model(plan, spec, where)
    job_config.apply_plan(cfg, plan, where)
    data, val_data = _check_data(cfg, plan, spec, where)
    prec, device_type, tags = _device_and_precision(cfg, plan, where)
    return Job(cfg, plan_path, plan, spec, rank, world_size, prec, device_type, tags, data, val_data)


def _check_outputs(cfg: JobConfig, rank: int) -> None:
    """Every output path, and the cores for --pin-cpus, before any work: a bad one found
    after training started would waste the run (or, for the trace, all of it)."""
    r = cfg.runtime
    if r.pin_cpus:  # asked for: enough cores for every local rank's threads, or a one-line error
        from runtime.pipeline import affinity
        affinity.share(r.threads)
    for key, check in (("checkpoint.dir", check_output_dir), ("log.dir", check_output_dir),
                       ("runtime.trace", check_output_path), ("checkpoint.save_model", check_output_path)):
        if cfg.get(key) is not None:
            check(cfg.get(key), ": ".join(p for p in cfg.origin(key) if p))
    if cfg.log.dir is None and rank == 0:  # rank 0 makes the run folder in the current one
        check_output_dir(RUNS_DIR, f"{RUNS_DIR} (the run folder's parent; or give --log-dir)")


def _check_data(cfg: JobConfig, plan, spec, where: str):
    """The token files (None for the built-in pydoc / synthetic data), checked before training."""
    from runtime.io.data import VOCAB, open_token_file

    d = cfg.data
    batch = int(plan.model["micro_batch"]) * plan.config.micro_batches
    seq_len = int(plan.model["seq_len"])
    if d.path == "pydoc":
        if spec.cfg.vocab < len(VOCAB):
            raise InputError(where, "model.vocab", f"{spec.cfg.vocab} is smaller than the pydoc corpus' {len(VOCAB)} "
                                                   "tokens; use --data synthetic")
    if d.path in ("pydoc", "synthetic"):
        if d.val_path:
            raise cfg.error("data.val_path", f"is for a token file given with --data, not the built-in {d.path!r} data")
        return None, None
    data = open_token_file(d.path, spec.cfg.vocab, batch, seq_len)
    val = open_token_file(d.val_path, spec.cfg.vocab, batch, seq_len) if d.val_path else None
    return data, val


def _device_and_precision(cfg: JobConfig, plan, where: str):
    """(precision, device type, p2p tags) of the job, from the config or the plan's profile."""
    import torch

    from runtime.config.precision import NAMES, precision

    r = cfg.runtime
    dtype_name = r.dtype or plan.model.get("dtype") or "float32"
    if dtype_name not in NAMES:
        raise InputError(where, "model.dtype", f"{dtype_name!r} is not one the runtime runs ({', '.join(NAMES)}); "
                                               "pass --dtype")
    prec = precision(dtype_name)
    device_type = r.device or plan.profile.get("device_type") or "cpu"
    if device_type not in ("cpu", "cuda"):
        raise InputError(where, "profile.device_type", f"{device_type!r}: pass --device cpu or --device cuda")
    if r.recv_ahead and device_type == "cuda":
        raise cfg.error("runtime.recv_ahead", "must be 0 on cuda (NCCL runs a peer's messages in issue order: "
                                              "a receive posted ahead of a send can deadlock the pair)")
    if device_type == "cuda" and not torch.cuda.is_available():
        found = f"cuda, but torch sees no CUDA device here (torch {torch.__version__}); pass --device cpu"
        raise cfg.error("runtime.device", found) if r.device else InputError(where, "profile.device_type", found)
    if r.pin_cpus is None:  # on a cpu, each rank on its own cores where the node has them (affinity)
        from runtime.pipeline import affinity
        r.pin_cpus = device_type == "cpu" and affinity.fits(r.threads)
    tags = (device_type == "cpu") if r.p2p_tags is None else r.p2p_tags
    if tags and device_type == "cuda":
        raise cfg.error("runtime.p2p_tags", "on needs gloo (--device cpu): NCCL ignores point-to-point tags")
    return prec, device_type, tags


def _resolve_model(plan, cfg: JobConfig, where: str):
    """The plan's model spec. User code is imported only when the command line names the
    same code (--model-code), so a plan file alone never runs code; an "hf:PATH" model is a
    transformers config (data), rebuilt from the plan's name (a relative PATH from the
    current directory)."""
    from runtime.models import MODEL_CONFIGS, ModelSpecError, resolve_config, resolve_model

    name = plan.model.get("name")
    if name.startswith("hf:"):  # a transformers config or model directory: data, not code
        if cfg.runtime.model_code is not None:
            raise cfg.error("runtime.model_code", f"{cfg.runtime.model_code!r} but the plan's model is {name!r}, "
                                                  "a transformers config (no code to allow)")
        try:
            return resolve_model(name, seq_len=plan.model.get("seq_len"))
        except ModelSpecError as e:
            raise InputError(where, "model.name", str(e)) from None
    if ":" in name:
        if cfg.runtime.model_code != name:
            raise InputError(where, "model.name", f"is user code {name!r}; pass --model-code {name} to allow importing it")
        try:
            return resolve_model(name)
        except ModelSpecError as e:
            raise InputError(where, "model.name", str(e)) from None
    if cfg.runtime.model_code is not None:
        raise cfg.error("runtime.model_code", f"{cfg.runtime.model_code!r} but the plan's model is the built-in {name!r}")
    if name not in MODEL_CONFIGS:
        raise InputError(where, "model.name", f"unknown model {name!r}; built-in: {', '.join(MODEL_CONFIGS)}")
    return resolve_model(resolve_config(name, vocab=plan.model.get("vocab"), seq_len=plan.model.get("seq_len")))


def _check_plan_fits_model(plan, spec, where: str) -> None:
    """The model built here against the plan. The verifier has checked the plan against
    the built-in models and a user model's recorded parts (pfcompile.formats.models); this
    checks a user model's code, which only the runtime imports."""
    parts = [p for stage in plan.partition for p in stage]
    if parts != list(spec.part_names):
        raise InputError(where, "partition", f"{echo(parts)} does not cut the model's parts "
                                             f"{echo(list(spec.part_names))} in order")
    # the spec the plan was made for must be the model built here
    for key in ("kind", "layers", "hidden", "heads", "ffn", "vocab"):
        if key in plan.model and plan.model[key] != getattr(spec.cfg, key, None):
            raise InputError(where, f"model.{key}", f"{echo(plan.model[key])} but the model "
                             f"{echo(plan.model['name'])} built here has {echo(getattr(spec.cfg, key, None))} (rule: model)")


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
