"""`pfcompile inspect MEASURED_TRACE --against PLAN`: where a run's time went, per op kind,
against the plan's prediction.

Per op kind: how many ops ran (after warm-up, all ranks), the predicted duration per op
(the plan's end - start, mean), the measured median and p90, the ratio (median over the ops
of measured / predicted: each op against its own prediction), and the step-time
error the kind explains: (Σ measured - Σ predicted) of its ops per step, divided by the
number of ranks (the ranks run side by side: a rank's extra time lengthens the step by
about its share). What no op kind explains is the time between ops: waits on peers, the
interpreter's own per-op work, and messages (whose transfer the plan models as lag, not as
op time); its row is "between ops".

An op's span in the plan holds the runtime's own work too: its dispatch (runtime.op_ms)
and, in a `step` op, the runtime's work between steps (runtime.step_ms), which a run's trace
times apart from the op. With the plan's profile (`--profile`) the predicted column is the
op's own time, as the run times it, and the runtime's work moves to "between ops"; without
it, the same from what the plan records of that work (Plan.own_ms); a plan made before it
recorded it gives the whole span (a step op then reads as if the optimizer ran faster).
"""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict

from pfcompile.calibrate.fit import rank_levels, sends_by_message
from pfcompile.calibrate.measured import MeasuredOp, MeasuredTrace
from pfcompile.formats.ops import COMPUTE_KINDS, P2P_KINDS
from pfcompile.formats.plan import Plan
from pfcompile.formats.profile import CAPTURE_KINDS, LEVEL_KINDS, Profile


def _p90(values: list[float]) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(0.9 * (len(s) - 1))))]


def runtime_in_span(plan: Plan, profile: Profile | None):
    """(op, cycle step) -> the runtime's own work inside the op's span in the plan (module
    doc); 0 without the plan's profile."""
    if profile is None:
        return lambda op, step=None: 0.0
    from pfcompile.check.replay import plan_costs
    from pfcompile.formats.rules import PlanLayout

    return plan_costs(plan, profile, PlanLayout(plan)).runtime_ms


def per_kind_rows(trace: MeasuredTrace, plan: Plan, profile: Profile | None = None) -> tuple[list[dict], dict]:
    k = plan.refresh_steps
    runtime_ms = runtime_in_span(plan, profile)
    predicted = {}
    for q, steps in enumerate(plan.ranks):
        for t, ops in enumerate(steps):
            for po in ops:
                predicted[(q, t, str(po.op))] = max(0.0, po.end - po.start - runtime_ms(po.op, t)) \
                    if profile is not None else plan.own_ms(po)
    by_kind: dict[str, dict[str, list[float]]] = defaultdict(lambda: {"measured": [], "predicted": []})
    for o in trace.ops:
        p = predicted.get((o.rank, o.step % k, str(o.op)))
        if p is None:
            continue
        by_kind[o.op.kind]["measured"].append(o.ms)
        by_kind[o.op.kind]["predicted"].append(p)
    steps = len({o.step for o in trace.ops})
    W = plan.world_size
    rows = []
    for kind, d in sorted(by_kind.items(), key=lambda kv: -sum(kv[1]["measured"])):
        m, p = d["measured"], d["predicted"]
        pred = sum(p) / len(p)
        med = statistics.median(m)
        ratios = [a / b for a, b in zip(m, p) if b > 0]
        rows.append({"kind": kind, "count": len(m), "predicted_ms": pred, "measured_median_ms": med,
                     "measured_p90_ms": _p90(m), "ratio": statistics.median(ratios) if ratios else None,
                     "explains_ms": (sum(m) - sum(p)) / steps / W})
    measured_step = trace.median_step_ms()
    predicted_step = float(plan.stats.get("step_time_ms") or 0.0)
    explained = sum(r["explains_ms"] for r in rows)
    total = {"measured_step_ms": measured_step, "predicted_step_ms": predicted_step,
             "error_ms": measured_step - predicted_step, "between_ops_ms": measured_step - predicted_step - explained,
             "steps": steps, "runtime_spans": runtime_spans(trace, W, steps)}
    if profile is not None:
        # what the plan gives the runtime's own work per step and rank (module doc)
        total["runtime_planned_ms"] = sum(runtime_ms(po.op, t) for steps_of_rank in plan.ranks
                                          for t, ops in enumerate(steps_of_rank) for po in ops) / (k * W)
    return rows, total


def runtime_spans(trace: MeasuredTrace, ranks: int, steps: int) -> dict[str, dict[str, float]]:
    """The runtime's own work between ops, from the trace's runtime row, per span name
    (pfcompile.formats.ops.RUNTIME_SPANS): mean ms per step and rank, and the longest one
    (a stall). Empty for a trace that predates the runtime row."""
    by_name: dict[str, list[float]] = defaultdict(list)
    for sp in trace.spans:
        by_name[sp.name].append(sp.ms)
    return {name: {"per_step_ms": sum(v) / steps / ranks, "median_ms": statistics.median(v), "max_ms": max(v),
                   "count": len(v)}
            for name, v in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))}


def format_runtime_spans(total: dict) -> list[str]:
    spans = total.get("runtime_spans") or {}
    if not spans:
        return []
    from pfcompile.formats.ops import RUNTIME_SPANS

    planned = total.get("runtime_planned_ms")
    whole = sum(v["per_step_ms"] for v in spans.values())
    lines = [f"  of which the runtime's own work (the trace's runtime row), ms per step and rank: {whole:.3f}"
             + (f" (the plan counts {planned:.3f}: runtime.step_ms, each op's dispatch and the activation)" if planned is not None else "")]
    for name, v in spans.items():
        lines.append(f"    {name:<10} {v['per_step_ms']:>7.3f}   median {v['median_ms']:.3f}, longest {v['max_ms']:.3f}"
                     f"   {RUNTIME_SPANS.get(name, '')}")
    return lines


def format_against(trace: MeasuredTrace, plan_path: str, plan: Plan, profile: Profile | None = None) -> str:
    """The per-op-kind table (the caller has checked the trace is a run of the plan:
    measured.check_against_plan, and of the profile: check_against_profile)."""
    rows, total = per_kind_rows(trace, plan, profile)
    head = f"{'op kind':<11} {'count':>6} {'predicted ms':>13} {'measured median':>16} {'p90':>9} {'ratio':>7} {'step error ms':>14}"
    lines = [f"measured {trace.path} against {plan_path}: {total['steps']} steps after warm-up", head, "-" * len(head)]
    for r in rows:
        ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else "n/a"
        lines.append(f"{r['kind']:<11} {r['count']:>6} {r['predicted_ms']:>13.3f} {r['measured_median_ms']:>16.3f} "
                     f"{r['measured_p90_ms']:>9.3f} {ratio:>7} {r['explains_ms']:>+14.3f}")
    lines.append(f"{'between ops':<11} {'':>6} {'':>13} {'':>16} {'':>9} {'':>7} {total['between_ops_ms']:>+14.3f}")
    lines += format_runtime_spans(total)
    lines += format_beside(beside_the_work(trace))
    ratio = total["measured_step_ms"] / total["predicted_step_ms"] if total["predicted_step_ms"] else float("nan")
    lines.append(f"step: measured {total['measured_step_ms']:.2f} ms (median), predicted {total['predicted_step_ms']:.2f} ms, "
                 f"measured/predicted {ratio:.3f}, error {total['error_ms']:+.2f} ms")
    lines.append("predicted: each op's own time in the plan; the runtime's dispatch and its work between steps "
                 "are in 'between ops'" if profile is not None else
                 "predicted: each op's span in the plan, with the runtime's dispatch and, for step, its work "
                 "between steps (--profile: the op's own time)")
    return "\n".join(lines)


PASSES = CAPTURE_KINDS  # the pipeline's own compute: fwd, bwd, B and W


def _is_optimizer_work(kind: str) -> bool:
    """An op the optimizer adds to the pipeline's compute (its per-layer ops, placed in the
    bubbles; a plugin's too: COMPUTE_KINDS learns them). Collectives are not work beside."""
    return kind in COMPUTE_KINDS and kind not in PASSES and kind != "step"


def _pooled_ratio(near: dict[tuple, list[float]], far: dict[tuple, list[float]]) -> tuple[float, int] | None:
    """Σ over the `near` ops of their time / Σ of what the same (kind, stage)'s `far` ops take
    on average: how much longer the near ones run, each against its own kind. None without both."""
    keys = [k for k in near if k in far]
    got = sum(sum(near[k]) for k in keys)
    want = sum(len(near[k]) * statistics.fmean(far[k]) for k in keys)
    n = sum(len(near[k]) for k in keys)
    return (got / want, n) if want > 0 else None


def beside_the_work(trace: MeasuredTrace) -> dict | None:
    """Whether the optimizer's work in the bubbles slows the pipeline around it, within one run
    (so free of the machine's drift between runs): each pipeline op (fwd, bwd, B, W)
    - `after`: right after an optimizer op on its rank (messages skipped) against the same
      kind and stage right after a pipeline op (its caches: what the work left in them);
    - `during`: over half of it beside an optimizer op on another rank against over half
      beside a pipeline op there (the neighbour: the memory bandwidth and cores they share);
    and each message (`lag`: its receive's end - its send's end, receives posted before the
    send ended) whose sender ran an optimizer op next, against one whose sender ran a pipeline
    op next (gloo moves it while the sender computes). Ratios > 1: slower beside the work.
    None when the run has no optimizer ops."""
    if not any(_is_optimizer_work(o.op.kind) for o in trace.ops):
        return None
    by_rank = trace.by_rank()
    after: dict[str, dict[tuple, list[float]]] = {"optimizer": defaultdict(list), "pipeline": defaultdict(list)}
    during: dict[str, dict[tuple, list[float]]] = {"optimizer": defaultdict(list), "pipeline": defaultdict(list)}
    # each rank's optimizer and pipeline ops as (starts, ends): a rank's ops do not overlap,
    # so both lists are sorted and an op's neighbours are found by bisection
    spans = {q: {w: tuple(map(list, zip(*[(o.start_ms, o.end_ms) for o in ops if (
                     _is_optimizer_work(o.op.kind) if w == "optimizer" else o.op.kind in PASSES)]))) or ([], [])
                 for w in ("optimizer", "pipeline")} for q, ops in by_rank.items()}

    def overlap(o: MeasuredOp, starts: list[float], ends: list[float]) -> float:
        i, total = bisect.bisect_right(ends, o.start_ms), 0.0
        while i < len(starts) and starts[i] < o.end_ms:
            total += min(o.end_ms, ends[i]) - max(o.start_ms, starts[i])
            i += 1
        return total

    next_op: dict[int, MeasuredOp] = {}
    for q, ops in by_rank.items():
        prev = None
        for o, b in zip(ops, ops[1:] + [None]):
            if b is not None:
                next_op[id(o)] = b
            if o.op.kind in PASSES and o.ms > 0:
                key = (o.op.kind, o.op.stage)
                if prev is not None and prev.step == o.step and prev.op.kind in PASSES:
                    after["pipeline"][key].append(o.ms)
                elif prev is not None and prev.step == o.step and _is_optimizer_work(prev.op.kind):
                    after["optimizer"][key].append(o.ms)
                for w in ("optimizer", "pipeline"):
                    beside = sum(overlap(o, *spans[p][w]) for p in by_rank if p != q)
                    if beside > o.ms / 2:
                        during[w][key].append(o.ms)
            if o.op.kind not in P2P_KINDS:
                prev = o
    sends = sends_by_message(trace)
    lag: dict[str, list[float]] = {"optimizer": [], "pipeline": []}
    for r in trace.ops:
        s = sends.get((r.step, r.op.message_key())) if r.op.kind in ("recv_act", "recv_grad") else None
        b = next_op.get(id(s)) if s is not None and r.start_ms <= s.end_ms else None
        if b is not None and b.op.kind in PASSES:
            lag["pipeline"].append(r.end_ms - s.end_ms)
        elif b is not None and _is_optimizer_work(b.op.kind):
            lag["optimizer"].append(r.end_ms - s.end_ms)
    out: dict = {}
    for name, d in (("after", after), ("during", during)):
        r = _pooled_ratio(d["optimizer"], d["pipeline"])
        out[name] = None if r is None else {"ratio": r[0], "ops": r[1]}
    out["lag"] = {w: {"messages": len(v), "mean_ms": statistics.fmean(v) if v else None,
                      "over_1ms": sum(x > 1.0 for x in v) / len(v) if v else None} for w, v in lag.items()}
    return out


def format_beside(b: dict | None) -> list[str]:
    if b is None:
        return []

    def ratio(x):
        return f"{x['ratio']:.3f} ({x['ops']} ops)" if x else "n/a"

    lag = b["lag"]
    msgs = "; ".join(f"after {w} work {v['mean_ms']:.3f} ms mean, {v['over_1ms']:.0%} over 1 ms ({v['messages']})"
                     for w, v in lag.items() if v["messages"])
    return [f"beside the optimizer's work (one run, so no drift between runs): pipeline ops right after it on "
            f"their rank {ratio(b['after'])}, beside it on another rank {ratio(b['during'])} of the same ops "
            f"beside pipeline ops; message lag {msgs or 'n/a'}"]


def whole_cycles(trace: MeasuredTrace, k: int) -> tuple[int, int, float] | None:
    """(first whole refresh cycle after warm-up, how many, the measured step time in steady
    state: the spacing of those cycles' ends over k). The replay's step is measured the same
    way (cycle 0 of a replay starts from idle, the run's first whole cycle from the previous
    one's tail). None with fewer than two whole cycles."""
    steps = sorted({o.step for o in trace.ops})
    if not steps:
        return None
    c0 = -(-steps[0] // k)
    cycles = (steps[-1] + 1) // k - c0
    if cycles < 2:
        return None
    lo, hi = c0 * k, (c0 + cycles) * k
    ends: dict[int, float] = {}
    for o in trace.ops:
        if lo <= o.step < hi:
            c = o.step // k - c0
            ends[c] = max(ends.get(c, o.end_ms), o.end_ms)
    return c0, cycles, (ends[cycles - 1] - ends[0]) / ((cycles - 1) * k)


def replayed_with_measured(trace: MeasuredTrace, plan: Plan, profile) -> dict | None:
    """The plan replayed with this run's own op times, to split a prediction's error in
    four. Each op's time is its occupancy (its start to its rank's next op start: the op
    and the runtime's gap after it; a step's last op, its own time and dispatch), and the
    work between steps (the last op's end to the next step's first op) goes into the step's
    `step` ops, as the cost model has it (Costs.between_steps_ms); receives
    and collectives stay as the cost model has them (their measured time is mostly waiting,
    which the replay must produce itself). Over the run's whole refresh cycles after
    warm-up:
    - `planned_work_step_ms`: every op at its mean own time in this run plus the runtime's
      work the plan counts in its span (dispatch, a step's share of the work between steps,
      the activation: runtime_in_span): the prediction's error up to here is the op times'
      level (the profile against this run);
    - `mean_ops_step_ms`: every op at its mean occupancy in this run: the difference to the
      previous is the runtime's work between ops beyond what the plan counts;
    - `level_ops_step_ms`: every op at its mean occupancy times its rank's level in its step
      (the rank-step's occupancy over its ops' means): the difference to the previous is
      the spread a rank's slow spells make (profile.runtime.level_spread);
    - `own_ops_step_ms`: every op instance at its own occupancy: the difference to the
      previous is the rest of the op times' spread from step to step, each op's beyond its
      rank's level (a late op delays its peers; a prediction from means cannot have it);
    - `measured_step_ms` against `own_ops_step_ms`: what the message and collective model
      misses.
    None when the run has fewer than two whole cycles after warm-up."""
    from pfcompile.check.replay import replay
    from pfcompile.formats.ops import COLLECTIVE_KINDS
    from pfcompile.formats.rules import CycleIndex, PlanLayout

    k = plan.refresh_steps
    window = whole_cycles(trace, k)
    if window is None:
        return None
    c0, cycles, measured = window
    X = CycleIndex(plan, PlanLayout(plan))
    lo, hi = c0 * k, (c0 + cycles) * k
    own: dict[int, float] = {}
    rank_step: dict[int, tuple[int, int]] = {}  # x -> (rank, step) it ran in
    steps_work: dict[int, float] = {}  # x -> the work between steps a `step` op carries
    bare: dict[int, float] = {}  # x -> the op's own time + the runtime's work the plan counts in its span
    op_ms = profile.runtime.op_ms
    planned_runtime_ms = runtime_in_span(plan, profile)
    for q, ops in trace.by_rank().items():
        between: dict[int, float] = {}  # step -> its last op's end (and dispatch) to the next step's first op
        for o, nxt in zip(ops, ops[1:] + [None]):
            if nxt is not None and nxt.step != o.step:
                between[o.step] = max(0.0, nxt.start_ms - o.end_ms - op_ms)
                nxt = None  # the last op of its step: its own time and dispatch
            if not lo <= o.step < hi or o.op.kind.startswith("recv_") or o.op.kind in COLLECTIVE_KINDS:
                continue
            j = X.find(o.step % k, q, o.op)
            if j >= 0:
                x = (o.step // k - c0) * X.M + j
                own[x] = (nxt.start_ms if nxt is not None else o.end_ms + op_ms) - o.start_ms
                rank_step[x] = (q, o.step)
                bare[x] = o.end_ms - o.start_ms + planned_runtime_ms(o.op, o.step % k)
        # the work between steps goes where the cost model has it, into the step's `step` ops
        # (Costs.between_steps_ms: one share per stage the rank holds)
        for o in ops:
            if o.op.kind == "step" and lo <= o.step < hi and o.step in between:
                j = X.find(o.step % k, q, o.op)
                shares = sum(1 for op in plan.ops(q, o.step % k) if op.kind == "step")
                if j >= 0:
                    x = (o.step // k - c0) * X.M + j
                    own[x] += between[o.step] / shares
                    steps_work[x] = between[o.step] / shares
    def cycle_means(durations: dict[int, float]) -> dict[int, float]:
        sums: dict[int, list[float]] = defaultdict(list)
        for x, ms in durations.items():
            sums[x % X.M].append(ms)
        return {c * X.M + j: sum(v) / len(v) for j, v in sums.items() for c in range(cycles)}

    planned_work = cycle_means(bare)
    means = cycle_means(own)
    # a rank's level in a step is over its ops' occupancies less the dispatch, as fit_spread
    # takes it: the dispatch and the runtime's work between steps stay at their means
    # (its compute ops only: a send's posting takes no level)
    ops_own = {x: ms - steps_work.get(x, 0.0) - op_ms for x, ms in own.items() if X.ops[x % X.M].kind in LEVEL_KINDS}
    ops_means, work_means = cycle_means(ops_own), cycle_means(steps_work)
    level = rank_levels((rank_step[x], ms, ops_means[x]) for x, ms in ops_own.items())
    leveled = {x: ops_means[x] * level.get(w, 1.0) + op_ms + work_means.get(x, 0.0) if x in ops_own else means[x]
               for x, w in rank_step.items()}
    out = {"measured_step_ms": measured, "cycles": cycles}

    def step_with(durations: dict[int, float]) -> float:
        return replay(plan, profile, cycles=cycles, check_memory=False, durations=durations).step_time_ms

    for key, durations in (("planned_work_step_ms", planned_work), ("mean_ops_step_ms", means),
                           ("level_ops_step_ms", leveled), ("own_ops_step_ms", own)):
        out[key] = step_with(durations)  # the spacing of its cycle ends over k
    # the level by op kind: the step with this kind's ops at their mean own time (and the work
    # the plan counts in their spans) and every other op at its profiled time, against the
    # profile's step. Kinds interact (a later op hides behind an earlier one's delay), so
    # these need not add up to the level.
    predicted = step_with({})
    kinds = sorted({X.ops[x % X.M].kind for x in planned_work})
    out["level_by_kind_ms"] = dict(sorted(
        ((kind, step_with({x: ms for x, ms in planned_work.items() if X.ops[x % X.M].kind == kind}) - predicted)
         for kind in kinds), key=lambda kv: -abs(kv[1])))
    return out


def format_replayed(r: dict | None, predicted_ms: float) -> str:
    if r is None:
        return "replayed with the run's op times: n/a (fewer than two whole refresh cycles after warm-up)"
    rows = [("predicted (the profile's op times)", predicted_ms, ""),
            ("this run's mean op times, its work as planned", r["planned_work_step_ms"], "the op times' level"),
            ("the same with its work between ops", r["mean_ops_step_ms"], "the runtime's work beyond the plan"),
            ("each rank's level in each step", r["level_ops_step_ms"], "its slow spells from step to step"),
            ("each step's own op times", r["own_ops_step_ms"], "each op's spread beyond its rank's level"),
            ("measured", r["measured_step_ms"], "messages and collectives beyond the model")]
    lines = [f"the plan replayed with this run's op times (receives and collectives as modelled), "
             f"{r['cycles']} refresh cycles:"]
    prev = None
    for name, ms, why in rows:
        delta = f"  {ms - prev:+7.2f}  {why}" if prev is not None else ""
        lines.append(f"  {name:<46} {ms:8.2f} ms/step{delta}")
        prev = ms
        if why == "the op times' level" and r.get("level_by_kind_ms"):
            shown = [f"{kind} {ms:+.2f}" for kind, ms in r["level_by_kind_ms"].items() if abs(ms) >= 0.005]
            lines.append(f"    by op kind, each alone at its measured mean: {', '.join(shown) or 'none moves the step'}")
    return "\n".join(lines)


def against_fitted_run(trace: MeasuredTrace, profile) -> dict:
    """A calibrated profile against the run it was fitted on: the traced plan (the file the
    trace names, if it is still there unchanged) replayed with the profile, plain and with
    the op times' spread, against the run's steady step time (whole_cycles). Close to 1 by
    construction when the model holds; what it leaves is the model's own error, so the
    error on a later run beyond it is that run's difference from this one (the machine's
    run-to-run variation, or a plan the model transfers to less well).
    {"plan": path, "measured_step_ms", "predicted_step_ms", "expected_step_ms" (None
    without a spread)}, or {"plan": path, "skipped": why}."""
    import os

    from pfcompile.calibrate.measured import check_against_plan
    from pfcompile.check.replay import expected_step_time, replay
    from pfcompile.formats.errors import InputError
    from pfcompile.formats.plan import load_plan

    path = str(trace.meta.get("plan") or "")
    if not path or not os.path.exists(path):
        return {"plan": path, "skipped": "the plan file the trace names is not there"}
    try:
        check_against_plan(trace, path)
        plan = load_plan(path)
    except InputError:
        return {"plan": path, "skipped": "the plan file the trace names has changed since the run"}
    window = whole_cycles(trace, plan.refresh_steps)
    if window is None:
        return {"plan": path, "skipped": "fewer than two whole refresh cycles after warm-up"}
    return {"plan": path, "measured_step_ms": window[2],
            "predicted_step_ms": replay(plan, profile, check_memory=False).step_time_ms,
            "expected_step_ms": expected_step_time(plan, profile)}


def format_fitted_run(trace: MeasuredTrace, r: dict) -> str:
    if "skipped" in r:
        return f"{trace.path}: no check against the fitted run ({r['skipped']}: {r['plan'] or 'none named'})"
    m, p, e = r["measured_step_ms"], r["predicted_step_ms"], r["expected_step_ms"]
    line = (f"{trace.path}: the calibrated profile against the run it was fitted on: measured {m:.2f} ms/step, "
            f"predicted {p:.2f}, measured/predicted {m / p:.3f}")
    return line + (f"; with the op times' spread {e:.2f}, measured/predicted {m / e:.3f}" if e else "")
