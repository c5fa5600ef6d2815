"""The runtime's settings as typed sections, one dataclass each, held by a JobConfig (as
torchtitan's JobConfig): [train] [optimizer] [schedule] [kfac] [shampoo] [muon] [data] [eval]
[log] [checkpoint] [runtime]. Every setting of a run is one key of one section; its type is the
field's annotation, its default the field's default, its valid range the field's `check`.

Where a run's values come from, later wins: the defaults here, then the TOML file
(`--config`), then each `--set SECTION.KEY=VALUE` in order, then the flag shorthands of
runtime.config.cli (`--steps 20` is `--set train.steps=20`). `--set` values are TOML values
(`--set kfac.damping=1e-4`, `--set optimizer.adam_betas=[0.9,0.98]`); a bare word is a
string (`--set schedule.decay=cosine`). Every problem is a one-line InputError naming the
file (or --set, or the flag) and the key.

The plan fixes kfac.refresh_steps, kfac.inverse, data.micro_batch, data.seq_len and
data.micro_batches: they may be written (and then must agree), never changed here;
`apply_plan` fills them in. `to_toml` writes the effective config, which `--config` reads
back.

Defaults are the values benchmarks/convergence.py selected for bert-tiny (K-FAC: lr 0.1,
momentum 0.9, damping 1e-4, EMA 0.9, KL clip 1e-5; AdamW lr 1e-3). [muon] has
torch.optim.Muon's defaults except adjust_lr_fn, "match_rms_adamw": it scales the update to
AdamW's RMS, so Muon's lr is on AdamW's scale (Moonshot's "Muon is Scalable for LLM Training").

Which optimizer a pipeline run uses is the plan's choice (kfac | shampoo | muon | adamw);
the single-process trainer takes it as an argument (runtime.train.train_reference).
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from dataclasses import dataclass, field

from pfcompile.formats.errors import InputError
from pfcompile.formats.models import DTYPES  # runtime.config.precision's, named where no torch is imported

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

MAX_STEPS = 10**9          # a step index fits every counter; more is a typo
MAX_THREADS = 1024
MAX_TIMEOUT_S = 7 * 86400  # a week: longer is never meant (and overflows gloo's millisecond timeout)
DECAYS = ("constant", "linear", "cosine", "polynomial")
# What AdamW keeps out of weight decay by default, as torchtitan and nanoGPT do: vectors
# (biases, and any parameter of one dimension), normalisation layers' weights, embeddings.
NO_DECAY_KINDS = ("bias", "norm", "embedding")


def no_decay_kinds(text: str) -> list[str]:
    """The kinds of a comma list ("bias,norm"; "" is none)."""
    return [k.strip() for k in text.split(",") if k.strip()]


# --- valid ranges: (predicate, what the message says a value must be) ------------------------------
def at_least(lo):
    return lambda v: v >= lo, f">= {lo}"


def between(lo, hi, text: str | None = None):
    return lambda v: lo <= v <= hi, f"in {text or f'{lo}..{hi}'}"


def one_of(*names: str):
    return lambda v: v in names, "one of " + ", ".join(names)


FINITE_NONNEGATIVE = (lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0")
POSITIVE_FINITE = (lambda v: math.isfinite(v) and v > 0, "a positive finite number")
FRACTION = (lambda v: 0 <= v < 1, "in [0, 1)")
NOT_EMPTY = (lambda v: v != "", "a non-empty string")


def setting(default, help: str, check=None):
    """A key of a section: its default, one line of help (runtime.config.cli's --help lists
    them) and its valid range (a None value, "not set", is never checked)."""
    return field(default=default, metadata={"help": help, "check": check})


@dataclass
class Train:
    steps: int = setting(10, "training steps", between(1, MAX_STEPS))
    seed: int = setting(0, "model and data seed", between(0, 2**63 - 1, "0..2**63-1"))


@dataclass
class Optimizer:
    lr: float = setting(0.1, "SGD-momentum learning rate of the K-FAC layers", POSITIVE_FINITE)
    momentum: float = setting(0.9, "SGD momentum", FINITE_NONNEGATIVE)
    weight_decay: float = setting(0.0, "SGD weight decay", FINITE_NONNEGATIVE)
    decoupled_weight_decay: bool = setting(False, "decay the covered weights by lr * weight_decay "
                                           "(AdamW's rule) instead of adding it to the gradient")
    adam_lr: float = setting(1e-3, "AdamW learning rate (what K-FAC does not cover; everything without K-FAC)",
                             FINITE_NONNEGATIVE)
    adam_betas: tuple[float, float] = setting((0.9, 0.999), "AdamW betas",
                                              (lambda v: all(0 <= b < 1 for b in v), "two numbers in [0, 1)"))
    adam_weight_decay: float = setting(0.01, "AdamW weight decay", FINITE_NONNEGATIVE)
    adam_no_decay: str = setting("bias,norm,embedding", "AdamW parameters kept out of weight decay: "
                                 "a comma list of " + " | ".join(NO_DECAY_KINDS) + " ('': decay all)",
                                 (lambda v: all(k in NO_DECAY_KINDS for k in no_decay_kinds(v)), "a comma list of "
                                  + " | ".join(NO_DECAY_KINDS)))
    max_grad_norm: float = setting(0.0, "clip the global gradient norm to this (0: off)", FINITE_NONNEGATIVE)


@dataclass
class Schedule:
    warmup_steps: int = setting(0, "linear warm-up steps of both learning rates", at_least(0))
    decay: str = setting("constant", "after warm-up: " + " | ".join(DECAYS), one_of(*DECAYS))
    decay_steps: int = setting(0, "decay length after warm-up (0: until the last step)", at_least(0))
    final_lr_ratio: float = setting(0.0, "decayed rate / peak rate", (lambda v: 0 <= v <= 1, "in [0, 1]"))
    power: float = setting(1.0, "polynomial decay exponent", FINITE_NONNEGATIVE)


@dataclass
class Kfac:
    damping: float = setting(1e-4, "Tikhonov damping", POSITIVE_FINITE)
    damping_mode: str = setting("pi", "pi | plain (plain needs an eigen plan)", one_of("pi", "plain"))
    ema: float = setting(0.9, "factor EMA", FRACTION)
    kl_clip: float = setting(1e-5, "KL clip (0: off)", FINITE_NONNEGATIVE)
    fisher: str = setting("empirical", "empirical (the pipeline runtime's only kind) | mc", one_of("empirical", "mc"))
    refresh_steps: int | None = setting(None, "fixed by the plan", at_least(1))
    inverse: str | None = setting(None, "fixed by the plan", one_of("cholesky", "eigen"))


@dataclass
class Shampoo:
    lr: float = setting(1e-3, "Shampoo learning rate of the covered weights (Adam grafting: Adam's scale)",
                        POSITIVE_FINITE)
    beta2: float = setting(0.999, "EMA of the statistics L, R (1: plain sums, the original Shampoo)",
                           (lambda v: 0 < v <= 1, "in (0, 1]"))
    epsilon: float = setting(1e-12, "damping added to the statistic's eigenvalues before the root", POSITIVE_FINITE)
    epsilon_mode: str = setting("absolute", "absolute (S + eps I) | relative (S + eps lambda_max I)",
                                one_of("absolute", "relative"))
    graft: str = setting("adam", "whose direction's norm per layer the step takes: adam | adagrad | rmsprop | sgd "
                         "(the gradient's) | none", one_of("adam", "adagrad", "rmsprop", "sgd", "none"))
    graft_beta2: float = setting(0.999, "the graft's second-moment EMA (rmsprop, adam)", (lambda v: 0 < v <= 1, "in (0, 1]"))
    graft_epsilon: float = setting(1e-8, "the graft's epsilon", POSITIVE_FINITE)
    beta1: float = setting(0.9, "EMA of the gradient (bias-corrected), preconditioned instead of it (0: off)", FRACTION)
    bias_correction: bool = setting(True, "divide the gradient's average and the statistics by 1 - beta^t")
    exponent_override: float = setting(0.0, "p of the root S^(-1/p) (0: 4, a matrix's two factors)", FINITE_NONNEGATIVE)
    start_preconditioning_step: int = setting(0, "before this step, the graft's direction alone", at_least(0))
    max_preconditioner_dim: int = setting(1024, "a weight is split into blocks of at most this many rows and "
                                          "columns, each with its own L, R", at_least(1))
    momentum: float | None = setting(0.0, "the step's heavy-ball momentum (unset: [optimizer] momentum)",
                                     FINITE_NONNEGATIVE)
    weight_decay: float | None = setting(0.0, "decoupled weight decay (times lr; unset: [optimizer] weight_decay, "
                                         "added to the gradient)", FINITE_NONNEGATIVE)
    defer_stats: bool = setting(False, "fold each step's gradient into the statistics in the next step (kept until "
                                "then): a plan may then run them in any bubble; a --defer-stats plan sets it")


@dataclass
class Soap:
    lr: float = setting(3e-3, "SOAP learning rate of the covered weights", POSITIVE_FINITE)
    beta1: float = setting(0.95, "Adam's first-moment EMA (in the eigenbasis)", FRACTION)
    beta2: float = setting(0.95, "Adam's second-moment EMA (in the eigenbasis)", FRACTION)
    shampoo_beta: float = setting(-1.0, "EMA of the statistics L, R (< 0: beta2)", (lambda v: v < 1, "< 1"))
    eps: float = setting(1e-8, "Adam's epsilon", POSITIVE_FINITE)
    weight_decay: float = setting(0.01, "decoupled weight decay (times lr)", FINITE_NONNEGATIVE)
    tie_break: float = setting(1e-6, "a fixed distinct diagonal added before the eigenbasis, relative to the "
                               "mean eigenvalue: a singular statistic's basis is then not rounding's choice",
                               FINITE_NONNEGATIVE)
    defer_stats: bool = setting(False, "fold each step's gradient into the statistics in the next step (kept until "
                                "then): a plan may then run them in any bubble; a --defer-stats plan sets it")


@dataclass
class Muon:
    lr: float = setting(1e-3, "Muon learning rate of the covered weights (before the shape adjustment)",
                        FINITE_NONNEGATIVE)
    weight_decay: float = setting(0.1, "decoupled weight decay (times lr)", FINITE_NONNEGATIVE)
    momentum: float = setting(0.95, "momentum (an EMA of the gradient)", FINITE_NONNEGATIVE)
    nesterov: bool = setting(True, "Nesterov momentum")
    ns_coefficients: tuple[float, float, float] = setting((3.4445, -4.775, 2.0315),
                                                          "Newton-Schulz quintic coefficients a, b, c")
    ns_steps: int = setting(5, "Newton-Schulz iterations", between(0, 99))
    eps: float = setting(1e-7, "floor of the norm the iteration's input is divided by", FINITE_NONNEGATIVE)
    ns_dtype: str = setting("bfloat16", "dtype of the iteration: " + " | ".join(DTYPES), one_of(*DTYPES))
    adjust_lr_fn: str = setting("match_rms_adamw", "original (sqrt(max(1, out/in))) | match_rms_adamw "
                                "(0.2 sqrt(max(out, in)))", one_of("original", "match_rms_adamw"))


@dataclass
class Data:
    path: str = setting("pydoc", "pydoc (the built-in corpus) | synthetic | a token file TRAIN.bin", NOT_EMPTY)
    val_path: str | None = setting(None, "held-out token file (pydoc and synthetic bring their own)", NOT_EMPTY)
    micro_batch: int | None = setting(None, "fixed by the plan", at_least(1))
    seq_len: int | None = setting(None, "fixed by the plan", at_least(1))
    micro_batches: int | None = setting(None, "fixed by the plan", at_least(1))


@dataclass
class Eval:
    every: int = setting(0, "evaluate every E steps (0: only after the last step)", at_least(0))
    batches: int = setting(8, "held-out batches per evaluation", at_least(1))


@dataclass
class Log:
    every: int = setting(10, "reduce metrics across ranks and write them every L steps (1: a synchronisation "
                             "every step)", at_least(1))
    dir: str | None = setting(None, "metrics.jsonl, TensorBoard events, train.toml, summary.json; default: a new "
                                    "run folder runs/PLAN-UTCTIME/ (with checkpoint.dir too)", NOT_EMPTY)
    json: bool = setting(False, "print the summary as one JSON object (what a person reads goes to stderr)")


@dataclass
class Checkpoint:
    dir: str | None = setting(None, "per-rank checkpoints and a copy of train.toml (the metrics: log.dir)", NOT_EMPTY)
    every: int = setting(0, "checkpoint every C steps (0: never)", at_least(0))
    keep: int = setting(1, "complete checkpoints kept, the newest (one at least: the one to resume from)",
                        at_least(1))
    resume: bool = setting(False, "continue from the last complete checkpoint")
    save_model: str | None = setting(None, "at the end, gather the trained model into this safetensors file "
                                           "(its spec beside it, .json)", NOT_EMPTY)
    save_model_every_checkpoint: bool = setting(False, "also write save_model at every checkpoint")


@dataclass
class Runtime:
    device: str | None = setting(None, "cpu (gloo) | cuda (NCCL, one GPU per local rank); default: the plan's "
                                       "profile's, else cpu", one_of("cpu", "cuda"))
    dtype: str | None = setting(None, "float32 | float64 | bfloat16 (mixed); default: the plan's model dtype, "
                                      "else float32", one_of(*DTYPES))
    p2p_tags: bool | None = setting(None, "match messages by tag (gloo only), else per pair in issue order as NCCL; "
                                          "default: true on cpu, false on cuda")
    recv_ahead: int | None = setting(None, "receives posted ahead of the op that needs them (0 on cuda); "
                                           "default: all of a step's (up to 64) on cpu, 0 on cuda", between(0, 64))
    timeout: float = setting(60.0, "seconds before a silent peer is an error",
                             (lambda v: math.isfinite(v) and 0 < v <= MAX_TIMEOUT_S,
                              f"a number of seconds in (0, {MAX_TIMEOUT_S}]"))
    threads: int = setting(1, "torch threads per rank", between(1, MAX_THREADS))
    pin_cpus: bool | None = setting(None, "bind local rank i of n to the i-th contiguous share of the job's cores; "
                                          "default: on a cpu where every local rank gets its threads' cores, else off")
    flush_denormal: bool = setting(True, "on a cpu, flush subnormal floats to zero (x86 FTZ/DAZ): met in "
                                         "arithmetic they run many times slower, and runs drift into them")
    keep_freed_memory: bool = setting(True, "on a cpu, malloc keeps what torch frees for the next tensor "
                                            "(glibc's mmap and trim thresholds raised): else large tensors are "
                                            "mapped afresh and page-fault in, most in plans with optimizer work")
    idle_network_threads: bool = setting(True, "on gloo, its network threads run only where the rank's thread does "
                                               "not (SCHED_IDLE): else one polling for a lock the rank holds preempts "
                                               "it for a scheduler slice")
    warmup: int | None = setting(None, "steps excluded from the measured step time; default: one refresh cycle "
                                       "if the steps allow, else 1", at_least(0))
    trace: str | None = setting(None, "write the measured timeline (Perfetto trace) to this file", NOT_EMPTY)
    model_code: str | None = setting(None, "allow importing the plan's user model, MODULE:FUNCTION (its name)",
                                     NOT_EMPTY)


@dataclass
class JobConfig:
    """The settings of one run. `source[key]` says where a key that is not a default came
    from (the file, "--set", or the flag), for error messages."""
    train: Train = field(default_factory=Train)
    optimizer: Optimizer = field(default_factory=Optimizer)
    schedule: Schedule = field(default_factory=Schedule)
    kfac: Kfac = field(default_factory=Kfac)
    shampoo: Shampoo = field(default_factory=Shampoo)
    soap: Soap = field(default_factory=Soap)
    muon: Muon = field(default_factory=Muon)
    data: Data = field(default_factory=Data)
    eval: Eval = field(default_factory=Eval)
    log: Log = field(default_factory=Log)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    runtime: Runtime = field(default_factory=Runtime)

    def __post_init__(self):
        self.source: dict[str, str] = {}
        for name, cls in _PLUGIN_SECTIONS.items():  # the sections optimizers registered (register_section)
            setattr(self, name, cls())

    def set(self, key: str, value, where: str) -> None:
        """Set "section.key" to a value of the field's type (ints are accepted for floats)."""
        if key not in KEYS:
            known = [k for k in KEYS if k.startswith(key.partition(".")[0] + ".")] or KEYS
            raise InputError(where, key, f"unknown key; known: {', '.join(known)}")
        section_name, _, name = key.partition(".")
        section = getattr(self, section_name)
        setattr(section, name, _typed(FIELD_TYPES[type(section)][name], value, where, key))
        self.source[key] = where

    def get(self, key: str):
        section, _, name = key.partition(".")
        return getattr(getattr(self, section), name)

    # --- errors naming where a key came from ---------------------------------------------------
    def origin(self, key: str) -> tuple[str, str | None]:
        """(where, field) of an error about `key`: a flag alone (as `--threads: ...`), else the
        file or --set and the key ("config" for a default)."""
        where = self.source.get(key)
        if where and where.startswith("--") and where != "--set":
            return where, None
        return where or "config", key

    def error(self, key: str, message: str) -> InputError:
        return InputError(*self.origin(key), message)

    def to_dict(self) -> dict:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

    def to_toml(self) -> str:
        """The config as a TOML file `--config` reads back (keys not set, None, left out)."""
        lines = []
        for name, table in self.to_dict().items():
            lines += ([""] if lines else []) + [f"[{name}]"]
            lines += [f"{key} = {toml_value(value)}" for key, value in table.items() if value is not None]
        return "\n".join(lines) + "\n"


SECTIONS = tuple(f.name for f in dataclasses.fields(JobConfig))


# the field types of the job and of each section, from their annotations
FIELD_TYPES = {cls: typing.get_type_hints(cls) for cls in (JobConfig, *typing.get_type_hints(JobConfig).values())}

KEYS = [f"{s}.{f.name}" for s in SECTIONS for f in dataclasses.fields(FIELD_TYPES[JobConfig][s])]
_PLUGIN_SECTIONS: dict[str, type] = {}
# optimizer name -> the section that holds its settings, recorded by runtime.optimizers.registry
# as it learns of each entry (this module never imports the registry); a built-in's is its name
OPTIMIZER_SECTIONS: dict[str, str] = {}


def register_section(name: str, cls: type) -> None:
    """Add a settings section [name] (a dataclass of `setting` fields) to every JobConfig made
    from now on: the TOML file's [name] table and `--set name.key=value` then set it. An
    optimizer's registry entry registers its own (runtime.optimizers.registry)."""
    global SECTIONS
    if name in SECTIONS:
        if _PLUGIN_SECTIONS.get(name, FIELD_TYPES[JobConfig].get(name)) is not cls:
            raise ValueError(f"config section [{name}] exists already")
        return
    _PLUGIN_SECTIONS[name] = cls
    SECTIONS = (*SECTIONS, name)
    FIELD_TYPES[cls] = typing.get_type_hints(cls)
    KEYS.extend(f"{name}.{f.name}" for f in dataclasses.fields(cls))


def unregister_section(name: str) -> None:
    """Remove a section register_section added (a test's plugin, at its end)."""
    global SECTIONS
    cls = _PLUGIN_SECTIONS.pop(name)
    SECTIONS = tuple(s for s in SECTIONS if s != name)
    KEYS[:] = [k for k in KEYS if not k.startswith(name + ".")]
    FIELD_TYPES.pop(cls, None)

# The plan fixes these: key -> (where in the plan, how to read it).
PLAN_FIXED = {
    "kfac.refresh_steps": ("config.refresh_steps", lambda plan: plan.refresh_steps),
    "kfac.inverse": ("config.inverse", lambda plan: plan.config.inverse),
    "data.micro_batch": ("model.micro_batch", lambda plan: plan.model.get("micro_batch")),
    "data.seq_len": ("model.seq_len", lambda plan: plan.model.get("seq_len")),
    "data.micro_batches": ("config.micro_batches", lambda plan: plan.config.micro_batches),
}


def load(path: str | None = None, overrides: list[str] = (), flags: list[tuple[str, object, str]] = ()) -> JobConfig:
    """Defaults, then the TOML file, then each `--set KEY=VALUE` in order, then the flag
    shorthands [(key, value, flag name)]; every value checked against its range."""
    cfg = JobConfig()
    if path:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except FileNotFoundError:
            raise InputError(path, None, "no such file") from None
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise InputError(path, None, f"not a valid TOML file ({str(e).splitlines()[0]})") from None
        for section, table in data.items():
            if not isinstance(table, dict):
                raise InputError(path, section, "must be a [section] table, e.g. [kfac] with damping = 1e-4")
            for name, value in table.items():
                cfg.set(f"{section}.{name}", value, path)
    for item in overrides:
        key, eq, text = item.partition("=")
        if not eq or not key.strip():
            raise InputError("--set", None, f"{item!r} is not SECTION.KEY=VALUE (e.g. kfac.damping=1e-4)")
        cfg.set(key.strip(), _parse_value(text.strip()), "--set")
    for key, value, flag in flags:
        cfg.set(key, value, flag)
    check(cfg)
    return cfg


def check(cfg: JobConfig) -> None:
    """Every key against its range, then the keys that need one another."""
    for name in SECTIONS:
        section = getattr(cfg, name)
        for f in dataclasses.fields(section):
            value, rule = getattr(section, f.name), f.metadata["check"]
            if rule and value is not None and not rule[0](value):
                raise cfg.error(f"{name}.{f.name}", f"must be {rule[1]}, got {value!r}")
    c = cfg.checkpoint
    for key in ("checkpoint.every", "checkpoint.resume"):
        if cfg.get(key) and not c.dir:
            raise cfg.error(key, "needs a checkpoint folder (checkpoint.dir, --checkpoint-dir)")
    if c.save_model_every_checkpoint and not c.save_model:
        raise cfg.error("checkpoint.save_model_every_checkpoint", "needs checkpoint.save_model (--save-model)")


def apply_plan(cfg: JobConfig, plan, plan_path: str) -> None:
    """Fill the plan-fixed keys from the plan; a config that says otherwise is an error."""
    for key, (plan_field, read) in PLAN_FIXED.items():
        fixed = read(plan)
        if key in cfg.source and cfg.get(key) != fixed:
            raise cfg.error(key, f"is {cfg.get(key)!r} but the plan fixes it at {fixed!r} "
                            f"({plan_path} {plan_field}); remove the key or plan again")
        section, _, name = key.partition(".")
        setattr(getattr(cfg, section), name, fixed)
    if plan.config.defer_stats:  # the plan may run the statistics before the gradient exists
        section = OPTIMIZER_SECTIONS.get(plan.config.optimizer, plan.config.optimizer)
        key = f"{section}.defer_stats"
        if key in cfg.source and not cfg.get(key):
            raise cfg.error(key, f"is false but {plan_path} config.defer_stats plans deferred statistics; "
                            "remove the key or plan again without --defer-stats")
        getattr(cfg, section).defer_stats = True
    k = cfg.kfac
    if k.fisher != "empirical" and plan.config.optimizer == "kfac":
        raise cfg.error("kfac.fisher", f"{k.fisher!r}: the pipeline runtime computes only the empirical Fisher")
    if k.damping_mode == "plain" and k.inverse != "eigen":
        raise cfg.error("kfac.damping_mode", f"'plain' needs an eigen-inverse plan; {plan_path} inverts by {k.inverse}")


def _typed(kind, value, where: str, key: str):
    """The value as the field's type: int, float (an int accepted), str, bool, or a tuple of
    floats (a TOML list); `X | None` takes X (None is "not set", which TOML cannot say)."""
    args = typing.get_args(kind)
    if type(None) in args:
        kind = next(a for a in args if a is not type(None))
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if typing.get_origin(kind) is tuple:
        n = len(typing.get_args(kind))
        if isinstance(value, (list, tuple)) and len(value) == n and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            return tuple(float(v) for v in value)
        want = f"a list of {n} numbers"
    elif kind is float:
        if number:
            return float(value)
        want = "a number"
    elif kind is int:
        if number and isinstance(value, int):
            return value
        want = "an integer"
    elif kind is bool:
        if isinstance(value, bool):
            return value
        want = "true or false"
    else:
        if isinstance(value, str):
            return value
        want = "a string"
    raise InputError(where, key, f"must be {want}, got {value!r}")


def _parse_value(text: str):
    """A TOML value; a bare word that is not one is a string (schedule.decay=cosine)."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def toml_value(value) -> str:
    """A value as TOML writes it (train.toml; the defaults --help shows)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        # JSON's escapes are TOML's; DEL, which JSON leaves as it is, TOML wants escaped
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return repr(value)
