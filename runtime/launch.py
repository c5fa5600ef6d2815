"""The runtime launched from Python as users launch it (the profiler's probe, the benchmarks):
torchrun on one node, from this interpreter, so its environment's torch runs the ranks."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator


def torchrun(nproc: int, *args: str) -> list[str]:
    """The command line: `torchrun --standalone --nproc-per-node NPROC ARGS...`."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *args]


@contextlib.contextmanager
def launch_env(**extra: str) -> Iterator[dict[str, str]]:
    """The launch's environment: one intra-op thread per rank (the ranks share the cores) and
    a TMPDIR of its own, removed when the block ends (with whatever the caller put there):
    torchrun makes a torchelastic_* folder there and never removes it."""
    with tempfile.TemporaryDirectory(prefix="pfcompile-torchrun-") as tmp:
        yield {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": tmp, **extra}
