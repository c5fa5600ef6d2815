"""The built-in models as the contract knows them, without torch: their names and sizes,
their parts and their K-FAC layers.

runtime.models builds its modules from this table, and the verifier checks a plan's model,
partition and layers against it, so a plan that `pfcompile inspect` accepts is one the
runtime can build (one rule, two readers). A user model ("package.module:function") is
code the contract cannot import: for it the verifier checks the partition against the part
names the plan recorded from its profile (`profile.parts`), and the runtime checks it once
more against the code.
"""

from __future__ import annotations

DTYPES = ("float32", "float64", "bfloat16")  # the runtime's precisions (runtime.config.precision)
DEVICE_TYPES = ("cpu", "cuda")  # the devices the runtime runs on (its backend follows: gloo, NCCL)
# a model spec's sizes: positive integers where given (micro_batch and seq_len always are)
MODEL_INTS = ("micro_batch", "seq_len", "hidden", "heads", "ffn", "layers", "vocab")
CORPUS_VOCAB = 100  # the pydoc corpus' character vocabulary (runtime.io.data.VOCAB)
BERT_VOCAB = 30522
LLAMA2_VOCAB = 32000
LLAMA3_VOCAB = 128256

# size -> (layers, hidden, heads, vocab, max_seq_len); ffn is 4 x hidden
_SIZES = {"tiny": (2, 64, 2, CORPUS_VOCAB, 128), "mini": (4, 256, 4, CORPUS_VOCAB, 128),
          "base": (12, 768, 12, BERT_VOCAB, 512), "large": (24, 1024, 16, BERT_VOCAB, 512)}

# Llama-style sizes: CPU ones (the SwiGLU width ~8/3 of hidden, as Llama's) and the shapes of
# Llama-3.2-1B and Llama-3-8B for profiling on a GPU (their rope scaling changes no cost).
# llama-small has Llama 2's 32,000-token vocabulary: its head costs as much as several blocks,
# as real vocabularies make it, so where the stages are cut matters (`--partition`).
# size -> (layers, hidden, heads, kv_heads, ffn, vocab, max_seq_len, rope_theta)
_LLAMA_SIZES = {"tiny": (2, 64, 4, 2, 176, CORPUS_VOCAB, 128, 1e4),
                "mini": (4, 256, 8, 2, 688, CORPUS_VOCAB, 128, 1e4),
                "small": (8, 512, 8, 2, 1376, LLAMA2_VOCAB, 128, 1e4),
                "1b": (16, 2048, 32, 8, 8192, LLAMA3_VOCAB, 131072, 5e5),
                "8b": (32, 4096, 32, 8, 14336, LLAMA3_VOCAB, 8192, 5e5)}

# name -> the runtime.models.ModelConfig fields of a built-in model
BUILTIN_MODELS: dict[str, dict] = {
    **{f"{kind}-{size}": {"kind": kind, "layers": n, "hidden": h, "heads": heads, "ffn": 4 * h, "vocab": vocab,
                          "max_seq_len": seq}
       for kind in ("bert", "gpt") for size, (n, h, heads, vocab, seq) in _SIZES.items()},
    **{f"llama-{size}": {"kind": "gpt", "layers": n, "hidden": h, "heads": heads, "ffn": ffn, "vocab": vocab,
                         "max_seq_len": seq, "arch": "llama", "kv_heads": kv, "rope_theta": theta}
       for size, (n, h, heads, kv, ffn, vocab, seq, theta) in _LLAMA_SIZES.items()},
}

# the nn.Linear layers of a block, in execution order, as runtime.models names them, per architecture
BLOCK_LINEARS = {"gpt2": ("attn.q", "attn.k", "attn.v", "attn.out", "ffn.fc1", "ffn.fc2"),
                 "llama": ("attn.q", "attn.k", "attn.v", "attn.out", "mlp.gate", "mlp.up", "mlp.down")}


def is_user_model(name: str) -> bool:
    """"package.module:function", or a Hugging Face model "hf:PATH": not a built-in model, so
    what the contract knows of it is what its profile recorded."""
    return ":" in name


def part_names(layers: int) -> list[str]:
    """A built-in model's parts, in order: embed, block0 .. block{layers-1}, head."""
    return ["embed", *(f"block{i}" for i in range(layers)), "head"]


def kfac_layer_names(layers: int, arch: str = "gpt2") -> list[str]:
    """The layers the optimizers cover in a built-in model, in execution order: every
    nn.Linear of the blocks ("block0.attn.q", ...), not the vocabulary projection."""
    return [f"block{i}.{name}" for i in range(layers) for name in BLOCK_LINEARS[arch]]
