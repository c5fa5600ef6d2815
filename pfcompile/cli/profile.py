"""`pfcompile profile`: measure a model on this machine, or convert published reference data.

torch is imported inside the command, so `pfcompile --help` and the other commands stay fast.
"""

from __future__ import annotations

import json
import sys

from pfcompile.formats.errors import InputError
from pfcompile.formats.optimizers import NAMES, optimizer

# The CPU demo's shape (runtime.train's default seq_len; a micro-batch of 8 sequences).
DEFAULT_MICRO_BATCH, DEFAULT_SEQ_LEN = 8, 64
# PipeFisher's published measurements: micro-batch 32 at sequence length 128.
REFERENCE_MICRO_BATCH, REFERENCE_SEQ_LEN = 32, 128


def register(sub) -> None:
    p = sub.add_parser(
        "profile", help="measure per-layer costs and memory into a profile JSON",
        description="Time every part's forward/backward and every covered layer's curvature, inversion "
                    "and preconditioning with the runtime's own code, measure message costs in a "
                    "2-rank process group, and write a versioned profile. With --reference, convert "
                    "PipeFisher's published per-block measurements instead.")
    p.add_argument("--model", default="bert-tiny", help="built-in model name, hf:PATH (a transformers config.json or model "
                   "directory) or package.module:function (default bert-tiny)")
    p.add_argument("--micro-batch", type=int, default=None,
                   help=f"sequences per micro-batch (default {DEFAULT_MICRO_BATCH}; reference {REFERENCE_MICRO_BATCH})")
    p.add_argument("--seq-len", type=int, default=None,
                   help=f"tokens per sequence (default {DEFAULT_SEQ_LEN}; reference {REFERENCE_SEQ_LEN})")
    p.add_argument("--device", default="cpu", help="cpu or cuda:N (default cpu)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float64"))
    p.add_argument("--repeats", type=int, default=20, help="timed runs per entry (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed runs before them (default 5)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: the runtime's per-rank default)")
    p.add_argument("--entry-budget", type=float, default=2.0, metavar="S",
                   help="stop repeating an entry once its samples add up to S seconds (at least 3 kept; default 2)")
    p.add_argument("--clock", choices=("wall", "thread"), default="wall",
                   help="wall: perf_counter (CUDA events on GPU); thread: this thread's CPU time, which "
                        "ignores time taken by other processes on a shared CPU (cpu, --threads 1)")
    p.add_argument("--ranks", type=int, default=1, metavar="R",
                   help="measure with R processes working at once, as a plan of R ranks runs on this machine "
                        "(R - 1 others run the model's forward/backward meanwhile; CPU; default 1)")
    p.add_argument("--no-comm", action="store_true",
                   help="skip the 2-rank communication measurement; state a latency/bandwidth model instead")
    p.add_argument("--cold-cache", action="store_true",
                   help="CPU: before each timed repeat, sweep a 64 MiB buffer so every op starts with cold caches, "
                        "as in a run where other ops ran in between (default: back-to-back repeats, warm caches)")
    p.add_argument("--no-runtime-probe", action="store_true",
                   help="skip the short 2-rank 1F1B run that measures the runtime's own costs around the ops "
                        "(per-op dispatch, work between steps, sends, receives); costed from the message "
                        "benchmark alone")
    # every declared optimizer with per-layer costs to time (adamw has none)
    timed = [name for name in NAMES if optimizer(name).cost_keys()]
    p.add_argument("--optimizer", action="append", default=None, metavar="NAME",
                   help="whose per-layer ops to time (repeatable): K-FAC's always; " + ", ".join(timed) +
                        " or a plugin's package.module:name add theirs (a reference profile estimates them from "
                        "their declared FLOPs)")
    p.add_argument("--muon-ns-dtype", choices=("bfloat16", "float32", "float64"), default="bfloat16",
                   help="dtype of Muon's Newton-Schulz iteration as timed (the runtime's muon.ns_dtype; default "
                        "bfloat16, torch.optim.Muon's; a CPU without bfloat16 matmul units runs float32 far faster)")
    p.add_argument("--reference", metavar="MODEL", default=None,
                   help="convert the published CSV of MODEL (bert-base, bert-large) instead of measuring")
    p.add_argument("--gpu", default="p100", help="with --reference: p100, v100 or rtx3090 (default p100)")
    p.add_argument("-o", "--output", metavar="PATH", default=None, help="write the profile JSON here")
    p.add_argument("--json", action="store_true", help="print the profile JSON instead of the table")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _positive(flag: str, value: int) -> None:
    if value <= 0:
        raise InputError(flag, None, f"must be a positive integer, got {value}")


def run(args) -> int:
    from pfcompile.formats.profile import format_profile

    if args.reference:
        from pfcompile.profiler.reference import reference_profile

        mb = REFERENCE_MICRO_BATCH if args.micro_batch is None else args.micro_batch
        seq = REFERENCE_SEQ_LEN if args.seq_len is None else args.seq_len
        if seq != REFERENCE_SEQ_LEN:
            raise InputError("--seq-len", None, f"the published measurements are at sequence length {REFERENCE_SEQ_LEN}, got {seq}")
        prof = reference_profile(args.reference, args.gpu, mb, seq)
    else:
        mb = DEFAULT_MICRO_BATCH if args.micro_batch is None else args.micro_batch
        seq = DEFAULT_SEQ_LEN if args.seq_len is None else args.seq_len
        for flag, v in (("--micro-batch", mb), ("--seq-len", seq), ("--repeats", args.repeats), ("--threads", args.threads)):
            _positive(flag, v)
        if args.warmup < 0:
            raise InputError("--warmup", None, f"must be >= 0, got {args.warmup}")
        for name in args.optimizer or ():
            try:
                costed = optimizer(name).cost_keys()
            except ValueError as e:
                raise InputError("--optimizer", None, str(e)) from None
            if not costed:
                raise InputError("--optimizer", None, f"{name!r} has no per-layer ops to time")
        from pfcompile.profiler import profile_model  # imports torch

        prof = profile_model(args.model, mb, seq, device=args.device, dtype=args.dtype, repeats=args.repeats,
                             warmup=args.warmup, threads=args.threads, comm=not args.no_comm,
                             entry_budget_s=args.entry_budget, clock=args.clock, progress=not args.quiet and not args.json,
                             ranks=args.ranks, probe=not args.no_runtime_probe, cold=args.cold_cache,
                             optimizers=tuple(args.optimizer or ("kfac",)), muon_ns_dtype=args.muon_ns_dtype)
    if args.output:
        prof.save(args.output)
    else:
        prof.to_json()  # fills in the hash
    if args.json:
        print(json.dumps(prof.to_json()))
    else:
        print(format_profile(prof))
        if args.output:
            wall = prof.provenance.get("wall_s")
            print(f"\nwrote {args.output}" + (f" (profiling took {wall} s)" if wall is not None else ""), file=sys.stderr)
    return 0
