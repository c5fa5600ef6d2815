"""`torchrun -m runtime.interleave PLAN PLAN... --blocks B --timed N`: several plans of one
model in one launch, their steps in alternating blocks (A B A B ...), for comparisons free
of the drift between launches (benchmarks/interleaved.py). Blocks compare plans with each
other, not with a run of their own: fitted from blocks, a plan reads faster than in a
launch of its own (docs/design.md 12.3).

A shared VM's speed moves by more than an optimizer's overhead within seconds, so two plans
timed in two launches compare two windows of the machine. Here every rank builds every plan
as `-m runtime` builds it (runtime.pipeline.loop.build_rank, after one `join`) and runs B
blocks of each in turn, each of N + 2 steps: the step after the switch (it finds the other
plan's tensors in the caches), N timed steps, and the one whose start ends them. The first
block of each plan is a warm-up. Each plan keeps its own steps, data, memory meter and
divergence check, and each block ends with its check settled, so a plan trains exactly as
in a launch of its own (benchmarks/interleaved.py --check-losses checks it).

Rank 0 prints one JSON line: each plan's steady period per timed block (ms, the ranks'
mean; runtime.observe.measure.step_period), its loss at every step, its compute ops per
step by class (passes, the rest; measured and planned, summed over the ranks), and its
minor page faults and involuntary context switches per step. With --trace-prefix, each
timed block of each plan is also a measured trace (block_trace_path): its first step is
the trace's warm-up, so `pfcompile inspect --against` reads the N timed steps.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import sys
from pathlib import Path


def block_trace_path(prefix: str, label: str, plan: str, block: int) -> str:
    """A timed block's measured trace: PREFIX-blockB-LABEL-PLANSTEM.trace.json."""
    return f"{prefix}-block{block}-{label}-{Path(plan).stem}.trace.json"


def plan_indices(text: str, plans: int) -> list[int] | str:
    """--set-for's "I[,I...]" -> the plans' indices, or what is wrong with it."""
    try:
        indices = [int(i) for i in text.split(",")]
    except ValueError:
        return f"{text!r} is not a comma-separated list of plan indices"
    wrong = [i for i in indices if not 0 <= i < plans]
    if wrong:
        return f"{wrong[0]} is not the index of one of the {plans} plans"
    return indices


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="torchrun -m runtime.interleave", description=__doc__.splitlines()[0])
    ap.add_argument("plans", nargs="+", help="plans of one model, stage layout and world, in block order")
    ap.add_argument("--blocks", type=int, required=True, help="blocks of each plan, the first a warm-up (at least 2)")
    ap.add_argument("--timed", type=int, required=True, help="timed steps per block")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="a setting of the plan --set-for names")
    ap.add_argument("--set-for", default="0", metavar="I[,I...]",
                    help="which plans (their indices) --set applies to; the process-wide settings "
                         "(runtime.threads, pin_cpus, flush_denormal, keep_freed_memory, idle_network_threads) of "
                         "the first apply to the launch")
    ap.add_argument("--labels", default=None, help="comma-separated names of the plans in the traces' file names "
                                                   "(default: their indices)")
    ap.add_argument("--trace-prefix", default=None, help="write each timed block of each plan as a measured trace")
    ap.add_argument("--log-dir", default=None, help="the runs' metrics folder (default: TMPDIR)")
    a = ap.parse_args(argv)
    if a.blocks < 2 or a.timed < 1:
        ap.error("--blocks at least 2 (the first of each plan is a warm-up), --timed at least 1")
    set_for = plan_indices(a.set_for, len(a.plans))
    if isinstance(set_for, str):
        ap.error(f"--set-for: {set_for}")
    labels = a.labels.split(",") if a.labels else [str(i) for i in range(len(a.plans))]
    if len(labels) != len(a.plans):
        ap.error(f"--labels: {len(labels)} names for {len(a.plans)} plans")
    from pfcompile.formats.errors import InputError
    from runtime.__main__ import EXIT_COMM, EXIT_INPUT, _fail
    from runtime.pipeline.comm import CommTimeout

    try:
        run(a.plans, a.blocks, a.timed, [x for s in a.set for x in ("--set", s)], set_for, labels,
            a.trace_prefix, a.log_dir or os.environ.get("TMPDIR", "."))
    except InputError as e:  # a plan, a setting or the model: one line, as -m runtime says it
        sys.exit(_fail(int(os.environ.get("RANK", 0)), e, EXIT_INPUT))
    except CommTimeout as e:
        sys.exit(_fail(int(os.environ.get("RANK", 0)), e, EXIT_COMM))


def run(plans: list[str], blocks: int, timed: int, settings: list[str], set_for: list[int], labels: list[str],
        trace_prefix: str | None, log_dir: str) -> None:
    from runtime.config.cli import build_parser, prepare
    from runtime.observe.measure import step_period
    from runtime.pipeline import comm
    from runtime.pipeline.loop import build_rank, join, train_step

    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    length = timed + 2  # the step after the switch, the timed steps, and the one whose start ends them
    steps = blocks * length
    jobs = []
    for i, path in enumerate(plans):
        argv = [path, "--steps", str(steps), "--data", "synthetic", "--log-dir", log_dir]
        jobs.append(prepare(build_parser().parse_args(argv + (settings if i in set_for else [])), rank, world_size))
    # one process runs every plan: its own settings (threads, cores, subnormals, malloc) are
    # those of the first plan --set is for, so a process-wide --set reaches the launch
    world, _ = join(jobs[set_for[0]])
    clean = False
    try:
        parts = [build_rank(job, world) for job in jobs]
        comm.barrier("the barrier before the first block", world.timeout)
        for r in parts:
            r.timeline.start()
        losses: list[list[float]] = [[] for _ in parts]  # this rank's share of each step's loss, per plan
        gc.disable()  # collections between blocks, on every rank at once (as the runtime's loop)
        # this rank's minor page faults and involuntary context switches in each plan's blocks
        # after the first: what the plan costs its process beyond its ops' arithmetic
        os_events = [[0, 0] for _ in parts]
        for block in range(blocks):
            for r, mine, events in zip(parts, losses, os_events):
                gc.collect(1)
                before = resource.getrusage(resource.RUSAGE_SELF)
                for step in range(block * length, (block + 1) * length):
                    then = step + 1 if step + 1 < (block + 1) * length else None  # the other plan's block next
                    mine.append(train_step(r, step, then)[1])
                r.interp.settle()  # its divergence check, before the other plan's steps
                if block:
                    after = resource.getrusage(resource.RUSAGE_SELF)
                    events[0] += after.ru_minflt - before.ru_minflt
                    events[1] += after.ru_nivcsw - before.ru_nivcsw
        os_events = comm.gather_json(world, os_events)
        periods, shares, ops = [], [], []
        timed_steps = [list(range(b * length + 1, (b + 1) * length)) for b in range(1, blocks)]
        for r, mine in zip(parts, losses):
            periods.append(comm.gather_json(world, [step_period([r.timeline], s) for s in timed_steps]))
            shares.append(comm.gather_json(world, mine))
            ops.append(comm.gather_json(world, op_time(r, {s for t in timed_steps for s in t[:-1]})))
        if trace_prefix:
            for label, r, job in zip(labels, parts, jobs):
                for b in range(1, blocks):
                    write_block(r, job, world, block_trace_path(trace_prefix, label, job.plan_path, b),
                                range(b * length, (b + 1) * length))
        clean = True
        if rank == 0:
            print(json.dumps({"periods_ms": [[statistics.fmean(ranks[b] for ranks in gathered)
                                              for b in range(blocks - 1)] for gathered in periods],
                              "losses": [[sum(col) for col in zip(*gathered)] for gathered in shares],
                              "op_ms": [{c: [sum(g[c][i] for g in gathered) for i in (0, 1)] for c in gathered[0]}
                                        for gathered in ops],
                              "os_per_step": [[sum(ranks[i][j] for ranks in os_events) / ((blocks - 1) * length)
                                               for j in (0, 1)] for i in range(len(parts))]}), flush=True)
    finally:
        gc.enable()
        comm.shutdown(clean, world.timeout)
    if clean:  # as `-m runtime`: every rank met at the final barrier, leave without gloo's teardown
        sys.stdout.flush()
        os._exit(0)


def write_block(r, job, world, path: str, block: range) -> None:
    """One block of the plan as a measured trace (rank 0 writes it): its first step, after the
    switch, is the trace's warm-up."""
    from runtime.observe import measure
    from runtime.pipeline import comm

    tl = r.timeline
    mine = measure.Timeline(tl.rank, tl.t0, [o for o in tl.ops if o[0] in block], [s for s in tl.steps if s[0] in block],
                            [m for m in tl.memory if m[0] in block], [s for s in tl.spans if s[0] in block],
                            [f for f in tl.faults if f[0] in block], tl.device_type, tl.host)
    gathered = comm.gather_json(world, mine.to_json())
    if world.rank == 0:
        measure.write_measured_trace(path, measure.align([measure.Timeline.from_json(d) for d in gathered]),
                                     measure.run_metadata(job, block.stop, block.start + 1, interleaved=True))


def op_time(r, steps: set[int]) -> dict[str, list[float]]:
    """This rank's compute ops over `steps`, measured and planned (ms, per step), as two
    classes: the pipeline's passes (forward, backward, B, W) and the rest (the update and
    the optimizer's work)."""
    from pfcompile.formats.ops import PASS_KINDS
    from runtime.observe.measure import matched_compute_ops, predicted_op_table

    out = {"passes": [0.0, 0.0], "update and optimizer": [0.0, 0.0]}
    for kind, ms, want_ms in matched_compute_ops(r.timeline, steps, predicted_op_table(r.interp.plan)):
        total = out["passes" if kind in PASS_KINDS else "update and optimizer"]
        total[0] += ms / len(steps)
        total[1] += want_ms / len(steps)
    return out


if __name__ == "__main__":
    main()
