"""The training config: one TOML file (`--config train.toml`) plus `--set SECTION.KEY=VALUE`
overrides, holding every knob of a run that the plan does not fix.

    [train]      steps, seed
    [optimizer]  lr, momentum, weight_decay (SGD on the K-FAC layers' preconditioned
                 gradients); adam_lr, adam_betas, adam_weight_decay (AdamW on the rest, and on
                 everything without K-FAC); max_grad_norm (global-norm clipping, 0 = off)
    [schedule]   warmup_steps (linear warm-up), decay = constant | linear | cosine |
                 polynomial, decay_steps (0 = until the last step), final_lr_ratio, power
    [kfac]       damping, damping_mode (pi | plain), ema, kl_clip (0 = off), fisher
    [eval]       every (0 = only at the end), batches
    [log]        every: metrics are reduced across ranks every so many steps (one small
                 collective; 1 = every step, which adds a synchronisation to every step)

The plan fixes kfac.refresh_steps, kfac.inverse, data.micro_batch, data.seq_len and
data.micro_batches: they may be written (and then must agree), never changed here.

Defaults are the values benchmarks/convergence.py selected for bert-tiny (K-FAC: lr 0.1,
momentum 0.9, damping 1e-4, EMA 0.9, KL clip 1e-5; AdamW lr 1e-3). `--set` values are
TOML values (`--set kfac.damping=1e-4`, `--set optimizer.adam_betas=[0.9,0.98]`); a bare
word is a string (`--set schedule.decay=cosine`). Later `--set`s win over earlier ones and
over the file. Every problem is a one-line InputError naming the file (or --set) and key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pfcompile.formats.errors import InputError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

# key -> (type, default, help). Types: int, float, str, bool, "pair" (two floats).
FIELDS: dict[str, tuple[object, object, str]] = {
    "train.steps": (int, 10, "training steps"),
    "train.seed": (int, 0, "model and data seed"),
    "optimizer.lr": (float, 0.1, "SGD learning rate of the K-FAC layers"),
    "optimizer.momentum": (float, 0.9, "SGD momentum"),
    "optimizer.weight_decay": (float, 0.0, "SGD weight decay"),
    "optimizer.adam_lr": (float, 1e-3, "AdamW learning rate (parameters K-FAC does not cover)"),
    "optimizer.adam_betas": ("pair", [0.9, 0.999], "AdamW betas"),
    "optimizer.adam_weight_decay": (float, 0.01, "AdamW weight decay"),
    "optimizer.max_grad_norm": (float, 0.0, "clip the global gradient norm to this (0: off)"),
    "schedule.warmup_steps": (int, 0, "linear warm-up steps"),
    "schedule.decay": (str, "constant", "constant | linear | cosine | polynomial"),
    "schedule.decay_steps": (int, 0, "decay length after warm-up (0: until the last step)"),
    "schedule.final_lr_ratio": (float, 0.0, "decayed rate / peak rate"),
    "schedule.power": (float, 1.0, "polynomial decay exponent"),
    "kfac.damping": (float, 1e-4, "Tikhonov damping"),
    "kfac.damping_mode": (str, "pi", "pi | plain (plain needs an eigen plan)"),
    "kfac.ema": (float, 0.9, "factor EMA"),
    "kfac.kl_clip": (float, 1e-5, "KL clip (0: off)"),
    "kfac.fisher": (str, "empirical", "empirical (the pipeline runtime's only kind) | mc"),
    "kfac.refresh_steps": (int, None, "fixed by the plan"),
    "kfac.inverse": (str, None, "fixed by the plan"),
    "data.micro_batch": (int, None, "fixed by the plan"),
    "data.seq_len": (int, None, "fixed by the plan"),
    "data.micro_batches": (int, None, "fixed by the plan"),
    "eval.every": (int, 0, "evaluate every E steps (0: only after the last step)"),
    "eval.batches": (int, 8, "held-out batches per evaluation"),
    "log.every": (int, 10, "reduce and write metrics every L steps"),
}

# The plan fixes these: key -> (where in the plan, how to read it).
PLAN_FIXED = {
    "kfac.refresh_steps": ("config.refresh_steps", lambda plan: plan.refresh_steps),
    "kfac.inverse": ("config.inverse", lambda plan: plan.config.inverse),
    "data.micro_batch": ("model.micro_batch", lambda plan: plan.model.get("micro_batch")),
    "data.seq_len": ("model.seq_len", lambda plan: plan.model.get("seq_len")),
    "data.micro_batches": ("config.micro_batches", lambda plan: plan.config.micro_batches),
}


@dataclass
class TrainConfig:
    """The effective settings (`values`) and where each non-default one came from."""
    values: dict[str, object] = field(default_factory=lambda: {k: d for k, (_, d, _) in FIELDS.items()})
    source: dict[str, str] = field(default_factory=dict)

    def __getitem__(self, key: str):
        return self.values[key]

    def set(self, key: str, value, where: str) -> None:
        if key not in FIELDS:
            section = key.split(".")[0]
            known = [k for k in FIELDS if k.startswith(section + ".")] or list(FIELDS)
            raise InputError(where, key, f"unknown key; known: {', '.join(known)}")
        self.values[key] = _typed(key, value, where)
        self.source[key] = where

    # --- what the rest of the runtime builds from it ---------------------------------------
    def kfac_config(self):
        from runtime.kfac import KfacConfig

        kl = self["kfac.kl_clip"]
        return KfacConfig(damping=self["kfac.damping"], ema=self["kfac.ema"], damping_mode=self["kfac.damping_mode"],
                          inverse=self["kfac.inverse"] or "cholesky", fisher=self["kfac.fisher"],
                          kl_clip=kl if kl > 0 else None, refresh_steps=self["kfac.refresh_steps"] or 1)

    def optim_config(self):
        from runtime.optim import OptimConfig

        steps, warm = self["train.steps"], self["schedule.warmup_steps"]
        decay_steps = self["schedule.decay_steps"] or max(1, steps - warm)
        return OptimConfig(lr=self["optimizer.lr"], momentum=self["optimizer.momentum"],
                           weight_decay=self["optimizer.weight_decay"], adam_lr=self["optimizer.adam_lr"],
                           adam_betas=tuple(self["optimizer.adam_betas"]),
                           adam_weight_decay=self["optimizer.adam_weight_decay"], warmup_steps=warm,
                           decay=self["schedule.decay"], decay_steps=decay_steps,
                           final_lr_ratio=self["schedule.final_lr_ratio"], power=self["schedule.power"])

    def to_toml(self) -> str:
        """The effective config as a TOML file `--config` reads back."""
        lines, section = [], None
        for key, value in self.values.items():
            sec, name = key.split(".", 1)
            if value is None:
                continue
            if sec != section:
                lines += ([""] if lines else []) + [f"[{sec}]"]
                section = sec
            lines.append(f"{name} = {_toml_value(value)}")
        return "\n".join(lines) + "\n"


def load(path: str | None, overrides: list[str] = (), flags: dict[str, tuple[object, str]] | None = None) -> TrainConfig:
    """Defaults, then the TOML file, then each `--set KEY=VALUE` in order, then the shorthand
    flags ({key: (value, flag name)}, e.g. --steps)."""
    cfg = TrainConfig()
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
    for key, (value, flag) in (flags or {}).items():
        if value is not None:
            cfg.set(key, value, flag)
    _check_ranges(cfg)
    return cfg


def apply_plan(cfg: TrainConfig, plan, plan_path: str) -> None:
    """Fill the plan-fixed keys from the plan; a config that says otherwise is an error."""
    for key, (plan_field, read) in PLAN_FIXED.items():
        fixed = read(plan)
        if key in cfg.source and cfg[key] != fixed:
            raise InputError(cfg.source[key], key, f"is {cfg[key]!r} but the plan fixes it at {fixed!r} "
                             f"({plan_path} {plan_field}); remove the key or plan again")
        cfg.values[key] = fixed
    if cfg["kfac.fisher"] != "empirical" and plan.config.kfac:
        raise InputError(cfg.source.get("kfac.fisher", "config"), "kfac.fisher",
                         f"{cfg['kfac.fisher']!r}: the pipeline runtime computes only the empirical Fisher")
    if cfg["kfac.damping_mode"] == "plain" and cfg["kfac.inverse"] != "eigen":
        raise InputError(cfg.source.get("kfac.damping_mode", "config"), "kfac.damping_mode",
                         f"'plain' needs an eigen-inverse plan; {plan_path} inverts by {cfg['kfac.inverse']}")


def _check_ranges(cfg: TrainConfig) -> None:
    from runtime.optim import DECAYS

    def bad(key, why):
        raise InputError(cfg.source.get(key, "config"), key, f"{cfg[key]!r}: {why}")

    for key in ("train.steps", "log.every", "eval.batches"):
        if cfg[key] < 1:
            bad(key, "must be >= 1")
    for key in ("schedule.warmup_steps", "schedule.decay_steps", "eval.every", "train.seed"):
        if cfg[key] < 0:
            bad(key, "must be >= 0")
    for key in ("optimizer.lr", "optimizer.adam_lr", "optimizer.weight_decay", "optimizer.adam_weight_decay",
                "optimizer.max_grad_norm", "optimizer.momentum", "kfac.kl_clip", "schedule.power"):
        if not (cfg[key] >= 0 and math.isfinite(cfg[key])):
            bad(key, "must be a finite number >= 0")
    if not cfg["kfac.damping"] > 0:
        bad("kfac.damping", "must be > 0")
    if not 0 <= cfg["kfac.ema"] < 1:
        bad("kfac.ema", "must be in [0, 1)")
    if not 0 <= cfg["schedule.final_lr_ratio"] <= 1:
        bad("schedule.final_lr_ratio", "must be in [0, 1]")
    if not all(0 <= b < 1 for b in cfg["optimizer.adam_betas"]):
        bad("optimizer.adam_betas", "both must be in [0, 1)")
    choices = {"schedule.decay": DECAYS, "kfac.damping_mode": ("pi", "plain"), "kfac.fisher": ("empirical", "mc"),
               "kfac.inverse": ("cholesky", "eigen", None)}
    for key, allowed in choices.items():
        if cfg[key] not in allowed:
            bad(key, f"must be one of {', '.join(a for a in allowed if a)}")


def _typed(key: str, value, where: str):
    kind = FIELDS[key][0]
    ok = {int: isinstance(value, int) and not isinstance(value, bool),
          float: isinstance(value, (int, float)) and not isinstance(value, bool),
          str: isinstance(value, str), bool: isinstance(value, bool),
          "pair": isinstance(value, list) and len(value) == 2
          and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)}[kind]
    if not ok:
        want = {int: "an integer", float: "a number", str: "a string", bool: "true or false",
                "pair": "a list of two numbers"}[kind]
        raise InputError(where, key, f"must be {want}, got {value!r}")
    if kind is float:
        return float(value)
    if kind == "pair":
        return [float(v) for v in value]
    return value


def _parse_value(text: str):
    """A TOML value; a bare word that is not one is a string (schedule.decay=cosine)."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)
