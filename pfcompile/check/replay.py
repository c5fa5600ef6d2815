"""Replay a plan: an event simulator that checks it and predicts its timeline.

Written from the plan semantics alone (docs/design.md §3-4, this replay §10;
pfcompile/formats/plan.py), independently of any placement method: it reads each rank's op
lists, takes durations and memory effects from pfcompile.graph.costs (the profile's
numbers), and executes the lists in order, as the runtime would, for `cycles` back-to-back
refresh cycles (2 by default, so the cycle boundary is exercised). It

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

from dataclasses import dataclass, field

import numpy as np

from pfcompile.formats.ops import COLLECTIVE_KINDS, COMPUTE_KINDS, SPLIT_BACKWARD_SCHEDULES, Op
from pfcompile.formats.plan import Plan
from pfcompile.formats.profile import LEVEL_KINDS, Profile
from pfcompile.formats.rules import CycleIndex, PlanError, PlanLayout, check_ops
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
           where: str = "<plan>", durations: dict[int, float] | None = None,
           transfers: dict[int, float] | None = None) -> ReplayResult:
    """The plan run by the cost model, `cycles` cycles from an idle start. `durations`:
    instance (cycle * ops per cycle + listing id of CycleIndex) -> ms, in place of the
    profile's duration (a measured run's ops: `pfcompile inspect --against --profile`).
    `transfers`: instance -> a multiplier of the link time of the messages it receives."""
    if len(profile.covered_layers) != len(plan.layers) or any(
            l.name != n for l, n in zip(profile.covered_layers, plan.layers)):
        raise ReplayError(where, "layers", "do not match the profile's K-FAC layers (plan made from another profile?)")
    L = PlanLayout(plan)
    costs = plan_costs(plan, profile, L)
    if costs.layer_stage != list(plan.layer_stage):
        raise ReplayError(where, "layer_stage", "does not follow from the partition and the profile")
    check_ops(plan, L, where)
    result = _simulate(plan, L, costs, cycles, check_memory, where, durations, transfers)
    check_pair_order(plan, L, where)  # after: a missing message is named by its consumer first
    return result


def plan_costs(plan: Plan, profile: Profile, L: PlanLayout) -> Costs:
    """The cost model of this plan's layout (its cluster, replicas, split backward, owners)."""
    # messages and collectives costed by the link they cross
    return Costs(profile, plan.partition, L.R, plan.config.inverse, plan.config.optimizer, cluster=plan.config.cluster,
                 stage_ranks=[L.replica_ranks(s) for s in range(L.S)], precond_owner=L.precond_owner,
                 split_backward=plan.config.schedule in SPLIT_BACKWARD_SCHEDULES, refresh_steps=plan.refresh_steps,
                 defer_stats=plan.config.defer_stats)


# the spread kind of an op kind, where they differ (formats.profile.SPREAD_KINDS)
SPREAD_KIND = {"send_act": "send", "send_grad": "send"}


# the steps expected_step_time replays by default (enough that its overhead's own spread from
# seed to seed is a small fraction of a point), and the drawn op instances it replays at most
EXPECTED_STEPS = 2000
EXPECTED_STEP_MAX_OPS = 200_000


def spread_replay_cycles(k: int, ops_per_cycle: int, steps: int = EXPECTED_STEPS,
                         max_instances: int = EXPECTED_STEP_MAX_OPS) -> int:
    """The refresh cycles expected_step_time replays: about `steps` steps, at least 3 cycles,
    at most `max_instances` op instances (beyond the 3 cycles)."""
    return max(3, min(-(-steps // k), max_instances // max(1, ops_per_cycle)))


def expected_step_time(plan: Plan, profile: Profile, *, steps: int = EXPECTED_STEPS, seed: int = 0,
                       max_instances: int = EXPECTED_STEP_MAX_OPS) -> float | None:
    """The step time a run sees when each op's time varies as the profile's
    `runtime.op_spread` and `runtime.level_spread` say (formats.profile): the plan replayed
    over about `steps` steps (whole refresh cycles, at most `max_instances` op instances)
    with every instance's work drawn independently from its kind's multipliers, times its
    rank's level in its step, drawn once per rank and step from the level spread for every
    LEVEL_KINDS op of it (kinds without either keep their time; receives, collectives and
    every wait are the replay's). The `message` spread draws each received message's link
    time, the `between_steps` spread each step op's share of the runtime's work between
    steps (neither takes the level). A late op delays whoever waits on it and an early one
    rarely lets them start sooner, so the result is above the step of mean op times (the
    plan's step_time_ms) by what the pipeline's dependencies make of the spread; a slow
    rank-step more so than as many slow ops spread over the ranks. With `runtime.busy`, each
    draw is the busy run's with the plan's busy weight (its utilization between the two
    probe runs'), and the runtime's work between steps moves by it. None without a spread.
    The draws are seeded: the same plan and profile give the same number."""
    rt = profile.runtime
    if not rt.has_spread():
        return None
    L = PlanLayout(plan)
    X = CycleIndex(plan, L)
    costs = plan_costs(plan, profile, L)
    cycles = spread_replay_cycles(L.k, X.M, steps, max_instances)
    rng = np.random.default_rng(seed)
    op_ms = rt.op_ms
    # how much of this plan varies as the probe's run with its bubbles filled did (runtime.busy)
    w = rt.busy_weight(replay(plan, profile, check_memory=False).utilization) if rt.busy is not None else 0.0
    busy = rt.busy if w > 0 else None
    spread, levels = rt.op_spread, rt.level_spread
    if w >= 1:  # all the busy run's: drawn as the base spreads are, with no mixing draws
        spread, levels, busy = busy.op_spread, busy.level_spread, None

    def draw(base: list[float] | None, other: list[float] | None = None, size=cycles):
        """Multipliers from `base` (1s without it), each taken from `other` instead with the
        busy weight where the plan is partly busy."""
        out = rng.choice(np.asarray(base), size=size) if base is not None else np.ones(size)
        if busy is not None:
            pick = rng.random(size) < w
            out[pick] = rng.choice(np.asarray(other), size=int(pick.sum())) if other is not None else 1.0
        return out

    def busy_of(key: str) -> list[float] | None:
        return busy.op_spread.get(key) if busy is not None else None

    busy_levels = busy.level_spread if busy is not None else None
    # a level per (cycle, step of the cycle, rank), or 1s without a level spread
    level = draw(levels or None, busy_levels or None, size=(cycles, L.k, L.W)) if levels or busy_levels \
        else np.ones((cycles, L.k, L.W))
    # the runtime's mean work between steps (not the activation) moves to the busy run's by
    # the same weight
    gap_more = w * (rt.busy.step_ms - rt.step_ms) / costs.stages_per_rank if w > 0 else 0.0

    durations: dict[int, float] = {}
    transfers: dict[int, float] = {}
    between, message = spread.get("between_steps"), spread.get("message")
    for j, op in enumerate(X.ops):
        if (message is not None or busy_of("message") is not None) and (X.remote[0][j] or X.remote[1][j]):
            for c, m in enumerate(draw(message, busy_of("message")).tolist()):
                transfers[c * X.M + j] = m
        kind = SPREAD_KIND.get(op.kind, op.kind)
        mult, busy_mult = spread.get(kind), busy_of(kind)
        leveled = bool(levels or busy_levels) and kind in LEVEL_KINDS
        gap_mult, busy_gap = (between, busy_of("between_steps")) if op.kind == "step" else (None, None)
        more = gap_more if op.kind == "step" else 0.0
        if mult is None and busy_mult is None and not leveled and gap_mult is None and busy_gap is None and not more:
            continue
        gap = costs.between_steps_ms(op, X.step[j])  # the runtime's, not the op's: no level
        work = costs.work_ms(op, X.step[j]) - gap
        draws = draw(mult, busy_mult)
        if leveled:
            draws = draws * level[:, X.step[j], X.rank[j]]
        gaps = draw(gap_mult, busy_gap)
        for c, (m, g) in enumerate(zip(draws.tolist(), gaps.tolist())):
            durations[c * X.M + j] = work * m + (gap + more) * g + op_ms
    return replay(plan, profile, cycles=cycles, check_memory=False, durations=durations,
                  transfers=transfers or None).step_time_ms


# --- the simulation --------------------------------------------------------------------------

def _simulate(plan: Plan, L: PlanLayout, costs: Costs, cycles: int, check_memory: bool, where: str,
              durations: dict[int, float] | None = None, transfers: dict[int, float] | None = None) -> ReplayResult:
    """Run each rank's lists in order, cycle after cycle, over the integer ids of
    CycleIndex (instance c * M + j: listing j in cycle c): an op starts when its rank is
    free and the sends it receives have arrived; a collective when every member is at it."""
    X = CycleIndex(plan, L)
    M, W = X.M, L.W
    ops, first = X.ops, X.first
    dur = [costs.duration(op, t) for op, t in zip(ops, X.step)]
    # a receive waits for its send's end plus the transfer time of the message (by its link,
    # Costs.message_ms); with `transfers`, m times its link time
    link = [[[costs.link_ms(ops[d], X.rank[d]) if d >= 0 else 0.0 for _, d in X.remote[b][j]] for j in range(M)]
            for b in (0, 1)]
    lag = [[[costs.lag_of_link(t) for t in links] for links in by_op] for by_op in link]
    n_of = [first[q + 1] - first[q] for q in range(W)]
    pos = [0] * W  # instances of rank q run so far (over all cycles)
    clock = [0.0] * W
    start = [0.0] * (cycles * M)
    end = [0.0] * (cycles * M)
    done = bytearray(cycles * M)

    def name(q, c, t, op):
        return f"{op} (rank {q}, step {t}{f', cycle {c}' if c else ''})"

    def current(q: int) -> tuple[int, int]:
        """(cycle, id) of rank q's next op."""
        c, i = divmod(pos[q], n_of[q])
        return c, first[q] + i

    def ready_time(q: int, c: int, j: int) -> float | None:
        """When rank q's op j of cycle c may start; None while a send it receives is not done."""
        b = 1 if c else 0
        bad = X.early[b].get(j)
        if bad is not None:
            dop, listed = bad
            t, op = X.step[j], ops[j]
            if listed:
                raise ReplayError(where, _where(q, t, X.pos[j], op), f"{name(q, c, t, op)} runs before its dependency {dop} on the same rank")
            raise ReplayError(where, _where(q, t, X.pos[j], op), f"{name(q, c, t, op)} depends on {dop}, which rank {q} never runs")
        at = clock[q]
        rem = X.remote[b][j]
        if rem:
            m = transfers.get(c * M + j) if transfers is not None else None
            lags = lag[b][j] if m is None else [costs.lag_of_link(m * t) for t in link[b][j]]
            for (dc, d), lg in zip(rem, lags):
                x = (c + dc) * M + d
                if d < 0 or not done[x]:
                    return None
                e = end[x] + lg
                if e > at:
                    at = e
        return at

    def run(q: int, c: int, j: int, at: float) -> None:
        x = c * M + j
        start[x] = at
        end[x] = clock[q] = at + (dur[j] if durations is None else durations.get(x, dur[j]))
        done[x] = 1
        pos[q] += 1

    total = cycles * M
    count = 0
    members_of = X.members
    while count < total:
        moved = False
        for q in range(W):
            last = cycles * n_of[q]
            while pos[q] < last:
                c, j = current(q)
                members = members_of.get(j)
                if members is not None:
                    ranks = [X.rank[m] if m >= 0 else -1 for m in members]
                    if any(m < 0 or pos[p] >= cycles * n_of[p] or current(p) != (c, m) for m, p in zip(members, ranks)):
                        break
                    ats = [ready_time(p, c, m) for m, p in zip(members, ranks)]
                    if any(a is None for a in ats):
                        break
                    at = max(ats)
                    for m, p in zip(members, ranks):
                        run(p, c, m, at)
                    count += len(members)
                    moved = True
                    continue
                at = ready_time(q, c, j)
                if at is None:
                    break
                run(q, c, j, at)
                count += 1
                moved = True
        if not moved:
            stuck = []
            for q in range(W):
                if pos[q] < cycles * n_of[q]:
                    c, j = current(q)
                    stuck.append(f"rank {q} at {name(q, c, X.step[j], ops[j])}")
            raise ReplayError(where, "ranks", "deadlock: " + "; ".join(stuck))
    _check_messages(X, L, where)
    return _result(plan, L, costs, X, start, end, cycles, check_memory, where)


def _check_messages(X: CycleIndex, L: PlanLayout, where: str) -> None:
    """Every send has its receive (a receive without a send already deadlocks)."""
    for j, op in enumerate(X.ops):
        if op.kind.startswith("send_"):
            q, t = X.rank[j], X.step[j]
            recv = Op("recv_" + op.kind[5:], stage=op.stage, mb=op.mb, peer=q)
            if X.find(t, op.peer, recv) < 0:
                raise ReplayError(where, _where(q, t, X.pos[j], op),
                                  f"{op} (rank {q}, step {t}) has no matching receive {recv} on rank {op.peer}")


def _result(plan: Plan, L: PlanLayout, costs: Costs, X: CycleIndex, start: list[float], end: list[float],
            cycles: int, check_memory: bool, where: str) -> ReplayResult:
    M, ops = X.M, X.ops
    times = [[[(0.0, 0.0)] * len(plan.ranks[q][t]) for t in range(L.k)] for q in range(L.W)]
    for j in range(M):
        times[X.rank[j]][X.step[j]][X.pos[j]] = (start[j], end[j])
    cycle_end = [max(end[c * M:(c + 1) * M], default=0.0) for c in range(cycles)]
    busy = [0.0] * L.W
    for q in range(L.W):
        for j in range(X.first[q], X.first[q + 1]):
            if ops[j].kind in COMPUTE_KINDS:
                busy[q] += end[j] - start[j]
    T = cycle_end[0]
    # the cycle as it repeats: the next cycle's first forward may start before this cycle's
    # last op ends, so cycles overlap; the mean spacing of cycle ends after the first (from
    # idle) is the period a long run sees
    steady = (cycle_end[-1] - cycle_end[0]) / (cycles - 1) if cycles > 1 else T
    resident = [costs.resident_bytes(L.held[q]) for q in range(L.W)]
    peaks, traces = [], []
    limit = plan.config.memory_limit_bytes
    allocs = [costs.allocates(op, refresh=(X.step[j] == 0)) for j, op in enumerate(ops)]
    late = [costs.allocates_at_end(op, refresh=(X.step[j] == 0)) for j, op in enumerate(ops)]
    frees = [costs.frees(op) for op in ops]
    for q in range(L.W):
        # (time, order, bytes, key, op): frees (order 0) before allocations at a tie; an
        # allocation at an op's end (order 2: a tensor leaving another buffer, costs.
        # allocates_at_end) is skipped when its freeing op has already ended
        events = []
        live: dict[tuple, int] = {}
        freed: set[tuple] = set()
        for c in range(cycles):
            for j in range(X.first[q], X.first[q + 1]):
                x = c * M + j
                for bkey, nbytes in allocs[j]:
                    events.append((start[x], 1, nbytes, (c,) + bkey, j))
                for bkey, nbytes in late[j]:
                    events.append((end[x], 2, nbytes, (c,) + bkey, j))
                for bkey in frees[j]:
                    events.append((end[x], 0, None, (c,) + bkey, j))
        events.sort(key=lambda e: (e[0], e[1]))
        cur, peak, peak_at, trace = resident[q], resident[q], "start", [(0.0, resident[q])]
        for at, order, nbytes, bkey, who in events:
            if order == 2 and bkey in freed:
                continue
            if order:
                live[bkey] = nbytes
                cur += nbytes
            else:
                cur -= live.pop(bkey, 0)
                freed.add(bkey)
            if bkey[0] == 0:
                trace.append((at, cur))
            if cur > peak:
                peak, peak_at = cur, who
        peaks.append(peak)
        traces.append(trace)
        if check_memory and limit is not None and peak > limit:
            at_op = peak_at if peak_at == "start" else f"{ops[peak_at]} (rank {q}, step {X.step[peak_at]})"
            raise ReplayError(where, "config.memory_limit_bytes",
                              f"rank {q} needs {peak} bytes (at {at_op}), over the limit of {limit}")
    util = sum(busy) / (L.W * T) if T > 0 else 0.0
    return ReplayResult(times=times, cycle_time_ms=T, step_time_from_idle_ms=T / L.k, refresh_steps=L.k, steady_cycle_time_ms=steady,
                        busy_ms=busy, idle_ms=[T - b for b in busy], utilization=util,
                        peak_memory_bytes=peaks, resident_bytes=resident, memory_trace=traces,
                        utilization_pipefisher=_pipefisher_utilization(X, start, end, L, cycles),
                        utilization_strict=sum(busy) / (L.W * steady) if steady > 0 else 0.0)


def _pipefisher_utilization(X: CycleIndex, start: list[float], end: list[float], L: PlanLayout,
                            cycles: int) -> list[float]:
    """PipeFisher's GPU utilization (pipe-fisher scripts/plot_cuda_timeline.py), one value per
    step of the cycle: the window runs from rank 0's first forward of the step to its first
    forward of the next step; each rank's busy time in it counts compute AND collectives
    (sync_grad, sync_curv, bcast_inv, ...), not point-to-point waits; the mean over ranks.
    Measured on the steady cycle (the second of three; the first when fewer are replayed).
    One difference: an op that straddles the window's end counts with its part inside
    (PipeFisher's script drops it); that makes every step's windows tile the timeline."""
    c = 1 if cycles >= 3 else 0
    M = X.M
    first_fwd: dict[tuple[int, int], float] = {}
    for cc in range(cycles):
        for j in range(X.first[0], X.first[1]):
            if X.ops[j].kind == "fwd" and (cc, X.step[j]) not in first_fwd:
                first_fwd[(cc, X.step[j])] = start[cc * M + j]
    busy_kinds = COMPUTE_KINDS | COLLECTIVE_KINDS
    # per rank, the busy ops of every cycle in execution order (as arrays: k windows each)
    spans = []
    for q in range(L.W):
        ids = [j for j in range(X.first[q], X.first[q + 1]) if X.ops[j].kind in busy_kinds]
        xs = np.array([cc * M + j for cc in range(cycles) for j in ids], dtype=np.int64)
        spans.append((np.asarray(start)[xs] if len(xs) else np.zeros(0), np.asarray(end)[xs] if len(xs) else np.zeros(0)))
    out = []
    for t in range(L.k):
        w0 = first_fwd.get((c, t))
        w1 = first_fwd.get((c, t + 1)) if t + 1 < L.k else first_fwd.get((c + 1, 0))
        if w0 is None or w1 is None or w1 <= w0:
            continue  # rank 0 runs no forward (cannot happen for a valid plan) or one cycle only
        per_rank = []
        for st, en in spans:
            inside = np.maximum(0.0, np.minimum(en, w1) - np.maximum(st, w0))
            per_rank.append(sum(inside.tolist()) / (w1 - w0))  # summed in order, as a list
        out.append(sum(per_rank) / L.W)
    return out
