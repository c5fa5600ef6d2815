"""A Hugging Face `transformers` causal LM of the Llama layout as pipeline parts:
`--model hf:PATH`, PATH a config.json (random weights) or a directory holding config.json
and safetensors weights (model.safetensors, or shards with model.safetensors.index.json).

PATH is data, not code: the runtime rebuilds the model from the plan's name without
--model-code. A relative PATH is resolved against the current directory of the command that
reads it (profile, runtime, evaluate), so run them from the same directory. Nothing is
fetched from a model hub: the config and the weights are read from local files only, and
HF_HUB_OFFLINE is set before `transformers` loads.

The cut (the Llama module layout: Llama, Mistral, Qwen2, Qwen3):
    embed  = model.embed_tokens                    tokens -> h
    blockI = model.layers[I] with its rotary table h -> h (cos/sin and the causal mask are
                                                   made inside, so only h crosses stages)
    head   = model.norm + lm_head                  h -> next-token loss or logits
Each part is the `transformers` module itself (materialised from a meta-device model), so
it computes what the uncut model computes. Random weights follow `transformers`'
initialisation (N(0, initializer_range), unit norms), drawn per (seed, part name) like the
built-in models; weights in the folder replace them (the seed then changes nothing). A config with tied embeddings (tie_word_embeddings) is trained UNTIED: the
head starts as a copy of the embedding, and a saved model says tie_word_embeddings false.

Saved models (runtime --save-model DIR/model.safetensors) use the `transformers` parameter
names and write DIR/config.json beside, so `AutoModelForCausalLM.from_pretrained(DIR)` loads
them (`hf_state_dict`, `save_pretrained`).
"""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path

import torch
import torch.nn as nn

from runtime.models.transformer import ModelConfig, ModelSpecError, lm_loss, part_seed

PREFIX = "hf:"
# model_types whose causal LM is embed -> decoder layers -> norm -> lm_head with nothing else
# in the model's forward (no embedding scale, no logit soft-cap): the cut computes the same.
LLAMA_LAYOUT = ("llama", "mistral", "qwen2", "qwen3")
WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"


def _transformers():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local files only: never reach a model hub
    try:
        import transformers
    except ImportError:
        raise ModelSpecError("hf: models need the `transformers` package: pip install '.[hf]'") from None
    return transformers


# --- parameter names: pipeline <-> transformers ------------------------------------------------
def hf_name(part: str, local: str) -> str:
    """The `transformers` name of a part's parameter (`block3`, `self_attn.q_proj.weight` ->
    `model.layers.3.self_attn.q_proj.weight`)."""
    if part == "embed":
        return f"model.{local}"
    if part == "head":
        return local if local.startswith("lm_head.") else f"model.{local}"
    return f"model.layers.{int(part[5:])}.{local.removeprefix('layer.')}"


def part_name_of(name: str) -> tuple[str, str]:
    """(part, local name) of a `transformers` parameter name; the inverse of hf_name."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if m:
        return f"block{m[1]}", f"layer.{m[2]}"
    if name.startswith("model.embed_tokens."):
        return "embed", name.removeprefix("model.")
    if name.startswith("model.norm.") or name.startswith("lm_head."):
        return "head", name.removeprefix("model.")
    raise ModelSpecError(f"{name!r} is not a parameter of the Llama layout")


# --- parts -------------------------------------------------------------------------------------
class HFEmbed(nn.Module):
    def __init__(self, embed_tokens: nn.Embedding):
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(tokens)


class HFBlock(nn.Module):
    """One decoder layer. The rotary table and the causal mask are made here, as the uncut
    model makes them once for all layers: what crosses a stage stays one hidden state."""

    def __init__(self, layer: nn.Module, rotary: nn.Module, attn_implementation: str):
        super().__init__()
        self.layer, self.rotary = layer, rotary
        self.eager = attn_implementation == "eager"

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        t = h.shape[1]
        positions = torch.arange(t, device=h.device)[None]
        cos_sin = self.rotary(h, positions)
        # eager attention adds the mask; SDPA and flash attention are causal when given none
        # (as transformers' own create_causal_mask leaves it for an unpadded batch)
        mask = None
        if self.eager:
            mask = torch.full((t, t), torch.finfo(h.dtype).min, dtype=h.dtype, device=h.device).triu(1)[None, None]
        out = self.layer(h, attention_mask=mask, position_ids=positions, position_embeddings=cos_sin)
        return out[0] if isinstance(out, tuple) else out  # transformers 4.x returns a tuple


class HFHead(nn.Module):
    def __init__(self, norm: nn.Module, lm_head: nn.Linear):
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, h: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.lm_head(self.norm(h))
        return logits if targets is None else lm_loss(logits, targets)


# --- the spec ------------------------------------------------------------------------------------
class HFModel:
    """The model spec (`cfg`, `part_names`, `build_part`) of `hf:PATH`."""

    def __init__(self, name: str, seq_len: int | None = None):
        self.name = name
        path = Path(name[len(PREFIX):])
        if path.is_dir():
            config_file, self.weights_dir = path / "config.json", path
        else:
            config_file, self.weights_dir = path, None
        if not config_file.is_file():
            raise ModelSpecError(f"model {name!r}: {config_file}: no such file (PATH is a config.json "
                                 "or a directory holding one)")
        try:
            raw = json.loads(config_file.read_text())
            model_type = raw["model_type"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ModelSpecError(f"{config_file}: not a transformers config.json with model_type "
                                 f"({type(e).__name__})") from None
        if model_type not in LLAMA_LAYOUT:
            raise ModelSpecError(f"{config_file}: model_type {model_type!r} is not one of the Llama layout this "
                                 f"cut supports ({', '.join(LLAMA_LAYOUT)})")
        tf = _transformers()
        try:
            config = tf.CONFIG_MAPPING[model_type].from_json_file(str(config_file))
            with torch.device("meta"):  # the structure only: no memory, even at 8B
                self.meta = tf.AutoModelForCausalLM.from_config(config)
        except (OSError, ValueError, TypeError, KeyError) as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ModelSpecError(f"{config_file}: transformers cannot build it ({msg})") from None
        inner = getattr(self.meta, "model", None)
        lacking = [a for a in ("embed_tokens", "layers", "norm", "rotary_emb") if not hasattr(inner, a)]
        if lacking or not hasattr(self.meta, "lm_head"):
            raise ModelSpecError(f"{config_file}: transformers {tf.__version__} builds {type(self.meta).__name__} without "
                                 f"model.{(lacking or ['lm_head'])[0]} (the cut needs the Llama layout of recent versions)")
        self.config_file = config_file
        self.hf_config = self.meta.config
        c = self.hf_config
        self.cfg = ModelConfig(name, "gpt", c.num_hidden_layers, c.hidden_size, c.num_attention_heads,
                               c.intermediate_size, c.vocab_size, c.max_position_embeddings, arch="hf",
                               kv_heads=c.num_key_value_heads, norm_eps=c.rms_norm_eps)
        self.part_names = ["embed", *(f"block{i}" for i in range(c.num_hidden_layers)), "head"]
        self.tied = bool(getattr(c, "tie_word_embeddings", False))
        window = self._sliding_window()
        if seq_len is not None and window is not None and seq_len > window:
            raise ModelSpecError(f"{config_file}: sliding_window {window} is shorter than seq_len {seq_len}; "
                                 "the pipeline attends over the whole sequence")
        self._files = self._weight_files() if self.weights_dir else {}

    def _sliding_window(self) -> int | None:
        c = self.hf_config
        window = getattr(c, "sliding_window", None)
        layer_types = getattr(c, "layer_types", None)
        if not window or getattr(c, "use_sliding_window", True) is False:
            return None
        if layer_types is not None and "sliding_attention" not in layer_types:
            return None
        return int(window)

    def _weight_files(self) -> dict[str, Path]:
        """`transformers` parameter name -> the safetensors file holding it ({} without weights)."""
        from safetensors import safe_open

        d = self.weights_dir
        if (d / INDEX).is_file():
            try:
                weight_map = json.loads((d / INDEX).read_text())["weight_map"]
                return {k: d / f for k, f in weight_map.items()}
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ModelSpecError(f"{d / INDEX}: not a safetensors index with weight_map ({type(e).__name__})") from None
        if not (d / WEIGHTS).is_file():
            return {}
        try:
            with safe_open(str(d / WEIGHTS), framework="pt") as f:
                return {k: d / WEIGHTS for k in f.keys()}
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types; one line
            raise ModelSpecError(f"{d / WEIGHTS}: cannot read safetensors ({str(e).splitlines()[0]})") from None

    def _materialise(self, module: nn.Module) -> nn.Module:
        """A real (CPU, uninitialised) copy of a meta-device submodule; the config is shared."""
        real = copy.deepcopy(module, memo={id(self.hf_config): self.hf_config}).to_empty(device="cpu")
        return real.float()  # whatever dtype the config names: the stage casts to the run's

    def _std(self) -> float:
        return getattr(self.hf_config, "initializer_range", None) or 0.02

    def _embedding_init(self, seed: int) -> torch.Tensor:
        """The embedding's random weight: also the tied head's starting weight."""
        embed = self.meta.model.embed_tokens
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(part_seed(seed, "embed"))
            w = torch.empty(embed.weight.shape).normal_(0.0, self._std())
        if embed.padding_idx is not None:
            w[embed.padding_idx] = 0
        return w

    def _init(self, part: nn.Module) -> None:
        """`transformers`' initialisation: N(0, initializer_range) Linear and Embedding
        weights, zero biases (and padding row), norms' weights one."""
        std = self._std()
        for m in part.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0.0, std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, 0.0, std)
                if m.padding_idx is not None:
                    with torch.no_grad():
                        m.weight[m.padding_idx].zero_()
            else:
                for pname, p in m.named_parameters(recurse=False):
                    nn.init.ones_(p) if pname == "weight" else nn.init.zeros_(p)

    def build_part(self, part_name: str, seed: int = 0) -> nn.Module:
        model = self.meta.model
        if part_name == "embed":
            part = HFEmbed(self._materialise(model.embed_tokens))
        elif part_name == "head":
            part = HFHead(self._materialise(model.norm), self._materialise(self.meta.lm_head))
        elif part_name in self.part_names:
            rotary = type(model.rotary_emb)(config=self.hf_config)  # real buffers, made from the config
            part = HFBlock(self._materialise(model.layers[int(part_name[5:])]), rotary,
                           self.hf_config._attn_implementation)
        else:
            raise ModelSpecError(f"model {self.name!r} has no part {part_name!r} "
                                 f"(parts: embed, block0..block{len(self.part_names) - 3}, head)")
        if self._files:
            self._load(part_name, part)
            return part
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(part_seed(seed, part_name))
            if part_name == "embed":
                with torch.no_grad():
                    part.embed_tokens.weight.copy_(self._embedding_init(seed))
            else:
                self._init(part)
        if part_name == "head" and self.tied:
            with torch.no_grad():
                part.lm_head.weight.copy_(self._embedding_init(seed))
        return part

    def _load(self, part_name: str, part: nn.Module) -> None:
        """The part's parameters from the safetensors weights (by `transformers` name)."""
        from safetensors import safe_open

        for local, p in part.named_parameters():
            key = hf_name(part_name, local)
            if key not in self._files and key == "lm_head.weight" and self.tied:
                key = "model.embed_tokens.weight"
            if key not in self._files:
                raise ModelSpecError(f"{self.weights_dir}: no tensor {key!r} in the safetensors weights")
            with safe_open(str(self._files[key]), framework="pt") as f:
                t = f.get_tensor(key)
            if t.shape != p.shape:
                raise ModelSpecError(f"{self._files[key]}: {key!r} has shape {list(t.shape)}, "
                                     f"the config makes {list(p.shape)}")
            with torch.no_grad():
                p.copy_(t.to(p.dtype))

    # --- saving --------------------------------------------------------------------------------
    @staticmethod
    def hf_state_dict(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The unpipelined model's tensors (`parts.block0.layer.…`) by `transformers` names."""
        out = {}
        for name, t in tensors.items():
            part, _, local = name.removeprefix("parts.").partition(".")
            out[hf_name(part, local)] = t
        return out

    @staticmethod
    def pipeline_state_dict(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The inverse of hf_state_dict."""
        out = {}
        for name, t in tensors.items():
            part, local = part_name_of(name)
            out[f"parts.{part}.{local}"] = t
        return out

    def save_config(self, directory: str | Path, dtype: torch.dtype) -> None:
        """config.json of the trained model: untied (the pipeline trains the head on its own)."""
        config = copy.deepcopy(self.hf_config)
        config.tie_word_embeddings = False
        config.architectures = [type(self.meta).__name__]
        config.torch_dtype = dtype
        config.save_pretrained(str(directory))


def resolve(name: str, seq_len: int | None = None) -> HFModel:
    return HFModel(name, seq_len)
