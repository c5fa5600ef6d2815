"""`torchrun --nproc-per-node N -m runtime PLAN`: execute a compiled plan.

Where things live: runtime.config.job (the run's settings: typed sections, the TOML file,
--set), runtime.config.cli (the flags, each a shorthand for one key; validation of the config,
plan, model and data against the job), runtime.pipeline.build (this rank's stages, K-FAC layers,
optimizers, the update), runtime.pipeline.loop (the training loop, given the job),
runtime.io.checkpoint (save / resume), runtime.observe.metrics (metrics log, progress), runtime.io.export
(the trained model file), runtime.observe.measure (timeline, summary), runtime.observe.faults (fault
injection for tests).

Exit codes: 0 done, 2 bad input (plan, flags, model), 3 a peer was lost / timed out,
4 the run diverged (a non-finite activation or loss; the step and stage are named).
"""

from __future__ import annotations

import json
import os
import sys

from pfcompile.formats.errors import InputError, printable
from runtime.config.cli import build_parser, prepare

EXIT_INPUT, EXIT_COMM, EXIT_DIVERGED = 2, 3, 4


def main(argv: list[str] | None = None) -> int:
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):  # what no encoder writes (a lone surrogate) prints escaped
            stream.reconfigure(errors="backslashreplace")
    args = build_parser().parse_args(argv)
    # From the environment torchrun sets, not from torch: bad input fails before torch loads.
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    try:
        job = prepare(args, rank, world_size)
    except InputError as e:
        return _fail(rank, e, EXIT_INPUT)
    from runtime.pipeline.comm import CommTimeout
    from runtime.pipeline.interpreter import NonFiniteError
    from runtime.pipeline.loop import run
    try:
        summary = run(job)
    except CommTimeout as e:
        return _fail(rank, e, EXIT_COMM)
    except NonFiniteError as e:
        return _fail(rank, e, EXIT_DIVERGED)
    except InputError as e:
        return _fail(rank, e, EXIT_INPUT)
    if summary is not None:
        if not job.config.log.json:
            print(summary.loss_curve(), flush=True)
            print(summary.line(), flush=True)
            if job.config.runtime.pin_cpus:
                print("runtime: pinned: " + ", ".join(f"rank {q} -> cpus {','.join(map(str, c))}"
                                                      for q, c in enumerate(summary.cpus)), flush=True)
            for line in summary.memory_lines():
                print(line, flush=True)
        else:
            print(json.dumps(summary.__dict__), flush=True)
            # a run over the memory limit still says so where a person reads it
            for line in summary.limit_lines():
                print(line, file=sys.stderr, flush=True)
    return 0


def _fail(rank: int, error: Exception, code: int) -> int:
    # one write of the whole line: ranks share the terminal, and print's separate write of
    # the newline lets another rank's line in between
    sys.stderr.write(f"runtime[rank {rank}]: error: {printable(str(error))}\n")
    sys.stderr.flush()
    return code


def _exit_without_teardown(code: int) -> None:
    """All ranks have met at the final barrier and nothing is left to do: exit without
    running gloo's destructors (see runtime.pipeline.comm.shutdown)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    code = main()
    if code in (0, EXIT_DIVERGED):  # every rank ends together (runtime.pipeline.loop): no teardown race
        _exit_without_teardown(code)
    sys.exit(code)
