"""Replay a plan: an event simulator that checks it and predicts its timeline.

Written from the plan semantics alone (DESIGN.md; pfcompile/formats/plan.py), independently of
any placement method: it reads each rank's op lists, takes durations and memory effects
from pfcompile.graph.costs (the profile's numbers), and executes the lists in order, as the
runtime would, for `cycles` back-to-back refresh cycles (2 by default, so the cycle
boundary is exercised). It

- checks every op is on a rank that holds its stage, that no op is listed twice, and that
  every required op is there (fwd/bwd of every (stage, mb) once per step; with K-FAC,
  curv_a/curv_b of every (layer, mb) once per cycle, sync_curv per replica (R > 1), an
  inv of each factor, bcast_inv when one replica inverts, precond each step);
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

from pfcompile.check.deps import PlanLayout, op_dependencies
from pfcompile.formats.errors import InputError
from pfcompile.formats.ops import COLLECTIVE_KINDS, COMPUTE_KINDS, FACTORS, FLOATING_KINDS, Op, peer_stage
from pfcompile.formats.plan import Plan
from pfcompile.formats.profile import Cluster, Profile
from pfcompile.graph.costs import Costs


class ReplayError(InputError):
    pass


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
    _check_static(plan, L, where)
    return _simulate(plan, L, costs, cycles, check_memory, where)


# --- static checks ------------------------------------------------------------------------------

def _check_static(plan: Plan, L: PlanLayout, where: str) -> None:
    floating_seen: dict[tuple[int, Op], str] = {}
    for q in range(L.W):
        for t in range(L.k):
            seen: dict[Op, int] = {}
            for i, po in enumerate(plan.ranks[q][t]):
                op = po.op
                name = f"{op} (rank {q}, step {t})"
                if op.kind in ("bwd", "bwd_input", "bwd_weight") and op.kind not in L.backward:
                    raise ReplayError(where, _where(q, t, i, op), f"{name}: the {plan.config.get('schedule')} family's backward ops are {', '.join(L.backward)}")
                if op.is_kfac and not L.kfac:
                    raise ReplayError(where, _where(q, t, i, op), f"{name} is a K-FAC op in a plan without K-FAC")
                s = L.stage_of(op)
                if not 0 <= s < L.S or s not in L.held[q]:
                    raise ReplayError(where, _where(q, t, i, op), f"{name}: rank {q} holds no replica of stage {s}")
                r = L.held[q][s]
                if op.mb is not None and L.mbr[op.mb] != r:
                    raise ReplayError(where, _where(q, t, i, op), f"{name}: micro-batch {op.mb} runs on replica {L.mbr[op.mb]}, rank {q} holds replica {r}")
                _check_peer(L, q, t, i, op, name, where)
                if op.kind in FLOATING_KINDS:
                    if (q, op) in floating_seen:
                        raise ReplayError(where, _where(q, t, i, op), f"{name} is listed twice in the cycle (also at {floating_seen[(q, op)]})")
                    floating_seen[(q, op)] = f"step {t}"
                elif op in seen:
                    raise ReplayError(where, _where(q, t, i, op), f"{name} is listed twice in step {t} (also at [{seen[op]}])")
                seen[op] = i
            _check_step_complete(plan, L, q, t, set(seen), where)
    if L.kfac:
        _check_kfac_complete(L, floating_seen, where)


def _check_peer(L: PlanLayout, q: int, t: int, i: int, op: Op, name: str, where: str) -> None:
    if not op.is_p2p:
        return
    other = peer_stage(op)
    if not 0 <= other < L.S:
        raise ReplayError(where, _where(q, t, i, op), f"{name}: there is no stage {other} to exchange with")
    expected = L.rank[(other, L.mbr[op.mb])]
    if op.peer != expected:
        raise ReplayError(where, _where(q, t, i, op), f"{name}: the peer of this message is rank {expected}, not {op.peer}")


def _check_step_complete(plan: Plan, L: PlanLayout, q: int, t: int, ops: set[Op], where: str) -> None:
    for s, r in sorted(L.held[q].items()):
        need = [Op(kind, stage=s, mb=m) for m in L.mbs_of(r) for kind in ("fwd",) + L.backward]
        need.append(Op("step", stage=s))
        if L.split_stage(s):
            need += [Op("rs_grad", stage=s), Op("ag_grad", stage=s)]
        elif L.R > 1:
            need.append(Op("sync_grad", stage=s))
        need += [Op("precond", layer=l) for l in L.preconditions(q, s)]
        for op in need:
            if op not in ops:
                raise ReplayError(where, f"ranks[{q}].steps[{t}]", f"{op} (rank {q}, step {t}) is missing")


def _check_kfac_complete(L: PlanLayout, floating: dict, where: str) -> None:
    def missing(q, op):
        return ReplayError(where, f"ranks[{q}]", f"{op} (rank {q}, any step of the cycle) is missing")

    bcasts: dict[tuple[int, str], list[tuple[int, Op]]] = defaultdict(list)  # (layer, factor) -> (rank, op)
    for (r, o) in floating:
        if o.kind == "bcast_inv":
            bcasts[(o.layer, o.factor)].append((r, o))
    for l, s in enumerate(L.layer_stage):
        group = L.group(s)
        for q in group:
            for m in L.mbs_of(L.held[q][s]):
                for kind in ("curv_a", "curv_b"):
                    if (q, Op(kind, layer=l, mb=m)) not in floating:
                        raise missing(q, Op(kind, layer=l, mb=m))
            if L.R > 1:
                for f in FACTORS:
                    if (q, Op("sync_curv", layer=l, factor=f)) not in floating:
                        raise missing(q, Op("sync_curv", layer=l, factor=f))
        owner = L.precond_owner[l] if L.precond_owner is not None else None
        for f in FACTORS:
            inverters = [q for q in group if (q, Op("inv", layer=l, factor=f)) in floating]
            if owner is not None:  # split preconditioning: the owner inverts, nobody else needs it
                q = L.rank[(s, owner)]
                if q not in inverters:
                    raise missing(q, Op("inv", layer=l, factor=f))
                continue
            if not inverters:
                raise missing(group[0], Op("inv", layer=l, factor=f))
            if len(inverters) < len(group):
                receivers = {r for r, _ in bcasts[(l, f)]}
                for q in group:
                    if q not in receivers:
                        raise missing(q, Op("bcast_inv", layer=l, factor=f, peer=inverters[0]))
                for (r, o) in bcasts[(l, f)]:
                    if o.peer not in inverters:
                        raise ReplayError(where, f"ranks[{r}]", f"{o} (rank {r}): rank {o.peer} does not invert factor {f} of layer {l}")


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

    rules: dict[tuple, tuple[list, list]] = {}  # (rank, step, op, cycle > 0) -> its dependencies

    def dependencies(q: int, c: int, t: int, op: Op) -> tuple[list, list]:
        """op_dependencies, derived once per listed op and shifted to later cycles (the
        rules of cycle c are those of cycle 1 with every cycle index moved by c - 1)."""
        c0 = 1 if c > 0 else 0
        got = rules.get((q, t, op, c0))
        if got is None:
            got = rules[(q, t, op, c0)] = op_dependencies(L, q, c0, t, op)
        if c == c0:
            return got
        shift = c - c0
        return ([(k[0] + shift,) + k[1:] for k in got[0]], [(k[0] + shift,) + k[1:] for k in got[1]])

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
