"""Training data: the pydoc corpus, synthetic tokens, or a token file, as deterministic batches.

A token file (`.bin`) is a flat array of token ids, uint16 or uint32 (the layout nanoGPT
writes), with a JSON sidecar beside it (train.bin -> train.json: {"dtype", "vocab_size"});
`python -m runtime.prepare_data` makes both from any text. It is read through numpy.memmap,
never whole; `open_token_file` checks it before training (one-line InputError).

The corpus is CPython's own `pydoc_data.topics` (~465 kB of English documentation), so the
project needs no download. Tokens are characters: 4 specials, newline and printable ASCII
(100 in all; anything else is [UNK], 0.1% of the text). Why characters and not words: there
are no unknown words to mask, a 465 k-token stream lets 1000 steps of 32×64 tokens see each
token ~4 times instead of ~20 (a word-level stream of ~100 k tokens overfits bert-tiny
within the benchmark), and the 100-way head keeps the time in the blocks K-FAC covers.

A batch depends only on (seed, step): a distributed run and a single-process run see the
same global batch at step t, and `split_micro_batches(batch, M)[m]` is global micro-batch m.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from pfcompile.formats.errors import InputError
from runtime.models import IGNORE_INDEX

SPECIALS = ["[PAD]", "[UNK]", "[MASK]", "[SEP]"]
PAD, UNK, MASK, SEP = range(4)
VOCAB = SPECIALS + ["\n"] + [chr(c) for c in range(32, 127)]
_INDEX = {ch: i for i, ch in enumerate(VOCAB) if i >= len(SPECIALS)}
MASK_FRACTION = 0.15
VAL_FRACTION = 0.10


class Batch(NamedTuple):
    tokens: torch.Tensor   # [b, T] int64
    targets: torch.Tensor  # [b, T] int64, IGNORE_INDEX where there is nothing to predict


def encode(text: str) -> torch.Tensor:
    return torch.tensor([_INDEX.get(ch, UNK) for ch in text], dtype=torch.long)


def decode(tokens) -> str:
    return "".join(VOCAB[int(t)] if int(t) >= len(SPECIALS) else ("_" if int(t) == MASK else "?") for t in tokens)


def corpus_tokens() -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation) token streams: the topics in sorted order, the last 10% held out."""
    from pydoc_data.topics import topics

    text = "\n".join(topics[k] for k in sorted(topics))
    ids = encode(text)
    cut = int(len(ids) * (1 - VAL_FRACTION))
    return ids[:cut], ids[cut:]


def _generator(seed: int, step: int, salt: int = 0) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(random.Random(f"{seed}/{step}/{salt}").getrandbits(62))
    return g


def mask_tokens(window: torch.Tensor, vocab: int, g: torch.Generator) -> Batch:
    """BERT masking: exactly max(1, round(15% of T)) positions per row are targets (so every
    micro-batch has the same number of targets); of those 80% -> [MASK], 10% -> a random
    token, 10% unchanged."""
    b, T = window.shape
    n = max(1, round(MASK_FRACTION * T))
    picked = torch.rand(b, T, generator=g).argsort(dim=1)[:, :n]
    chosen = torch.zeros(b, T, dtype=torch.bool).scatter_(1, picked, True)
    targets = torch.where(chosen, window, torch.full_like(window, IGNORE_INDEX))
    roll = torch.rand(b, T, generator=g)
    rand_tok = torch.randint(len(SPECIALS), vocab, (b, T), generator=g)
    tokens = window.clone()
    tokens[chosen & (roll < 0.8)] = MASK
    swap = chosen & (roll >= 0.8) & (roll < 0.9)
    tokens[swap] = rand_tok[swap]
    return Batch(tokens, targets)


@dataclass
class BatchStream:
    """Deterministic batches from a token stream. task: "mlm" (BERT) or "lm" (GPT, next token)."""

    stream: torch.Tensor
    task: str
    batch_size: int
    seq_len: int
    seed: int = 0
    vocab: int = len(VOCAB)

    def __post_init__(self):
        if self.task not in ("mlm", "lm"):
            raise ValueError(f"task must be 'mlm' or 'lm', got {self.task!r}")
        if len(self.stream) < self.seq_len + 2:
            raise ValueError(f"token stream of {len(self.stream)} is shorter than seq_len {self.seq_len} + 2")

    def _windows(self, starts: torch.Tensor) -> torch.Tensor:
        idx = starts[:, None] + torch.arange(self.seq_len + 1)
        if isinstance(self.stream, torch.Tensor):
            return self.stream[idx]
        return torch.from_numpy(np.asarray(self.stream[idx.numpy()], dtype=np.int64))  # memmap: reads only these

    def _from_windows(self, w: torch.Tensor, g: torch.Generator) -> Batch:
        if self.task == "lm":
            return Batch(w[:, :-1].contiguous(), w[:, 1:].contiguous())
        return mask_tokens(w[:, :-1].contiguous(), self.vocab, g)

    def batch(self, step: int) -> Batch:
        """The global batch of training step `step`: random windows, random masks."""
        g = _generator(self.seed, step)
        starts = torch.randint(0, len(self.stream) - self.seq_len - 1, (self.batch_size,), generator=g)
        return self._from_windows(self._windows(starts), g)

    def __iter__(self):
        step = 0
        while True:
            yield self.batch(step)
            step += 1

    def fixed_batches(self, max_batches: int | None = None) -> list[Batch]:
        """Consecutive non-overlapping windows with fixed masks: a validation set."""
        n = (len(self.stream) - 1) // self.seq_len
        starts = torch.arange(n) * self.seq_len
        out = []
        for i in range(0, n - self.batch_size + 1, self.batch_size):
            out.append(self._from_windows(self._windows(starts[i:i + self.batch_size]), _generator(self.seed, i, salt=1)))
            if max_batches and len(out) >= max_batches:
                break
        return out


def task_of(kind: str) -> str:
    return "lm" if kind == "gpt" else "mlm"


def make_stream(kind: str, batch_size: int, seq_len: int, seed: int = 0, split: str = "train",
                synthetic: bool = False, vocab: int | None = None, token_file: TokenFile | None = None) -> BatchStream:
    """Batches for a model kind ("bert" -> MLM, "gpt" -> next token) from the pydoc corpus,
    from a synthetic uniform token stream of `vocab` tokens (deterministic in seed), or from
    a checked token file (then `split` is ignored: pass the held-out file for validation)."""
    if token_file is not None:
        return BatchStream(token_file.tokens, task_of(kind), batch_size, seq_len, seed, token_file.vocab_size)
    if synthetic:
        v = vocab or len(VOCAB)
        g = _generator(seed, 0, salt=2 if split == "train" else 3)
        stream = torch.randint(len(SPECIALS), v, (max(64 * seq_len, 4096),), generator=g)
        return BatchStream(stream, task_of(kind), batch_size, seq_len, seed, v)
    if vocab is not None and vocab < len(VOCAB):
        raise ValueError(f"the pydoc corpus needs a vocabulary of at least {len(VOCAB)}, got {vocab}")
    train, val = corpus_tokens()
    return BatchStream(train if split == "train" else val, task_of(kind), batch_size, seq_len, seed, len(VOCAB))


def split_micro_batches(batch: Batch, micro_batches: int) -> list[Batch]:
    """M equal micro-batches; global micro-batch m is rows [m*b/M, (m+1)*b/M)."""
    b = batch.tokens.shape[0]
    if micro_batches < 1 or b % micro_batches:
        raise ValueError(f"batch of {b} rows does not split into {micro_batches} equal micro-batches")
    n = b // micro_batches
    return [Batch(batch.tokens[i * n:(i + 1) * n], batch.targets[i * n:(i + 1) * n]) for i in range(micro_batches)]


# --- token files --------------------------------------------------------------------------------
TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def sidecar_path(path: str | Path) -> Path:
    """train.bin -> train.json: the dtype and vocabulary size of a token file."""
    return Path(path).with_suffix(".json")


@dataclass
class TokenFile:
    path: str
    dtype: str
    vocab_size: int
    tokens: np.ndarray  # a read-only numpy.memmap


def open_token_file(path: str, model_vocab: int, batch_size: int, seq_len: int) -> TokenFile:
    """Open and check a token file: it exists and is not empty, its size is a multiple of the
    dtype's, no id is >= the model's vocabulary, and it holds at least one batch."""
    from pfcompile.formats.jsonio import Fields, read_json

    p = Path(path)
    if not p.is_file():
        raise InputError(path, None, "no such file" if not p.exists() else "is not a file")
    side = sidecar_path(p)
    if not side.is_file():
        raise InputError(str(side), None, f"missing: {path} needs this JSON sidecar with dtype (uint16 or uint32) and "
                         "vocab_size; python -m runtime.prepare_data writes both")
    f = Fields(read_json(side), str(side))
    dtype = f.req("dtype", str, check=lambda v: v in TOKEN_DTYPES, why="uint16 or uint32")
    vocab = f.req("vocab_size", int, check=lambda v: v > len(SPECIALS), why=f"an integer > {len(SPECIALS)}")
    if vocab > model_vocab:
        raise InputError(str(side), "vocab_size", f"{vocab} exceeds the model's vocabulary of {model_vocab}")
    size, item = p.stat().st_size, np.dtype(TOKEN_DTYPES[dtype]).itemsize
    if size == 0:
        raise InputError(path, None, "empty file")
    if size % item:
        raise InputError(path, None, f"size {size} bytes is not a multiple of {dtype}'s {item} bytes (wrong dtype in {side.name}?)")
    tokens = np.memmap(p, dtype=TOKEN_DTYPES[dtype], mode="r")
    need = batch_size * seq_len + 1
    if len(tokens) < need:
        raise InputError(path, None, f"{len(tokens)} tokens, fewer than one batch needs "
                         f"({batch_size} rows x {seq_len} tokens + 1 = {need})")
    limit = min(vocab, model_vocab)
    chunk = 1 << 22
    for start in range(0, len(tokens), chunk):  # streamed: a large file is never in memory whole
        part = tokens[start:start + chunk]
        if int(part.max()) >= limit:
            i = start + int(np.argmax(part >= limit))
            raise InputError(path, None, f"token id {int(tokens[i])} at position {i} is >= the vocabulary size {limit}")
    return TokenFile(str(path), dtype, vocab, tokens)
