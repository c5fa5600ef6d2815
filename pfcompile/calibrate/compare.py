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
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from pfcompile.calibrate.measured import MeasuredTrace, check_against_plan
from pfcompile.formats.plan import Plan


def _p90(values: list[float]) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(0.9 * (len(s) - 1))))]


def per_kind_rows(trace: MeasuredTrace, plan: Plan) -> tuple[list[dict], dict]:
    k = plan.refresh_steps
    predicted = {}
    for q, steps in enumerate(plan.ranks):
        for t, ops in enumerate(steps):
            for po in ops:
                predicted[(q, t, str(po.op))] = po.end - po.start
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
             "steps": steps}
    return rows, total


def format_against(trace: MeasuredTrace, plan_path: str, plan: Plan) -> str:
    check_against_plan(trace, plan_path)
    rows, total = per_kind_rows(trace, plan)
    head = f"{'op kind':<11} {'count':>6} {'predicted ms':>13} {'measured median':>16} {'p90':>9} {'ratio':>7} {'step error ms':>14}"
    lines = [f"measured {trace.path} against {plan_path}: {total['steps']} steps after warm-up", head, "-" * len(head)]
    for r in rows:
        ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else "n/a"
        lines.append(f"{r['kind']:<11} {r['count']:>6} {r['predicted_ms']:>13.3f} {r['measured_median_ms']:>16.3f} "
                     f"{r['measured_p90_ms']:>9.3f} {ratio:>7} {r['explains_ms']:>+14.3f}")
    lines.append(f"{'between ops':<11} {'':>6} {'':>13} {'':>16} {'':>9} {'':>7} {total['between_ops_ms']:>+14.3f}")
    ratio = total["measured_step_ms"] / total["predicted_step_ms"] if total["predicted_step_ms"] else float("nan")
    lines.append(f"step: measured {total['measured_step_ms']:.2f} ms (median), predicted {total['predicted_step_ms']:.2f} ms, "
                 f"measured/predicted {ratio:.3f}, error {total['error_ms']:+.2f} ms")
    return "\n".join(lines)
