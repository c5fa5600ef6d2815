"""`python -m runtime.prepare_data input.txt -o train.bin --val-fraction 0.05`: a text file
as token files the runtime trains on (`--data train.bin --val-data train.val.bin`).

Tokenizers, both deterministic and without a vocabulary file:
- char (default): the pydoc corpus' 100 tokens (4 specials, newline, printable ASCII; any
  other character is [UNK]), so the built-in tiny models (vocabulary 100) take it;
- byte: 4 specials + the 256 byte values (vocabulary 260), for any text and language.
Ids 0-3 are [PAD], [UNK], [MASK], [SEP] in both, as BERT's masked-LM batches need.

The last --val-fraction of the tokens goes to the held-out file (default: OUTPUT's stem +
.val.bin), the rest to OUTPUT; each gets its JSON sidecar (train.bin -> train.json).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from pfcompile.formats.errors import InputError
from pfcompile.formats.jsonio import atomic_file, write_json
from runtime.io.data import SPECIALS, TOKEN_DTYPES, VOCAB, encode, sidecar_path


def tokenize(text_bytes: bytes, level: str) -> tuple[np.ndarray, int]:
    """(ids, vocabulary size) of the text."""
    if level == "byte":
        return np.frombuffer(text_bytes, dtype=np.uint8).astype(np.int64) + len(SPECIALS), len(SPECIALS) + 256
    text = text_bytes.decode("utf-8", errors="replace")
    return encode(text).numpy(), len(VOCAB)


def write_tokens(path: Path, ids: np.ndarray, dtype: str, vocab: int, meta: dict) -> None:
    with atomic_file(path) as f:
        f.write(ids.astype(TOKEN_DTYPES[dtype]).tobytes())
    write_json(sidecar_path(path), {"dtype": dtype, "vocab_size": vocab, "tokens": int(len(ids)), **meta})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m runtime.prepare_data", description=__doc__.splitlines()[0])
    ap.add_argument("input", help="a text file (UTF-8 for --level char)")
    ap.add_argument("-o", "--output", required=True, help="training token file, e.g. out/train.bin")
    ap.add_argument("--val-fraction", type=float, default=0.05, help="held-out share of the tokens (default 0.05; 0: none)")
    ap.add_argument("--val-output", default=None, help="held-out token file (default: OUTPUT's stem + .val.bin)")
    ap.add_argument("--level", choices=("char", "byte"), default="char", help="tokenizer (default char)")
    ap.add_argument("--dtype", choices=tuple(TOKEN_DTYPES), default="uint16", help="id type on disk (default uint16)")
    args = ap.parse_args(argv)
    try:
        if not 0.0 <= args.val_fraction < 1.0:
            raise InputError("--val-fraction", None, f"must be in [0, 1), got {args.val_fraction}")
        try:
            raw = Path(args.input).read_bytes()
        except FileNotFoundError:
            raise InputError(args.input, None, "no such file") from None
        except OSError as e:
            raise InputError(args.input, None, f"cannot read: {e.strerror}") from None
        ids, vocab = tokenize(raw, args.level)
        if len(ids) == 0:
            raise InputError(args.input, None, "empty file")
        cut = len(ids) - int(round(len(ids) * args.val_fraction))
        out = Path(args.output)
        val_out = Path(args.val_output) if args.val_output else out.with_name(out.stem + ".val.bin")
        meta = {"tokenizer": args.level, "source": str(args.input)}
        write_tokens(out, ids[:cut], args.dtype, vocab, {**meta, "part": "train"})
        print(f"prepare_data: {out}: {cut} tokens ({args.level}, vocabulary {vocab}, {args.dtype})")
        if cut < len(ids):
            write_tokens(val_out, ids[cut:], args.dtype, vocab, {**meta, "part": "val"})
            print(f"prepare_data: {val_out}: {len(ids) - cut} held-out tokens")
    except InputError as e:
        print(f"prepare_data: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
