"""The runtime's optimizers, one entry each: everything the runtime needs of an optimizer
besides its declaration (pfcompile.formats.optimizers: its op kinds, when each runs).

An entry names, as callables or as "package.module:attribute" strings (imported on first use,
so this module and runtime.config load without torch):

- `config`: JobConfig -> the math module's config (None: no covered layers, AdamW only),
  an instance of `config_class`; `section` is the JobConfig section holding its settings;
- `make_layer(name, linear, math_config, micro_batches)`: one covered layer's state (K-FAC's
  with its capture hooks attached). A layer has one method per op kind of the declaration
  that is not a collective (`curv_a`, `inv`, `precond`, ...), each called with the keywords
  `mb`, `factor` and `cycle_step` (the step's position in the refresh cycle, 0 on refresh
  steps), taking what it needs;
- `stage_optimizer(module, layers, OptimConfig)`: what applies the layers' update directions
  (and AdamW on the rest);
- `kl_clip`: it KL-clips (the math config's kl_clip), `captures`: its layers capture inputs
  and output gradients in forwards and backwards (kfac.capturing), `clip_first`: gradient
  clipping scales the gradient before its per-step ops (Muon: they fold the gradient into
  state), else after them (linear in the gradient: K-FAC, Shampoo), and `base_lr`, the
  config key of the rate its covered weights follow; `title` and `refresh_what` name it and
  what its per-cycle op computes of a factor in the divergence message.

Registering an optimizer is one `register(...)` call in its own module; an optimizer named
"package.module:attribute" is that module's entry, imported on demand.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

from pfcompile.formats import optimizers as declarations
from pfcompile.formats.optimizers import Optimizer as Declaration
from runtime.config import job


def _load(ref):
    """A callable given as itself or as "package.module:attribute"."""
    if not isinstance(ref, str):
        return ref
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class OptimizerEntry:
    name: str
    config: Callable | str | None = None
    config_class: type | str | None = None
    make_layer: Callable | str | None = None
    stage_optimizer: Callable | str = "runtime.optimizers.stage:SgdOnCoveredOptimizer"
    section: str | None = None
    settings: type | None = None   # a plugin's own section class (runtime.config.job.register_section)
    kl_clip: bool = False
    captures: bool = False
    clip_first: bool = False
    base_lr: str = "optimizer.lr"
    title: str = ""                # its name in messages (default: `name`)
    refresh_what: str = "refresh"  # what its per-cycle op computes of a factor, in messages
    declaration: Declaration | None = field(default=None, compare=False)  # None: the contract's of `name`

    def __post_init__(self):
        if not self.title:
            object.__setattr__(self, "title", self.name)

    @property
    def ops(self) -> Declaration:
        return self.declaration if self.declaration is not None else declarations.optimizer(self.name)

    def math_config(self, job):
        return None if self.config is None else _load(self.config)(job)

    def layer(self, name: str, linear, math_config, micro_batches: int):
        return _load(self.make_layer)(name, linear, math_config, micro_batches)

    def build_stage_optimizer(self, module, layers, optim_cfg):
        return _load(self.stage_optimizer)(module, layers, optim_cfg)



@dataclass(frozen=True)
class OpContext:
    """Where a layer op runs: its micro-batch and factor (None where the op has none), and
    the step's position in the refresh cycle."""
    mb: int | None = None
    factor: str | None = None
    cycle_step: int = 0

    def keywords(self) -> dict:
        return {"mb": self.mb, "factor": self.factor, "cycle_step": self.cycle_step}


_ENTRIES: dict[str, OptimizerEntry] = {}


def register(entry: OptimizerEntry) -> OptimizerEntry:
    """Add (or replace) an optimizer, and its own settings section if it brings one; returns
    the entry (a plugin module keeps it as an attribute)."""
    if entry.settings is not None:
        job.register_section(entry.section or entry.name, entry.settings)
    _add(entry.name, entry)
    return entry


def _add(name: str, entry: OptimizerEntry) -> None:
    """Known under `name`; the job config learns which section holds its settings."""
    _ENTRIES[name] = entry
    job.OPTIMIZER_SECTIONS[name] = entry.section or entry.name


def unregister(entry: OptimizerEntry) -> None:
    """Remove an entry (under every name it was found by) and the settings section it brought."""
    for name in [n for n, e in _ENTRIES.items() if e is entry]:
        del _ENTRIES[name]
        job.OPTIMIZER_SECTIONS.pop(name, None)
    if entry.settings is not None:
        job.unregister_section(entry.section or entry.name)


def names() -> tuple[str, ...]:
    return tuple(_ENTRIES)


def entry(name: str) -> OptimizerEntry:
    """The entry of `name`: a registered one, or "package.module:attribute" (imported; the
    attribute is an OptimizerEntry, registered under that name). A ValueError lists the known."""
    if name in _ENTRIES:
        return _ENTRIES[name]
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            found = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"optimizer {name!r}: cannot import it ({e})") from None
        if not isinstance(found, OptimizerEntry):
            raise ValueError(f"optimizer {name!r} is not a runtime.optimizers.registry.OptimizerEntry")
        _add(name, found)
        return found
    raise ValueError(f"unknown optimizer {name!r} (known: {', '.join(_ENTRIES)}, or package.module:entry)")


def entry_of_config(math_config) -> OptimizerEntry:
    """The entry whose math config `math_config` is (None: AdamW's)."""
    if math_config is None:
        return _ENTRIES["adamw"]
    for e in _ENTRIES.values():
        if e.config_class is not None and isinstance(math_config, _load(e.config_class)):
            return e
    raise ValueError(f"no optimizer has a config of type {type(math_config).__name__}")


register(OptimizerEntry("kfac", config="runtime.optimizers.kfac:kfac_config",
                        config_class="runtime.optimizers.kfac:KfacConfig",
                        make_layer="runtime.optimizers.kfac:make_layer", section="kfac",
                        kl_clip=True, captures=True, title="K-FAC", refresh_what="inversion"))
register(OptimizerEntry("shampoo", config="runtime.optimizers.shampoo:shampoo_config",
                        config_class="runtime.optimizers.shampoo:ShampooConfig",
                        make_layer="runtime.optimizers.shampoo:make_layer",
                        stage_optimizer="runtime.optimizers.shampoo:stage_optimizer", section="shampoo",
                        base_lr="shampoo.lr", title="Shampoo", refresh_what="inverse fourth root"))
register(OptimizerEntry("soap", config="runtime.optimizers.soap:soap_config",
                        config_class="runtime.optimizers.soap:SoapConfig",
                        make_layer="runtime.optimizers.soap:make_layer",
                        stage_optimizer="runtime.optimizers.soap:stage_optimizer", section="soap",
                        clip_first=True, base_lr="soap.lr", title="SOAP", refresh_what="eigenbasis"))
register(OptimizerEntry("muon", config="runtime.optimizers.muon:muon_config",
                        config_class="runtime.optimizers.muon:MuonConfig",
                        make_layer="runtime.optimizers.muon:make_layer",
                        stage_optimizer="runtime.optimizers.stage:MuonOptimizer", section="muon",
                        clip_first=True, base_lr="muon.lr", title="Muon"))
register(OptimizerEntry("adamw", base_lr="optimizer.adam_lr", title="AdamW"))
