"""Replay a plan: an event simulator that checks it and predicts its timeline.

Written from the plan semantics alone (DESIGN.md; pfcompile/formats/plan.py), independently of
any placement method: it reads each rank's op lists, takes durations and memory effects
from pfcompile.graph.costs (the profile's numbers), and executes the lists in order, as the
runtime would, for `cycles` back-to-back refresh cycles (2 by default, so the cycle
boundary is exercised). It

- checks the ops of the cycle and the per-pair message order with the contract's rules
  (pfcompile.formats.rules.check_ops, pfcompile.formats.verify.check_pair_order: the same
  rules the runtime's verifier applies);
- runs the lists: an op starts when its rank is free and its dependencies are done; a
  dependency on the same rank that has not run yet is an error (in-order execution never
  satisfies it); a receive waits for its send plus the message's transfer time;
  collectives start when every member of the stage's replica group reaches them; if no
  rank can move, it reports a deadlock naming each rank's stuck op;
- tracks memory per rank (resident + buffers) against the memory limit.

Every error is a ReplayError (an InputError: one line, names the op by rank, step and
compact text). Cycle 0's times are the plan's prediction (the next cycle only starts
after them on each rank, so they equal a single cycle from idle).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from pfcompile.formats.ops import COLLECTIVE_KINDS, COMPUTE_KINDS, FLOATING_KINDS, Op
from pfcompile.formats.plan import Plan
from pfcompile.formats.profile import Cluster, Profile
from pfcompile.formats.rules import PlanError, PlanLayout, check_ops, cycle_dependencies
from pfcompile.formats.verify import check_pair_order
from pfcompile.graph.costs import Costs


# The rules (what a cycle holds, where each op runs, what it waits for) are the contract's
# (pfcompile.formats.rules), shared with the verifier the runtime runs; this module adds
# durations, messages' transfer times and memory.
ReplayError = PlanError


@dataclass
class ReplayResult:
    times: list[list[list[tuple[float, float]]]]  # times[rank][step][i] = (start, end), cycle 0
    cycle_time_ms: float  # cycle 0 from an idle start
    step_time_from_idle_ms: float  # cycle_time_ms / k
    steady_cycle_time_ms: float  # the cycle as it repeats: mean distance of cycle ends after the first
    busy_ms: list[float]  # compute time per rank, one cycle
    idle_ms: list[float]
    utilization: float
    peak_memory_bytes: list[int]
    resident_bytes: list[int]
    memory_trace: list[list[tuple[float, int]]] = field(default_factory=list)  # (ms, bytes) cycle 0
    utilization_pipefisher: list[float] = field(default_factory=list)  # per step of the cycle
    utilization_strict: float = 0.0

    refresh_steps: int = 1

    @property
    def step_time_ms(self) -> float:
        """The step time a run sees: the steady cycle over k."""
        return self.steady_cycle_time_ms / self.refresh_steps

    def stats(self) -> dict:
        pf = self.utilization_pipefisher
        return {
            "utilization": round(self.utilization, 6),
            "utilization_pipefisher": [round(u, 6) for u in pf],
            "utilization_pipefisher_mean": round(sum(pf) / len(pf), 6) if pf else None,
            "utilization_strict": round(self.utilization_strict, 6),
            "step_time_ms": round(self.step_time_ms, 6),
            "step_time_from_idle_ms": round(self.step_time_from_idle_ms, 6),
            "cycle_time_ms": round(self.cycle_time_ms, 6),
            "steady_cycle_time_ms": round(self.steady_cycle_time_ms, 6),
            "busy_ms": [round(b, 6) for b in self.busy_ms],
            "idle_ms": [round(b, 6) for b in self.idle_ms],
            "peak_memory_bytes": self.peak_memory_bytes,
        }


def _where(q: int, t: int, i: int, op: Op) -> str:
    return f"ranks[{q}].steps[{t}][{i}]"


def replay(plan: Plan, profile: Profile, *, cycles: int = 3, check_memory: bool = True,
           where: str = "<plan>") -> ReplayResult:
    if len(profile.kfac_layers) != len(plan.layers) or any(
            l.name != n for l, n in zip(profile.kfac_layers, plan.layers)):
        raise ReplayError(where, "layers", "do not match the profile's K-FAC layers (plan made from another profile?)")
    L = PlanLayout(plan)
    cluster = plan.config.get("cluster")  # messages and collectives costed by the link they cross
    costs = Costs(profile, plan.partition, L.R, plan.config.get("inverse", "cholesky"), L.kfac,
                  cluster=Cluster.from_json(cluster) if cluster else None,
                  stage_ranks=[L.replica_ranks(s) for s in range(L.S)], precond_owner=L.precond_owner)
    if costs.layer_stage != list(plan.layer_stage):
        raise ReplayError(where, "layer_stage", "does not follow from the partition and the profile")
    check_ops(plan, L, where)
    result = _simulate(plan, L, costs, cycles, check_memory, where)
    check_pair_order(plan, L, where)  # after: a missing message is named by its consumer first
    return result


# --- the simulation --------------------------------------------------------------------------

def _simulate(plan: Plan, L: PlanLayout, costs: Costs, cycles: int, check_memory: bool, where: str) -> ReplayResult:
    # each rank's sequence over all cycles: (cycle, step, index, op)
    seq = [[(c, t, i, po.op) for c in range(cycles) for t in range(L.k) for i, po in enumerate(plan.ranks[q][t])]
           for q in range(L.W)]
    listed = [{(c, None if op.kind in FLOATING_KINDS else t, op) for c, t, _, op in s} for s in seq]
    pos = [0] * L.W
    clock = [0.0] * L.W
    end: dict[tuple, float] = {}
    start_of: dict[tuple, float] = {}
    timeline: list[list[tuple]] = [[] for _ in range(L.W)]  # (start, end, cycle, step, i, op)

    def key(q, c, t, op):
        return (c, None if op.kind in FLOATING_KINDS else t, q, op)

    def name(q, c, t, op):
        return f"{op} (rank {q}, step {t}{f', cycle {c}' if c else ''})"

    dependencies = cycle_dependencies(L)  # op_dependencies, derived once per listed op

    def ready_time(q: int) -> float | None:
        """When rank q's next op may start as far as its own dependencies go; None if it must wait."""
        c, t, i, op = seq[q][pos[q]]
        local, remote = dependencies(q, c, t, op)
        at = clock[q]
        for dk in local:
            if dk not in end:
                dc, dt, _, dop = dk
                if (dc, dt, dop) in listed[q]:
                    raise ReplayError(where, _where(q, t, i, op), f"{name(q, c, t, op)} runs before its dependency {dop} on the same rank")
                raise ReplayError(where, _where(q, t, i, op), f"{name(q, c, t, op)} depends on {dop}, which rank {q} never runs")
        for dk in remote:
            if dk not in end:
                return None
            at = max(at, end[dk] + costs.message_ms(dk[3], dk[2]))
        return at

    def run(q: int, at: float) -> None:
        c, t, i, op = seq[q][pos[q]]
        d = costs.duration(op)
        kk = key(q, c, t, op)
        start_of[kk], end[kk] = at, at + d
        timeline[q].append((at, at + d, c, t, i, op))
        clock[q] = at + d
        pos[q] += 1

    total = sum(len(s) for s in seq)
    done = 0
    while done < total:
        moved = False
        for q in range(L.W):
            while pos[q] < len(seq[q]):
                c, t, i, op = seq[q][pos[q]]
                if op.is_collective:
                    members = L.group(L.stage_of(op))
                    want = key(q, c, t, op)
                    if not all(pos[p] < len(seq[p]) and key(p, *_cto(seq[p][pos[p]])) == (want[0], want[1], p, op)
                               for p in members):
                        break
                    ats = [ready_time(p) for p in members]
                    if any(a is None for a in ats):
                        break
                    at = max(ats)
                    for p in members:
                        run(p, at)
                    done += len(members)
                    moved = True
                    continue
                at = ready_time(q)
                if at is None:
                    break
                run(q, at)
                done += 1
                moved = True
        if not moved:
            stuck = [f"rank {q} at {name(q, seq[q][pos[q]][0], seq[q][pos[q]][1], seq[q][pos[q]][3])}"
                     for q in range(L.W) if pos[q] < len(seq[q])]
            raise ReplayError(where, "ranks", "deadlock: " + "; ".join(stuck))
    _check_messages(seq, end, L, where)
    return _result(plan, L, costs, timeline, cycles, check_memory, where)


def _cto(entry):
    c, t, i, op = entry
    return c, t, op


def _check_messages(seq, end, L: PlanLayout, where: str) -> None:
    """Every send has its receive (a receive without a send already deadlocks)."""
    for q in range(L.W):
        for c, t, i, op in seq[q]:
            if op.kind.startswith("send_"):
                recv = Op("recv_" + op.kind[5:], stage=op.stage, mb=op.mb, peer=q)
                if (c, t, op.peer, recv) not in end:
                    raise ReplayError(where, _where(q, t, i, op),
                                      f"{op} (rank {q}, step {t}) has no matching receive {recv} on rank {op.peer}")


def _result(plan: Plan, L: PlanLayout, costs: Costs, timeline, cycles: int, check_memory: bool, where: str) -> ReplayResult:
    times = [[[(0.0, 0.0)] * len(plan.ranks[q][t]) for t in range(L.k)] for q in range(L.W)]
    cycle_end = [0.0] * cycles
    busy = [0.0] * L.W
    for q in range(L.W):
        for st, en, c, t, i, op in timeline[q]:
            cycle_end[c] = max(cycle_end[c], en)
            if c == 0:
                times[q][t][i] = (st, en)
                if op.kind in COMPUTE_KINDS:
                    busy[q] += en - st
    T = cycle_end[0]
    # the cycle as it repeats: the next cycle's first forward may start before this cycle's
    # last op ends, so cycles overlap; the mean spacing of cycle ends after the first (from
    # idle) is the period a long run sees
    steady = (cycle_end[-1] - cycle_end[0]) / (cycles - 1) if cycles > 1 else T
    resident = [costs.resident_bytes(sorted(L.held[q])) for q in range(L.W)]
    peaks, traces = [], []
    limit = plan.config.get("memory_limit_bytes")
    for q in range(L.W):
        events = []  # (time, order, delta, op text): frees (order 0) before allocations at a tie
        live: dict[tuple, int] = {}
        for st, en, c, t, i, op in timeline[q]:
            for bkey, nbytes in costs.allocates(op, refresh=(t == 0)):
                events.append((st, 1, nbytes, (c,) + bkey, (op, t)))
            for bkey in costs.frees(op):
                events.append((en, 0, None, (c,) + bkey, (op, t)))
        events.sort(key=lambda e: (e[0], e[1]))
        cur, peak, peak_at, trace = resident[q], resident[q], "start", [(0.0, resident[q])]
        for at, order, nbytes, bkey, who in events:
            if order == 1:
                live[bkey] = nbytes
                cur += nbytes
            else:
                cur -= live.pop(bkey, 0)
            if bkey[0] == 0:
                trace.append((at, cur))
            if cur > peak:
                peak, peak_at = cur, who
        peaks.append(peak)
        traces.append(trace)
        if check_memory and limit is not None and peak > limit:
            at_op = peak_at if peak_at == "start" else f"{peak_at[0]} (rank {q}, step {peak_at[1]})"
            raise ReplayError(where, "config.memory_limit_bytes",
                              f"rank {q} needs {peak} bytes (at {at_op}), over the limit of {limit}")
    util = sum(busy) / (L.W * T) if T > 0 else 0.0
    return ReplayResult(times=times, cycle_time_ms=T, step_time_from_idle_ms=T / L.k, refresh_steps=L.k, steady_cycle_time_ms=steady,
                        busy_ms=busy, idle_ms=[T - b for b in busy], utilization=util,
                        peak_memory_bytes=peaks, resident_bytes=resident, memory_trace=traces,
                        utilization_pipefisher=_pipefisher_utilization(timeline, L, cycles),
                        utilization_strict=sum(busy) / (L.W * steady) if steady > 0 else 0.0)


def _pipefisher_utilization(timeline, L: PlanLayout, cycles: int) -> list[float]:
    """PipeFisher's GPU utilization (pipe-fisher scripts/plot_cuda_timeline.py), one value per
    step of the cycle: the window runs from rank 0's first forward of the step to its first
    forward of the next step; each rank's busy time in it counts compute AND collectives
    (sync_grad, sync_curv, bcast_inv, ...), not point-to-point waits; the mean over ranks.
    Measured on the steady cycle (the second of three; the first when fewer are replayed).
    One difference: an op that straddles the window's end counts with its part inside
    (PipeFisher's script drops it); that makes every step's windows tile the timeline."""
    c = 1 if cycles >= 3 else 0
    first_fwd: dict[tuple[int, int], float] = {}
    for st, _en, cc, t, _i, op in timeline[0]:
        if op.kind == "fwd" and (cc, t) not in first_fwd:
            first_fwd[(cc, t)] = st
    busy_kinds = COMPUTE_KINDS | COLLECTIVE_KINDS
    out = []
    for t in range(L.k):
        w0 = first_fwd.get((c, t))
        w1 = first_fwd.get((c, t + 1)) if t + 1 < L.k else first_fwd.get((c + 1, 0))
        if w0 is None or w1 is None or w1 <= w0:
            continue  # rank 0 runs no forward (cannot happen for a valid plan) or one cycle only
        per_rank = []
        for q in range(L.W):
            b = sum(max(0.0, min(en, w1) - max(st, w0)) for st, en, _c, _t, _i, op in timeline[q]
                    if op.kind in busy_kinds)
            per_rank.append(b / (w1 - w0))
        out.append(sum(per_rank) / L.W)
    return out
