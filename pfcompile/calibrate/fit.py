"""`pfcompile calibrate`: fit a profile's entries to what the runtime measured.

For every op kind the runtime times, the median measured duration (over the steps after
warm-up, every rank and every trace) replaces the profile's entry:
- per K-FAC layer: curv_a, curv_b, precond, and inv of the method the plan used, directly
  (one op is one entry);
- per part: fwd, bwd and the optimizer step are measured per STAGE (a stage may hold several
  parts), so each part's entry is scaled by measured / predicted of its stage (the
  proportional fit: parts keep their relative costs); a part seen in several stages or
  traces takes the mean of its fits. A stage predicted at 0 ms spreads its measurement
  evenly over its parts;
- point-to-point messages: a message whose receiver was already waiting when it was sent
  gives one transfer time (receive end - send start; ranks share a clock origin at a
  barrier). With two or more message sizes, latency and bandwidth are fitted (least squares
  on relative error); with one size, the bandwidth is kept and the latency fitted.
Op kinds the trace does not have (e.g. inv with another method) keep their entries.
Split-backward kinds (bwd_input, bwd_weight) are not fitted (the profile has one bwd entry).

The result records what it was calibrated from in its provenance (`calibration`: the
traces' paths and plan hashes, the parent profile's hash, how many entries per kind), so
its hash differs from the parent's and every plan made from it names it.
"""

from __future__ import annotations

import copy
import datetime as _dt
import statistics
from collections import defaultdict

from pfcompile.calibrate.measured import MeasuredTrace, check_against_profile
from pfcompile.formats.profile import SCHEMA_VERSION, LinkModel, Profile

PART_KINDS = ("fwd", "bwd", "step")
LAYER_KINDS = ("curv_a", "curv_b", "precond", "inv")


def medians(traces: list[MeasuredTrace]) -> dict[tuple, list[float]]:
    """(kind, key) -> measured durations, key = stage (per trace: (trace index, stage)) or layer[, factor]."""
    out: dict[tuple, list[float]] = defaultdict(list)
    for i, tr in enumerate(traces):
        for o in tr.ops:
            k = o.op.kind
            if k in PART_KINDS:
                out[(k, i, o.op.stage)].append(o.ms)
            elif k == "inv":
                out[(k, o.op.layer, o.op.factor)].append(o.ms)
            elif k in LAYER_KINDS:
                out[(k, o.op.layer)].append(o.ms)
    return out


def message_samples(trace: MeasuredTrace, profile: Profile) -> list[tuple[int, float]]:
    """(bytes, transfer ms) of each message whose receive was posted before its send."""
    sends, recvs = {}, {}
    for o in trace.ops:
        if o.op.kind in ("send_act", "send_grad"):
            sends[(o.step, o.op.message_key())] = o
        elif o.op.kind in ("recv_act", "recv_grad"):
            recvs[(o.step, o.op.message_key())] = o
    parts = trace.layout["partition"]
    out_bytes = [profile.part(stage[-1]).out_bytes for stage in parts]
    samples = []
    for key, r in recvs.items():
        s = sends.get(key)
        if s is None or r.start_ms > s.start_ms:
            continue
        kind, stage, _ = key[1]
        nbytes = out_bytes[stage] if kind == "act" else (out_bytes[stage - 1] if stage > 0 else 0)
        samples.append((nbytes, r.end_ms - s.start_ms))
    return samples


def fit_latency_bandwidth(samples: list[tuple[int, float]], old: LinkModel) -> LinkModel:
    """Median per size; two or more sizes: weighted least squares of ms = latency + bytes/bw
    (weights 1/ms: relative error); one size: the old bandwidth, the latency fitted."""
    by_size: dict[int, list[float]] = defaultdict(list)
    for n, ms in samples:
        by_size[n].append(ms)
    pts = sorted((n, statistics.median(v)) for n, v in by_size.items())
    if len(pts) >= 2:
        w = [1.0 / max(ms, 1e-9) ** 2 for _, ms in pts]
        sw = sum(w)
        mx = sum(wi * n for wi, (n, _) in zip(w, pts)) / sw
        my = sum(wi * ms for wi, (_, ms) in zip(w, pts)) / sw
        sxx = sum(wi * (n - mx) ** 2 for wi, (n, _) in zip(w, pts))
        slope = sum(wi * (n - mx) * (ms - my) for wi, (n, ms) in zip(w, pts)) / sxx if sxx > 0 else 0.0
        if slope > 0:
            return LinkModel(latency_ms=max(0.0, my - slope * mx), bytes_per_ms=1.0 / slope)
    n, ms = pts[-1]
    return LinkModel(latency_ms=max(0.0, ms - n / old.bytes_per_ms), bytes_per_ms=old.bytes_per_ms)


def calibrate(profile: Profile, traces: list[MeasuredTrace]) -> tuple[Profile, dict]:
    """A new profile with entries fitted to the traces' medians; returns (profile, counts per kind)."""
    for tr in traces:
        check_against_profile(tr, profile)
    new = copy.deepcopy(profile)
    meds = {key: statistics.median(v) for key, v in medians(traces).items()}
    counts: dict[str, int] = defaultdict(int)

    # per K-FAC layer: direct
    for key, ms in meds.items():
        kind = key[0]
        if kind in ("curv_a", "curv_b", "precond"):
            setattr(new.kfac_layers[key[1]], f"{kind}_ms", ms)
            counts[kind] += 1
        elif kind == "inv":
            _, layer, factor = key
            method = traces[0].layout.get("inverse", "cholesky")
            L = new.kfac_layers[layer]
            (L.inv_a_ms if factor == "A" else L.inv_b_ms)[method] = ms
            counts["inv"] += 1

    # per part: proportional within each measured stage, mean over observations
    fits: dict[tuple[str, str], list[float]] = defaultdict(list)
    for key, ms in meds.items():
        kind = key[0]
        if kind not in PART_KINDS:
            continue
        _, i, stage = key
        layout = traces[i].layout
        names = layout["partition"][stage]
        step_kind = "kfac" if layout.get("kfac") else "adamw"
        old = [_part_ms(profile, name, kind, step_kind) for name in names]
        total = sum(old)
        for name, o in zip(names, old):
            fits[(name, kind if kind != "step" else f"step.{step_kind}")].append(
                ms * o / total if total > 0 else ms / len(names))
    for (name, what), values in fits.items():
        part = new.part(name)
        value = sum(values) / len(values)
        if what.startswith("step."):
            part.step_ms[what.split(".", 1)[1]] = value
        else:
            setattr(part, f"{what}_ms", value)
        counts[what.split(".")[0]] += 1

    # messages
    samples = [s for tr in traces for s in message_samples(tr, profile)]
    if samples:
        new.comm.p2p = fit_latency_bandwidth(samples, profile.comm.p2p)
        counts["p2p messages"] = len(samples)

    new.spread = {}  # the measured spreads belonged to the parent's samples
    new.schema_version = SCHEMA_VERSION
    new.provenance = {**profile.provenance, "calibration": {
        "parent_hash": profile.hash,
        "traces": [{"path": tr.path, "plan_sha256": tr.meta["plan_sha256"], "steps_used": len({o.step for o in tr.ops}),
                    "load_avg": tr.meta.get("load_avg")} for tr in traces],
        "entries": dict(counts),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "method": "median of the measured ops after warm-up; parts scaled per stage; p2p from waiting receives",
    }}
    new.to_json()  # the new hash
    return new, dict(counts)


def _part_ms(profile: Profile, name: str, kind: str, step_kind: str) -> float:
    p = profile.part(name)
    if kind == "step":
        return p.step_ms.get(step_kind, 0.0)
    return p.fwd_ms if kind == "fwd" else p.bwd_ms
