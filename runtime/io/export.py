"""The trained model as one file: rank 0 gathers every stage's parameters (replica 0 of
each stage; replicas are equal) into a safetensors file, with the model's spec beside it
(model.safetensors -> model.json). runtime.models.load_trained loads the pair into the
unpipelined model in a single process; `python -m runtime.evaluate` evaluates it.

Parameter names are the unpipelined model's (`parts.block0.attn.q.weight`): a stage's
names are already those of the whole model, so the stages' dicts simply merge. A
`transformers` model ("hf:PATH") is written with its `transformers` names and config.json
(runtime.models.hf), so it loads back into `transformers`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from pfcompile.formats.jsonio import write_atomic, write_json

FORMAT = "pfcompile-model"


def spec_path(path: str | Path) -> Path:
    return Path(path).with_suffix(".json")


def gather_model(world, plan, stages: dict) -> dict[str, torch.Tensor] | None:
    """Every stage's parameters on rank 0 (None elsewhere), by point-to-point messages
    after the training steps (nothing else is in flight then)."""
    from runtime.pipeline.comm import gather_json, talking

    owner = {p["stage"]: p["rank"] for p in plan.placement if p["replica"] == 0}
    mine = {s: sr.module.state_dict() for s, sr in stages.items() if sr.replica == 0}
    layout = gather_json(world, {str(s): [[n, list(t.shape), str(t.dtype).removeprefix("torch.")] for n, t in sd.items()]
                                 for s, sd in mine.items()})
    out: dict[str, torch.Tensor] = {}
    for s in range(plan.num_stages):
        q = owner[s]
        if q == world.rank == 0:
            out.update({n: t.detach().cpu().clone() for n, t in mine[s].items()})
        elif world.rank == q:
            flat = torch.cat([t.detach().reshape(-1) for t in mine[s].values()])
            with talking(f"sending stage {s} to rank 0", world.timeout):
                dist.send(flat, dst=0)
        elif world.rank == 0:
            entries = layout[q][str(s)]
            dtype = getattr(torch, entries[0][2])
            flat = torch.empty(sum(int(torch.Size(shape).numel()) for _, shape, _ in entries), dtype=dtype,
                               device=world.device)
            with talking(f"receiving stage {s} from rank {q}", world.timeout):
                dist.recv(flat, src=q)
            offset = 0
            for name, shape, _ in entries:
                n = int(torch.Size(shape).numel())
                out[name] = flat[offset:offset + n].view(shape).cpu().clone()
                offset += n
    return out if world.rank == 0 else None


def save_model(path: str, tensors: dict[str, torch.Tensor], spec: dict, model=None) -> None:
    """model.safetensors (the tensors, the spec also in its metadata) and model.json (the spec).

    A `transformers` model (`model`: a runtime.models.hf.HFModel) is saved in its own layout: the
    tensors by their `transformers` names and config.json beside, so the folder loads with
    AutoModelForCausalLM.from_pretrained (which wants the file named model.safetensors and
    the metadata format "pt")."""
    from safetensors.torch import save

    from runtime.models.hf import HFModel

    spec = {"format": FORMAT, **spec}
    metadata = {FORMAT: json.dumps(spec)}
    if isinstance(model, HFModel):
        tensors = model.hf_state_dict(tensors)
        metadata["format"] = "pt"
        model.save_config(Path(path).parent, getattr(torch, spec["dtype"]))
    write_atomic(path, save({n: t.contiguous() for n, t in tensors.items()}, metadata=metadata))
    write_json(spec_path(path), spec)


def model_spec(job, val_batches: int) -> dict:
    """What load_trained and runtime.evaluate need: the model, its dtype, and the evaluation
    of the run (its batches, precision and stages, so a single process evaluates exactly as
    the pipeline did); and the run's config (`job`: runtime.config.job's sections), which
    made it."""
    plan, cfg = job.plan, job.spec.cfg
    N = plan.config.micro_batches
    built_in = ":" not in plan.model["name"]
    return {"model": plan.model["name"], "config": cfg.to_dict() if built_in else None,
            "dtype": str(job.dtype).removeprefix("torch."), "part_names": list(job.spec.part_names),
            "eval": {"batch_size": int(plan.model["micro_batch"]) * N, "micro_batches": N,
                     "seq_len": int(plan.model["seq_len"]), "batches": val_batches, "kind": cfg.kind,
                     # how the pipeline evaluated: its precision (bfloat16: autocast, and the
                     # activations cast at each stage boundary), its stages, and which replica
                     # summed which micro-batches' losses
                     "precision": job.precision.name, "partition": plan.partition,
                     "micro_batch_replica": plan.micro_batch_replica},
            "job": job.config.to_dict()}
