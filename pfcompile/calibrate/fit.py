"""`pfcompile calibrate`: fit a profile's entries to what the runtime measured.

What an op costs its rank is its OCCUPANCY: from its start to the next op's start on the
same rank in the same step (its own work, whatever the runtime does after it, and the
dispatch of the next op), not only the span the runtime timed. The fit:
- `runtime.op_ms`, the dispatch of one op: the median gap between an op's end and the next
  op's start (the common case; an op with more work after its timed span, e.g. a backward's
  gradient bookkeeping, keeps that work in its own entry);
- every compute op kind: statistic(occupancy - op_ms) (an op that ends its step: its timed
  span, the runtime's work after it being the step's),
  - per covered layer: each op with a cost key in the traced plan's optimizer's declaration
    (K-FAC's curv_a, curv_b, precond, and inv of the method the plan used; Shampoo's, Muon's),
    directly into that entry of its optimizer_ms (one op is one entry);
  - per part: fwd, bwd and the optimizer step are measured per STAGE (a stage may hold
    several parts), so each part's entry is scaled by measured / predicted of its stage (the
    proportional fit: parts keep their relative costs); a part seen in several stages or
    traces takes the mean of its fits. A stage predicted at 0 ms spreads its measurement
    evenly over its parts;
- `runtime.send_ms`: statistic(occupancy of a send - op_ms) (posting it);
- `runtime.step_ms`: statistic over ranks and steps of the gap between a rank's last op of a
  step and its first op of the next, less op_ms (the runtime's work between steps);
- the messages (fit_receives): a receive posted `gap` after its send ended lasts
  max(recv_ms, latency + bytes/bandwidth - gap) (the pair meets, then the data moves:
  Costs.message_ms). `runtime.recv_ms` is the statistic of the receives posted after their
  send ended; the p2p link is fitted to (receive end - send end) of those posted before:
  with two message sizes or more, latency and bandwidth (formats.profile.fit_link, as the
  profiler's message benchmark fits them);
  with one, the latency, the bandwidth staying the profile's (its message benchmark spans
  sizes). Ranks share a clock origin (runtime.observe.measure.align).
- the op times' spread (fit_spread): a rank's level in each step (its compute ops'
  occupancy over their entries' means) as `runtime.level_spread`, and each sample over the
  mean of its entry's samples and over its rank's level in its step, pooled per op kind, as
  `runtime.op_spread`; each as 20 quantile midpoints scaled to mean 1 (fewer than
  SPREAD_MIN_SAMPLES samples: none); receives have none (their waiting is the message's lag,
  which the replay makes). Beside them, op_spread's `message` (a waiting receive's end - its
  send's end, over the fitted link's time for its size: message_spread) and `between_steps`
  (the runtime's work between steps over its mean).
The statistic is the MEAN by default: a step is a sum of op occupancies, and sums add
means; a skewed op (rare stalls) has a median below its mean, and a profile of medians
predicts a step that is too short. `statistic="median"` fits medians.
Op kinds the trace does not have (e.g. inv with another method) keep their entries.
A split backward's B and W (bwd_input, bwd_weight: zero-bubble plans) are fitted per part as
fwd and bwd are, into `bwd_input_ms` / `bwd_weight_ms` (from the parent's measured split, or
its 50/50 estimate where it had none, for the proportions within a stage).

The result records what it was calibrated from in its provenance (`calibration`: the
traces' paths and plan hashes, the parent profile's hash, how many entries per kind, the
statistic), so its hash differs from the parent's and every plan made from it names it.
"""

from __future__ import annotations

import copy
import datetime as _dt
import statistics
from collections import defaultdict
from dataclasses import dataclass

from pfcompile.calibrate.measured import MeasuredTrace, check_against_profile
from pfcompile.formats.dataflow import captures as spec_captures
from pfcompile.formats.optimizers import Optimizer, optimizer
from pfcompile.formats.profile import (
    CAPTURE_KINDS,
    LEVEL_KINDS,
    SCHEMA_VERSION,
    SPREAD_KINDS,
    LinkModel,
    Profile,
    RuntimeOverheads,
    fit_link,
)

PART_KINDS = ("fwd", "bwd", "bwd_input", "bwd_weight", "step")


STATISTICS = {"mean": statistics.fmean, "median": statistics.median}
SPREAD_QUANTILES = 20
SPREAD_MIN_SAMPLES = 20


def sends_by_message(trace: MeasuredTrace) -> dict:
    """(step, message key) -> the send of that message: what a receive is matched with."""
    return {(o.step, o.op.message_key()): o for o in trace.ops if o.op.kind in ("send_act", "send_grad")}


def dispatch_gaps(traces: list[MeasuredTrace]) -> list[float]:
    """End of an op to the next op's start on its rank, within a step (every op kind)."""
    return [b.start_ms - a.end_ms for tr in traces for ops in tr.by_rank().values()
            for a, b in zip(ops, ops[1:]) if a.step == b.step]


def op_instances(traces: list[MeasuredTrace], op_ms: float):
    """What each op costs its rank, less the dispatch of the next (op_ms): its occupancy - op_ms
    when the next op is in the same step, its timed span when it is the step's last.
    (kind, key) -> ms, key = (trace index, stage) for parts, (layer, factor) for the per-layer
    ops with a cost key in the traced plan's optimizer's declaration;
    ("send",) for sends; ("between steps",) -> a rank's last op's end to its next step's
    first op, less op_ms and less the activation in it (the runtime's work between steps);
    ("activate", trace index, stages of the rank) -> the rank's activation at a cycle's start
    (the trace's runtime row), which the cost model counts apart (Costs.activation_ms);
    (kind, trace index, stage, "capture") -> a pipeline op of a refresh step whose optimizer
    captures (K-FAC), apart from the same op in the cycle's other steps (Part.capture_ms).
    Yields (key, (trace index, rank, step) or None for the runtime's own work, ms)."""
    for i, tr in enumerate(traces):
        spec = optimizer(optimizer_of(tr.layout))
        captures, cycle = spec_captures(spec), int(tr.layout.get("refresh_steps", 1))
        activation: dict[tuple[int, int], float] = defaultdict(float)
        for sp in tr.spans:
            if sp.name == "activate":
                activation[(sp.rank, sp.step)] += sp.ms
        for rank, ops in tr.by_rank().items():
            stages = tuple(sorted({o.op.stage for o in ops if o.op.kind == "step"}))
            for a, b in zip(ops, ops[1:] + [None]):
                if b is not None and b.step != a.step:
                    act = activation.get((rank, b.step), 0.0)
                    yield ("between steps",), None, b.start_ms - a.end_ms - op_ms - act
                    if act > 0 and spec.activation is not None:
                        yield ("activate", i, stages), None, act
                occ = b.start_ms - a.start_ms - op_ms if b is not None and b.step == a.step else a.ms
                k, where = a.op.kind, (i, rank, a.step)
                if k in CAPTURE_KINDS and captures and a.step % cycle == 0:
                    yield (k, i, a.op.stage, "capture"), where, occ
                elif k in PART_KINDS:
                    yield (k, i, a.op.stage), where, occ
                elif _costed(spec, k) and a.op.layer is not None:
                    yield (k, a.op.layer, a.op.factor), where, occ
                elif k in ("send_act", "send_grad"):
                    yield ("send",), where, occ


def receives(trace: MeasuredTrace, profile: Profile) -> list[tuple[int, float, float]]:
    """(bytes, receive start - send end, receive duration) of every message whose send is in the trace."""
    sends = sends_by_message(trace)
    parts = trace.layout["partition"]
    out_bytes = [profile.part(stage[-1]).out_bytes for stage in parts]
    out = []
    for r in trace.ops:
        if r.op.kind not in ("recv_act", "recv_grad"):
            continue
        key = r.op.message_key()
        s = sends.get((r.step, key))
        if s is None:
            continue
        kind, stage, _ = key
        nbytes = out_bytes[stage] if kind == "act" else (out_bytes[stage - 1] if stage > 0 else 0)
        out.append((nbytes, r.start_ms - s.end_ms, r.ms))
    return out


def fit_receives(recvs: list[tuple[int, float, float]], old: LinkModel, statistic) -> tuple[LinkModel, float]:
    """The link's latency and the receive's completion time. A receive posted `gap` after its
    send ended lasts max(recv_ms, latency + bytes/bandwidth - gap) (Costs.message_ms: the pair
    meets, then the data moves). A receive posted after its send ended measures recv_ms; one
    posted before measures the link (its end - the send's end): latency and bandwidth with
    two sizes or more, else the latency at the profile's bandwidth."""
    late = [d for n, gap, d in recvs if gap >= 0]
    recv = statistic(late) if late else 0.0
    by_size: dict[int, list[float]] = defaultdict(list)
    for n, gap, d in recvs:
        if gap < 0:
            by_size[n].append(gap + d)  # the receive's end - its send's end
    if not by_size:
        return old, recv
    pts = sorted((n, statistic(v)) for n, v in by_size.items())
    if len(pts) >= 2 and pts[-1][0] > pts[0][0]:  # two sizes or more: latency and bandwidth
        return fit_link(pts), recv
    lat = statistic([max(0.0, x - n / old.bytes_per_ms) for n, v in by_size.items() for x in v])
    return LinkModel(latency_ms=lat, bytes_per_ms=old.bytes_per_ms), recv


def quantile_multipliers(ratios: list[float]) -> list[float] | None:
    """SPREAD_QUANTILES multipliers of `ratios` (samples over their means): the quantile
    midpoints, scaled so they average exactly 1 (a spread moves an op around its entry's
    time, never the entry itself). None below SPREAD_MIN_SAMPLES."""
    v = sorted(ratios)
    if len(v) < SPREAD_MIN_SAMPLES:
        return None
    Q = SPREAD_QUANTILES
    q = [v[min(len(v) - 1, int((i + 0.5) / Q * len(v)))] for i in range(Q)]
    scale = statistics.fmean(q)
    return [round(x / scale, 6) for x in q] if scale > 0 else None


def message_spread(recvs: list[tuple[int, float, float]], link: LinkModel) -> list[float] | None:
    """runtime.op_spread["message"]: each receive that waited for its data (posted before its
    send ended), its end - its send's end over the link's time for its size (0 at least: the
    ranks' clocks are aligned to within a fraction of a millisecond, not exactly)."""
    return quantile_multipliers([max(0.0, gap + d) / link.time_ms(n) for n, gap, d in recvs
                                 if gap < 0 and link.time_ms(n) > 0])


def over_mean(samples: list[float]) -> list[float] | None:
    """Quantile multipliers of samples over their mean (None when the mean is not positive)."""
    mean = statistics.fmean(samples) if samples else 0.0
    return quantile_multipliers([max(0.0, x) / mean for x in samples]) if mean > 0 else None


def rank_levels(rows) -> dict:
    """A rank's level in each of its steps: the sum of its compute ops' times there over the
    sum of their means. `rows`: (where: the rank-step, op's time, its mean); where -> level."""
    sums: dict = defaultdict(lambda: [0.0, 0.0])
    for where, ms, mean in rows:
        sums[where][0] += ms
        sums[where][1] += mean
    return {w: own / expected for w, (own, expected) in sums.items() if expected > 0}


def fit_spread(instances: list[tuple], by_key: dict[tuple, list[float]]) -> tuple[dict[str, list[float]], list[float]]:
    """The op times' spread (module doc) from op_instances and their samples by key:
    (runtime.op_spread, runtime.level_spread). A rank's level in a step is the occupancy of
    its LEVEL_KINDS ops in that step over their entries' means (rank_levels); each op's ratio
    to its entry's mean is then divided by its rank's level in its step, so op_spread keeps
    only what the ops do apart. Too few steps for a level (fewer than SPREAD_MIN_SAMPLES): no
    level spread, and op_spread the ratios as they are."""
    mean = {key: statistics.fmean(v) for key, v in by_key.items()}
    level = rank_levels((where, max(0.0, ms), mean[key]) for key, where, ms in instances
                        if where is not None and key[0] in LEVEL_KINDS and mean[key] > 0)
    level_spread = quantile_multipliers(list(level.values()))
    pooled: dict[str, list[float]] = defaultdict(list)
    for key, where, ms in instances:
        if where is None or key[0] not in SPREAD_KINDS or mean[key] <= 0:
            continue
        ratio = max(0.0, ms) / mean[key]
        if level_spread is not None and key[0] in LEVEL_KINDS and level.get(where, 0) > 0:
            ratio /= level[where]
        pooled[key[0]].append(ratio)
    op_spread = {}
    for kind in SPREAD_KINDS:
        mult = quantile_multipliers(pooled.get(kind, []))
        if mult is not None:
            op_spread[kind] = mult
    return op_spread, level_spread or []


@dataclass
class RuntimeFit:
    entries: dict[tuple, float]      # op_instances() keys -> the statistic, less op_ms (>= 0)
    overheads: RuntimeOverheads
    link: LinkModel                  # the p2p link (the profile's when no receive was traced)
    receives: int                    # receives the link and recv_ms were fitted from
    overhead_entries: int            # of the four overheads, how many the traces gave


def fit_runtime(traces: list[MeasuredTrace], profile: Profile, statistic: str = "mean") -> RuntimeFit:
    """The per-op samples' statistic and the runtime's overheads and link from traces (module
    doc); `pfcompile calibrate` and the profiler's runtime probe both fit with it. Overheads
    the traces do not show keep the profile's. The spreads are the traces' own, so a busy
    spread (runtime.busy, the probe's run with its bubbles filled) is not kept: the plan
    the traces ran varies as they did."""
    stat = STATISTICS[statistic]
    gaps = dispatch_gaps(traces)
    op_ms = max(0.0, statistics.median(gaps)) if gaps else 0.0
    instances = list(op_instances(traces, op_ms))
    by_key: dict[tuple, list[float]] = defaultdict(list)
    for key, _, ms in instances:
        by_key[key].append(ms)
    entries = {key: max(0.0, stat(v)) for key, v in by_key.items()}
    old = profile.runtime
    link, recv_ms = profile.comm.p2p, old.recv_ms
    recvs = [r for tr in traces for r in receives(tr, profile)]
    if recvs:
        link, recv_ms = fit_receives(recvs, profile.comm.p2p, stat)
    # Receives have no spread of their own: a send ends when it is posted, so a receive posted
    # after it may still wait for the data, and its duration's long tail is the message's lag,
    # which the replay already makes; drawing it as well would count that wait twice and
    # over-predict the step.
    # A level spread fitted makes op_spread's kinds the ops' variation beyond it: one kept from
    # the old profile without it would be the whole variation, so none is kept then.
    op_spread, level_spread = fit_spread(instances, by_key)
    # not ops, but they vary too, and their stalls delay whoever waits on them
    for kind, mult in (("message", message_spread(recvs, link) if recvs else None),
                       ("between_steps", over_mean(by_key.get(("between steps",), [])))):
        if mult is not None:
            op_spread[kind] = mult
    keep = {} if level_spread and not old.level_spread else old.op_spread
    overheads = RuntimeOverheads(op_ms=op_ms, step_ms=entries.get(("between steps",), old.step_ms),
                                 send_ms=entries.get(("send",), old.send_ms), recv_ms=recv_ms,
                                 op_spread={**keep, **op_spread},
                                 level_spread=level_spread or (old.level_spread if not op_spread else []))
    given = sum(1 for key in (("between steps",), ("send",)) if key in entries) + bool(gaps) + bool(recvs)
    return RuntimeFit(entries, overheads, link, len(recvs), given)


def calibrate(profile: Profile, traces: list[MeasuredTrace], statistic: str = "mean") -> tuple[Profile, dict]:
    """A new profile with entries fitted to the traces (module doc); returns (profile, counts per kind)."""
    for tr in traces:
        check_against_profile(tr, profile)
    if statistic not in STATISTICS:
        raise ValueError(f"statistic must be one of {', '.join(STATISTICS)}, got {statistic!r}")
    new = copy.deepcopy(profile)
    fit = fit_runtime(traces, profile, statistic)
    fitted = fit.entries
    counts: dict[str, int] = defaultdict(int)

    # per covered layer: direct, into the entry its declaration names (the traced plan's
    # optimizer, the op's factor, the plan's inversion method)
    name = optimizer_of(traces[0].layout)
    spec, method = optimizer(name), traces[0].layout.get("inverse", "cholesky")
    for key, ms in fitted.items():
        kind = key[0]
        if kind in PART_KINDS or not _costed(spec, kind) or len(key) != 3:
            continue
        new.covered_layers[key[1]].optimizer_ms.setdefault(name, {})[spec.cost_key(kind, key[2], method)] = ms
        counts[kind] += 1

    # each layer's activation: the rank's measured activation shared by its stages' layers in
    # proportion to their entries (the run times a rank's activation as one span)
    if spec.activation is not None:
        key_act = spec.activation
        for key, ms in fitted.items():
            if key[0] != "activate":
                continue
            parts = {p for st in key[2] for p in traces[key[1]].layout["partition"][st]}
            layers = [l for l, layer in enumerate(profile.covered_layers) if layer.part in parts]
            old = [profile.covered_layers[l].optimizer_ms.get(name, {}).get(key_act, 0.0) for l in layers]
            for l, share in zip(layers, in_proportion(ms, old)):
                new.covered_layers[l].optimizer_ms.setdefault(name, {})[key_act] = share
            counts["activate"] += 1

    # what a capturing refresh step adds to each pipeline op (Part.capture_ms): the
    # statistic of its ops on refresh steps less that of the same ops on the cycle's other
    # steps of the same run; a run that captures in every step (k = 1) keeps the entries
    # and fits the ops' own times without them
    captured: dict[tuple[str, str], list[float]] = defaultdict(list)
    for key, ms in list(fitted.items()):
        if len(key) != 4 or key[3] != "capture":
            continue
        kind, i, stage, _ = key
        names = traces[i].layout["partition"][stage]
        old = [(profile.part(n).capture_ms or {}).get(kind, 0.0) for n in names]
        plain = fitted.get((kind, i, stage))
        if plain is None:
            fitted[(kind, i, stage)] = max(0.0, ms - sum(old))
            continue
        weights = old if sum(old) > 0 else [_part_ms(profile, n, kind, "") for n in names]
        for n, share in zip(names, in_proportion(max(0.0, ms - plain), weights)):
            captured[(n, kind)].append(share)
    for (n, kind), values in captured.items():
        part = new.part(n)
        part.capture_ms = {**(part.capture_ms or {}), kind: sum(values) / len(values)}
        counts["capture"] += 1

    # per part: proportional within each measured stage, mean over observations
    fits: dict[tuple[str, str], list[float]] = defaultdict(list)
    for key, ms in fitted.items():
        kind = key[0]
        if kind not in PART_KINDS or len(key) != 3:
            continue
        _, i, stage = key
        layout = traces[i].layout
        names = layout["partition"][stage]
        step_kind = optimizer_of(layout)
        old = [_part_ms(profile, name, kind, step_kind) for name in names]
        for name, share in zip(names, in_proportion(ms, old)):
            fits[(name, kind if kind != "step" else f"step.{step_kind}")].append(share)
    for (name, what), values in fits.items():
        part = new.part(name)
        value = sum(values) / len(values)
        if what.startswith("step."):
            part.step_ms[what.split(".", 1)[1]] = value
        else:
            setattr(part, f"{what}_ms", value)
        counts[what.split(".")[0]] += 1
    for part, was in zip(new.parts, profile.parts):  # a split is both numbers or both null
        if (part.bwd_input_ms is None) != (part.bwd_weight_ms is None):
            b, w = was.split_backward_ms()
            part.bwd_input_ms = b if part.bwd_input_ms is None else part.bwd_input_ms
            part.bwd_weight_ms = w if part.bwd_weight_ms is None else part.bwd_weight_ms

    # the runtime around the ops, and the messages' lag
    new.runtime, new.comm.p2p = fit.overheads, fit.link
    if fit.receives:
        counts["p2p messages"] = fit.receives
    counts["runtime overheads"] = fit.overhead_entries

    new.spread = {}  # the measured spreads belonged to the parent's samples
    new.schema_version = SCHEMA_VERSION
    new.provenance = {**profile.provenance, "calibration": {
        "parent_hash": profile.hash,
        "traces": [{"path": tr.path, "plan_sha256": tr.meta["plan_sha256"], "steps_used": len({o.step for o in tr.ops}),
                    "load_avg": tr.meta.get("load_avg")} for tr in traces],
        "entries": dict(counts),
        "statistic": statistic,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "method": f"{statistic} occupancy (start to the next op's start) of the measured ops after warm-up, "
                  "less the median dispatch gap; parts scaled per stage; runtime overheads from sends, "
                  "non-waiting receives and the gaps between steps; p2p lag from waiting receives",
    }}
    new.to_json()  # the new hash
    return new, dict(counts)


def _costed(spec: Optimizer, kind: str) -> bool:
    """Whether `kind` is one of the optimizer's per-layer ops with a profile entry (cost key)."""
    d = spec.op(kind)
    return d is not None and d.cost is not None


def optimizer_of(layout: dict) -> str:
    """The traced plan's optimizer (traces of plans from before Shampoo and Muon say "kfac": bool)."""
    return layout.get("optimizer") or ("kfac" if layout.get("kfac") else "adamw")


def in_proportion(ms: float, weights: list[float]) -> list[float]:
    """`ms` shared in proportion to `weights` (what the profile had for each part or layer a
    measurement covers as one); equal shares when they are all 0."""
    total = sum(weights)
    return [ms * w / total if total > 0 else ms / len(weights) for w in weights]


def _part_ms(profile: Profile, name: str, kind: str, step_kind: str) -> float:
    p = profile.part(name)
    if kind == "step":
        return p.step_ms.get(step_kind, p.step_ms.get(optimizer(step_kind).step_like, 0.0))
    if kind in ("bwd_input", "bwd_weight"):
        return p.split_backward_ms()[kind == "bwd_weight"]
    return p.fwd_ms if kind == "fwd" else p.bwd_ms
