"""`python -m runtime.evaluate MODEL.safetensors --data VAL.bin`: the loss and perplexity of
a trained model file (written by `torchrun -m runtime ... --save-model`) on held-out data,
in one process.

By default it uses the run's evaluation batches (batch size, micro-batches, sequence length
and count are in the spec beside the model file) and computes as the pipeline did (its
precision: bfloat16 under autocast with the activations cast at each stage boundary; each
replica's sum of its micro-batches' loss / N in the compute's float), so it reproduces the
pipeline's last evaluation; `--data pydoc` evaluates on the pydoc corpus' held-out part.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch

from pfcompile.formats.errors import InputError


@torch.no_grad()
def evaluate_model(model, batches, micro_batches: int, precision: str = "float32", partition=None,
                   micro_batch_replica=None) -> float:
    """Mean over batches of the mean over micro-batches of each one's mean loss: the
    pipeline's evaluation (runtime.pipeline.loop._evaluate), computed by the unpipelined model the
    way the pipeline computes it: stage by stage (`partition`, default one stage) under the
    run's precision, each stage's output cast as it crosses to the next, each replica
    summing loss_m / N over its micro-batches (`micro_batch_replica`) as a tensor in the
    compute's float, each replica's sums added over the batches in float64, then the
    replicas' totals."""
    from runtime.config.precision import precision as make_precision
    from runtime.io.data import split_micro_batches

    prec = make_precision(precision)
    stages = partition or [list(model.names)]
    replica_of = micro_batch_replica or [0] * micro_batches
    device_type = next(model.parameters()).device.type
    model.eval()
    totals: dict[int, float] = {}  # replica -> its last stage's rank's total over the batches
    for batch in batches:
        sums: dict[int, object] = {}
        for m, b in enumerate(split_micro_batches(batch, micro_batches)):
            x = b.tokens
            for s, names in enumerate(stages):
                last = s == len(stages) - 1
                with prec.autocast(device_type):
                    for name in names[:-1] if last else names:
                        x = model.parts[name](x)
                    x = model.parts[names[-1]](x, b.targets) / micro_batches if last else prec.boundary(x)
            r = replica_of[m]
            sums[r] = sums.get(r, 0.0) + x
        for r, v in sums.items():
            totals[r] = totals.get(r, 0.0) + float(v)
    return sum(v for _, v in sorted(totals.items())) / len(batches)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m runtime.evaluate", description=__doc__.splitlines()[0])
    ap.add_argument("model", help="model file written by --save-model (its .json spec beside it)")
    ap.add_argument("--data", required=True, metavar="VAL.bin|pydoc", help="held-out token file, or pydoc")
    ap.add_argument("--batches", type=int, default=None, help="evaluation batches (default: the run's)")
    ap.add_argument("--model-code", default=None, metavar="MODULE:FUNCTION", help="allow importing a user model")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    from runtime.io.data import VOCAB, make_stream, open_token_file
    from runtime.models import ModelSpecError, load_trained

    torch.set_num_threads(1)
    try:
        try:
            model, meta = load_trained(args.model, args.model_code)
        except ModelSpecError as e:
            raise InputError(None, None, str(e)) from None
        ev = meta["eval"]
        n = args.batches or ev["batches"] or 8
        if n < 1:
            raise InputError("--batches", None, f"must be >= 1, got {n}")
        if args.data == "pydoc":
            if model.cfg.vocab < len(VOCAB):
                raise InputError(args.model, "vocab", f"{model.cfg.vocab} is smaller than the pydoc corpus' {len(VOCAB)} tokens")
            stream = make_stream(ev["kind"], ev["batch_size"], ev["seq_len"], seed=0, split="val")
        else:
            tokens = open_token_file(args.data, model.cfg.vocab, ev["batch_size"], ev["seq_len"])
            stream = make_stream(ev["kind"], ev["batch_size"], ev["seq_len"], seed=0, token_file=tokens)
        batches = stream.fixed_batches(n)
        loss = evaluate_model(model, batches, ev["micro_batches"], ev.get("precision", meta.get("dtype", "float32")),
                              ev.get("partition"), ev.get("micro_batch_replica"))
    except InputError as e:
        print(f"evaluate: error: {e}", file=sys.stderr)
        return 2
    result = {"model": args.model, "data": args.data, "loss": loss, "perplexity": math.exp(min(loss, 700.0)),
              "batches": len(batches)}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"evaluate: {args.model} on {args.data}: loss {loss:.6f}, perplexity {result['perplexity']:.3f} "
              f"({len(batches)} batches of {ev['batch_size']} x {ev['seq_len']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
