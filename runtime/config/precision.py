"""Numeric precision of a run: float64 / float32 throughout, or bfloat16 mixed precision
the way GPUs train.

bfloat16: parameters, gradients, K-FAC accumulators, factors, inverses and optimizer state
stay float32; forward (and so backward) runs under `torch.autocast(dtype=bfloat16)`; the
K-FAC hooks capture the bf16 activations / output gradients and curvature accumulates them
in float32 (runtime.optimizers.kfac casts rows to the accumulator's dtype). Activations cross a stage
boundary in bfloat16 (the stage's output is cast, inside the autograd graph, so the
gradient that comes back is bfloat16 too): half the bytes of a float32 message. The
profiler applies the same rules, so the plan's memory model sees the same sizes.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from runtime.config.job import DTYPES as NAMES  # runtime.dtype's choices, named once


@dataclass(frozen=True)
class Precision:
    name: str
    param_dtype: torch.dtype     # parameters, gradients, K-FAC state, optimizer state
    compute_dtype: torch.dtype   # activations, and the messages between stages

    @property
    def mixed(self) -> bool:
        return self.compute_dtype != self.param_dtype

    def autocast(self, device_type: str):
        """The context a forward runs in (nothing unless mixed)."""
        if not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device_type, dtype=self.compute_dtype)

    def boundary(self, t: torch.Tensor) -> torch.Tensor:
        """A stage's output as it crosses to the next stage."""
        return t.to(self.compute_dtype) if t.is_floating_point() and t.dtype != self.compute_dtype else t


def flush_denormals(device_type: str, on: bool = True) -> bool:
    """On a CPU, make subnormal floats (below 1.2e-38 in float32, 2.2e-308 in float64) zero
    in this thread's arithmetic (x86 FTZ/DAZ, torch.set_flush_denormal), or stop. x86 runs
    an instruction that meets one through microcode, many times slower: a run whose
    gradients or second-order statistics drift toward zero slows step after step, and no
    profile of fresh weights sees it. A subnormal's value is below every tolerance a
    float32 or float64 run compares to. The flag is the calling thread's (one torch thread
    per rank here). -> whether this thread now flushes them (denormals_flushed)."""
    if device_type == "cpu":
        torch.set_flush_denormal(on)
    return denormals_flushed()


@contextlib.contextmanager
def flushing_denormals(device_type: str, on: bool = True):
    """`flush_denormals` for a block; the thread's setting before it is restored."""
    before = denormals_flushed()
    flush_denormals(device_type, on)
    try:
        yield
    finally:
        flush_denormals(device_type, before)


def denormals_flushed() -> bool:
    """Whether this thread's float32 arithmetic flushes a subnormal result to zero."""
    return float(torch.tensor([1e-30], dtype=torch.float32) * 1e-15) == 0.0


def precision(name: str) -> Precision:
    if name == "bfloat16":
        return Precision(name, torch.float32, torch.bfloat16)
    if name in ("float32", "float64"):
        dtype = getattr(torch, name)
        return Precision(name, dtype, dtype)
    raise ValueError(f"unknown precision {name!r} (have: {', '.join(NAMES)})")
