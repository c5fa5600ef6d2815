"""A user's own model for pfcompile: `--model my_model:build` (with examples/ on PYTHONPATH).

A model spec is any object with `cfg` (a runtime.models.ModelConfig: sizes, kind, vocab),
`part_names` (embed, blocks..., head: the order a pipeline cuts) and
`build_part(part_name, seed)` returning that part as an nn.Module, built from
(seed, part name) alone. Parts follow the call convention of runtime.models:
embed(tokens) -> h, block(h) -> h, head(h, targets) -> loss (head(h) -> logits).

This one is a small causal LM whose blocks use a gated (SwiGLU) feed-forward; every
nn.Linear in a block (attn.q/k/v/out, mlp.gate/up/down) is covered by K-FAC.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from runtime.models import Attention, Embed, Head, ModelConfig, part_seed

CFG = ModelConfig(name="my-glu-lm", kind="gpt", layers=3, hidden=48, heads=3, ffn=96)


class GluBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.hidden), nn.LayerNorm(cfg.hidden)
        self.attn = Attention(cfg)
        self.mlp = nn.ModuleDict({"gate": nn.Linear(cfg.hidden, cfg.ffn), "up": nn.Linear(cfg.hidden, cfg.ffn),
                                  "down": nn.Linear(cfg.ffn, cfg.hidden)})

    def forward(self, h):
        h = h + self.attn(self.ln1(h))
        x = self.ln2(h)
        return h + self.mlp["down"](F.silu(self.mlp["gate"](x)) * self.mlp["up"](x))


class GluLM:
    cfg = CFG
    part_names = ["embed", *(f"block{i}" for i in range(CFG.layers)), "head"]

    def build_part(self, part_name: str, seed: int = 0) -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(part_seed(seed, part_name))  # same weights whichever rank builds it
            if part_name == "embed":
                return Embed(self.cfg)
            if part_name == "head":
                return Head(self.cfg)
            if part_name in self.part_names:
                return GluBlock(self.cfg)
        raise ValueError(f"{self.cfg.name} has no part {part_name!r}")


def build() -> GluLM:
    return GluLM()


def not_a_model():
    return "this is not a model spec"
