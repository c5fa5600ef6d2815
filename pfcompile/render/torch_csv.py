"""A plan's pipeline order as torch.distributed.pipelining's schedule CSV.

One row per pipeline rank, one action per cell, in the text `_Action.from_str` reads:
`2F0` forward of stage 2 on micro-batch 0, `2B0` its backward (split backward of the
zero-bubble families: `2I0` the input gradient, `2W0` the weight gradients), `2SEND_F0` / `3RECV_F0`
the activation from stage 2 to 3, `3SEND_B0` / `2RECV_B0` the input-gradient back. Note
that torch names a receive by the *receiving* stage, pfcompile by the producing one.

`format="compute_comms"` (default) keeps the plan's own send/recv order and loads with
`_PipelineScheduleRuntime._load_csv(path, format="compute_comms")`; `"compute_only"`
keeps forwards and backwards and lets torch place the communication (`_load_csv(path)`).

What the format cannot hold is left out, and `export` says so: the optimizer's work, gradient
all-reduce and the optimizer step (torch runs its own), and the refresh cycle (step 0's
order is written; the pipeline order is the same in every step). torch knows a stage on
one rank only, so a plan with R replicas of each stage (data parallel, Chimera's two
pipelines) becomes R files, one per replica's pipeline, with that replica's ranks as
rows and its micro-batches numbered from 0; interleaving between the pipelines is lost.
"""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path

from pfcompile.formats.jsonio import write_atomic
from pfcompile.formats.ops import PASS_KINDS, PIPELINE_KINDS, Op, stage_served
from pfcompile.formats.plan import Plan
from pfcompile.render.style import optimizer_title

FORMATS = ("compute_comms", "compute_only")


# op kind -> torch's action; a receive is named by the stage it serves (the consumer)
_ACTIONS = {"fwd": "F", "bwd": "B", "bwd_input": "I", "bwd_weight": "W", "send_act": "SEND_F",
            "recv_act": "RECV_F", "send_grad": "SEND_B", "recv_grad": "RECV_B"}


def _action(op: Op, local_mb: int) -> str:
    if op.kind not in _ACTIONS:
        raise ValueError(f"{op} is no pipeline action")
    stage = stage_served(op) if op.kind.startswith("recv") else op.stage
    return f"{stage}{_ACTIONS[op.kind]}{local_mb}"


def replicas(plan: Plan) -> list[int]:
    return sorted({p["replica"] for p in plan.placement})


def pipeline_ranks(plan: Plan, replica: int) -> list[int]:
    """The ranks of one replica's pipeline, in rank order: torch's rows (group ranks)."""
    return sorted({p["rank"] for p in plan.placement if p["replica"] == replica})


def actions(plan: Plan, replica: int = 0, fmt: str = "compute_comms") -> list[list[str]]:
    """Rows of action strings for one replica's pipeline (step 0 of the cycle)."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    mbs = [mb for mb, r in enumerate(plan.micro_batch_replica) if r == replica]
    local = {mb: i for i, mb in enumerate(mbs)}
    kinds = PIPELINE_KINDS if fmt == "compute_comms" else PASS_KINDS
    rows = []
    for q in pipeline_ranks(plan, replica):
        held = {s for s, r in plan.stages_of(q) if r == replica}
        row = [_action(p.op, local[p.op.mb]) for p in plan.ranks[q][0]
               if p.op.kind in kinds and p.op.mb in local and _on_pipeline(p.op, held)]
        rows.append(row)
    return rows


def _on_pipeline(op: Op, held: set[int]) -> bool:
    return stage_served(op) in held  # a receive runs on the stage it feeds


def csv_paths(plan: Plan, path: str | os.PathLike) -> list[Path]:
    """One file per replica: `x.csv` for one, else `x.replica0.csv`, `x.replica1.csv`, ..."""
    path = Path(path)
    reps = replicas(plan)
    if len(reps) == 1:
        return [path]
    return [path.with_name(f"{path.stem}.replica{r}{path.suffix or '.csv'}") for r in reps]


def export(plan: Plan, path: str | os.PathLike, fmt: str = "compute_comms") -> tuple[list[Path], str]:
    """Write the CSV file(s); returns the paths and a note of what the format left out."""
    paths = csv_paths(plan, path)
    for replica, out in zip(replicas(plan), paths):
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows(actions(plan, replica, fmt))
        write_atomic(out, buf.getvalue())
    left_out = []
    if plan.config.optimizer_work:
        left_out.append(f"{optimizer_title(plan.config.optimizer)} ops")
    left_out.append("gradient all-reduce and optimizer step")
    if plan.refresh_steps > 1:
        left_out.append(f"steps 1..{plan.refresh_steps - 1} of the refresh cycle (same pipeline order)")
    note = f"torch pipelining CSV ({fmt}) holds forward/backward"
    note += "/send/recv only" if fmt == "compute_comms" else " only"
    note += "; left out: " + ", ".join(left_out)
    if len(paths) > 1:
        note += f"; one file per replica pipeline ({len(paths)}), their interleaving is not kept"
    return paths, note
