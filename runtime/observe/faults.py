"""Fault injection for tests, kept out of the training loop's way.

PFC_RUNTIME_CRASH="RANK:STEP" makes that rank exit abruptly (os._exit, no cleanup) at the
start of that step, on the first attempt only (TORCHELASTIC_RESTART_COUNT == 0), so a
torchrun restart can be shown to resume from the last complete checkpoint.
PFC_RUNTIME_PAUSE="RANK:STEP:SECONDS" makes that rank sleep at the start of that step, so
a peer that crashed meanwhile is already gone when it next talks to it (gloo then raises
from the call itself: an isend, an irecv, a collective).
PFC_RUNTIME_NAN="RANK:STEP[:STAGE]" fills that rank's first stage's (or STAGE's)
parameters with NaN at the start of that step (a diverged update on demand; the head's
stage makes the loss NaN), so the stop of every rank on a non-finite value can be shown
naming the step and the stage. It prints when it does, with the Unix time, so a test can
time the stop from it.
"""

from __future__ import annotations

import os
import sys

CRASH_EXIT_CODE = 17


def crash_hook(rank: int):
    """A callable `hook(step)` for the loop to call at the start of every step: it kills this
    process (or pauses it) at the configured step, and does nothing otherwise (or when
    nothing is set)."""
    step = _crash_step(rank)
    r, s, seconds = ((os.environ.get("PFC_RUNTIME_PAUSE") or "").split(":") + [None, None])[:3]
    pause_step = int(s) if seconds is not None and int(r) == rank else None

    def hook(current: int) -> None:
        if current == step:
            os._exit(CRASH_EXIT_CODE)
        if current == pause_step:
            import time

            time.sleep(float(seconds))
    return hook


def _crash_step(rank: int) -> int | None:
    spec = os.environ.get("PFC_RUNTIME_CRASH")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    r, _, s = spec.partition(":")
    return int(s) if int(r) == rank else None


def poison_hook(rank: int, stages: dict):
    """A callable `hook(step)`: at the configured step, NaN into this rank's first stage."""
    spec = os.environ.get("PFC_RUNTIME_NAN")
    r, s, stage = ((spec or "").split(":") + [None, None])[:3]
    step = int(s) if spec and int(r) == rank else None

    def hook(current: int) -> None:
        if current == step and stages:
            import time

            import torch

            target = int(stage) if stage is not None else min(stages)
            with torch.no_grad():
                for p in stages[target].module.parameters():
                    p.fill_(float("nan"))
            sys.stdout.write(f"runtime[rank {rank}]: fault: stage {target}'s parameters set to NaN at step "
                             f"{current} (unix time {time.time():.3f})\n")  # one write: ranks share the terminal
            sys.stdout.flush()
    return hook
