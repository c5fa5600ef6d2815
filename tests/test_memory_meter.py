"""The CPU memory meter (runtime.observe.memory) stops counting once its count repeats, and
only then: a real stage, real optimizer state, its forward and backward counted op by op."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn as nn

from runtime.observe.memory import MemoryMeter, nbytes


def _meter(cycle: int):
    torch.manual_seed(0)
    stage = nn.Linear(16, 16)
    optimizer = torch.optim.SGD(stage.parameters(), lr=0.1, momentum=0.9)
    meter = MemoryMeter({0: SimpleNamespace(module=stage, layers={}, optimizer=optimizer)}, torch.device("cpu"))
    meter.cycle = cycle
    return stage, optimizer, meter


def _step(meter: MemoryMeter, stage: nn.Module, optimizer, step: int, micro_batches: int) -> int:
    """One step of `micro_batches` forwards, then their backwards, then the update."""
    meter.begin_step()
    outs = []
    for m in range(micro_batches):
        x = torch.randn(8, 16)
        outs.append(meter.forward(0, m, lambda x=x: torch.tanh(stage(x)).sum()))
        meter.after("fwd", 0, m)
    for m, out in enumerate(outs):
        out.backward()
        meter.after("bwd", 0, m)
    optimizer.step()
    meter.after("step", 0)
    return meter.end_step(step)


def test_the_meter_stops_after_two_equal_cycles_and_reports_the_last_ones_peaks():
    # a cycle of two steps, the first with 3 micro-batches in flight, the second with 1: the
    # peaks alternate, and the first step has no momentum yet
    stage, optimizer, meter = _meter(cycle=2)
    peaks, steady_at = [], None
    for step in range(10):
        peaks.append(_step(meter, stage, optimizer, step, 3 if step % 2 == 0 else 1))
        if meter.steady and steady_at is None:
            steady_at = step
    assert peaks[0] < peaks[2] and peaks[1] < peaks[0]  # momentum appears in step 0's update; 3 > 1 forwards
    assert steady_at == 4  # steps 1-2 and 3-4 agree; steps 0-1 did not (no momentum at step 0's start)
    assert peaks[5:] == [peaks[3], peaks[4]] * 2 + [peaks[3]]  # the last counted cycle, in phase
    # what the meter counts: parameters, gradients, momentum and the saved activations of the
    # forwards in flight (the Linear's input and tanh's output: 8 x 16 float32 each)
    params = sum(nbytes(p) for p in stage.parameters())
    assert peaks[2] == 3 * params + 3 * 2 * 8 * 16 * 4


def test_the_meter_does_not_stop_while_its_count_grows():
    stage, optimizer, meter = _meter(cycle=1)
    peaks = []
    for step in range(8):
        peaks.append(_step(meter, stage, optimizer, step, 1))
        # a leak: state the optimizer keeps adding to
        optimizer.state[stage.weight][f"leak{step}"] = torch.zeros(64)
    assert not meter.steady
    assert all(b - a == 64 * 4 for a, b in zip(peaks[2:], peaks[3:]))
