"""A measured trace (written by `torchrun -m runtime PLAN --trace OUT`) read back: every op
of every rank after the warm-up, with its measured duration, and the plan it ran.

The runtime records the plan's identity in the trace (`otherData`: plan_sha256,
plan_profile, plan_model, plan_layout, warmup_steps; runtime.observe.measure.plan_identity), so
a trace is refused, with one line, against a plan or profile it did not run.
"""

from __future__ import annotations

import hashlib
import statistics
from dataclasses import dataclass, field

from pfcompile.formats.errors import InputError
from pfcompile.formats.jsonio import read_json
from pfcompile.formats.ops import Op, parse_op


@dataclass
class MeasuredOp:
    rank: int
    step: int
    op: Op
    start_ms: float
    end_ms: float

    @property
    def ms(self) -> float:
        return self.end_ms - self.start_ms


@dataclass
class MeasuredSpan:
    """The runtime's own work between a rank's ops (pfcompile.formats.ops.RUNTIME_SPANS)."""
    rank: int
    step: int
    name: str
    start_ms: float
    end_ms: float

    @property
    def ms(self) -> float:
        return self.end_ms - self.start_ms


@dataclass
class MeasuredTrace:
    path: str
    meta: dict
    ops: list[MeasuredOp] = field(default_factory=list)   # after the warm-up, every rank
    spans: list[MeasuredSpan] = field(default_factory=list)  # likewise (none in a trace that predates them)

    @property
    def layout(self) -> dict:
        return self.meta["plan_layout"]

    @property
    def profile_hash(self) -> str:
        return str(self.meta["plan_profile"].get("hash", ""))

    def by_rank(self) -> dict[int, list[MeasuredOp]]:
        """Each rank's ops in the order they started."""
        out: dict[int, list[MeasuredOp]] = {}
        for o in self.ops:
            out.setdefault(o.rank, []).append(o)
        for ops in out.values():
            ops.sort(key=lambda o: o.start_ms)
        return out

    def step_times_ms(self) -> list[float]:
        """Wall time of each measured step: first op start to last op end over all ranks."""
        spans: dict[int, list[float]] = {}
        for o in self.ops:
            lo_hi = spans.setdefault(o.step, [o.start_ms, o.end_ms])
            lo_hi[0], lo_hi[1] = min(lo_hi[0], o.start_ms), max(lo_hi[1], o.end_ms)
        return [hi - lo for _, (lo, hi) in sorted(spans.items())]

    def median_step_ms(self) -> float:
        times = self.step_times_ms()
        return statistics.median(times) if times else 0.0


NEEDS = ("plan_sha256", "plan_profile", "plan_model", "plan_layout", "warmup_steps")


def load_measured(path: str) -> MeasuredTrace:
    """Read a measured trace; a file that is not one (or predates plan identities) is one InputError."""
    obj = read_json(path)
    meta = obj.get("otherData") if isinstance(obj, dict) else None
    if not isinstance(meta, dict) or meta.get("source") != "measured":
        raise InputError(path, "otherData.source", "is not 'measured': not a trace written by `torchrun -m runtime --trace`")
    missing = [k for k in NEEDS if k not in meta]
    if missing:
        raise InputError(path, f"otherData.{missing[0]}", "missing: the trace predates plan identities; run the plan again")
    trace = MeasuredTrace(str(path), meta)
    warm = int(meta["warmup_steps"])
    for i, e in enumerate(obj.get("traceEvents", [])):
        if e.get("ph") != "X":
            continue
        span = e.get("cat") == "runtime"
        try:
            step = int(e["args"]["step"])
            op = str(e["name"]) if span else parse_op(e["name"])
            start, dur = float(e["ts"]) / 1000.0, float(e["dur"]) / 1000.0
            rank = int(e["pid"])
        except (KeyError, TypeError, ValueError) as err:
            raise InputError(path, f"traceEvents[{i}]", f"not a measured op event ({type(err).__name__}: {err})") from None
        if step < warm:
            continue
        if span:
            trace.spans.append(MeasuredSpan(rank, step, op, start, start + dur))
        else:
            trace.ops.append(MeasuredOp(rank, step, op, start, start + dur))
    if not trace.ops:
        raise InputError(path, "traceEvents", f"no op after the {warm} warm-up steps: run more steps")
    return trace


def file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return "sha256:" + hashlib.sha256(f.read()).hexdigest()


def check_against_plan(trace: MeasuredTrace, plan_path: str) -> None:
    """The trace must be a run of exactly this plan file."""
    want = file_sha256(plan_path)
    if trace.meta["plan_sha256"] != want:
        raise InputError(trace.path, "otherData.plan_sha256",
                         f"the trace ran another plan ({trace.meta['plan_sha256'][:19]}..., not {plan_path}'s {want[:19]}...)")


def check_against_profile(trace: MeasuredTrace, profile) -> None:
    """The trace must be a run of a plan made from this profile (same model, same hash)."""
    name = trace.meta["plan_model"].get("name")
    if name != profile.name:
        raise InputError(trace.path, "otherData.plan_model.name", f"the trace ran model {name!r}, the profile is of {profile.name!r}")
    if trace.profile_hash != profile.hash:
        raise InputError(trace.path, "otherData.plan_profile.hash",
                         f"the trace ran a plan made from profile {trace.profile_hash[:19]}..., not this profile's "
                         f"{profile.hash[:19]}... (calibrate the profile the plan was made from)")
