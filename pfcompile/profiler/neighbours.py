"""Profiling under the run's conditions: ranks - 1 other processes, each the whole model's
forward and backward in a loop, share the machine while the ops are timed."""

from __future__ import annotations

import time

import torch

from pfcompile.profiler.parts import PartBench
from pfcompile.profiler.settings import DTYPES, resolve_spec
from runtime.config.allocator import keep_freed_memory
from runtime.config.precision import flush_denormals


def _neighbour(model: str, micro_batch: int, seq_len: int, dtype: str, threads: int, stop) -> None:
    """One other 'rank': the whole model's forward and backward, again and again, until stopped."""
    torch.set_num_threads(threads)
    flush_denormals("cpu")  # as the ranks of a run do (runtime.flush_denormal)
    keep_freed_memory("cpu")  # likewise (runtime.keep_freed_memory)
    spec = resolve_spec(model, seq_len)
    benches = [PartBench(spec, name, micro_batch, seq_len, torch.device("cpu"), DTYPES[dtype])
               for name in spec.part_names]
    for b in benches:
        out = b.forward()
        if not b.is_last:
            b.grad_out = torch.ones_like(out)
        b.out = None
    while not stop.is_set():
        for b in benches:
            b.forward()
            b.backward()


class Neighbours:
    """ranks - 1 neighbour processes for the duration of a `with` block (none for one rank)."""

    def __init__(self, model, micro_batch, seq_len, dtype, threads, count):
        self.args, self.count, self.procs = (model, micro_batch, seq_len, dtype, threads), count, []

    def __enter__(self):
        if self.count:
            import torch.multiprocessing as mp
            ctx = mp.get_context("spawn")
            self.stop = ctx.Event()
            self.procs = [ctx.Process(target=_neighbour, args=(*self.args, self.stop), daemon=True)
                          for _ in range(self.count)]
            for p in self.procs:
                p.start()
            time.sleep(1.0)  # let them build their model and start working
        return self

    def __exit__(self, *exc):
        if self.procs:
            self.stop.set()
            for p in self.procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.terminate()
        return False
