"""The task graph of a plan, rebuilt from the plan alone: its ops plus the vocabulary's rules.

A task is one op on one rank in one step of the refresh cycle. Its dependencies follow
the table in pfcompile/ops.py (and DESIGN.md): a producer is looked up on the rank the
rule names, in the same step; floating K-FAC work (curvature, factor sync, inversion,
broadcast) may run in any step of the cycle, so it is found in the same step if it runs
there, else in the latest earlier one; a producer that only runs in a previous cycle (the
inverses in force) gives no edge. Curvature is always of step 0's micro-batches. The rules match the planner's
task graph (pfcompile/graph.py) on each rank; across ranks only messages and broadcasts
are edges here, the members of a collective are linked by `collective_peers` instead.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterator

from pfcompile.ops import FACTORS, Op
from pfcompile.plan import Plan


# K-FAC work of one refresh that may run in any step of the cycle (as in pfcompile/graph.py)
FLOATING_KINDS = frozenset({"curv_a", "curv_b", "sync_curv", "inv", "bcast_inv"})


@dataclass(frozen=True)
class Task:
    rank: int
    step: int
    op: Op
    start: float
    end: float

    @property
    def key(self) -> tuple[int, int, Op]:
        return (self.rank, self.step, self.op)


# A requirement is a list of alternatives, tried in order; the first that finds any
# producer wins. An alternative names (rank, kind, predicate over the producer op), and
# optionally the one step of the cycle the producer must be in.
Alternative = tuple  # (int, str, Callable[[Op], bool]) or with a 4th item: step


def tasks_of(plan: Plan) -> list[Task]:
    return [Task(q, t, p.op, p.start, p.end)
            for q, steps in enumerate(plan.ranks) for t, ops in enumerate(steps) for p in ops]


def _requirements(plan: Plan, q: int, op: Op) -> list[list[Alternative]]:
    k, s, mb, l, f = op.kind, op.stage, op.mb, op.layer, op.factor
    ls = plan.layer_stage
    last = plan.num_stages - 1
    at = lambda st, m: (lambda o: o.stage == st and o.mb == m)  # noqa: E731
    if k == "fwd":
        return [] if s == 0 else [[(q, "recv_act", at(s - 1, mb)), (q, "fwd", at(s - 1, mb))]]
    if k == "bwd":
        own = [[(q, "fwd", at(s, mb))]]
        if s == last:
            return own
        return own + [[(q, "recv_grad", at(s + 1, mb)), (q, "bwd", at(s + 1, mb))]]
    if k == "send_act":
        return [[(q, "fwd", at(s, mb))]]
    if k == "send_grad":
        return [[(q, "bwd", at(s, mb))]]
    if k in ("recv_act", "recv_grad"):
        return [[(op.peer, "send" + k[4:], at(s, mb))]]
    if k in ("curv_a", "curv_b"):
        return [[(q, "fwd" if k == "curv_a" else "bwd", at(ls[l], mb), 0)]]
    of_layer = lambda o: o.layer == l  # noqa: E731
    same_factor = lambda o: o.layer == l and o.factor == f  # noqa: E731
    if k == "sync_curv":
        return [[(q, "curv_" + f.lower(), of_layer)]]
    if k == "inv":  # both factors: the damping of each is corrected by the other's norm (pi)
        return [[(q, "sync_curv", lambda o, g=g: o.layer == l and o.factor == g), (q, "curv_" + g.lower(), of_layer)]
                for g in FACTORS]
    if k == "bcast_inv":
        return [[(op.peer, "inv", same_factor)]]
    if k == "sync_grad":
        return [[(q, "bwd", lambda o: o.stage == s)]]
    if k == "precond":
        return [[(q, "sync_grad", lambda o: o.stage == ls[l]), (q, "bwd", lambda o: o.stage == ls[l])]]
    if k == "step":
        return [[(q, "precond", lambda o: ls[o.layer] == s), (q, "sync_grad", lambda o: o.stage == s),
                 (q, "bwd", lambda o: o.stage == s)]]
    raise ValueError(f"no dependency rule for op kind {k!r}")


def dependencies(plan: Plan, tasks: list[Task] | None = None) -> Iterator[tuple[Task, Task]]:
    """(producer, consumer) pairs over all tasks of the plan."""
    tasks = tasks_of(plan) if tasks is None else tasks
    by_kind: dict[tuple[int, str], list[Task]] = defaultdict(list)
    for task in tasks:
        by_kind[(task.rank, task.op.kind)].append(task)

    def resolve(alt: Alternative, step: int) -> list[Task]:
        rank, kind, pred = alt[:3]
        pinned = alt[3] if len(alt) > 3 else None
        if pinned is None and kind not in FLOATING_KINDS:
            pinned = step  # per-step work feeds only its own step
        chosen: dict[Op, Task] = {}
        for cand in by_kind.get((rank, kind), ()):
            if cand.step > step or not pred(cand.op) or (pinned is not None and cand.step != pinned):
                continue
            best = chosen.get(cand.op)
            if best is None or cand.step > best.step:  # same step, else the latest earlier one
                chosen[cand.op] = cand
        return list(chosen.values())

    for task in tasks:
        for requirement in _requirements(plan, task.rank, task.op):
            for alt in requirement:
                found = resolve(alt, task.step)
                if found:
                    for producer in found:
                        if producer.key != task.key:
                            yield producer, task
                    break


def collective_peers(plan: Plan, tasks: list[Task]) -> Iterator[tuple[Task, Task]]:
    """Pairs of tasks that are the same collective on neighbouring members of its group."""
    members: dict[tuple[int, Op], list[Task]] = defaultdict(list)
    for task in tasks:
        if task.op.is_collective:
            members[(task.step, _collective_key(task.op))].append(task)
    for group in members.values():
        group.sort(key=lambda t: t.rank)
        yield from zip(group, group[1:])


def _collective_key(op: Op) -> Op:
    # bcast_inv carries its source rank, the same on every member: the op itself is the key.
    return op
