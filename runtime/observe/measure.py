"""The measured timeline: every op's start and end on every rank, as a Perfetto trace in the
renderer's format (pfcompile.formats.trace), and the one-line summary of a run.

Times are milliseconds from a start instant all ranks agree on (a barrier right before the
first step), so the ranks' rows line up in the trace like the plan's predicted rows. A
barrier releases the ranks some time apart, which would put a message's receive before
its send; ranks on one host share the monotonic clock
that perf_counter reads, so `align` moves every such rank onto rank 0's origin exactly.
Ranks on other hosts keep their barrier origin.

On CUDA an op's start and end are CUDA events recorded on the current stream and read
once the step is over (`end_step`): kernels run asynchronously, and synchronising after
every op would make an `isend` blocking (a pair of ranks that both send first could
deadlock) and would change what is measured. The origin event is recorded with the host
instant t0, so the ranks still line up. On CPU the marks are perf_counter instants.
"""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import statistics
import time
from dataclasses import dataclass, field

from pfcompile.formats.ops import COMPUTE_KINDS  # the rest (messages, collectives) is bubble to compute
from pfcompile.formats.trace import stream_of, write_trace


@dataclass
class Timeline:
    rank: int
    t0: float = field(default_factory=time.perf_counter)
    # (step, op text, op kind, start_ms, end_ms)
    ops: list[tuple[int, str, str, float, float]] = field(default_factory=list)
    # (step, start_ms, end_ms) of each whole step on this rank
    steps: list[tuple[int, float, float]] = field(default_factory=list)
    # peak bytes of each step on this rank: (step, bytes)
    memory: list[tuple[int, int]] = field(default_factory=list)
    # the runtime's own work between ops (pfcompile.formats.ops.RUNTIME_SPANS): (step, name, start_ms, end_ms)
    spans: list[tuple[int, str, float, float]] = field(default_factory=list)
    # the process's minor page faults so far at each step's end: (step, count)
    faults: list[tuple[int, int]] = field(default_factory=list)
    device_type: str = "cpu"
    host: str = field(default_factory=socket.gethostname)
    cpus: list[int] = field(default_factory=list)  # the cores this rank's threads may use (runtime.pipeline.affinity)
    denormals_flushed: bool | None = None  # its arithmetic flushes subnormals (runtime.config.precision); None: unknown
    freed_memory_kept: bool | None = None  # its malloc keeps what torch frees (runtime.config.allocator); None: unknown
    network_threads_idle: int | None = None  # its gloo network threads under SCHED_IDLE (runtime.config.network_threads)

    def __post_init__(self):
        self._origin = None   # CUDA: the event recorded at t0
        self._pending: list[tuple[int, str, str, object, object]] = []
        self._pending_spans: list[tuple[int, str, object, object]] = []

    def start(self) -> None:
        """Make now the origin of every time (all ranks call it right after a barrier)."""
        self.t0 = time.perf_counter()
        if self.device_type == "cuda":
            import torch
            self._origin = torch.cuda.Event(enable_timing=True)
            self._origin.record()

    def now_ms(self) -> float:
        return (time.perf_counter() - self.t0) * 1000.0

    def mark(self):
        """An instant: a host time in ms on CPU, a CUDA event recorded on the current stream on CUDA."""
        if self._origin is None:
            return self.now_ms()
        import torch
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def record(self, step: int, text: str, kind: str, start, end) -> None:
        """One op between two marks (floats are recorded as they are; events when the step ends)."""
        if isinstance(start, float):
            self.ops.append((step, text, kind, start, end))
        else:
            self._pending.append((step, text, kind, start, end))

    @contextlib.contextmanager
    def span(self, step: int, name: str):
        """The runtime's own work of `name` (RUNTIME_SPANS) in the block, on the trace's
        "runtime" row: what a rank does between its ops, timed like an op (host instants on
        a CPU; on CUDA events on the stream, read when the step ends or at `flush_spans`)."""
        start = self.mark()
        try:
            yield
        finally:
            end = self.mark()
            if isinstance(start, float):
                self.spans.append((step, name, start, end))
            else:
                self._pending_spans.append((step, name, start, end))

    def _read_events(self) -> None:
        """The pending events' times (the caller has waited for the latest one)."""
        ms = lambda ev: float(self._origin.elapsed_time(ev))  # noqa: E731
        self.ops.extend((st, text, kind, ms(a), ms(b)) for st, text, kind, a, b in self._pending)
        self.spans.extend((st, name, ms(a), ms(b)) for st, name, a, b in self._pending_spans)
        self._pending.clear()
        self._pending_spans.clear()

    def flush_spans(self) -> None:
        """Read the spans recorded after the last step ended (CUDA), before the timeline is sent."""
        if self._pending_spans:
            self._pending_spans[-1][-1].synchronize()
            self._read_events()

    def end_step(self, step: int, start, end, peak_bytes: int | None = None) -> None:
        """Close a step: read its events (waiting for the last one) and keep its peak memory."""
        if not isinstance(start, float):
            end.synchronize()
            self._read_events()
            start, end = float(self._origin.elapsed_time(start)), float(self._origin.elapsed_time(end))
        self.steps.append((step, start, end))
        self.faults.append((step, resource.getrusage(resource.RUSAGE_SELF).ru_minflt))
        if peak_bytes is not None:
            self.memory.append((step, int(peak_bytes)))

    def to_json(self) -> dict:
        return {"rank": self.rank, "ops": self.ops, "steps": self.steps, "memory": self.memory,
                "spans": self.spans, "faults": self.faults, "t0": self.t0, "host": self.host, "cpus": self.cpus,
                "denormals_flushed": self.denormals_flushed, "freed_memory_kept": self.freed_memory_kept,
                "network_threads_idle": self.network_threads_idle}

    @staticmethod
    def from_json(d: dict) -> Timeline:
        return Timeline(d["rank"], float(d.get("t0", 0.0)), [tuple(o) for o in d["ops"]],
                        [tuple(s) for s in d["steps"]], [tuple(m) for m in d.get("memory", [])],
                        [tuple(s) for s in d.get("spans", [])], [tuple(f) for f in d.get("faults", [])],
                        host=str(d.get("host", "")), cpus=[int(c) for c in d.get("cpus", [])],
                        denormals_flushed=d.get("denormals_flushed"), freed_memory_kept=d.get("freed_memory_kept"),
                        network_threads_idle=d.get("network_threads_idle"))

    def shifted(self, ms: float) -> Timeline:
        """The same timeline with every time moved by `ms`."""
        return Timeline(self.rank, self.t0 - ms / 1000.0, [(st, t, k, a + ms, b + ms) for st, t, k, a, b in self.ops],
                        [(st, a + ms, b + ms) for st, a, b in self.steps], list(self.memory),
                        [(st, n, a + ms, b + ms) for st, n, a, b in self.spans], list(self.faults), self.device_type, self.host,
                        list(self.cpus), self.denormals_flushed, self.freed_memory_kept, self.network_threads_idle)

    def to_counters(self):
        """Per step, from its start: the minor page faults it took (from the previous step's end
        to its own; none without the previous step's count) and its peak memory in MiB, as
        counter tracks beside the ops (pfcompile.formats.trace)."""
        faults, peaks = dict(self.faults), dict(self.memory)
        out = []
        for step, start, _ in self.steps:
            values = {}
            if step in faults and step - 1 in faults:
                values["page faults"] = faults[step] - faults[step - 1]
            if step in peaks:
                values["peak memory MiB"] = round(peaks[step] / 2**20, 3)
            if values:
                out.append((self.rank, "step", start, values))
        return out

    def to_events(self):
        return [(self.rank, stream_of(kind), text, s, e, {"step": step, "op": kind})
                for step, text, kind, s, e in self.ops] + \
               [(self.rank, "runtime", name, s, e, {"step": step, "span": name})
                for step, name, s, e in self.spans]


def align(timelines: list[Timeline]) -> list[Timeline]:
    """Every rank on rank 0's host onto rank 0's origin (module doc); the others as they are."""
    first = min(timelines, key=lambda tl: tl.rank)
    return [tl.shifted((tl.t0 - first.t0) * 1000.0) if tl.host == first.host and tl.host else tl
            for tl in timelines]


@dataclass
class Summary:
    steps: int
    loss: float | None
    step_ms: float            # measured wall time per step (all ranks, after warm-up)
    bubble: float             # 1 - compute time / (ranks x wall time), over the same steps
    predicted_ms: float | None
    resumed_at: int = 0       # first step this attempt ran (after --resume)
    losses: list[float] = field(default_factory=list)  # loss of each step this attempt ran
    # Measured / predicted duration of the compute ops themselves (fwd, bwd, K-FAC, step with
    # a predicted duration): how far the profile is from this run's machine. The step-time
    # ratio divided by it is how faithfully the schedule itself ran.
    op_ratio: float | None = None
    # Peak memory per rank (bytes): measured (max over the steps this attempt ran; CUDA:
    # torch.cuda.max_memory_allocated, CPU: the runtime's count of what the planner models)
    # and the plan's prediction (stats.peak_memory_bytes); None where unknown.
    peak_memory_bytes_measured: list[int] | None = None
    peak_memory_bytes_predicted: list[int] | None = None
    memory_limit_bytes: int | None = None
    # The plan's step time with the profile's op-time spread (stats.expected_step_time_ms:
    # pfcompile.check.replay.expected_step_time); None when the profile had no spread.
    expected_ms: float | None = None
    # The cores each rank's threads were allowed at the end of the run, read from the kernel
    # (every core of the job unpinned; its own share with --pin-cpus); [] where unknown.
    cpus: list[list[int]] = field(default_factory=list)
    # The steady step period: each rank's start of its first timed step to the start of its
    # last, over the steps between, averaged over the ranks (None under two timed steps).
    # step_ms also counts how far the ranks' first starts and last ends lie apart (in 1F1B
    # the last stage starts a step while the first still finishes the previous one): over
    # n steps that is 1/n of a backward pass more.
    period_ms: float | None = None
    refresh_steps: int | None = None  # the plan's k (memory_lines: the run's steady state)
    # Whether each rank's arithmetic flushed subnormal floats to zero (runtime.flush_denormal),
    # read back from the rank's CPU state; None where unknown.
    denormals_flushed: list[bool | None] = field(default_factory=list)
    # Whether each rank's malloc kept the memory torch frees (runtime.keep_freed_memory).
    freed_memory_kept: list[bool | None] = field(default_factory=list)
    # Each rank's minor page faults per step over the steps after warm-up (None: under two):
    # memory the process maps afresh, which a plan does not count.
    page_faults_per_step: list[float | None] = field(default_factory=list)
    # How many of each rank's gloo network threads ran under SCHED_IDLE at the end of the run
    # (runtime.idle_network_threads), read back from the kernel; None off gloo or unknown.
    network_threads_idle: list[int | None] = field(default_factory=list)

    def over_limit(self) -> list[int]:
        """Ranks whose measured peak exceeds the plan's memory limit."""
        if not self.memory_limit_bytes or not self.peak_memory_bytes_measured:
            return []
        return [q for q, b in enumerate(self.peak_memory_bytes_measured) if b > self.memory_limit_bytes]

    def memory_lines(self) -> list[str]:
        """A table: per rank the measured and predicted peak, and a line per rank over the limit."""
        got, want = self.peak_memory_bytes_measured, self.peak_memory_bytes_predicted
        if not got:
            return []
        out = ["rank  peak measured  peak predicted  measured/predicted"]
        for q, b in enumerate(got):
            p = want[q] if want and q < len(want) else None
            ratio = f"{b / p:.3f}" if p else "n/a"
            out.append(f"{q:>4}  {b / 2**20:>10.2f} MiB  " + (f"{p / 2**20:>11.2f} MiB" if p else f"{'n/a':>15}")
                       + f"  {ratio:>18}")
        if self.refresh_steps and not self.resumed_at and self.steps < 3 * self.refresh_steps:
            # the optimizer's state is allocated as it is first computed (K-FAC: the factors and
            # inverses in the first cycle, the second inverse slot in the second), and the plan's
            # peak is the steady state's, which a run holds only from its third cycle on
            out.append(f"runtime: {self.steps} steps are under 3 refresh cycles ({3 * self.refresh_steps}): "
                       f"not all the optimizer state the plan counts is allocated yet, so the measured peak "
                       f"can be below the prediction")
        return out + self.limit_lines()

    def limit_lines(self) -> list[str]:
        return [f"runtime: rank {q} measured peak {self.peak_memory_bytes_measured[q]} bytes exceeds the plan's "
                f"memory limit of {self.memory_limit_bytes} bytes" for q in self.over_limit()]

    def loss_curve(self, points: int = 8) -> str:
        """The loss at about `points` evenly spaced steps, first and last included."""
        n = len(self.losses)
        if not n:
            return "loss: n/a"
        picks = sorted({round(i * (n - 1) / max(1, points - 1)) for i in range(min(points, n))})
        return "loss by step: " + ", ".join(f"{self.resumed_at + i}: {self.losses[i]:.3f}" for i in picks)

    def line(self) -> str:
        loss = f"{self.loss:.4f}" if self.loss is not None else "n/a"
        pred = "predicted n/a"
        if self.predicted_ms:
            pred = (f"predicted {self.predicted_ms:.2f} ms/step, measured/predicted "
                    f"{self.step_ms / self.predicted_ms:.3f}")
        if self.predicted_ms and self.op_ratio:
            pred += (f" (compute ops ran at {self.op_ratio:.2f}x their profiled time; schedule alone "
                     f"{self.step_ms / self.predicted_ms / self.op_ratio:.3f})")
        if self.expected_ms:
            pred += (f"; with the op times' spread: predicted {self.expected_ms:.2f} ms/step, measured/predicted "
                     f"{self.step_ms / self.expected_ms:.3f}")
        resumed = f" (resumed at step {self.resumed_at})" if self.resumed_at else ""
        return (f"runtime: {self.steps} steps{resumed}, loss {loss}, measured {self.step_ms:.2f} ms/step, "
                f"bubble {self.bubble:.1%}, {pred}")


def summarize(timelines: list[Timeline], loss: float | None, predicted_ms: float | None,
              warmup_steps: int, total_steps: int, resumed_at: int = 0,
              losses: list[float] | None = None, predicted_ops=None,
              predicted_peaks: list[int] | None = None, memory_limit: int | None = None,
              expected_ms: float | None = None, refresh_steps: int | None = None) -> Summary:
    """Step time and bubble over the steps after warm-up (the first cycle pays for lazy
    allocations and, on CUDA, kernel loading)."""
    all_steps = sorted({s for tl in timelines for s, _, _ in tl.steps})
    kept = [s for s in all_steps if s >= warmup_steps] or all_steps
    lo = min(start for tl in timelines for s, start, _ in tl.steps if s in kept)
    hi = max(end for tl in timelines for s, _, end in tl.steps if s in kept)
    wall = hi - lo
    busy = sum(e - s for tl in timelines for step, _, kind, s, e in tl.ops
               if step in kept and kind in COMPUTE_KINDS)
    bubble = 1.0 - busy / (wall * len(timelines)) if wall > 0 else 0.0
    op_ratio = _op_ratio(timelines, set(kept), predicted_ops) if predicted_ops else None
    measured_peaks = None
    if all(tl.memory for tl in timelines):
        measured_peaks = [max(b for _, b in tl.memory) for tl in sorted(timelines, key=lambda t: t.rank)]
    return Summary(total_steps, loss, wall / len(kept), bubble, predicted_ms, resumed_at, list(losses or []),
                   op_ratio, measured_peaks, list(predicted_peaks) if predicted_peaks else None, memory_limit,
                   expected_ms, [tl.cpus for tl in sorted(timelines, key=lambda t: t.rank)],
                   step_period(timelines, kept), refresh_steps,
                   [tl.denormals_flushed for tl in sorted(timelines, key=lambda t: t.rank)],
                   [tl.freed_memory_kept for tl in sorted(timelines, key=lambda t: t.rank)],
                   [faults_per_step(tl, kept) for tl in sorted(timelines, key=lambda t: t.rank)],
                   [tl.network_threads_idle for tl in sorted(timelines, key=lambda t: t.rank)])


def faults_per_step(tl: Timeline, kept: list[int]) -> float | None:
    """A rank's minor page faults per step from the end of its first kept step to the end of
    its last (Summary.page_faults_per_step)."""
    at = {s: n for s, n in tl.faults if s in kept}
    if len(at) < 2:
        return None
    first, last = min(at), max(at)
    return (at[last] - at[first]) / (last - first)


def step_period(timelines: list[Timeline], kept: list[int]) -> float | None:
    """Summary.period_ms: the mean over ranks of (start of the last kept step - start of the
    first) / (steps between)."""
    if len(kept) < 2:
        return None
    first, last = kept[0], kept[-1]
    periods = []
    for tl in timelines:
        starts = {s: a for s, a, _ in tl.steps}
        if first in starts and last in starts:
            periods.append((starts[last] - starts[first]) / (last - first))
    return sum(periods) / len(periods) if periods else None


def predicted_op_table(plan) -> list[list[list[tuple[str, float]]]]:
    """[rank][cycle step] = [(op text, planned ms)] in execution order: what matched_compute_ops
    matches a timeline's ops against. Each op's own time (Plan.own_ms): a run times the
    runtime's work around it apart."""
    return [[[(str(po.op), plan.own_ms(po)) for po in ops] for ops in steps] for steps in plan.ranks]


def matched_compute_ops(tl: Timeline, kept: set[int], predicted_ops):
    """(op kind, measured ms, planned ms) of each compute op of `tl` in the `kept` steps whose
    text is the plan's at its place (predicted_op_table), in the order run."""
    k = len(predicted_ops[tl.rank])
    index: dict[int, int] = {}
    for step, text, kind, s, e in tl.ops:
        i = index.get(step, 0)
        index[step] = i + 1
        if step not in kept or kind not in COMPUTE_KINDS:
            continue
        want_text, want_ms = predicted_ops[tl.rank][step % k][i]
        if want_text == text:
            yield kind, e - s, want_ms


def _op_ratio(timelines: list[Timeline], kept: set[int], predicted_ops) -> float | None:
    """Σ measured / Σ predicted duration over compute ops with a predicted duration.
    predicted_ops[rank][cycle step] = [(op text, predicted ms)] in execution order."""
    measured = predicted = 0.0
    for tl in timelines:
        for _, ms, want_ms in matched_compute_ops(tl, kept, predicted_ops):
            if want_ms > 0:
                measured += ms
                predicted += want_ms
    return measured / predicted if predicted > 0 else None


def per_step_ms(timelines: list[Timeline]) -> list[float]:
    """Wall time of each step over all ranks (first start to last end)."""
    out = []
    for s in sorted({s for tl in timelines for s, _, _ in tl.steps}):
        lo = min(a for tl in timelines for st, a, _ in tl.steps if st == s)
        hi = max(b for tl in timelines for st, _, b in tl.steps if st == s)
        out.append(hi - lo)
    return out


def median_step_ms(timelines: list[Timeline], warmup_steps: int) -> float:
    times = per_step_ms(timelines)
    return statistics.median(times[warmup_steps:] or times)


def plan_identity(path: str, plan) -> dict:
    """What a measured trace records of its plan, so `pfcompile inspect --against` and
    `pfcompile calibrate` can refuse a trace of another plan or model: the plan file's sha256,
    the profile it was planned from, and what maps an op to profile entries."""
    import hashlib
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    return {"plan_sha256": f"sha256:{digest}", "plan_profile": dict(plan.profile), "plan_model": dict(plan.model),
            "plan_layout": {"partition": plan.partition, "layers": plan.layers, "layer_stage": plan.layer_stage,
                            "schedule": plan.config.schedule, "optimizer": plan.config.optimizer,
                            "inverse": plan.config.inverse,
                            "replicas": plan.config.replicas, "refresh_steps": plan.refresh_steps}}


def run_metadata(job, steps: int, warmup_steps: int, **extra) -> dict:
    """A run's measured-trace metadata: its plan (path and identity), how many steps it ran
    and how many of them were warm-up, its dtype and device; `extra` adds the caller's own."""
    return {"plan": os.path.abspath(job.plan_path), "steps": steps, "warmup_steps": warmup_steps,
            **plan_identity(job.plan_path, job.plan), "dtype": job.precision.name, "device_type": job.device_type,
            **extra}


def write_measured_trace(path: str, timelines: list[Timeline], metadata: dict) -> None:
    events = [ev for tl in timelines for ev in tl.to_events()]
    write_trace(path, events, metadata={"source": "measured", **metadata},
                counters=[c for tl in timelines for c in tl.to_counters()])
