"""Transformer models as an ordered list of parts: embed, block0..block{N-1}, head.

A pipeline stage holds a contiguous run of parts. Every part is built deterministically
from (seed, part name) alone, so a rank that builds only its own parts gets exactly the
weights the full model would have, and a model cut into any number of stages computes the
same loss and gradients as the uncut one.

Blocks are pre-LN (LayerNorm before attention and before the FFN, as in GPT-2/nanoGPT):
it trains without warm-up tricks at the small sizes the tests and demo use, and K-FAC sees
the same Linear layers (q, k, v, out, fc1, fc2) either way. The head is a final LayerNorm
plus the vocabulary projection; BERT and GPT differ only in the attention mask and in the
targets the data builds (masked tokens vs. the next token).

The Llama family (arch "llama", kind "gpt") is the decoder LLMs people train: RMSNorm,
rotary positions (no position table), SwiGLU, grouped-query attention, bias-free Linears
and an untied output head; K-FAC covers attn.q/k/v/out and mlp.gate/up/down. A Hugging
Face `transformers` model ("hf:PATH") is cut into the same parts by runtime.models.hf.

Part call convention (what a pipeline passes between stages):
    embed(tokens[b,T]) -> h[b,T,H];  block(h) -> h;  head(h, targets[b,T]) -> scalar loss
    (mean over target tokens, -100 ignored); head(h) -> logits[b,T,V].
"""

from __future__ import annotations

import math
import re
import zlib
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from pfcompile.formats import models as contract
from pfcompile.formats.models import CORPUS_VOCAB

IGNORE_INDEX = -100
ARCHS = ("gpt2", "llama", "hf")


class ModelSpecError(ValueError):
    """A model name or module:function that does not resolve. One line, lists valid names."""


@dataclass(frozen=True)
class ModelConfig:
    name: str
    kind: str  # "bert" (bidirectional, MLM) or "gpt" (causal, next token)
    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int = CORPUS_VOCAB
    max_seq_len: int = 128
    dropout: float = 0.0
    arch: str = "gpt2"       # "gpt2": LayerNorm, learned positions, GELU; "llama": see the module doc; "hf"
    kv_heads: int = 0        # grouped-query attention's key/value heads (llama); 0: as many as heads
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5   # RMSNorm's epsilon (llama)

    def __post_init__(self):
        if self.kind not in ("bert", "gpt"):
            raise ModelSpecError(f"model {self.name!r}: kind must be 'bert' or 'gpt', got {self.kind!r}")
        if self.arch not in ARCHS:
            raise ModelSpecError(f"model {self.name!r}: arch must be one of {', '.join(ARCHS)}, got {self.arch!r}")
        if self.arch == "llama" and self.kind != "gpt":
            raise ModelSpecError(f"model {self.name!r}: arch 'llama' is a causal LM (kind 'gpt'), got {self.kind!r}")
        # an hf model's head size is its config's (head_dim), not hidden / heads
        if self.arch != "hf" and self.hidden % self.heads:
            raise ModelSpecError(f"model {self.name!r}: hidden {self.hidden} is not divisible by heads {self.heads}")
        if self.kv_heads and self.heads % self.kv_heads:
            raise ModelSpecError(f"model {self.name!r}: heads {self.heads} is not divisible by kv_heads {self.kv_heads}")

    @property
    def groups(self) -> int:
        """Query heads per key/value head (1 without grouped-query attention)."""
        return self.heads // (self.kv_heads or self.heads)

    @property
    def causal(self) -> bool:
        return self.kind == "gpt"

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> ModelConfig:
        keys = ModelConfig.__dataclass_fields__
        return ModelConfig(**{k: v for k, v in d.items() if k in keys})


# the built-in models, from the contract's table (the verifier checks plans against it too)
MODEL_CONFIGS: dict[str, ModelConfig] = {name: ModelConfig(name, **sizes) for name, sizes in contract.BUILTIN_MODELS.items()}


# --- parts -------------------------------------------------------------------------------
class Embed(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos = nn.Embedding(cfg.max_seq_len, cfg.hidden)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        return self.drop(self.tok(tokens) + self.pos(pos))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # Registration order is execution order: kfac_linears relies on it.
        self.q = nn.Linear(cfg.hidden, cfg.hidden)
        self.k = nn.Linear(cfg.hidden, cfg.hidden)
        self.v = nn.Linear(cfg.hidden, cfg.hidden)
        self.out = nn.Linear(cfg.hidden, cfg.hidden)
        self.heads, self.causal = cfg.heads, cfg.causal
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        split = lambda y: y.view(b, t, self.heads, h // self.heads).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        # Explicit softmax attention (not SDPA) so float32 and float64 take the same path.
        att = (q @ k.transpose(-2, -1)) / math.sqrt(h // self.heads)
        if self.causal:
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            att = att.masked_fill(mask, float("-inf"))
        y = self.drop(att.softmax(-1)) @ v
        return self.out(y.transpose(1, 2).reshape(b, t, h))


class FFN(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden, cfg.ffn)
        self.fc2 = nn.Linear(cfg.ffn, cfg.hidden)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(F.gelu(self.fc1(x))))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.ffn = FFN(cfg)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.ln1(h))
        return h + self.ffn(self.ln2(h))


class Head(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln = nn.LayerNorm(cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.vocab)

    def forward(self, h: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.proj(self.ln(h))
        return logits if targets is None else lm_loss(logits, targets)


# --- Llama-style parts -----------------------------------------------------------------------
class LlamaEmbed(nn.Module):
    """Token embedding only: positions enter each block's attention as rotations."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok(tokens)


def rotary(t: int, head_dim: int, theta: float, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [t, head_dim] of rotary positions 0..t-1 (the two-halves layout of
    Hugging Face's Llama), computed in float64 and cast to `like`'s dtype."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=like.device) / head_dim)
    freqs = torch.arange(t, dtype=torch.float64, device=like.device)[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(like.dtype), emb.sin().to(like.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class GQAttention(nn.Module):
    """Causal grouped-query attention with rotary positions and bias-free projections."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads, self.groups, self.head_dim, self.theta = cfg.heads, cfg.groups, cfg.hidden // cfg.heads, cfg.rope_theta
        kv = cfg.heads // cfg.groups * self.head_dim
        # Registration order is execution order: kfac_linears relies on it.
        self.q = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.k = nn.Linear(cfg.hidden, kv, bias=False)
        self.v = nn.Linear(cfg.hidden, kv, bias=False)
        self.out = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        split = lambda y: y.view(b, t, -1, self.head_dim).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        cos, sin = rotary(t, self.head_dim, self.theta, q)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if self.groups > 1:  # each key/value head serves `groups` query heads
            k, v = k.repeat_interleave(self.groups, dim=1), v.repeat_interleave(self.groups, dim=1)
        # SDPA, as Llama trainers run it: at the 1b/8b shapes an explicit T x T softmax
        # would be the memory the profile measures.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.out(y.transpose(1, 2).reshape(b, t, h))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.up = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.down = nn.Linear(cfg.ffn, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.attn = GQAttention(cfg)
        self.norm2 = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.norm1(h))
        return h + self.mlp(self.norm2(h))


class LlamaHead(nn.Module):
    """Final RMSNorm and the untied, bias-free vocabulary projection."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.proj = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, h: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.proj(self.norm(h))
        return logits if targets is None else lm_loss(logits, targets)


PART_CLASSES = {"gpt2": (Embed, Block, Head), "llama": (LlamaEmbed, LlamaBlock, LlamaHead)}


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over target tokens (targets == -100 are ignored)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX)


def part_names(cfg: ModelConfig) -> list[str]:
    return contract.part_names(cfg.layers)


def part_seed(seed: int, part_name: str) -> int:
    """A seed for one part from (model seed, part name): independent of which rank builds it."""
    return (seed * 1_000_003 + zlib.crc32(part_name.encode())) % (2**63 - 1)


def _init_weights(module: nn.Module) -> None:
    # GPT-2/BERT (and Llama) initialisation: N(0, 0.02) weights, zero biases, unit norms.
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)


def build_part(cfg: ModelConfig, part_name: str, seed: int = 0, dtype: torch.dtype | None = None) -> nn.Module:
    """Build one part deterministically from (seed, part name)."""
    if cfg.arch not in PART_CLASSES:
        raise ModelSpecError(f"model {cfg.name!r}: arch {cfg.arch!r} is built by its own spec (resolve_model)")
    embed, block, head = PART_CLASSES[cfg.arch]
    if part_name == "embed":
        make = embed
    elif part_name == "head":
        make = head
    elif re.fullmatch(r"block\d+", part_name) and int(part_name[5:]) < cfg.layers:
        make = block
    else:
        raise ModelSpecError(f"model {cfg.name!r} has no part {part_name!r} (parts: embed, block0..block{cfg.layers - 1}, head)")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(part_seed(seed, part_name))
        part = make(cfg)
        _init_weights(part)
    return part.to(dtype) if dtype is not None else part


