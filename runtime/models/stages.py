"""Model specs and stages: a name, a ModelConfig, "hf:PATH" or "package.module:function"
resolved to a spec (`cfg`, `part_names`, `build_part`), a stage as a contiguous run of its
parts, the uncut model, the covered Linears, and a trained model file loaded back.

The built-in architectures are in runtime.models.transformer, `transformers` models in
runtime.models.hf; this module is the one that chooses between them.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Iterable
from dataclasses import replace

import torch
import torch.nn as nn

from runtime.models import hf
from runtime.models.transformer import MODEL_CONFIGS, ModelConfig, ModelSpecError, build_part, part_names


# --- model specs: built-in configs and user models --------------------------------------
class BuiltinModel:
    """The model-spec interface (`cfg`, `part_names`, `build_part`) for a ModelConfig.

    A user model (resolve_model("pkg.mod:fn")) is any object with the same three members.
    """

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self.part_names = part_names(cfg)

    def build_part(self, part_name: str, seed: int = 0) -> nn.Module:
        return build_part(self.cfg, part_name, seed)


def _valid_names() -> str:
    return ", ".join(MODEL_CONFIGS) + ", hf:PATH (a transformers config.json or model directory), or package.module:function"


def resolve_config(name_or_spec: str | ModelConfig | dict, vocab: int | None = None, seq_len: int | None = None) -> ModelConfig:
    """A built-in name (or a ModelConfig / its dict) -> ModelConfig, with vocab/seq_len overrides."""
    if isinstance(name_or_spec, ModelConfig):
        cfg = name_or_spec
    elif isinstance(name_or_spec, dict):
        try:
            cfg = ModelConfig.from_dict(name_or_spec)
        except TypeError as e:
            raise ModelSpecError(f"bad model spec {name_or_spec!r:.80}: {e}") from None
    elif isinstance(name_or_spec, str) and name_or_spec in MODEL_CONFIGS:
        cfg = MODEL_CONFIGS[name_or_spec]
    else:
        raise ModelSpecError(f"unknown model {name_or_spec!r:.80}; valid: {_valid_names()}")
    if vocab is not None:
        cfg = replace(cfg, vocab=vocab)
    if seq_len is not None:
        cfg = replace(cfg, max_seq_len=max(cfg.max_seq_len, seq_len))
    return cfg


def resolve_model(name_or_spec, vocab: int | None = None, seq_len: int | None = None):
    """Anything naming a model -> an object with `cfg`, `part_names`, `build_part(name, seed)`.

    Accepts a built-in name, a ModelConfig, a spec object, "hf:PATH" (a `transformers`
    config or model directory: runtime.models.hf) or "package.module:function" (the function is
    called with no arguments and must return a spec object).
    """
    if hasattr(name_or_spec, "build_part") and hasattr(name_or_spec, "part_names"):
        return name_or_spec
    if isinstance(name_or_spec, str) and name_or_spec.startswith("hf:"):
        return hf.resolve(name_or_spec, seq_len)
    if isinstance(name_or_spec, str) and ":" in name_or_spec:
        mod_name, _, fn_name = name_or_spec.partition(":")
        try:
            fn = getattr(importlib.import_module(mod_name), fn_name)
            spec = fn()
        except Exception as e:  # noqa: BLE001 - any failure is the user's spec; report it in one line
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ModelSpecError(f"model {name_or_spec!r}: cannot load ({type(e).__name__}: {msg}); valid: {_valid_names()}") from None
        if not all(hasattr(spec, a) for a in ("cfg", "part_names", "build_part")):
            raise ModelSpecError(f"model {name_or_spec!r}: {fn_name}() returned {type(spec).__name__}, "
                                 f"not an object with cfg, part_names, build_part; valid: {_valid_names()}")
        return spec
    return BuiltinModel(resolve_config(name_or_spec, vocab, seq_len))


def _as_spec(model):
    return model if hasattr(model, "build_part") else resolve_model(model)


# --- stages and the whole model --------------------------------------------------------
class Stage(nn.Module):
    """A contiguous run of parts. forward(x, targets=None): tokens or hidden states in;
    hidden states out, or the loss (logits if targets is None) when the stage holds the head."""

    def __init__(self, model, names: Iterable[str], seed: int = 0, dtype: torch.dtype | None = None):
        super().__init__()
        spec = _as_spec(model)
        self.cfg = spec.cfg
        self.names = list(names)
        order = list(spec.part_names)
        idx = [order.index(n) if n in order else -1 for n in self.names]
        if not idx or -1 in idx or idx != list(range(idx[0], idx[0] + len(idx))):
            raise ModelSpecError(f"stage parts {self.names} are not a contiguous run of {order}")
        self.parts = nn.ModuleDict({n: spec.build_part(n, seed) for n in self.names})
        if dtype is not None:
            self.to(dtype)
        self.has_head = self.names[-1] == order[-1]

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        for name, part in self.parts.items():
            if name == self.names[-1] and self.has_head:
                return part(x, targets) if targets is not None else part(x)
            x = part(x)
        return x


def build_stage(model, names: Iterable[str], seed: int = 0, dtype: torch.dtype | None = None) -> Stage:
    return Stage(model, names, seed, dtype)


class PipelineModel(Stage):
    """The uncut model: one Stage holding every part."""

    def __init__(self, model, seed: int = 0, dtype: torch.dtype | None = None):
        super().__init__(model, _as_spec(model).part_names, seed, dtype)


def build_model(model, seed: int = 0, dtype: torch.dtype | None = None) -> PipelineModel:
    return PipelineModel(model, seed, dtype)


def split_parts(names: list[str], stages: int) -> list[list[str]]:
    """Cut parts into `stages` contiguous runs of near-equal length (tests, examples)."""
    if not 1 <= stages <= len(names):
        raise ValueError(f"cannot cut {len(names)} parts into {stages} stages")
    q, r = divmod(len(names), stages)
    out, i = [], 0
    for s in range(stages):
        n = q + (1 if s < r else 0)
        out.append(names[i:i + n])
        i += n
    return out


# --- K-FAC coverage ------------------------------------------------------------------------
DEFAULT_KFAC_PATTERNS = (r"^block\d+\.",)  # every Linear inside the blocks; not the vocabulary projection


def kfac_linears(module_with_parts: nn.Module,
                 include: Callable[[str], bool] | Iterable[str] | None = None) -> list[tuple[str, nn.Linear]]:
    """Every covered nn.Linear as ("{part}.{path}", module), in execution order.

    `include` is a predicate on the name or a list of regexes (any match covers the layer);
    the default covers the blocks' q, k, v, out, fc1, fc2.
    """
    if include is None or not callable(include):
        patterns = [re.compile(p) for p in (DEFAULT_KFAC_PATTERNS if include is None else include)]
        include = lambda name: any(p.search(name) for p in patterns)  # noqa: E731
    parts = module_with_parts.parts
    items = parts.items() if isinstance(parts, nn.ModuleDict) else zip(module_with_parts.names, parts)
    out = []
    for part_name, part in items:
        for path, m in part.named_modules():
            name = f"{part_name}.{path}"
            if isinstance(m, nn.Linear) and include(name):
                out.append((name, m))
    return out


# --- a trained model file ----------------------------------------------------------------------
def load_trained(path: str, model_code: str | None = None) -> tuple[PipelineModel, dict]:
    """The unpipelined model of a `--save-model` file (model.safetensors with model.json
    beside it) and its spec. A user model's code is imported only if `model_code` names it;
    a `transformers` model is rebuilt from the config.json saved beside. Raises
    ModelSpecError (one line) on a missing or mismatched pair."""
    import json
    from pathlib import Path

    from safetensors import SafetensorError
    from safetensors.torch import load_file

    spec_file = Path(path).with_suffix(".json")
    try:
        meta = json.loads(spec_file.read_text())
        name = meta["model"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelSpecError(f"{spec_file}: not a model spec written with the safetensors file ({type(e).__name__})") from None
    hf_names = name.startswith("hf:")
    if hf_names:  # saved in the transformers layout, its config.json beside (runtime.models.hf)
        config = spec_file.parent / "config.json"
        if not config.is_file():
            raise ModelSpecError(f"{config}: missing: the transformers config saved with {path}")
        spec = resolve_model(f"hf:{config}")
    elif ":" in name:
        if model_code != name:
            raise ModelSpecError(f"{spec_file}: model is user code {name!r}; pass --model-code {name} to allow importing it")
        spec = resolve_model(name)
    else:
        spec = resolve_model(resolve_config(meta["config"]))
    model = build_model(spec, dtype=getattr(torch, meta.get("dtype", "float32")))
    try:
        state = load_file(path)
    except (OSError, SafetensorError) as e:
        raise ModelSpecError(f"{path}: cannot read safetensors ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    if hf_names:
        try:
            state = spec.pipeline_state_dict(state)
        except ModelSpecError as e:
            raise ModelSpecError(f"{path}: {e}") from None
    missing = set(model.state_dict()) ^ set(state)
    if missing:
        raise ModelSpecError(f"{path}: tensors do not match model {name!r} (e.g. {sorted(missing)[0]!r})")
    model.load_state_dict(state)
    return model, meta
