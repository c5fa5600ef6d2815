"""Timing one callable on one device: perf_counter, the thread's CPU time or CUDA events.

Warm-up runs first, then `repeats` samples; an entry stops early once its samples add up to
`entry_budget_s` (keeping at least 3), so a 1000x1000 eigendecomposition does not dominate
the profiling time. The median goes into the profile's entry, [p10, p90] into its `spread`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Timing:
    median: float
    p10: float
    p90: float
    samples: int


COLD_SWEEP_BYTES = 64 << 20  # above the last-level cache of the CPUs we profile on


class Clock:
    """Times a callable on one device: warm-up, then repeats, each optionally after an untimed setup."""

    def __init__(self, device: torch.device, repeats: int, warmup: int, entry_budget_s: float = 2.0,
                 kind: str = "wall", cold: bool = False):
        self.device, self.repeats, self.warmup, self.budget = device, repeats, warmup, entry_budget_s
        # cold: before each repeat, untimed, sweep a buffer larger than the CPU's caches, so an
        # op starts from memory as it does in a run, where other ops ran in between (a repeat
        # right after the last one finds its weights and inputs in cache)
        self._sweep = torch.empty(COLD_SWEEP_BYTES // 4, dtype=torch.float32) if cold and device.type == "cpu" else None
        # "thread": CPU time of this thread (time.thread_time). With one torch thread all the
        # work runs on it, so time spent descheduled by other processes is not counted.
        self.now = time.thread_time if kind == "thread" else time.perf_counter

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _once(self, fn: Callable[[], object]) -> float:
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end))
        t0 = self.now()
        fn()
        return (self.now() - t0) * 1e3

    def time(self, fn: Callable[[], object], setup: Callable[[], object] | None = None) -> Timing:
        return self.time_in_turn({"": (fn, setup)})[""]

    def time_in_turn(self, entries: dict[str, tuple[Callable[[], object], Callable[[], object] | None]]
                     ) -> dict[str, Timing]:
        """Each entry's callable (after its untimed setup) timed in turn, one sample of each
        per round, so a slow spell of the machine falls on all of them alike: their ratios
        (a split backward's B + W against the whole backward) hold where entries timed one
        after the other would each catch another spell. Stops early as `time` does, once
        the rounds add up to the entries' budgets."""
        samples: dict[str, list[float]] = {name: [] for name in entries}
        for i in range(self.warmup + self.repeats):
            for name, (fn, setup) in entries.items():
                if setup is not None:
                    setup()
                if self._sweep is not None:
                    self._sweep.fill_(float(i))
                self._sync()
                ms = self._once(fn)
                if i >= self.warmup:
                    samples[name].append(ms)
            taken = i + 1 - self.warmup
            if taken >= 3 and sum(map(sum, samples.values())) > self.budget * 1e3 * len(entries):
                break
        out = {}
        for name, v in samples.items():
            p10, p50, p90 = np.percentile(v, [10, 50, 90])
            out[name] = Timing(float(p50), float(p10), float(p90), len(v))
        return out
