"""Reference profiles from PipeFisher's published per-block measurements (CSV).

The CSVs (pfcompile/data/pipe-fisher-prof/, from kazukiosawa/pipe-fisher, folder prof/,
commit 753fdf0d) give one row per micro-batch size with the costs of ONE transformer
block. pfcompile plans per K-FAC layer, so the block's K-FAC costs are split over its six
nn.Linear layers in proportion to their arithmetic (stated in the provenance):

- curvature A of a layer ~ in², B ~ out² (one token-by-feature GEMM each);
- inversion of a factor ~ dim³;
- preconditioning ~ in·out·(in+out) (two GEMMs);
- factor and inverse sizes are exact (dim² fp32, no bias augmentation, as in the CSV,
  whose mem_kron they sum to); kept output gradients are tokens·out fp32 (they sum to
  mem_save_err); kept inputs tokens·in fp32 (not published; computed the same way).

Forward/backward time, saved activations and parameters are the block's published
numbers. The CSV measures blocks only: embeddings and head are given zero cost, as in
the paper's own simulation of uniform stages. Communication is a latency/bandwidth model.
"""

from __future__ import annotations

import csv
import datetime as _dt
from importlib import resources
from pathlib import Path

from pfcompile.formats.errors import InputError
from pfcompile.formats.profile import Comm, CoveredLayer, LinkModel, Part, Profile, estimated_step_ms
from pfcompile.profiler.optimizer_layers import estimable_optimizers, estimated_optimizer_ms, gemm_rate_flops_per_ms

MIB = 1024 * 1024
SOURCE = "kazukiosawa/pipe-fisher, folder prof/, commit 753fdf0d (2023-04-29)"
# name -> (blocks, hidden, ffn, heads, vocab)
BERT_SHAPES = {
    "bert-base": (12, 768, 3072, 12, 30522),
    "bert-large": (24, 1024, 4096, 16, 30522),
}
GPUS = ("p100", "v100", "rtx3090")
# Interconnect of the paper's cluster is not in the CSV: a 10 GB/s, 10 µs link
# (order of magnitude of a PCIe/Aries-class inter-GPU link); stated in the profile.
LINK = LinkModel(latency_ms=0.01, bytes_per_ms=10e9 / 1e3)


def csv_path(model: str, gpu: str) -> Path:
    return Path(str(resources.files("pfcompile") / "data" / "pipe-fisher-prof" / f"{model}_time_memory_{gpu}.csv"))


def read_rows(path: Path) -> list[dict[str, float]]:
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except FileNotFoundError:
        raise InputError(str(path), None, "no such file") from None
    out = []
    for i, r in enumerate(rows):
        try:
            out.append({k: float(v) for k, v in r.items()})
        except (TypeError, ValueError):
            raise InputError(str(path), f"row {i + 2}", "not a number in every column") from None
    return out


def block_linears(hidden: int, ffn: int) -> list[tuple[str, int, int]]:
    """The six K-FAC layers of one BERT encoder block, in execution order."""
    return [("attn.q", hidden, hidden), ("attn.k", hidden, hidden), ("attn.v", hidden, hidden),
            ("attn.out", hidden, hidden), ("ffn.fc1", hidden, ffn), ("ffn.fc2", ffn, hidden)]


def reference_profile(model: str = "bert-large", gpu: str = "p100", micro_batch: int = 32,
                      seq_len: int = 128) -> Profile:
    if model not in BERT_SHAPES:
        raise InputError("--model", None, f"no reference data for {model!r} (have: {', '.join(BERT_SHAPES)})")
    if gpu not in GPUS:
        raise InputError("--gpu", None, f"no reference data for {gpu!r} (have: {', '.join(GPUS)})")
    path = csv_path(model, gpu)
    rows = {int(r["bs"]): r for r in read_rows(path)}
    if micro_batch not in rows:
        raise InputError(str(path), "bs", f"no row for micro-batch {micro_batch} (have: {sorted(rows)})")
    row = rows[micro_batch]
    n_blocks, hidden, ffn, heads, vocab = BERT_SHAPES[model]
    tokens = micro_batch * seq_len
    linears = block_linears(hidden, ffn)

    def split(total: float, weights: list[float]) -> list[float]:
        s = sum(weights)
        return [total * w / s for w in weights]

    curv = split(row["time_kron"], [w for _, i, o in linears for w in (i * i, o * o)])
    inv = split(row["time_inv"], [w for _, i, o in linears for w in (i ** 3, o ** 3)])
    prec = split(row["time_prec"], [i * o * (i + o) for _, i, o in linears])

    parts = [Part("embed", 0.0, 0.0, 0, 0, 0, tokens * hidden * 4)]
    layers = []
    for b in range(n_blocks):
        parts.append(Part(
            name=f"block{b}", fwd_ms=row["time_f"], bwd_ms=row["time_b"],
            act_bytes=round(row["mem_act"] * MIB), param_bytes=round(row["mem_param"] * MIB),
            grad_bytes=round(row["mem_param"] * MIB), out_bytes=tokens * hidden * 4,
        ))
        for j, (name, i, o) in enumerate(linears):
            layers.append(CoveredLayer(
                name=f"block{b}.{name}", part=f"block{b}", in_features=i, out_features=o, bias=True,
                # the CSV publishes one inversion time; eigen is not measured there
                optimizer_ms={"kfac": {"curv_a": curv[2 * j], "curv_b": curv[2 * j + 1],
                                       "inv_A.cholesky": inv[2 * j], "inv_A.eigen": inv[2 * j],
                                       "inv_B.cholesky": inv[2 * j + 1], "inv_B.eigen": inv[2 * j + 1],
                                       "precond": prec[j]}},
                kept_a_bytes=tokens * i * 4, kept_b_bytes=tokens * o * 4,
                factor_a_bytes=i * i * 4, factor_b_bytes=o * o * 4,
                inverse_a_bytes=i * i * 4, inverse_b_bytes=o * o * 4,
            ))
    parts.append(Part("head", 0.0, 0.0, 0, 0, 0, 0))
    prof = Profile(
        source="reference",
        provenance={
            "source": SOURCE,
            "file": path.name,
            "device": gpu.upper(),
            "dtype": "float32",
            "note": ("reference data, not measured by pfcompile: per-block costs published with "
                     "PipeFisher, split over the block's nn.Linear layers by arithmetic "
                     "(curvature ~ dim^2, inversion ~ dim^3, preconditioning ~ in*out*(in+out)); "
                     "embeddings and head not measured (zero cost); eigen inversion time set "
                     "equal to the published (Cholesky) inversion time"),
            "comm_note": "latency/bandwidth model: 10 us, 10 GB/s for point-to-point and all-reduce",
            "created": _dt.date.today().isoformat(),
        },
        model={"name": model, "kind": "bert", "layers": n_blocks, "hidden": hidden, "heads": heads,
               "ffn": ffn, "vocab": vocab, "seq_len": seq_len, "micro_batch": micro_batch, "dtype": "float32"},
        parts=parts,
        covered_layers=layers,
        comm=Comm(method="model", act_bytes=tokens * hidden * 4, p2p=LINK, allreduce=LINK),
    )
    # the CSV has no optimizer-step time: the documented estimate (parameter bytes streamed)
    for p in prof.parts:
        p.step_ms = estimated_step_ms(prof, p)
    prof.provenance["step_note"] = "optimizer step not published: estimated_step_ms (parameter bytes streamed at 200 GB/s)"
    # nor Shampoo's or Muon's ops: their FLOPs at the block forward's own GEMM rate (estimated)
    rate = gemm_rate_flops_per_ms(prof.model, row["time_f"])
    estimated = estimable_optimizers()
    for layer in prof.covered_layers:
        for opt in estimated:
            layer.optimizer_ms[opt] = estimated_optimizer_ms(opt, layer.in_features, layer.out_features, rate)
    prof.provenance["optimizer_note"] = (
        f"{' and '.join(estimated)} costs estimated, not measured: each op's FLOPs (pfcompile.profiler.optimizer_layers) "
        f"at {rate / 1e9:.2f} TFLOP/s, a block's forward FLOPs over its published forward time")
    prof.provenance["estimated"] = [f"covered_layers[].optimizer_ms.{opt}" for opt in estimated]
    # nor a split backward: B and W stay null, the documented 50/50 estimate (Part.split_backward_ms)
    prof.provenance["split_note"] = ("split backward not published: bwd_input_ms/bwd_weight_ms null, estimated as "
                                     "half the backward each (pfcompile.formats.profile.WEIGHT_SHARE)")
    return prof


if __name__ == "__main__":  # regenerate the committed reference profiles
    import sys

    out = Path(sys.argv[1] if len(sys.argv) > 1 else "profiles")
    for m in BERT_SHAPES:
        p = reference_profile(m, "p100", 32, 128)
        p.save(str(out / f"{m}-p100-ref.json"))
        print(f"wrote {out / f'{m}-p100-ref.json'}: {len(p.parts)} parts, {len(p.covered_layers)} covered layers")
