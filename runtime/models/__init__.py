"""The models: built-in transformers (transformer), `transformers` models (hf), and specs
resolved to stages (stages). `from runtime.models import ...` is the public API: what a
user's model code, the examples and the tests import.
"""

from runtime.models.stages import (
    BuiltinModel,
    PipelineModel,
    Stage,
    build_model,
    build_stage,
    kfac_linears,
    load_trained,
    resolve_config,
    resolve_model,
    split_parts,
)
from runtime.models.transformer import (
    ARCHS,
    IGNORE_INDEX,
    MODEL_CONFIGS,
    Attention,
    Block,
    Embed,
    Head,
    ModelConfig,
    ModelSpecError,
    build_part,
    lm_loss,
    part_names,
    part_seed,
)

__all__ = [
    "ARCHS", "IGNORE_INDEX", "MODEL_CONFIGS", "Attention", "Block", "BuiltinModel", "Embed", "Head", "ModelConfig",
    "ModelSpecError", "PipelineModel", "Stage", "build_model", "build_part", "build_stage", "kfac_linears",
    "lm_loss", "load_trained", "part_names", "part_seed", "resolve_config", "resolve_model", "split_parts",
]
